"""The journal API: atomic turn appends, ordered reads, snapshots and fencing,
the same over every backend."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, cast

from rollout_journal.journal.backend import (
    Backend,
    HeldBack,
    OutRecord,
    StoredRecord,
    Stream,
    compacted,
    partition_for,
)
from rollout_journal.journal.codec import Codec, peek_seq
from rollout_journal.journal.errors import (
    ConfigurationError,
    CorruptRecordError,
    FencedWriteError,
    JournalError,
    PartitionRevokedError,
    RecordLocation,
)
from rollout_journal.journal.event_chunks import ChunkJoiner, split_event
from rollout_journal.journal.events import (
    ROLLOUT_EVENT_TYPES,
    AttemptStarted,
    EventChunk,
    FenceEntry,
    FenceHistory,
    RolloutAcknowledged,
    RolloutEvent,
    TrainingRecord,
    WorkloadRegistered,
)
from rollout_journal.journal.fencing import EpochFence, FencedEventDropped
from rollout_journal.journal.group_commit import AppendReceipt, GroupCommitter
from rollout_journal.journal.metrics import NO_METRICS, JournalMetrics
from rollout_journal.journal.projection import Projection
from rollout_journal.journal.snapshots import (
    BLOCK_BYTES,
    LEGACY_WORKLOAD_PREFIX,
    MIN_BLOCK_BYTES,
    WORKLOAD_SUFFIX,
    Fence,
    SnapshotDraft,
    SnapshotIndex,
    SnapshotSlots,
    bucket_records,
    check_stable,
    fence_record,
    load_snapshots,
    snapshot_records,
    tombstone_records,
    workload_key,
)
from rollout_journal.journal.summary import SummaryWriter, load_summaries, summary_of

if TYPE_CHECKING:  # restore builds on the journal
    from rollout_journal.journal.restore import RolloutHistory

log = logging.getLogger(__name__)

_PEEKABLE = frozenset((*ROLLOUT_EVENT_TYPES, EventChunk))  # records that begin with a rollout event's Header

__all__ = ["Journal", "JournaledEvent", "ReadReport", "Cursor", "AppendReceipt", "SnapshotDraft"]


@dataclass(frozen=True, slots=True)
class JournaledEvent:
    event: RolloutEvent
    location: RecordLocation


@dataclass
class ReadReport:
    """Collects what a lenient read stepped over. Pass one to read past bad records;
    without one, the first corrupt record raises. ``held_back``: partitions whose read ended short
    of records another writer's open transaction holds back (once each; a read-only Kafka journal's):
    nothing is wrong with the journal, but the read shows less than is committed."""

    errors: list[JournalError] = field(default_factory=list)
    fenced: list[FencedEventDropped] = field(default_factory=list)
    records_read: int = 0  # records the backend handed over, wanted or not: what the read cost
    held_back: list[HeldBack] = field(default_factory=list)

    def note_held_back(self, held: Iterable[HeldBack]) -> None:
        """Add ``held``, keeping the first note of each (topic, partition)."""
        known = {(h.topic, h.partition) for h in self.held_back}
        for h in held:
            if (h.topic, h.partition) not in known:
                known.add((h.topic, h.partition))
                log.info("%s", h)  # the reader says it (a replay command: on stderr, once); logged at INFO only
                self.held_back.append(h)

    def merge(self, again: ReadReport, read_whole: Collection[int] = ()) -> None:
        """Add what ``again`` found that this report lacks: ``again`` reports a later read of records
        this report's read covered too (restore reading a rollout again), so each bad record and
        fenced event is added once, however often it was read; ``records_read`` adds up (every read
        cost). ``read_whole``: event-log partitions ``again`` read all of this report's read of: there,
        its held-back notes replace this report's (none once the read caught up); elsewhere a
        partition keeps its first note."""
        known = {str(e) for e in self.errors}
        self.errors.extend(e for e in again.errors if str(e) not in known)
        dropped = {f.location for f in self.fenced}
        self.fenced.extend(f for f in again.fenced if f.location not in dropped)
        self.records_read += again.records_read
        if read_whole:
            self.held_back = [h for h in self.held_back if h.partition not in read_whole]
        self.note_held_back(again.held_back)

    @property
    def clean(self) -> bool:
        return not self.errors and not self.fenced


@dataclass(frozen=True)
class Cursor:
    """Where to resume reading one rollout: from ``offset`` in its partition,
    skipping events with ``seq <= after_seq``; ``epoch`` is the fence already known,
    ``history`` every attempt the fence history names, as (epoch, seq of its AttemptStarted)."""

    offset: int = 0
    after_seq: int = -1
    epoch: int = 0
    resume_seq: int | None = None  # the fence's AttemptStarted is still ahead: older epochs count below this seq
    history: tuple[tuple[int, int], ...] = ()


class Journal:
    """Event journal of rollouts over one backend.

    ``append`` is thread-safe and returns a future that resolves when the
    batch is durable; appends from many rollouts are group-committed.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        linger_ms: float = 2.0,
        max_batch_appends: int = 4096,
        max_commit_attempts: int = 5,
        inline_snapshot_limit: int = 256 * 1024,
        max_record_bytes: int = 512 * 1024,
        max_event_bytes: int = 64 * 1024 * 1024,
        metrics: JournalMetrics | None = None,
        commit_interval_ms: float = 0.0,
        acknowledgement_bucket_size: int = 256,
        snapshot_block_bytes: int = BLOCK_BYTES,
    ) -> None:
        """``max_record_bytes``: an event encoding to more is journaled as ``EventChunk`` pieces
        (lowered to what the backend takes, e.g. a Kafka topic's ``max.message.bytes``), and so is a
        snapshot state over ``inline_snapshot_limit`` (as blob chunks). ``max_event_bytes``: the
        largest event an append takes, and a reader joins; a larger one fails its own append.
        ``metrics`` hears of commits, transactions and fenced appends (``journal.metrics``).
        ``commit_interval_ms``: the least time between the starts of two commits (a fleet worker's
        100 ms: its transactions grow with time, not with turns; see ``journal.group_commit``).
        ``acknowledgement_bucket_size``: once this writer knows that many acknowledged fences of a
        partition, its next acknowledgement there folds them into one bucket (see
        ``journal.snapshots``), so a restore reads a few buckets, not a fence per rollout ever run;
        0 never folds (a version before buckets reads the journal as it always did).
        ``snapshot_block_bytes``: a snapshot's growing sections (a head of tokens, a conversation)
        are written in blocks of this size, each once (see ``journal.snapshots``), so a rollout's
        snapshot bytes grow with its turns, not their square; 0 never writes blocks (a version
        before blocks restores every snapshot)."""
        if acknowledgement_bucket_size < 0:
            raise ConfigurationError(
                f"acknowledgement_bucket_size must be 0 (never fold) or more, not {acknowledgement_bucket_size}"
            )
        if snapshot_block_bytes < 0 or 0 < snapshot_block_bytes < MIN_BLOCK_BYTES:
            raise ConfigurationError(
                f"snapshot_block_bytes must be 0 (no blocks) or at least {MIN_BLOCK_BYTES}, not {snapshot_block_bytes}"
            )
        self.snapshot_block_bytes = snapshot_block_bytes
        self.backend = backend
        self.metrics = metrics or NO_METRICS
        backend.observe(self.metrics)
        self.codec = Codec()
        limit = backend.max_record_bytes
        self.max_record_bytes = max_record_bytes if limit is None else min(max_record_bytes, limit)
        self.max_event_bytes = max_event_bytes
        # A blob chunk is a record too: a few hundred bytes of framing besides its data.
        self.inline_snapshot_limit = min(inline_snapshot_limit, self.max_record_bytes - 1024)
        self._projections: dict[tuple[tuple[str, tuple[str, ...]], ...], Projection] = {}
        self._fence = EpochFence()
        self._fence_lock = threading.Lock()
        self._committed_end: dict[int, int] = {}  # partition -> end after our last commit (committer thread only)
        self._slots: dict[str, SnapshotSlots] = {}  # rollout -> its two snapshot keys, as this writer knows them
        # rollout -> its fence history as this writer knows it: for the fence record (restore's first read)
        # and an acknowledgement's marker; a training record carries the rollout state's own
        self._attempts: dict[str, list[FenceEntry]] = {}
        # A group member's: partition -> the token of the assignment it was taken under (take_partition).
        # Appends commit only while the group still assigns the partition under that token.
        self._taken: dict[int, int] = {}
        self._acknowledged: set[str] = set()  # rollouts this writer knows acknowledged (restore, or applied here)
        self._acknowledging: dict[str, int] = {}  # rollout -> its newest acknowledgement not yet settled
        self._ack_serial = 0
        self.acknowledgement_bucket_size = acknowledgement_bucket_size
        # partition -> acknowledged rollouts whose fence record is durable and in no bucket this writer wrote
        # (rollout -> its acknowledged epoch and newest attempt): what the next fold there takes
        self._loose: dict[int, dict[str, tuple[int, int]]] = {}
        self._workloads_stream_checked = False  # register_workload looked for registrations to copy there
        # Each rollout's summary, folded from what this writer appends (a backend that keeps summaries)
        # (a summary goes whole into its own record and into a snapshot's, beside an inline state)
        self._summaries = SummaryWriter(self.codec, self.inline_snapshot_limit) if backend.keeps_summaries else None
        self._committer = GroupCommitter(
            backend,
            linger_ms=linger_ms,
            max_batch_appends=max_batch_appends,
            max_commit_attempts=max_commit_attempts,
            on_committed=self._note_committed,
            metrics=self.metrics,
            commit_interval_ms=commit_interval_ms,
        )

    # -- writing -----------------------------------------------------------
    def partition_of(self, rollout_id: str) -> int:
        return partition_for(rollout_id, self.backend.partitions)

    def append(
        self,
        events: Sequence[RolloutEvent],
        snapshot: SnapshotDraft | None = None,
        result: TrainingRecord | None = None,
    ) -> Future[AppendReceipt]:
        """Append one turn's events (and its snapshot, and a final turn's training record on the
        results stream) atomically. The record is published as handed over: its fence history
        (``attempts``) is the rollout's own, which its state folded from every ``AttemptStarted``.

        Raises ``FencedWriteError`` at once if an event's epoch is older than
        the epoch this journal knows for its rollout, ``OversizedEventError`` if
        an event encodes to more than ``max_event_bytes``.
        """
        if snapshot is not None:  # first too: a bad draft fails its own append, never the committer's batch
            check_stable(snapshot)
        encoded: list[OutRecord] = []
        for event in events:  # first: an event too large even in pieces fails this append before anything changes
            rollout_id, value = event.header.rollout_id, self.codec.encode(event)
            pieces = split_event(self.codec, event, value, self.max_record_bytes, self.max_event_bytes)
            encoded.extend(
                OutRecord(Stream.EVENTS, rollout_id, piece, rollout_id, continuation=i > 0)
                for i, piece in enumerate(pieces)
            )
        headers = [e.header for e in events] + ([snapshot.header] if snapshot is not None else [])
        with self._fence_lock:
            try:
                for header in headers:
                    current = self._fence.current(header.rollout_id)
                    if header.epoch < current:
                        raise FencedWriteError(header.rollout_id, header.epoch, current)
                owned = self._owned_under(events, snapshot)
            except (FencedWriteError, PartitionRevokedError):
                self.metrics.appends_fenced(1)
                raise
            for event in events:
                if isinstance(
                    event, AttemptStarted
                ):  # the fence history, in the same commit, where restore reads first
                    h = event.header
                    self._fence.raise_to(h.rollout_id, h.epoch)
                    attempts = self._attempts.setdefault(h.rollout_id, [])
                    attempts.append(FenceEntry.of(h))
                    encoded.append(fence_record(self.codec, FenceHistory(h.rollout_id, list(attempts))))
            if self._summaries is not None:
                encoded.extend(self._summary_records(events))
                if snapshot is not None:
                    summary = self._summaries.encoded(snapshot.header.rollout_id, snapshot.covers_seq)
                    snapshot = dataclasses.replace(snapshot, summary=summary)
        if result is not None:  # the same commit as the final turn: a trainer sees both or neither
            rollout_id = result.rollout_id
            pieces = split_event(
                self.codec, result, self.codec.encode(result), self.max_record_bytes, self.max_event_bytes
            )
            encoded.extend(
                OutRecord(Stream.RESULTS, rollout_id, piece, rollout_id, continuation=i > 0)
                for i, piece in enumerate(pieces)
            )
        if snapshot is None:
            return self._summarized(events, self._committer.submit(lambda: encoded, check=owned))
        draft = snapshot
        partition = self.partition_of(draft.header.rollout_id)
        if partition not in self._committed_end:  # asked here, not in the committer: it may fail or block
            self._committed_end.setdefault(partition, self.backend.end_offset(partition))
        future = self._committer.submit(lambda: encoded + self._snapshot_records(draft), check=owned)
        Future.add_done_callback(future, lambda done: self._snapshot_settled(draft.header.rollout_id, done))
        return self._summarized(events, future)

    def _snapshot_settled(self, rollout_id: str, done: Future[AppendReceipt]) -> None:
        """A snapshot whose commit failed leaves what this writer knows of the rollout's slots ahead
        of the stream (its blocks taken as written): forget it, so the next snapshot writes every
        block it names, into slot 0 (safe whichever slot holds the newest valid one: the commit that
        overwrites it writes the newer one). What the older values named stays until the topic goes."""
        if not done.cancelled() and done.exception() is not None:
            self._slots.pop(rollout_id, None)

    def _summary_records(self, events: Sequence[RolloutEvent]) -> list[OutRecord]:
        """(Under the fence lock.) Each rollout's summary after ``events``, with tombstones of the
        keys of the attempts a new one supersedes (see :mod:`rollout_journal.journal.summary`)."""
        assert self._summaries is not None
        by_rollout: dict[str, list[RolloutEvent]] = {}
        for event in events:
            by_rollout.setdefault(event.header.rollout_id, []).append(event)
        records: list[OutRecord] = []
        for rollout_id, its in by_rollout.items():
            superseding = any(isinstance(e, AttemptStarted) for e in its)
            earlier = [entry.epoch for entry in self._attempts.get(rollout_id, [])] if superseding else []
            records += self._summaries.records(its, earlier)
        return records

    def _summarized(self, events: Sequence[RolloutEvent], future: Future[AppendReceipt]) -> Future[AppendReceipt]:
        """An append that fails leaves its rollouts' folds ahead of the journal: forget them (their
        next summaries are incomplete until a restore learns them again)."""
        summaries = self._summaries
        if summaries is None or not events:
            return future
        rollout_ids = {e.header.rollout_id for e in events}

        def settled(done: Future[AppendReceipt]) -> None:
            if done.cancelled():
                return
            if done.exception() is not None:
                with self._fence_lock:
                    for rollout_id in rollout_ids:
                        summaries.forget(rollout_id)

        # Future's own method: the committer's would make the batch due and skip its linger.
        Future.add_done_callback(future, settled)
        return future

    def first_offset(self, rollout_id: str) -> int:
        """Where the rollout's events begin on its partition, as its newest summary says (0 where
        no summary tells: a backend without summaries, or a summary written before it was known)."""
        if not self.backend.keeps_summaries:
            return 0
        index = load_summaries(self.codec, self.backend.read_summaries([self.partition_of(rollout_id)]))
        summary = index.summaries.get(rollout_id)
        return summary.first_offset if summary is not None and summary.complete and summary.first_offset > 0 else 0

    def note_restored(self, history: RolloutHistory) -> None:
        """Tell the writer the history a restore of a rollout read (:func:`~rollout_journal.journal.summary.summary_of`
        folds its summary from it), so the summaries it writes next are whole. Nothing is folded on a
        backend that keeps no summaries."""
        if self._summaries is not None:
            fold = summary_of(self.codec, history)
            with self._fence_lock:
                self._summaries.note(history.rollout_id, fold)

    def _owned_under(self, events: Sequence[RolloutEvent], snapshot: SnapshotDraft | None) -> Callable[[], None]:
        """The check an append's batch runs in the committer before every attempt: its partition is
        still assigned under the token it was taken with (a group member's backend; any other owns
        every partition). Raises ``PartitionRevokedError`` at once if it is not now."""
        rollout_ids = {e.header.rollout_id for e in events} | ({snapshot.header.rollout_id} if snapshot else set())
        return self._partition_check({self.partition_of(r) for r in rollout_ids})

    def _partition_check(self, partitions: Collection[int]) -> Callable[[], None]:
        if not self.backend.writes_per_partition:
            return lambda: None
        expected = {p: self._taken.get(p) for p in partitions}
        for partition, token in expected.items():
            if token is None or self.backend.owner_token(partition) != token:
                raise self._revoked(partition)

        def still_owned() -> None:
            for partition, token in expected.items():
                if self.backend.owner_token(partition) != token:
                    raise self._revoked(partition)

        return still_owned

    def _revoked(self, partition: int) -> PartitionRevokedError:
        return PartitionRevokedError(
            f"partition {partition} is not this writer's now (revoked, lost, or assigned anew since the "
            "attempt began): the append is refused; the partition's owner continues from the last committed turn",
            partition,
        )

    def append_sync(
        self,
        events: Sequence[RolloutEvent],
        snapshot: SnapshotDraft | None = None,
        result: TrainingRecord | None = None,
    ) -> AppendReceipt:
        return self.append(events, snapshot, result).result()

    def acknowledge(
        self, event: RolloutAcknowledged, attempts: Sequence[FenceEntry] | None = None
    ) -> Future[AppendReceipt]:
        """The trainer took a finished rollout: journal ``event`` (built by whoever acknowledges, as
        every event is, so the event a writer applies to its state is the one journaled), tombstone
        the rollout's snapshots, and mark its fence acknowledged at the event's epoch (kept, so no
        zombie snapshot brings it back). ``attempts``: its fence history, for a writer that never
        ran it (a trainer acknowledging from its training record); else what this writer knows."""
        header = event.header
        rollout_id = header.rollout_id
        partition = self.partition_of(rollout_id)
        encoded = OutRecord(Stream.EVENTS, rollout_id, self.codec.encode(event), rollout_id)
        check = self._partition_check([partition])  # refused here: nothing to remember
        with self._fence_lock:
            self._acknowledged.add(rollout_id)
            known = self._attempts.get(rollout_id, []) if attempts is None else attempts
            marker = FenceHistory(rollout_id, list(known), header.epoch)
            newest = max(known, key=lambda entry: entry.epoch).attempt if known else 0  # what its fence says
            summary = self._summary_records([event]) if self._summaries is not None else []
            folding = self._take_fold(partition)
        fence = fence_record(self.codec, marker)
        folded = bucket_records(self.codec, partition, folding) if folding else []
        future = self._committer.submit(
            lambda: [
                encoded,
                *tombstone_records(rollout_id, self._slots.get(rollout_id), keep_fence=True),
                fence,
                *summary,
                *folded,
            ],
            check=check,
        )
        self._summarized([event], future)
        with self._fence_lock:
            self._ack_serial += 1
            serial = self._acknowledging[rollout_id] = self._ack_serial

        def settled(done: Future[AppendReceipt]) -> None:
            self._acknowledgement_settled(rollout_id, serial, done)
            self._fold_settled(partition, rollout_id, (header.epoch, newest), folding, done)

        # Future's own method: the committer's would make the batch due and skip its linger.
        Future.add_done_callback(future, settled)
        return future

    def _take_fold(self, partition: int) -> dict[str, tuple[int, int]]:
        """(Under the fence lock.) The loose acknowledged fences of ``partition`` to fold into a bucket
        with the next acknowledgement's commit, taken out of ``_loose`` (given back if it fails);
        nothing until there are ``acknowledgement_bucket_size`` of them. A bucket holds at most what
        fits half a record."""
        size = self.acknowledgement_bucket_size
        loose = self._loose.get(partition)
        if size == 0 or loose is None or len(loose) < size:
            return {}
        taken: dict[str, tuple[int, int]] = {}
        budget = self.max_record_bytes // 2
        for rollout_id in list(loose)[:size]:  # one bucket's worth: an unreadable bucket costs no more
            budget -= len(rollout_id.encode()) + 12
            if budget < 0 and taken:
                break
            taken[rollout_id] = loose.pop(rollout_id)
        return taken

    def _fold_settled(
        self,
        partition: int,
        rollout_id: str,
        entry: tuple[int, int],
        folding: dict[str, tuple[int, int]],
        done: Future[AppendReceipt],
    ) -> None:
        """An acknowledgement's commit settled: its rollout's fence is a loose one now, to be folded
        later; the fences it folded are gone, or, if it failed, loose again. A wait cancelled before
        the commit decided says nothing of it: the fold is given back (folding a fence twice is
        harmless) and the rollout is not taken for loose (the next restore learns its fence). A
        partition this writer released meanwhile is not its to fold."""
        failed = done.cancelled() or done.exception() is not None
        with self._fence_lock:
            loose = self._loose.get(partition)
            released = self.backend.writes_per_partition and partition not in self._taken
            if loose is None and (failed or released):
                return
            loose = self._loose.setdefault(partition, {})
            if failed:
                loose.update(folding)
            else:
                loose[rollout_id] = entry

    def _acknowledgement_settled(self, rollout_id: str, serial: int, done: Future[AppendReceipt]) -> None:
        """Durable (or cancelled by its waiter: the committer commits it all the same): the rollout's
        slots are gone. Failed: the rollout is not acknowledged here after all, so the
        acknowledgement can be applied again (and its blobs still be tombstoned); unless a newer
        acknowledgement of it (a take's, say) was made since, which then decides."""
        failed = not done.cancelled() and done.exception() is not None
        with self._fence_lock:
            if self._acknowledging.get(rollout_id) != serial:
                return
            del self._acknowledging[rollout_id]
            if failed:
                self._acknowledged.discard(rollout_id)
        if not failed:
            self._slots.pop(rollout_id, None)
            if self._summaries is not None:  # nothing follows an acknowledgement: a long-lived writer keeps no fold
                with self._fence_lock:
                    self._summaries.drop([rollout_id])

    def request_acknowledgement(
        self, event: RolloutAcknowledged, attempts: Sequence[FenceEntry] | None = None
    ) -> Future[AppendReceipt]:
        """The trainer took a finished rollout. On Kafka the request (``event`` itself) goes to
        ``<namespace>.acks`` and the rollout's partition owner journals that event in its own
        transaction (:meth:`apply_acknowledgement`): the trainer never writes an owner's partitions.
        Elsewhere it is :meth:`acknowledge`."""
        publish = getattr(self.backend, "publish_acknowledgement", None)
        if publish is None:
            return self.acknowledge(event, attempts)
        encoded = self.codec.encode(event)
        published = cast("Future[RecordLocation]", publish(event.header.rollout_id, encoded))
        receipt: Future[AppendReceipt] = Future()

        def delivered(done: Future[RecordLocation]) -> None:  # the request is durable: that is its receipt
            error = done.exception()
            if error is not None:
                receipt.set_exception(error)
            else:
                receipt.set_result(AppendReceipt([done.result()], 0.0, 1))

        published.add_done_callback(delivered)
        return receipt

    def apply_acknowledgement(self, stored: StoredRecord) -> Future[AppendReceipt] | None:
        """(An owner's.) Apply one record of ``<namespace>.acks``: ``RolloutAcknowledged`` on the events,
        the snapshots tombstoned, the fence marked, in this owner's next transaction. None when there is
        nothing to do: acknowledged already, a stale attempt's, or not a record of this partition."""
        try:
            if stored.error is not None or stored.value is None:
                raise CorruptRecordError(stored.location, stored.error or "an acknowledgement record has no value")
            ack = self.codec.decode(stored.value, stored.location)
            if not isinstance(ack, RolloutAcknowledged):
                raise CorruptRecordError(stored.location, f"holds a {type(ack).__name__}, not RolloutAcknowledged")
        except JournalError as exc:
            log.warning("skipping acknowledgement record: %s", exc)
            return None
        header = ack.header
        rollout_id = header.rollout_id
        if self.partition_of(rollout_id) != stored.location.partition:
            log.warning("acknowledgement of %s at %s is on the wrong partition; skipped", rollout_id, stored.location)
            return None
        with self._fence_lock:
            current = self._fence.current(rollout_id)
            done = rollout_id in self._acknowledged
        if done:
            return None
        if header.epoch < current:
            log.info(
                "acknowledgement of %s epoch %d is stale (epoch %d runs); skipped", rollout_id, header.epoch, current
            )
            return None
        return self.acknowledge(ack)  # the event the trainer built, journaled as it is

    def register_workload(self, registration: WorkloadRegistered) -> Future[AppendReceipt]:
        """Record a workload (its spec and rollout ids) in the compacted streams; the newest wins. On
        the snapshot stream (restore and the read tools find it there) and, on a backend that keeps
        one, the workloads stream (what a fleet's workers follow). Found empty there the first time,
        the workloads stream gets a copy of every registration of the snapshot stream in the same
        commit (a namespace of an older version), so that following it misses none."""
        value = self.codec.encode(registration)
        records = [OutRecord(Stream.SNAPSHOTS, workload_key(registration.name), value, registration.name)]
        checking = self.backend.keeps_workloads and not self._workloads_stream_checked
        if checking:
            records += self._legacy_registration_copies(exclude=registration.name)
        if self.backend.keeps_workloads:
            records.append(OutRecord(Stream.WORKLOADS, registration.name, value, registration.name))
        committed = self._committer.submit(lambda: records)
        if checking:  # once the copies are durable; a failed commit looks again next time

            def checked(done: Future[AppendReceipt]) -> None:
                if done.exception() is None:
                    self._workloads_stream_checked = True

            committed.add_done_callback(checked)
        return committed

    def _legacy_registration_copies(self, exclude: str) -> list[OutRecord]:
        """Copies for the workloads stream of the snapshot stream's registrations, when it holds none."""
        if registrations(self.codec, self.backend.read_workloads()):
            return []
        legacy = self._snapshot_registrations()
        legacy.pop(exclude, None)
        if legacy:
            log.info(
                "%s held no workload registration: %d copied there from the snapshot stream (%s)",
                self._workloads_stream_name(),
                len(legacy),
                ", ".join(sorted(legacy)),
            )
        return [OutRecord(Stream.WORKLOADS, name, self.codec.encode(r), name) for name, r in sorted(legacy.items())]

    def _snapshot_registrations(self) -> dict[str, WorkloadRegistered]:
        """Every registration the snapshot stream holds (all of it is read: its states too)."""
        records = [
            r
            for r in self.backend.read_snapshots()
            if r.error is None and (r.key.endswith(WORKLOAD_SUFFIX) or r.key.startswith(LEGACY_WORKLOAD_PREFIX))
        ]
        index = load_snapshots(self.codec, records)
        for exc in index.errors:
            log.warning("%s", exc)
        return index.workloads

    def _workloads_stream_name(self) -> str:
        return str(getattr(self.backend, "workloads_topic", f"the {self.backend.kind} journal's workloads stream"))

    def workloads(self) -> dict[str, WorkloadRegistered]:
        """Every workload registered, newest registration per name: from the workloads stream, or, on
        a backend without one or while it holds none (a namespace of an older version), from the
        snapshot stream."""
        if self.backend.keeps_workloads:
            found = registrations(self.codec, self.backend.read_workloads())
            if found:
                return found
        return self._snapshot_registrations()

    def tombstone(self, rollout_id: str) -> Future[AppendReceipt]:
        """Drop everything a rollout holds in the compacted stream: snapshots, blob chunks, fence.
        It leaves no marker: a read that outlasts the stream's tombstone retention (Kafka's
        ``delete.retention.ms``, 10 minutes by default) may miss these tombstones and see the rollout as it
        was. A rollout that must stay gone is acknowledged instead: its fence stays."""
        with self._fence_lock:
            self._attempts.pop(rollout_id, None)
        return self._committer.submit(lambda: tombstone_records(rollout_id, self._slots.pop(rollout_id, None)))

    def discard(self, records: Sequence[OutRecord]) -> Future[AppendReceipt]:
        """Commit ``records``, tombstones of snapshot-stream keys nothing names any more (a restore's
        ``RestorePlan.orphans``: blocks and blob chunks of rollouts acknowledged or tombstoned by a
        writer that did not know them), while this writer still owns their partitions."""
        check = self._partition_check({self.partition_of(r.partition_key) for r in records})
        return self._committer.submit(lambda: list(records), check=check)

    def note_epoch(self, rollout_id: str, epoch: int) -> None:
        """Tell the writer-side fence an epoch learned by reading (restore)."""
        with self._fence_lock:
            self._fence.raise_to(rollout_id, epoch)

    def note_fence(self, rollout_id: str, fence: Fence) -> None:
        """Tell the writer a rollout's fence history (restore learns it), so the next attempt's fence
        record keeps every earlier attempt, and appends of older epochs are refused."""
        with self._fence_lock:
            self._fence.raise_to(rollout_id, fence.epoch)
            self._attempts[rollout_id] = list(fence.history)
            if fence.acknowledged_epoch is not None:
                self._acknowledged.add(rollout_id)
                entry = (fence.acknowledged_epoch, fence.attempt)
                self._loose.setdefault(self.partition_of(rollout_id), {})[rollout_id] = entry

    def note_folded(self, rollout_ids: Iterable[str]) -> None:
        """Tell the writer rollouts that buckets name as acknowledged (restore learns them): in bulk,
        and nothing more than that (no attempt of theirs follows), since a long history has many."""
        with self._fence_lock:
            self._acknowledged.update(rollout_ids)

    def note_snapshot_slots(self, rollout_id: str, slots: SnapshotSlots) -> None:
        """Tell the writer what a rollout's snapshot keys hold (restore learns it), so the next snapshot
        overwrites the older one and superseded blobs are tombstoned."""
        self._slots[rollout_id] = slots

    def _snapshot_records(self, draft: SnapshotDraft) -> list[OutRecord]:
        # Runs in the committer thread: no event of this rollout newer than
        # ``covers_seq`` can precede the end of our previous commit.
        rollout_id = draft.header.rollout_id
        partition = self.partition_of(rollout_id)
        records, self._slots[rollout_id] = snapshot_records(
            self.codec,
            draft,
            partition,
            self._committed_end[partition],
            self.inline_snapshot_limit,
            self._slots.get(rollout_id, SnapshotSlots()),
            self.snapshot_block_bytes,
        )
        return records

    def _note_committed(self, records: Sequence[OutRecord], locations: list[RecordLocation]) -> None:
        if self._summaries is not None:  # before the appends' futures resolve: their next summaries know
            with self._fence_lock:
                self._summaries.located(records, locations)
        for record, location in zip(records, locations):
            if record.stream is Stream.EVENTS:
                after = self.backend.offset_after(location)
                if after > self._committed_end.get(location.partition, 0):
                    self._committed_end[location.partition] = after

    def flush(self) -> None:
        """Wait until everything appended so far is durable."""
        self._committer.submit(lambda: []).result()

    # -- partition ownership (a worker fleet's backend) ---------------------------------------
    def take_partition(self, partition: int, token: int | None = None) -> None:
        """Prepare to write ``partition``, which the group assigned (under ``token``, the backend's
        ``own()``; None: its current one): the backend learns where the previous owner's commits end
        (waiting while its last transaction is undecided). Appends to the partition commit from now
        on, while that assignment lasts. Restore the partition's rollouts after this, never before."""
        current = self.backend.owner_token(partition)
        token = current if token is None else token
        if self.backend.writes_per_partition and (token is None or token != current):
            raise self._revoked(partition)
        self.backend.take_partition(partition)
        self._committed_end.pop(partition, None)  # the next snapshot asks where the partition ends now
        if token is not None:
            self._taken[partition] = token

    def release_partition(self, partition: int) -> None:
        """Stop writing ``partition`` (revoked or lost: its appends are refused from now on) and forget
        what this writer knew of its rollouts: whoever takes it next restores them."""
        self._taken.pop(partition, None)
        self.backend.release_partition(partition)
        self._committed_end.pop(partition, None)
        with self._fence_lock:
            for rollout_id in [r for r in self._attempts if self.partition_of(r) == partition]:
                del self._attempts[rollout_id]
                self._fence.forget(rollout_id)
            self._acknowledged = {r for r in self._acknowledged if self.partition_of(r) != partition}
            self._acknowledging = {r: n for r, n in self._acknowledging.items() if self.partition_of(r) != partition}
            self._loose.pop(partition, None)
            if self._summaries is not None:
                self._summaries.drop(r for r in self._summaries.known() if self.partition_of(r) == partition)
        for rollout_id in [r for r in self._slots if self.partition_of(r) == partition]:
            self._slots.pop(rollout_id, None)

    def close(self) -> None:
        self._committer.close()
        self.backend.close()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading -----------------------------------------------------------
    def _decode(
        self, stored: StoredRecord, report: ReadReport | None, chunks: ChunkJoiner, projection: Projection | None = None
    ) -> JournaledEvent | None:
        """The event a record holds (only the fields ``projection`` keeps, if given); None for a piece
        of a chunked event not yet complete, or (with a report) a bad record."""
        try:
            if stored.error is not None:
                raise CorruptRecordError(stored.location, stored.error)
            if stored.value is None:  # a tombstone written by a foreign producer: no record at all
                raise CorruptRecordError(stored.location, "the record has no value (null); no journal event does")
            decode = self.codec.decode if projection is None else projection.decode
            record = decode(stored.value, stored.location)
            location = stored.location
            if isinstance(record, EventChunk):
                joined = chunks.add(record, location)
                if joined is None:
                    return None
                location = joined.location
                record = decode(joined.encoded, location)
            if not isinstance(record, ROLLOUT_EVENT_TYPES):
                raise CorruptRecordError(
                    location,
                    f"holds a {type(record).__name__} record, not a rollout event (it belongs on the snapshot stream)",
                )
            # cast: checked just above (isinstance narrows on a tuple of the Union's classes only from mypy 2.0)
            return JournaledEvent(cast(RolloutEvent, record), location)
        except JournalError as exc:
            self._report(exc, report)
            return None

    @staticmethod
    def _report(exc: JournalError, report: ReadReport | None) -> None:
        if report is None:
            raise exc
        log.warning("%s", exc)
        report.errors.append(exc)

    def _admit(self, fence: EpochFence, item: JournaledEvent, report: ReadReport | None) -> bool:
        if fence.admit(item.event):
            return True
        header = item.event.header
        dropped = FencedEventDropped(
            item.location, header.rollout_id, header.epoch, fence.current(header.rollout_id), type(item.event).__name__
        )
        log.info("%s", dropped)
        if report is not None:
            report.fenced.append(dropped)
        return False

    def note_damage(self, report: ReadReport | None) -> None:
        """Damage no record read shows (a lost snapshot file) goes into a report, once."""
        if report is None:
            return
        known = {str(e) for e in report.errors}
        for damage in self.backend.damage():
            if str(damage) not in known:
                log.warning("%s", damage)
                report.errors.append(damage)

    def read_rollouts(
        self,
        cursors: Mapping[str, Cursor],
        report: ReadReport | None = None,
        first_offsets: dict[str, int] | None = None,
    ) -> Iterator[JournaledEvent]:
        """Events of the given rollouts after their cursors, in log order per
        partition, fenced. One pass per partition from its lowest cursor. ``first_offsets`` (if
        given) receives where a rollout's first event (seq 0) lies when the read passes over it,
        covered by the rollout's snapshot: a summary that snapshot keeps may not know it."""
        self.note_damage(report)
        by_partition: dict[int, dict[str, Cursor]] = {}
        for rollout_id, known in cursors.items():
            by_partition.setdefault(self.partition_of(rollout_id), {})[rollout_id] = known
        for partition, wanted in sorted(by_partition.items()):
            fence = EpochFence()
            for rollout_id, known in wanted.items():
                fence.raise_to(rollout_id, known.epoch, known.resume_seq)
                fence.learn(rollout_id, dict(known.history))
            start = min(c.offset for c in wanted.values())
            chunks = ChunkJoiner(self.max_event_bytes)
            for stored in read_events_noting(self.backend, partition, start, report):
                if report is not None:
                    report.records_read += 1
                cursor = wanted.get(stored.key)
                if cursor is None and stored.error is None:
                    continue  # another rollout sharing the partition
                if cursor is not None and stored.location.offset < cursor.offset:
                    continue
                if cursor is not None and cursor.after_seq >= 0:
                    seq = self._peeked_seq(stored)
                    if seq is None and first_offsets is not None:  # its first event may lie here, unread
                        first_offsets.setdefault(stored.key, -1)
                    elif seq is not None and seq <= cursor.after_seq:  # covered by the snapshot: skip undecoded
                        if seq == 0 and first_offsets is not None:
                            first_offsets.setdefault(stored.key, stored.location.offset)
                        continue
                item = self._decode(stored, report, chunks)
                if item is None or item.event.header.rollout_id not in wanted:
                    continue
                if item.event.header.seq <= wanted[item.event.header.rollout_id].after_seq:
                    continue
                if self._admit(fence, item, report):
                    yield item
            for exc in chunks.unfinished():
                self._report(exc, report)

    def _peeked_seq(self, stored: StoredRecord) -> int | None:
        """The seq of a header-led record, read without decoding it; None where it cannot be peeked
        (unreadable, or another kind of record): the full decode names what is wrong."""
        if stored.error is not None or stored.value is None:
            return None
        try:
            if self.codec.record_class(stored.value) not in _PEEKABLE:
                return None
            return peek_seq(stored.value)
        except (IndexError, ValueError):
            return None

    def read_rollout(
        self, rollout_id: str, cursor: Cursor = Cursor(), report: ReadReport | None = None
    ) -> Iterator[JournaledEvent]:
        """One rollout's events after ``cursor`` in order, fenced."""
        return self.read_rollouts({rollout_id: cursor}, report)

    def scan(
        self,
        report: ReadReport | None = None,
        fields: Mapping[type, tuple[str, ...]] | None = None,
        partitions: Iterable[int] | None = None,
    ) -> Iterator[JournaledEvent]:
        """Every committed event of the journal (of ``partitions`` only, if given), fenced,
        partition by partition. Memory stays bounded by the number of rollouts (one epoch each).

        ``fields`` (record class -> field names) reads those record types projected: only the named
        fields are decoded, the others are ``None`` (see :mod:`rollout_journal.journal.projection`); for a reader
        that folds bookkeeping only, never for one that restores, audits or exports. Damage beyond
        any one record (:meth:`note_damage`) goes into ``report`` on a whole-journal scan only."""
        projection = None if fields is None else self.projection(fields)
        if partitions is None:
            self.note_damage(report)
        for partition in range(self.backend.partitions) if partitions is None else partitions:
            fence = EpochFence()
            chunks = ChunkJoiner(self.max_event_bytes)
            for stored in read_events_noting(self.backend, partition, 0, report):
                if report is not None:
                    report.records_read += 1
                item = self._decode(stored, report, chunks, projection)
                if item is not None and self._admit(fence, item, report):
                    yield item
            for exc in chunks.unfinished():
                self._report(exc, report)

    def projection(self, fields: Mapping[type, tuple[str, ...]]) -> Projection:
        """The projected reader keeping ``fields`` (built once per field set: readers are generated)."""
        key = tuple(sorted((cls.__name__, tuple(names)) for cls, names in fields.items()))
        found = self._projections.get(key)
        if found is None:
            found = self._projections[key] = Projection(self.codec, fields)
        return found

    def follow_workloads(self) -> WorkloadFeed:
        """The workload registrations as they are committed (a fleet's workers pick them up): the
        workloads stream, followed; the snapshot stream is read once, at the first poll, only where
        the workloads stream holds nothing yet (a namespace of an older version)."""
        follow = getattr(self.backend, "follow_workloads", None)
        if follow is None:
            raise ConfigurationError(
                f"a {self.backend.kind} journal cannot be followed; a fleet shares a Kafka namespace"
            )
        follower = follow()
        if follower is None:
            raise ConfigurationError(
                f"{self._workloads_stream_name()} does not exist: open the namespace with a writer of this "
                "version (a worker, submit), which creates it"
            )
        return WorkloadFeed(self.codec, follower, self._snapshot_registrations, self._workloads_stream_name())

    def snapshots(self, partitions: Collection[int] | None = None) -> SnapshotIndex:
        """Newest valid snapshot of every rollout still in the compacted stream (on ``partitions``
        only, if given), with every fence and workload registration found there."""
        index = load_snapshots(self.codec, self.backend.read_snapshots(partitions))
        for exc in index.errors:
            log.warning("%s", exc)
        return index


