"""What the journal tells whoever watches its writer: plain callbacks, so ``journal`` imports no
metrics library (a fleet worker's Prometheus endpoint implements them, in
``participants/workload/metrics.py``).

Each callback runs on the thread that saw the thing happen (the committer thread, or the caller
of an append that was refused at once) and must return at once: count, observe, never block.
"""

from __future__ import annotations

from typing import Protocol


class JournalMetrics(Protocol):
    """The journal's side of a worker's metrics; :data:`NO_METRICS` when nobody watches."""

    def commit_seconds(self, seconds: float) -> None:
        """One group commit made appends durable; ``seconds``: how long the backend's commit took (on
        Kafka one transaction, begin to commit; a redone attempt counts from its own start)."""

    def transaction_committed(self) -> None:
        """A Kafka transaction committed (a member writes one per group commit, whatever it carries)."""

    def transaction_reinitialized(self) -> None:
        """The transactional producer was re-created to heal a dead transaction (a stalled or timed-out
        one, a stale generation): news, not a fault, unless it keeps happening."""

    def appends_fenced(self, count: int) -> None:
        """``count`` appends refused by a fence: their partition is no longer this writer's (revoked,
        lost, assigned anew), or their epoch is older than the rollout's newest."""


class _NoMetrics:
    def commit_seconds(self, seconds: float) -> None:
        pass

    def transaction_committed(self) -> None:
        pass

    def transaction_reinitialized(self) -> None:
        pass

    def appends_fenced(self, count: int) -> None:
        pass


NO_METRICS: JournalMetrics = _NoMetrics()
