"""Group commit: turns of many rollouts share one backend commit.

Callers enqueue a batch and get a ``CommitFuture`` that resolves once the
batch is durable. One committer thread (the only thread the journal owns:
librdkafka and durable writes block) commits everything queued at once when a
batch is due:

- as soon as somebody waits for a queued append (``result()``, or a callback
  such as ``asyncio.wrap_future`` adds): nobody is kept waiting for company;
- ``linger_ms`` after the oldest queued append at the latest;
- or when ``max_batch_appends`` are queued;

and never sooner than ``commit_interval_ms`` after the previous commit started (Kafka Streams'
``commit.interval.ms``): a fleet worker's transactions then grow with time, not with its turns
(one per interval at most, over every partition it owns), and a waiter or a progress mark that
makes a batch due no longer buys a transaction of its own.

Commits are thus driven by demand, not by a clock: an agent that appends turn
t+1 before it waits for turn t gets both in one commit, and the committer
thread wakes (and takes the GIL from the model's thread) once per commit,
not once per append. An abortable failure redoes the same batch; a fatal one
fails every pending future and closes the committer, because the next attempt
must take over.

An abortable failure whose cause is transient (a broker or coordinator away, a
transaction the producer had to restart) is redone with backoff for as long as
the backend's ``redo_budget_s``; any other abortable one ``max_commit_attempts``
times.

A backend that writes only the partitions its consumer group assigns it (a group
member's Kafka backend) reports each partition's outcome: a partition no longer
assigned (``PartitionRevokedError``), or whose records the broker refused
(``RecordsRefusedError``), fails that partition's appends only, while the others
commit. An append whose ownership check fails (its rollout was admitted under an
assignment that has since changed) fails alone, before every attempt. An append
must then stay within one partition (one rollout's turn always does); one that
spans several fails alone.

Every future ``submit`` hands out resolves: ``submit`` checks for a close or a
fatal stop and enqueues under one lock, so an append is either queued before
the stop sentinel (and committed, or failed with the rest) or refused with
``JournalClosedError`` at once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from rollout_journal.journal.backend import Backend, OutRecord, Stream, partition_for
from rollout_journal.journal.errors import (
    AbortableCommitError,
    FatalJournalError,
    JournalClosedError,
    JournalStoppedError,
    NotAuthorizedError,
    PartitionFencedError,
    RecordLocation,
    RecordsRefusedError,
    writer_fenced,
)
from rollout_journal.journal.metrics import NO_METRICS, JournalMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AppendReceipt:
    """Proof that an append is durable."""

    locations: list[RecordLocation]  # one per event of the append, in order
    commit_ms: float  # wall time of the backend commit that carried it
    batch_appends: int  # how many appends shared that commit


class CommitFuture(Future[AppendReceipt]):
    """A ``Future`` whose waiters make its commit due now (see the module docstring)."""

    def __init__(self, make_due: Callable[[], None]) -> None:
        super().__init__()
        self._make_due = make_due

    def hasten(self) -> None:
        """Make this append's commit due now without waiting for it: for records worth little
        unless durable soon (a model call's progress, which a crash otherwise loses with the
        linger), written by a caller that must not block on them."""
        if not self.done():
            self._make_due()

    def result(self, timeout: float | None = None) -> AppendReceipt:
        if not self.done():
            self._make_due()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self.done():
            self._make_due()
        return super().exception(timeout)

    def add_done_callback(self, fn: Callable[[Future[AppendReceipt]], object]) -> None:
        if not self.done():
            self._make_due()
        super().add_done_callback(fn)


@dataclass
class PendingAppend:
    # Built in the committer thread, so it can see the backend's state at commit time.
    build: Callable[[], Sequence[OutRecord]]
    future: CommitFuture
    # Raises PartitionFencedError when the append may no longer commit (run before every attempt).
    check: Callable[[], None] | None = None

    def still_valid(self, metrics: JournalMetrics = NO_METRICS) -> bool:
        """Run the check; a failed one fails this append alone."""
        if self.check is None:
            return True
        try:
            self.check()
            return True
        except PartitionFencedError as exc:
            if self.future.running():
                self.future.set_exception(exc)
                metrics.appends_fenced(1)
            return False


class _Redo:
    """Whether an aborted commit is redone: transient causes for ``budget_s``, with backoff; others
    ``attempts`` times in all."""

    def __init__(self, attempts: int, budget_s: float) -> None:
        self.attempts, self.budget_s = attempts, budget_s
        self.counted = 0
        self.started: float | None = None
        self.delay = 0.05

    def allowed(self, exc: AbortableCommitError) -> bool:
        if exc.transient and self.budget_s > 0:
            now = time.monotonic()
            self.started = now if self.started is None else self.started
            if now - self.started < self.budget_s:
                time.sleep(self.delay)
                self.delay = min(self.delay * 2, 2.0)
                return True
        self.counted += 1
        return self.counted < self.attempts


class GroupCommitter:
    def __init__(
        self,
        backend: Backend,
        *,
        linger_ms: float,
        max_batch_appends: int,
        max_commit_attempts: int,
        on_committed: Callable[[Sequence[OutRecord], list[RecordLocation]], None],
        metrics: JournalMetrics = NO_METRICS,
        commit_interval_ms: float = 0.0,
    ) -> None:
        self._backend = backend
        self._metrics = metrics
        self._linger_s = linger_ms / 1000.0
        self._interval_s = commit_interval_ms / 1000.0
        self._next_commit_at = 0.0  # monotonic: the previous commit's start plus the interval
        self._max_appends = max_batch_appends
        self._max_attempts = max_commit_attempts
        self._on_committed = on_committed
        self._queue: queue.SimpleQueue[PendingAppend | None] = queue.SimpleQueue()  # C-level put: cheap on the hot path
        self._due = threading.Event()  # somebody waits: commit what is queued without lingering
        self._failure: BaseException | None = None
        self._closed = False
        # Held while checking for a stop and enqueueing, and while stopping: no append
        # can slip in behind the stop sentinel or after the fatal drain.
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="journal-committer", daemon=True)
        self._thread.start()

    def submit(self, build: Callable[[], Sequence[OutRecord]], check: Callable[[], None] | None = None) -> CommitFuture:
        """Queue an append; raises ``JournalClosedError`` once the journal is closed (its subclass
        ``JournalStoppedError`` once a fatal error stopped it). ``check`` runs before every attempt
        to commit it: a ``PartitionFencedError`` it raises fails this append alone."""
        pending = PendingAppend(build, CommitFuture(self._make_due), check)
        with self._lock:
            if self._failure is not None:
                raise JournalStoppedError(self._failure) from self._failure
            if self._closed:
                raise JournalClosedError("journal is closed")
            self._queue.put(pending)
        return pending.future

    def _make_due(self) -> None:
        """Somebody waits for a queued append: end the current linger now. Called again
        after its append was committed, it only makes the next batch skip its linger."""
        self._due.set()

    def close(self) -> None:
        """Commit what is queued, then stop; later appends are refused."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        self._due.set()
        self._thread.join()

    def _next_batch(self) -> tuple[list[PendingAppend], bool]:
        """Wait for an append, linger until the batch is due, then take what is queued.

        The linger sleeps on an event rather than on the queue, so appends arriving
        meanwhile do not wake this thread one by one (each wake takes the GIL from the
        thread that runs the model)."""
        first = self._queue.get()
        if first is not None and not self._due.is_set():
            self._due.wait(self._linger_s)
        if first is not None:
            # what arrives meanwhile joins this batch; a close waits one interval at most
            time.sleep(max(0.0, self._next_commit_at - time.monotonic()))
        self._due.clear()
        batch: list[PendingAppend] = []
        item, stop = first, False
        while True:
            if item is None:
                stop = True
                break
            batch.append(item)
            if len(batch) >= self._max_appends:
                break
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
        return batch, stop

    def _run(self) -> None:
        try:
            while True:
                batch, stop = self._next_batch()
                if batch:
                    self._next_commit_at = time.monotonic() + self._interval_s
                    self._commit(batch)
                if stop or self._failure is not None:  # after a fatal error _fail resolved everything queued
                    return
        except BaseException as exc:  # a bug here must not leave callers waiting forever
            log.exception("journal committer crashed")
            self._fail([], exc)

    def _commit(self, batch: list[PendingAppend]) -> None:
        # A caller that stopped waiting (a cancelled future) still gets its records committed:
        # skipping them could leave a later turn of the same rollout durable without this one.
        for pending in batch:
            pending.future.set_running_or_notify_cancel()
        batch = [pending for pending in batch if pending.still_valid(self._metrics)]
        built: list[tuple[PendingAppend, Sequence[OutRecord]]] = []
        try:
            for pending in batch:
                built.append((pending, pending.build()))
        except BaseException as exc:  # a later append may depend on this one: nothing of the batch commits
            self._fail([(p, ()) for p in batch], FatalJournalError(f"could not build a journal batch: {exc!r}"))
            return
        if self._backend.writes_per_partition:
            self._commit_per_partition(built)
            return
        records = [r for _, recs in built for r in recs]
        redo = _Redo(self._max_attempts, self._backend.redo_budget_s)
        attempt = 0
        while True:
            attempt += 1
            started = time.perf_counter()
            try:
                locations = self._backend.commit(records) if records else []
                break
            except AbortableCommitError as exc:
                log.log(
                    logging.INFO if exc.transient else logging.WARNING,
                    "commit of %d records aborted (attempt %d), redoing: %s",
                    len(records),
                    attempt,
                    exc,
                )
                if not redo.allowed(exc):
                    self._fail(built, FatalJournalError(f"commit still aborted after {attempt} attempts: {exc}"))
                    return
            except BaseException as exc:
                self._fail(built, exc)
                return
        commit_ms = (time.perf_counter() - started) * 1000.0
        if records:
            self._metrics.commit_seconds(commit_ms / 1000.0)
        self._on_committed(records, locations)
        self._resolve(built, locations, commit_ms, len(built))

    @staticmethod
    def _resolve(
        built: Sequence[tuple[PendingAppend, Sequence[OutRecord]]],
        locations: list[RecordLocation],
        commit_ms: float,
        batch_appends: int,
    ) -> None:
        """Resolve each append with the locations of its events (``locations``: of every record, in order)."""
        i = 0
        for pending, recs in built:
            if pending.future.running():
                mine = zip(recs, locations[i : i + len(recs)])
                events = [loc for record, loc in mine if record.stream is Stream.EVENTS and not record.continuation]
                pending.future.set_result(AppendReceipt(events, commit_ms, batch_appends))
            i += len(recs)

    def _commit_per_partition(self, built: list[tuple[PendingAppend, Sequence[OutRecord]]]) -> None:
        """One backend commit of every partition; each partition succeeds, fails or is redone on its own."""
        n = self._backend.partitions
        groups: dict[int, list[tuple[PendingAppend, Sequence[OutRecord]]]] = {}
        nothing: list[tuple[PendingAppend, Sequence[OutRecord]]] = []  # flushes: nothing to write
        for pending, recs in built:
            partitions = {partition_for(r.partition_key, n) for r in recs}
            if len(partitions) > 1:
                if not pending.future.running():
                    continue  # its caller gave up on it: nothing to tell (its records are not written)
                pending.future.set_exception(
                    ValueError(
                        f"an append spans partitions {sorted(partitions)}; with one writer per partition an append "
                        "must stay within one (one rollout's records always do)"
                    )
                )
            elif partitions:
                groups.setdefault(partitions.pop(), []).append((pending, recs))
            else:
                nothing.append((pending, recs))
        todo = {p: group for p, group in groups.items()}
        redo = _Redo(self._max_attempts, self._backend.redo_budget_s)
        attempt = 0
        while todo:
            attempt += 1
            if attempt > 1:  # ownership may have moved while the commit was redone
                todo = {p: [item for item in group if item[0].still_valid(self._metrics)] for p, group in todo.items()}
                todo = {p: group for p, group in todo.items() if group}
                if not todo:
                    break
            records = {p: [r for _, recs in group for r in recs] for p, group in todo.items()}
            started = time.perf_counter()
            try:
                outcomes = self._backend.commit_partitions(records)
            except BaseException as exc:
                self._fail([item for group in todo.values() for item in group] + nothing, exc)
                return
            commit_ms = (time.perf_counter() - started) * 1000.0
            if any(isinstance(outcome, list) and outcome for outcome in outcomes.values()):
                self._metrics.commit_seconds(commit_ms / 1000.0)
            aborted: AbortableCommitError | None = None
            for p, outcome in outcomes.items():
                group = todo[p]
                if isinstance(outcome, list):
                    self._on_committed(records[p], outcome)
                    self._resolve(group, outcome, commit_ms, len(built))
                    del todo[p]
                elif isinstance(
                    outcome, (PartitionFencedError, RecordsRefusedError, ValueError)
                ):  # this partition alone
                    log.info("partition %d: %d appends refused: %s", p, len(group), outcome)
                    if isinstance(outcome, PartitionFencedError):
                        self._metrics.appends_fenced(sum(1 for pending, _ in group if pending.future.running()))
                    for pending, _ in group:
                        if pending.future.running():
                            pending.future.set_exception(outcome)
                    del todo[p]
                elif isinstance(outcome, AbortableCommitError):
                    aborted = outcome
                else:
                    self._fail([item for group in todo.values() for item in group] + nothing, outcome)
                    return
            if aborted is not None and todo:
                log.warning("commit of %d partitions aborted (attempt %d), redoing: %s", len(todo), attempt, aborted)
                if not redo.allowed(aborted):
                    failure = FatalJournalError(f"commit still aborted after {attempt} attempts: {aborted}")
                    self._fail([item for group in todo.values() for item in group] + nothing, failure)
                    return
        self._resolve(nothing, [], 0.0, len(built))

    def _fail(self, built: Sequence[tuple[PendingAppend, Sequence[OutRecord]]], exc: BaseException) -> None:
        # a takeover, or a refusal by the cluster's ACLs: the caller reports it once
        level = logging.INFO if writer_fenced(exc) or isinstance(exc, NotAuthorizedError) else logging.ERROR
        log.log(level, "journal commit failed fatally; stopping the writer: %s", exc)
        with self._lock:  # from here on submit refuses: what is queued now is all there will be
            self._failure = exc
            queued = []
            while True:
                try:
                    queued.append(self._queue.get_nowait())
                except queue.Empty:
                    break
        for pending, _ in built:
            if pending.future.running():
                pending.future.set_exception(exc)
        for item in queued:  # fail whatever was queued too (a close's sentinel needs nothing)
            if item is not None and item.future.set_running_or_notify_cancel():
                item.future.set_exception(JournalStoppedError(exc))
