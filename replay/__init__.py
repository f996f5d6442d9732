"""Looking back at a journal: offline replay of rollouts, never calling the model.

Public API (import from here, not from the modules)::

    from replay import open_replay, list_rollouts, build_timeline, resource_state
    from replay import export_journal, export_training, fork_rollout, TokenizerCatalog

Every command opens its journal with :func:`open_replay` (a file journal directory
or ``kafka://host:port/namespace``, read-only), streams it with a
:class:`~replay.progress.Progress`, applies the events it reads through the
rollout aggregate (``participants.rollout_state``), and returns a result with
``as_json()``, ``text()`` and the ``report`` of what the read stepped over; the
command line (``replay.cli``) prints it (``replay.terminal.emit``).

Names load lazily (PEP 562): ``import replay`` costs nothing, and torch is
imported only by what needs it.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    # reading a journal
    "ReplaySource": ".source", "open_replay": ".source",
    "Progress": ".progress", "NoProgress": ".progress",
    # errors
    "ReplayError": ".errors", "NoSuchRolloutError": ".errors", "NoSuchResourceError": ".errors",
    "NoSuchRevisionError": ".errors", "NoSuchTurnError": ".errors", "TokenizerUnavailableError": ".errors",
    "ExportError": ".errors", "ForkError": ".errors",
    # replay list
    "list_rollouts": ".listing", "Listing": ".listing", "RolloutRow": ".listing", "RolloutFilter": ".listing",
    # replay show
    "build_timeline": ".timeline", "Timeline": ".timeline", "AttemptView": ".timeline", "TurnView": ".timeline",
    "CallView": ".timeline", "MutationView": ".timeline",
    "TokenSegment": ".lineage", "TokenLineage": ".lineage",
    "TokenizerCatalog": ".tokenizers", "TokenizerIdentity": ".tokenizers",
    # replay state
    "resource_state": ".resource_state", "ResourceAtRevision": ".resource_state",
    # export, export-training, fork
    "export_journal": ".export", "ExportReport": ".export",
    "export_training": ".training", "training_records": ".training", "TrainingRecord": ".training",
    "TrainingExport": ".training",
    "fork_rollout": ".fork", "ForkResult": ".fork",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(module, __name__), name)


def __dir__() -> list[str]:
    return sorted(_EXPORTS)


__all__ = list(_EXPORTS)