class RecordFollower(Protocol):
    """What a backend's ``follow_workloads()`` returns: each poll, the records committed since the last."""

    def poll(self) -> list[StoredRecord]: ...

    def close(self) -> None: ...


def read_events_noting(
    backend: Backend, partition: int, start: int, report: ReadReport | None
) -> Iterator[StoredRecord]:
    """``backend.read_events(partition, start)``; where the backend can tell that an open transaction
    held the read back (a read-only Kafka backend), that goes to ``report`` once the partition is read."""
    if report is None:
        yield from backend.read_events(partition, start)
        return
    held: list[HeldBack] = []
    yield from backend.read_events(partition, start, held)
    report.note_held_back(held)


def registrations(codec: Codec, stored: Iterable[StoredRecord]) -> dict[str, WorkloadRegistered]:
    """The newest registration per workload of records of the workloads stream (key: the workload's
    name); a tombstone drops its workload, a record that is no registration is logged and skipped."""
    found: dict[str, WorkloadRegistered] = {}
    for key, kept in compacted(
        stored, 1, lambda r: log.warning("%s", CorruptRecordError(r.location, str(r.error)))
    ).items():
        record = kept[-1]
        try:
            value = codec.decode(cast(bytes, record.value), record.location)
        except JournalError as exc:
            log.warning("%s", exc)
            continue
        if not isinstance(value, WorkloadRegistered) or value.name != key:
            log.warning("%s holds no registration of workload %r; skipped", record.location, key)
            continue
        found[key] = value
    return found


