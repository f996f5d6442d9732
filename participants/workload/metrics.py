"""A group member's metrics, and its Prometheus endpoint (``rollout-journal worker --metrics-port N``).

Every :class:`~rollout_journal.participants.workload.worker.FleetWorker` counts into a
:class:`WorkerMetrics` of its own (a registry per worker, so several members in one process never
share a series); the endpoint serves it at ``http://<host>:N/metrics`` only when asked. The
journal reports its commits through :class:`~rollout_journal.journal.metrics.JournalMetrics`,
which this class implements, so ``journal`` itself imports no Prometheus.

What each series means, and what to alert on, is in docs/scaling.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

RebalanceKind = Literal["assigned", "revoked", "lost"]

# A group commit is a transaction on Kafka: tens of ms on a quiet cluster, seconds when the
# coordinators are saturated (issue 20's 50-member probe: p99 3.8 s).
COMMIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# A take: the commit point, reading the partition's rollouts and restoring them (grows with the
# partition's live rollouts; with its history, on an older namespace).
RESTORE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class WorkerMetrics:
    """The series of one worker (names as Prometheus shows them):

    - ``rj_turns_total``: turns made durable by this worker (``rate()``: turns/s);
    - ``rj_commit_seconds``: how long each group commit took (one transaction on Kafka);
    - ``rj_transactions_total``, ``rj_transaction_reinits_total``: transactions committed, and
      producers re-created to heal a dead transaction;
    - ``rj_owned_partitions``: partitions taken and driven here now; ``rj_partitions``: the
      namespace's; ``rj_group_members``: the group's members, as last described (when a rebalance
      left this worker nothing);
    - ``rj_restore_seconds``: per partition taken, from its assignment to its rollouts admitted;
    - ``rj_rebalances_total{kind=assigned|revoked|lost}``: membership changes seen here;
    - ``rj_fenced_appends_total``: appends refused because their partition or epoch moved on;
    - ``rj_results_awaiting_trainer``: the trainer's lag on the results stream, as this worker sees
      it: rollouts on its owned partitions whose training record is there (finished, or given up)
      and whose acknowledgement is not yet applied and durable here;
      ``rj_oldest_result_awaiting_trainer_seconds``: how long the oldest of them has waited since
      this worker learned of it (its finish here, or the take that restored it finished); 0 when
      none waits. Both are read at each scrape (:meth:`watch_awaiting_trainer`).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.turns = Counter("rj_turns", "Turns made durable by this worker", registry=r)
        self.commits = Histogram(
            "rj_commit_seconds",
            "Duration of each group commit (a Kafka transaction)",
            buckets=COMMIT_BUCKETS,
            registry=r,
        )
        self.transactions = Counter("rj_transactions", "Kafka transactions committed", registry=r)
        self.reinits = Counter(
            "rj_transaction_reinits", "Transactional producers re-created to heal a dead transaction", registry=r
        )
        self.owned = Gauge("rj_owned_partitions", "Partitions taken and driven by this worker now", registry=r)
        self.partitions = Gauge("rj_partitions", "Partitions of the namespace (fixed at its creation)", registry=r)
        self.members = Gauge(
            "rj_group_members",
            "Members of the worker group when last described (a rebalance left this worker idle)",
            registry=r,
        )
        self.restores = Histogram(
            "rj_restore_seconds",
            "Per partition taken: commit point, read and restore of its rollouts",
            buckets=RESTORE_BUCKETS,
            registry=r,
        )
        self.rebalances = Counter("rj_rebalances", "Membership changes this worker saw", ["kind"], registry=r)
        for kind in ("assigned", "revoked", "lost"):  # every series from the start: rate() needs a zero
            self.rebalances.labels(kind=kind)
        self.fenced = Counter(
            "rj_fenced_appends", "Appends refused: their partition or their rollout's epoch moved on", registry=r
        )
        self.awaiting_trainer = Gauge(
            "rj_results_awaiting_trainer",
            "Rollouts on owned partitions whose training record (finished or given up) is on the results "
            "stream and whose trainer acknowledgement is not yet applied here",
            registry=r,
        )
        self.oldest_awaiting_trainer = Gauge(
            "rj_oldest_result_awaiting_trainer_seconds",
            "Age of the oldest result awaiting the trainer, since this worker learned of it (its finish here, "
            "or the take that restored it finished); 0 when none waits",
            registry=r,
        )

    # -- the journal's (JournalMetrics) ---------------------------------------------------------

    def commit_seconds(self, seconds: float) -> None:
        self.commits.observe(seconds)

    def transaction_committed(self) -> None:
        self.transactions.inc()

    def transaction_reinitialized(self) -> None:
        self.reinits.inc()

    def appends_fenced(self, count: int) -> None:
        if count:
            self.fenced.inc(count)

    # -- the worker's ---------------------------------------------------------------------------

    def turn_committed(self) -> None:
        self.turns.inc()

    def restored(self, seconds: float) -> None:
        self.restores.observe(seconds)

    def rebalanced(self, kind: RebalanceKind) -> None:
        self.rebalances.labels(kind=kind).inc()

    def watch_owned(self, count: Callable[[], int]) -> None:
        """``rj_owned_partitions`` reads ``count()`` at each scrape."""
        self.owned.set_function(lambda: float(count()))

    def watch_awaiting_trainer(self, count: Callable[[], int], oldest_seconds: Callable[[], float]) -> None:
        """``rj_results_awaiting_trainer`` reads ``count()`` and
        ``rj_oldest_result_awaiting_trainer_seconds`` reads ``oldest_seconds()`` at each scrape (on the
        endpoint's thread: both must be safe to call from there)."""
        self.awaiting_trainer.set_function(lambda: float(count()))
        self.oldest_awaiting_trainer.set_function(oldest_seconds)

    def serve(self, port: int, address: str = "0.0.0.0") -> Callable[[], None]:
        """Serve ``/metrics`` on ``address:port`` (a thread of its own); returns what stops it."""
        server, thread = start_http_server(port, addr=address, registry=self.registry)

        def stop() -> None:
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)

        return stop
