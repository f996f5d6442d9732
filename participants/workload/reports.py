"""What a run of a workload did: a row per rollout, where its restore went, and the run's totals.

The runner fills them as it restores and drives rollouts (a fleet's worker: over its whole
life); ``run_workload`` returns them and the command line prints them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RolloutReport:
    rollout_id: str
    turns_committed_before: int  # turns found committed in the journal when this run began
    turns_run_here: int  # turns this run executed
    tokens_run_here: int
    restarted_from_zero: bool
    reused_result: bool  # finished before; offered again from the journal
    outcome: dict[str, Any] | None = None
    acknowledged: bool = False  # the trainer took its result before this run: nothing to do
    set_aside: str | None = None  # its journal could not be restored (why); the other rollouts ran
    failed: str | None = None  # it stopped on an infrastructure failure (why), journaled; the others ran
    given_up: str | None = None  # its infrastructure failures reached the budget (the last one's why): terminal


@dataclass
class RestoreTiming:
    """Where a run's restore went, in seconds, before any rollout ran a new turn.

    Reading the journal is rarely the bulk: a restart-only sandbox starts a new
    interpreter per rollout, and an exported state is imported and its mutations
    re-applied, so each phase is reported on its own."""

    read_s: float = 0.0  # the snapshot stream and the events since each snapshot
    fold_s: float = 0.0  # applying those events to every rollout's aggregate
    rebuild_s: float = 0.0  # resumed rollouts' environments: started, exports imported, mutations re-applied
    fence_s: float = 0.0  # the resumed attempts' AttemptStarted made durable (a fresh run: 0)

    @property
    def total_s(self) -> float:
        return self.read_s + self.fold_s + self.rebuild_s + self.fence_s

    def as_ms(self) -> dict[str, float]:
        phases = {
            "read": self.read_s,
            "fold": self.fold_s,
            "rebuild": self.rebuild_s,
            "fence": self.fence_s,
            "total": self.total_s,
        }
        return {name: round(seconds * 1000, 2) for name, seconds in phases.items()}


@dataclass
class RunReport:
    rollouts: dict[str, RolloutReport] = field(default_factory=dict)
    restore: RestoreTiming = field(default_factory=RestoreTiming)
    events_replayed: int = 0
    run_seconds: float = 0.0
    read_errors: list[str] = field(default_factory=list)

    @property
    def restore_seconds(self) -> float:
        """The whole restore: reading, folding, rebuilding environments and writing the fences."""
        return self.restore.total_s

    @property
    def turns_run(self) -> int:
        return sum(r.turns_run_here for r in self.rollouts.values())

    def outcomes(self) -> dict[str, dict[str, Any] | None]:
        """Outcome per rollout this run produced or offered again (acknowledged, set-aside, failed
        and given-up ones have none)."""
        return {
            rid: r.outcome
            for rid, r in sorted(self.rollouts.items())
            if not r.acknowledged and not r.set_aside and not r.failed and not r.given_up
        }

    @property
    def set_aside(self) -> dict[str, str]:
        """Rollouts whose journal could not be restored, and why."""
        return {rid: r.set_aside for rid, r in sorted(self.rollouts.items()) if r.set_aside}

    @property
    def failed(self) -> dict[str, str]:
        """Rollouts whose last attempt stopped on an infrastructure failure (journaled as ``RolloutFailed``)
        and was not retried in this run (it was stopped first), and why."""
        return {rid: r.failed for rid, r in sorted(self.rollouts.items()) if r.failed}

    @property
    def given_up(self) -> dict[str, str]:
        """Rollouts given up (``RolloutGivenUp``: their failures reached ``failure_policy.max_failures``),
        and the last failure."""
        return {rid: r.given_up for rid, r in sorted(self.rollouts.items()) if r.given_up}
