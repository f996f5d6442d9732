"""The live path: a workload's config and specs, its restore and runner, the agent, checkpoints,
the fleet worker.

Public API (import from here)::

    from rollout_journal.participants.workload import WorkloadConfig, run_workload, FleetWorker

Names load lazily (PEP 562): importing this package, or ``.config`` or ``.specs``, never imports
torch or the HTTP stack; running a workload loads its model backend when asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollout_journal.participants.lazy_exports import lazy_exports as _lazy_exports

_EXPORTS: dict[str, str] = {
    "ModelConfig": ".config",
    "TopologyChangedError": ".config",
    "WorkloadConfig": ".config",
    "check_journal_location": ".config",
    "RolloutSpec": ".specs",
    "workload_specs": ".specs",
    "build_backend": ".run",
    "open_workload_journal": ".run",
    "run_workload": ".run",
    "Runner": ".runner",
    "RestoreTiming": ".reports",
    "RolloutReport": ".reports",
    "RunReport": ".reports",
    "Agent": ".agent",
    "LiveRollout": ".agent",
    "CheckpointReport": ".checkpoint",
    "CoordinatedCheckpointer": ".checkpoint",
    "FleetWorker": ".worker",
    "WorkerReport": ".worker",
    "submit_workload": ".worker",
}

__all__ = [  # the names of _EXPORTS, spelled out for tools that read __all__ without running it
    "Agent",
    "CheckpointReport",
    "CoordinatedCheckpointer",
    "FleetWorker",
    "LiveRollout",
    "ModelConfig",
    "RestoreTiming",
    "RolloutReport",
    "RolloutSpec",
    "RunReport",
    "Runner",
    "TopologyChangedError",
    "WorkerReport",
    "WorkloadConfig",
    "build_backend",
    "check_journal_location",
    "open_workload_journal",
    "run_workload",
    "submit_workload",
    "workload_specs",
]

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ loads on first use
    from rollout_journal.participants.workload.agent import Agent, LiveRollout
    from rollout_journal.participants.workload.checkpoint import CheckpointReport, CoordinatedCheckpointer
    from rollout_journal.participants.workload.config import (
        ModelConfig,
        TopologyChangedError,
        WorkloadConfig,
        check_journal_location,
    )
    from rollout_journal.participants.workload.reports import RestoreTiming, RolloutReport, RunReport
    from rollout_journal.participants.workload.run import build_backend, open_workload_journal, run_workload
    from rollout_journal.participants.workload.runner import Runner
    from rollout_journal.participants.workload.specs import RolloutSpec, workload_specs
    from rollout_journal.participants.workload.worker import FleetWorker, WorkerReport, submit_workload


__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS, globals())