class WorkloadFeed:
    """New workload registrations, as they are committed to the workloads stream."""

    def __init__(
        self,
        codec: Codec,
        follower: RecordFollower,
        legacy: Callable[[], dict[str, WorkloadRegistered]],
        where: str,
    ) -> None:
        """``legacy``: the snapshot stream's registrations, read at the first poll if the workloads
        stream holds none; ``where``: the journal, as the log line names it."""
        self._codec = codec
        self._follower = follower
        self._legacy: Callable[[], dict[str, WorkloadRegistered]] | None = legacy
        self._where = where

    def poll(self) -> dict[str, WorkloadRegistered]:
        """The registrations committed since the last poll (the first: all), newest per workload."""
        found = registrations(self._codec, self._follower.poll())
        legacy, self._legacy = self._legacy, None
        if legacy is not None and not found:  # nothing there: a namespace whose snapshot stream alone holds them?
            found = legacy()
            if found:
                log.info(
                    "%s holds no workload registration; %d read once from the snapshot stream "
                    "(a namespace of an older version; the next submit copies them there): %s",
                    self._where,
                    len(found),
                    ", ".join(sorted(found)),
                )
        return found

    def close(self) -> None:
        """Stop following; a poll after this (a worker polls on one thread and closes on another)
        finds nothing, not even the snapshot stream's registrations."""
        self._legacy = None
        self._follower.close()
