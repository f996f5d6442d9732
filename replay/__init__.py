"""Looking back at a journal: offline replay of rollouts, never calling the model.

Public API (import from here, not from the modules)::

    from rollout_journal.replay import open_replay, list_rollouts, build_timeline, resource_state
    from rollout_journal.replay import export_journal, export_training, fork_rollout, TokenizerCatalog

Every command that reads a journal through this API (``replay list``, ``show``, ``state`` and
``report``; ``export``, ``export-training``, ``fork``, ``audit``, ``verify``) opens it with :func:`open_replay`
(a file journal directory or ``kafka://host:port/namespace``, read-only), streams it with a
:class:`~rollout_journal.replay.progress.Progress`, applies the events it reads through the
rollout aggregate (``rollout_journal.participants.rollout.state``), and returns a result with
``as_json()``, ``text()`` and the ``report`` of what the read stepped over; the
command line (``rollout_journal.replay.cli.main``) prints it (``rollout_journal.replay.terminal.emit``).
``status`` is the exception: :func:`~rollout_journal.replay.status.fleet_status` opens the
journal read-only itself, once per reading, and on Kafka also asks the worker group who owns
each partition.

Names load lazily (PEP 562): ``import rollout_journal.replay`` costs nothing, and torch is
imported only by what needs it.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    # reading a journal
    "ReplaySource": ".source",
    "open_replay": ".source",
    "Progress": ".progress",
    "NoProgress": ".progress",
    # errors
    "ReplayError": ".errors",
    "NoSuchRolloutError": ".errors",
    "NoSuchResourceError": ".errors",
    "NoSuchRevisionError": ".errors",
    "NoSuchTurnError": ".errors",
    "TokenizerUnavailableError": ".errors",
    "ExportError": ".errors",
    "ForkError": ".errors",
    # replay list
    "list_rollouts": ".listing",
    "Listing": ".listing",
    "RolloutRow": ".listing",
    "RolloutFilter": ".listing",
    # replay show
    "build_timeline": ".timeline",
    "Timeline": ".timeline",
    "AttemptView": ".timeline",
    "TurnView": ".timeline",
    "CallView": ".timeline",
    "MutationView": ".timeline",
    "TokenSegment": ".lineage",
    "TokenLineage": ".lineage",
    "TokenizerCatalog": ".tokenizers",
    "TokenizerIdentity": ".tokenizers",
    # replay state
    "resource_state": ".resource_at_revision",
    "ResourceAtRevision": ".resource_at_revision",
    # export, export-training, fork
    "export_journal": ".export",
    "ExportReport": ".export",
    "export_training": ".training",
    "training_records": ".training",
    "TrainingRecord": ".training",
    "TrainingExport": ".training",
    "fork_rollout": ".fork",
    "ForkResult": ".fork",
}


__all__ = [  # the names of _EXPORTS, spelled out for tools that read __all__ without running it
    "AttemptView",
    "CallView",
    "ExportError",
    "ExportReport",
    "ForkError",
    "ForkResult",
    "Listing",
    "MutationView",
    "NoProgress",
    "NoSuchResourceError",
    "NoSuchRevisionError",
    "NoSuchRolloutError",
    "NoSuchTurnError",
    "Progress",
    "ReplayError",
    "ReplaySource",
    "ResourceAtRevision",
    "RolloutFilter",
    "RolloutRow",
    "Timeline",
    "TokenLineage",
    "TokenSegment",
    "TokenizerCatalog",
    "TokenizerIdentity",
    "TokenizerUnavailableError",
    "TrainingExport",
    "TrainingRecord",
    "TurnView",
    "build_timeline",
    "export_journal",
    "export_training",
    "fork_rollout",
    "list_rollouts",
    "open_replay",
    "resource_state",
    "training_records",
]

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ loads on first use
    from rollout_journal.replay.errors import (
        ExportError,
        ForkError,
        NoSuchResourceError,
        NoSuchRevisionError,
        NoSuchRolloutError,
        NoSuchTurnError,
        ReplayError,
        TokenizerUnavailableError,
    )
    from rollout_journal.replay.export import ExportReport, export_journal
    from rollout_journal.replay.fork import ForkResult, fork_rollout
    from rollout_journal.replay.lineage import TokenLineage, TokenSegment
    from rollout_journal.replay.listing import Listing, RolloutFilter, RolloutRow, list_rollouts
    from rollout_journal.replay.progress import NoProgress, Progress
    from rollout_journal.replay.resource_at_revision import ResourceAtRevision, resource_state
    from rollout_journal.replay.source import ReplaySource, open_replay
    from rollout_journal.replay.timeline import AttemptView, CallView, MutationView, Timeline, TurnView, build_timeline
    from rollout_journal.replay.tokenizers import TokenizerCatalog, TokenizerIdentity
    from rollout_journal.replay.training import TrainingExport, TrainingRecord, export_training, training_records


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(module, __name__), name)


def __dir__() -> list[str]:
    return sorted(_EXPORTS)
