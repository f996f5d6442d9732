"""The Kafka backend's readers: a pool of ``read_committed`` consumers.

Consumers are assigned (not subscribed) to partitions and never commit offsets;
offsets are not contiguous (transaction markers, aborted records). A read borrows
a consumer, assigns it, and returns it unassigned, so concurrent or interleaved
reads each get their own.

Where a read ends: a read_committed consumer sees a partition up to its last
stable offset (LSO), the first offset of the oldest transaction still open on it.
Another producer's open transaction therefore hides everything committed after
it began, by anyone. A pool built for a writer (``stable=True``: what restore
reads before a worker writes) never returns such a prefix: it reads each
partition to the high watermark seen when the read starts, waiting until the LSO
reaches it, and refuses with :class:`UnstableReadError`, naming the partition,
once ``settings.stable_read_timeout_ms`` passes. A pool for tools and readers
(``stable=False``) reads to the LSO and never waits on another's transaction,
but still sees every commit of its own backend (read-your-writes:
``commit_transaction`` returns before the broker writes the commit markers, so a
read waits milliseconds until the LSO covers them).

Such a read may therefore show less than is committed: a writer killed inside a
transaction holds the LSO at its start until the broker aborts it, while others
commit after it. A read asked to (``read_from(..., held=[])``: a read-only
backend's) says so once it has read a partition: if the partition's log reaches
past the read's end (the high watermark of the last fetch response, free; asked
of the broker only for a partition the read did not fetch) and the LSO does not
move past it within a short grace of when it was first seen there (a live
writer's transaction ends within milliseconds; a partition still at the same LSO
when read again waits no more), it adds a :class:`HeldBack`.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Message, TopicPartition

from rollout_journal.journal.backend import HeldBack, StoredRecord
from rollout_journal.journal.deadlines import Deadline
from rollout_journal.journal.errors import (
    ClusterUnreachableError,
    JournalClosedError,
    JournalError,
    RecordLocation,
    UnstableReadError,
)
from rollout_journal.journal.kafka.access import AUTHORIZATION_CODES, GROUP, TOPIC, refusal
from rollout_journal.journal.kafka.clients import (
    base_config,
    close_client,
    describe,
    kafka_error,
    new_client,
    on_client_error,
    refresh_if_stale,
)
from rollout_journal.journal.kafka.config import KafkaSettings
from rollout_journal.journal.kafka.retry import Action, Retry, Role, classify, cluster_down

log = logging.getLogger(__name__)

# Bounded prefetch of a reader (librdkafka's default is 64 MiB). With librdkafka's default
# fetch.queue.backoff.ms (1 s) a full prefetch queue stalls fetching for a second: measured
# 12 MB/s reading one partition; 10 ms gives ~500-800 MB/s on the dev broker.
_READ_PREFETCH_KBYTES = 16384
_READ_QUEUE_BACKOFF_MS = 10
_BATCH = 1024  # records taken from the client's queue at once
# How long a read that ended at an open transaction waits for it to end before it calls it held back: a
# live writer's transaction ends within milliseconds, a killed writer's stays open for its timeout.
_LIVE_TRANSACTION_GRACE_S = 0.5


class ReaderPool:
    """Pooled read_committed consumers of one namespace's topics."""

    def __init__(self, settings: KafkaSettings, *, stable: bool = False) -> None:
        self.settings = settings
        self.stable = stable
        # Under the namespace's prefix, so the namespace's group ACL covers it
        # (see rollout_journal.journal.kafka.access).
        self.group = f"{settings.namespace}.reader-{uuid.uuid4().hex[:8]}"
        self._lock = threading.Lock()
        self._idle: list[Consumer] = []
        self._all: list[Consumer] = []
        self._closed = False
        self._high_marks: Consumer | None = None  # read_uncommitted: asks for high watermarks only
        self._high_lock = threading.Lock()
        # Read-your-writes: the end of this backend's last commit per (topic, partition), and (a group
        # member's) the commit point of the partition's previous owner, learned at a take.
        self._committed_end: dict[tuple[str, int], int] = {}
        # A member's partitions with no commit point (never written by a member: a namespace of an older
        # version): read to the high watermark once every transaction on them is decided, as a writer's.
        self._settle: set[tuple[str, int]] = set()
        self._floors: dict[tuple[str, int], int] = {}
        # Where a read to the LSO last found each partition's LSO, and since when it has been there
        # (monotonic): an open transaction is called held back once it has stood there a grace.
        self._lso_seen: dict[tuple[str, int], tuple[int, float]] = {}
        self._lso_lock = threading.Lock()

    @property
    def open_consumers(self) -> int:
        return len(self._all)

    def consumer_config(self, isolation: str = "read_committed") -> dict[str, Any]:
        """A reader consumer's librdkafka config (passthrough applied)."""
        cfg = base_config(self.settings, self.settings.transactional_id or "reader", "reader")
        cfg.update(
            {
                # librdkafka requires a group id; readers are assigned, never join it, never commit.
                "group.id": self.group,
                "isolation.level": isolation,
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "enable.partition.eof": True,
                "auto.offset.reset": "error",  # a deleted offset is an error, never a silent skip
                # A read ends at EOF, found by a fetch that waits up to this long at the tail; requests on a
                # connection are served in order, so the next offset query waits behind it too. 500 ms
                # (default) -> 10 ms -> 1 ms: a 50-record read takes ~1 s -> ~22 ms -> ~4 ms on the dev broker.
                "fetch.wait.max.ms": 1,
                "queued.max.messages.kbytes": _READ_PREFETCH_KBYTES,
                "fetch.queue.backoff.ms": _READ_QUEUE_BACKOFF_MS,
                "error_cb": on_client_error(self.settings),
            }
        )
        cfg.update(self.settings.librdkafka)
        return cfg

    def note_committed(self, locations: Sequence[RecordLocation]) -> None:
        """A writer of this backend committed these records: later reads must see them."""
        ends = self._committed_end
        for loc in locations:
            key = (loc.source, loc.partition)
            if ends.get(key, -1) <= loc.offset:
                ends[key] = loc.offset + 1

    def note_floor(self, topic: str, partition: int, offset: int | None) -> None:
        """A member took ``partition``: its previous owner committed through ``offset`` (the group's
        committed offset; None: no member ever committed there). Reads of it end there at least,
        waiting for the last stable offset to pass it; with None, at the high watermark once stable."""
        key = (topic, partition)
        if offset is None:
            self._settle.add(key)
            return
        self._settle.discard(key)
        self._floors[key] = offset

    def forget(self, topic: str, partition: int) -> None:
        """A member let ``partition`` go: what it knew of its end is the next owner's to learn."""
        self._committed_end.pop((topic, partition), None)
        self._floors.pop((topic, partition), None)
        self._settle.discard((topic, partition))

    def known_end(self, topic: str, partition: int) -> int | None:
        """Where this backend knows committed records of a partition reach at least (None: unknown)."""
        ends = [
            e
            for e in (self._committed_end.get((topic, partition)), self._floors.get((topic, partition)))
            if e is not None
        ]
        return max(ends) if ends else None

    # -- the pool ---------------------------------------------------------------------------

    def _acquire(self) -> Consumer:
        with self._lock:
            if self._closed:
                raise JournalClosedError(f"Kafka readers of namespace {self.settings.namespace} are closed")
            if self._idle:
                return self._idle.pop()
        consumer = new_client(Consumer, self.consumer_config(), "consumer")
        with self._lock:
            self._all.append(consumer)
            if self._closed:
                self._all.remove(consumer)
                close_client(consumer)
                raise JournalClosedError(f"Kafka readers of namespace {self.settings.namespace} are closed")
        return consumer

    def _release(self, consumer: Consumer, *, healthy: bool = True) -> None:
        if healthy:
            try:
                consumer.unassign()
            except (KafkaException, RuntimeError):
                healthy = False
        with self._lock:
            if healthy and not self._closed:
                self._idle.append(consumer)
                return
            if consumer in self._all:
                self._all.remove(consumer)
        close_client(consumer)

    def close(self) -> None:
        """Close every consumer. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            consumers, self._all, self._idle = self._all, [], []
        with self._high_lock:
            if self._high_marks is not None:
                consumers.append(self._high_marks)
                self._high_marks = None
        for consumer in consumers:
            close_client(consumer)

    # -- offsets ----------------------------------------------------------------------------

    def _watermarks(self, consumer: Consumer, topic: str, partition: int) -> tuple[int, int]:
        """(log start, last stable offset): read_committed consumers report the LSO as the high mark.

        Transient errors (a broker gone, a leader not elected yet just after topic creation, a
        leader moving) are retried under the backend's retry policy (``journal.kafka.retry``)."""
        retry = Retry(self.settings.cluster_unavailable_timeout_ms / 1000, f"offsets of {topic}[{partition}]")
        query_s = self.settings.operation_timeout_ms / 1000
        while True:
            try:
                marks = consumer.get_watermark_offsets(
                    TopicPartition(topic, partition), timeout=min(query_s, max(1.0, retry.left_s())), cached=False
                )
            except KafkaException as exc:
                err = kafka_error(exc)
                if classify(err, Role.OFFSETS) is Action.RETRY and retry.wait(err):
                    refresh_if_stale(consumer, err, topic, min(query_s, max(1.0, retry.left_s())))
                    continue
                denied = refusal(self.settings, err, {TOPIC: ("READ", topic)})
                if denied is not None:
                    raise denied from None
                if cluster_down(err) or classify(err, Role.OFFSETS) is Action.RETRY:
                    raise ClusterUnreachableError(
                        f"cannot query offsets of topic {topic} partition {partition} on "
                        f"{self.settings.bootstrap_servers} for {retry.elapsed_s:.0f} s: {exc}"
                    ) from exc
                raise JournalError(f"cannot query offsets of topic {topic} partition {partition}: {exc}") from exc
            if marks is not None:
                return marks
            if not retry.wait(None):
                raise ClusterUnreachableError(
                    f"timed out querying offsets of topic {topic} partition {partition} "
                    f"for {retry.elapsed_s:.0f} s on {self.settings.bootstrap_servers}"
                )

    def _stable_marks(self, consumer: Consumer, topic: str, partition: int, *, floors: bool = False) -> tuple[int, int]:
        """Watermarks that cover every commit this backend has returned from (read-your-writes), and
        with ``floors`` the commit point its take learned."""
        wanted = self._committed_end.get((topic, partition), 0)
        if floors:
            wanted = max(wanted, self._floors.get((topic, partition), 0))
        # Ours: milliseconds until the commit markers are written. A take's commit point: as long as an
        # older zombie's transaction stays open below it (the broker aborts it after its timeout).
        bound_s = max(self.settings.operation_timeout_ms, 2 * self.settings.transaction_timeout_ms) / 1000
        low, end = self._lso_toward(consumer, topic, partition, wanted, Deadline(bound_s))
        if end < wanted:
            raise UnstableReadError(topic, partition, end, wanted, bound_s)
        return low, end

    def _lso_toward(
        self, consumer: Consumer, topic: str, partition: int, target: int, deadline: Deadline
    ) -> tuple[int, int]:
        """(log start, last stable offset), asked again with a growing pause (2 ms to 200 ms) until
        the LSO reaches ``target`` or ``deadline`` passes; the caller tells which from the LSO."""
        low, lso = self._watermarks(consumer, topic, partition)
        delay = 0.002
        while lso < target and not deadline.passed():
            deadline.sleep(delay)
            delay = min(delay * 2, 0.2)
            low, lso = self._watermarks(consumer, topic, partition)
        return low, lso

    def _high_watermark(self, topic: str, partition: int) -> int:
        """The partition's high watermark: the end of its log, open transactions included."""
        with self._high_lock:
            if self._closed:
                raise JournalClosedError(f"Kafka readers of namespace {self.settings.namespace} are closed")
            if self._high_marks is None:
                self._high_marks = new_client(Consumer, self.consumer_config("read_uncommitted"), "consumer")
            return self._watermarks(self._high_marks, topic, partition)[1]

    def _settled_marks(self, consumer: Consumer, topic: str, partition: int) -> tuple[int, int]:
        """(log start, high watermark seen now), once every record below that watermark is decided
        (the LSO reached it); ``UnstableReadError`` if an open transaction holds it back too long."""
        high = self._high_watermark(topic, partition)
        bound_s = self.settings.stable_read_timeout_ms / 1000
        low, stable = self._lso_toward(consumer, topic, partition, high, Deadline(bound_s))
        if stable < high:
            raise UnstableReadError(topic, partition, stable, high, bound_s)
        return low, high

    def _held_back(self, consumer: Consumer, topic: str, partition: int, end: int, fetched: bool) -> HeldBack | None:
        """Whether a read of ``partition`` that ended at ``end`` (its last stable offset then) was held
        back by a transaction still open: the log reaches past ``end`` and the LSO stays there."""
        high = -1
        if fetched:  # the last fetch response's high watermark, kept by the client: no request
            high = consumer.get_watermark_offsets(TopicPartition(topic, partition), cached=True)[1]
        if high < 0:
            high = self._high_watermark(topic, partition)
        if high <= end:
            return None
        # Past the end: a transaction open when the read started, or records appended since. Held
        # back only if the LSO stays at ``end`` a grace after it was first seen there: a live writer's
        # transaction ends sooner. A partition the pool reads again at the same LSO waits no more;
        # each partition read gets the grace, however long the tool runs.
        with self._lso_lock:
            seen = self._lso_seen.get((topic, partition))
        seen_at = seen[1] if seen is not None and seen[0] == end else time.monotonic()
        grace = Deadline(max(0.0, seen_at + _LIVE_TRANSACTION_GRACE_S - time.monotonic()))
        if self._lso_toward(consumer, topic, partition, end + 1, grace)[1] > end:
            return None
        return HeldBack(topic, partition, end, high, self.settings.transaction_timeout_ms)

    def _saw_lso(self, topic: str, partition: int, lso: int) -> None:
        """A read to the LSO found ``partition`` ending at ``lso`` (now, if it was elsewhere before)."""
        with self._lso_lock:
            seen = self._lso_seen.get((topic, partition))
            if seen is None or seen[0] != lso:
                self._lso_seen[(topic, partition)] = (lso, time.monotonic())

    def end_offset(self, topic: str, partition: int) -> int:
        """The last stable offset of a partition: the next committed record's offset is at least this."""
        consumer = self._acquire()
        try:
            return self._stable_marks(consumer, topic, partition)[1]
        finally:
            self._release(consumer)

    # -- reading ----------------------------------------------------------------------------

    def read(self, topic: str, partitions: list[int], from_offset: int | None) -> Iterator[StoredRecord]:
        """Committed records of ``partitions`` from ``from_offset`` (None: the log start) to the end
        seen when reading starts, in log order per partition."""
        return self.read_from(topic, {p: from_offset for p in partitions})

    def read_from(
        self,
        topic: str,
        starts: dict[int, int | None],
        ends: dict[int, int] | None = None,
        *,
        stable: bool | None = None,
        held: list[HeldBack] | None = None,
    ) -> Iterator[StoredRecord]:
        """Committed records of each partition from its start offset (None: the log start) to the end
        seen when reading starts; ``ends`` (if given) receives each partition's end. ``stable``
        overrides the pool's rule of where a read ends (see the module docstring). ``held`` (if given)
        receives, once the read is done, each partition a transaction still open held back (a read to
        the LSO only; one that waits for it is never held back)."""
        consumer = self._acquire()
        healthy = False
        settled = self.stable if stable is None else stable
        try:
            ends = {} if ends is None else ends
            next_offset: dict[int, int] = {}
            assignment: list[TopicPartition] = []
            to_lso: list[int] = []  # partitions read to their last stable offset: maybe held back
            for p, from_offset in starts.items():
                if settled or (stable is None and (topic, p) in self._settle):
                    low, end = self._settled_marks(consumer, topic, p)
                else:
                    low, end = self._stable_marks(consumer, topic, p, floors=stable is None)
                    to_lso.append(p)
                    if held is not None:
                        self._saw_lso(topic, p, end)
                start = low if from_offset is None else from_offset
                if start < low:
                    raise JournalError(
                        f"topic {topic} partition {p}: offsets before {low} were deleted by retention; "
                        f"cannot read from offset {start}"
                    )
                ends[p] = end
                if start < end:
                    next_offset[p] = start
                    assignment.append(TopicPartition(topic, p, start))
            if assignment:
                # No pause() of finished partitions: a paused-then-reassigned partition stalls ~1 s in librdkafka.
                consumer.assign(assignment)
            yield from self._consume(consumer, topic, {p: ends[p] for p in next_offset}, next_offset)
            if held is not None:
                for p in to_lso:
                    found = self._held_back(consumer, topic, p, ends[p], fetched=p in next_offset)
                    if found is not None:
                        held.append(found)
            healthy = True
        finally:
            self._release(consumer, healthy=healthy)

    def _consume(
        self, consumer: Consumer, topic: str, ends: dict[int, int], next_offset: dict[int, int]
    ) -> Iterator[StoredRecord]:
        pending = set(ends)
        # A broker gone stalls a fetch until its partitions' leadership moves: seconds on a replicated
        # cluster; the read gives up only when the whole cluster stays away (journal.kafka.retry).
        stall_s = self.settings.cluster_unavailable_timeout_ms / 1000
        last_progress = time.monotonic()

        while pending:
            first = consumer.poll(0.2)  # consume() would wait out its timeout for a full batch
            now = time.monotonic()
            if first is None:
                if now - last_progress > stall_s:
                    where = ", ".join(f"{p}@{next_offset[p]}" for p in sorted(pending))
                    raise ClusterUnreachableError(
                        f"reading topic {topic} made no progress for {stall_s:.0f} s at partition@offset {where} "
                        f"(end {', '.join(str(ends[p]) for p in sorted(pending))}); is the cluster reachable?"
                    )
                continue
            last_progress = now
            # Then what is already fetched, at once: a poll() a record cost as much as the rest of the read
            yield from self._records(topic, [first, *consumer.consume(_BATCH, 0)], ends, next_offset, pending)

    def _records(
        self, topic: str, batch: list[Message], ends: dict[int, int], next_offset: dict[int, int], pending: set[int]
    ) -> Iterator[StoredRecord]:
        """The records of one consumed batch still owed (in order), ending partitions as they are read."""
        for msg in batch:
            if not pending:
                return
            err = msg.error()
            if err is not None and err.code() in AUTHORIZATION_CODES:  # a group's names no partition: checked first
                denied = refusal(self.settings, err, {TOPIC: ("READ", topic), GROUP: ("DESCRIBE", self.group)})
                if denied is not None:  # always, for these codes
                    raise denied
            p = msg.partition()
            if msg.topic() != topic or p not in pending:
                continue  # a finished partition (fetched ahead) or an outdated assignment
            offset = msg.offset()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    if offset is not None and offset >= ends[p]:
                        pending.discard(p)
                    continue
                if classify(err, Role.READER) is Action.SKIP:  # a broker gone, a leader moving: fetched again
                    log.debug("reading %s[%d]: %s; reading on", topic, p, describe(err))
                    continue
                raise JournalError(f"reading topic {topic} partition {p} at offset {next_offset[p]}: {describe(err)}")
            assert offset is not None  # a message without an error has one
            if offset < next_offset[p]:
                continue  # already seen: an outdated fetch
            if offset >= ends[p]:
                pending.discard(p)  # committed after the read started: not ours to return
                continue
            next_offset[p] = offset + 1
            yield stored_record(topic, p, offset, msg.key(), msg.value())
            if offset + 1 >= ends[p]:
                pending.discard(p)


def stored_record(topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None) -> StoredRecord:
    location = RecordLocation(topic, partition, offset)
    if key is None:
        return StoredRecord("", value, location, error=f"record at {location} has no key")
    try:
        return StoredRecord(key.decode("utf-8"), value, location)
    except UnicodeDecodeError as exc:
        return StoredRecord(
            key.decode("utf-8", "replace"), value, location, error=f"key of record at {location} is not UTF-8: {exc}"
        )


class StreamingFollower:
    """A ``read_committed`` consumer of its own, assigned to every partition of one topic from
    given offsets, handing on records as they are committed (the trainer's results feed).
    It never rereads to a watermark: one long-lived fetch stream. ``fetch_wait_ms``: how long the
    broker holds a fetch that finds nothing new, which sets its requests per second when idle."""

    def __init__(
        self,
        pool: ReaderPool,
        topic: str,
        partitions: int,
        offsets: dict[int, int],
        batch: int = 4096,
        *,
        fetch_wait_ms: int = 50,
    ) -> None:
        cfg = pool.consumer_config()
        cfg.update({"enable.partition.eof": False, "fetch.wait.max.ms": fetch_wait_ms})
        cfg.update(pool.settings.librdkafka)
        self._consumer = new_client(Consumer, cfg, "consumer")
        self._settings = pool.settings
        self._topic = topic
        self._batch = batch
        self._consumer.assign([TopicPartition(topic, p, offsets.get(p, OFFSET_BEGINNING)) for p in range(partitions)])
        self._position: dict[int, int] = {}  # partition -> next offset to hand on (assign() keeps them)
        # Owners poll it on a worker thread and close it on another once cancelled: librdkafka must not
        # close a consumer that another thread polls (confluent-kafka-python #1797), so close() waits
        # for a poll in flight (at most its timeout) and a poll after it hands on nothing.
        self._use = threading.Lock()
        self._closed = False

    def assign(self, starts: dict[int, int | None]) -> None:
        """Follow exactly these partitions: one followed already goes on where it is, a new one starts
        at its offset (None: the log start)."""
        wanted = {p: self._position.get(p, OFFSET_BEGINNING if o is None else o) for p, o in starts.items()}
        with self._use:
            if self._closed:
                return
            self._position = {p: o for p, o in self._position.items() if p in wanted}
            self._consumer.assign([TopicPartition(self._topic, p, o) for p, o in sorted(wanted.items())])

    def poll(self, timeout_s: float) -> list[StoredRecord]:
        """What was committed since the last poll, in order per partition; waits up to ``timeout_s``
        (nothing once closed)."""
        with self._use:
            return [] if self._closed else self._poll(timeout_s)

    def _poll(self, timeout_s: float) -> list[StoredRecord]:
        records: list[StoredRecord] = []
        first = self._consumer.poll(timeout_s)  # consume() would wait out its timeout for a full batch
        if first is None:
            return records
        for msg in [first, *self._consumer.consume(self._batch, 0)]:
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF or classify(err, Role.READER) is Action.SKIP:
                    log.debug("following %s: %s", self._topic, describe(err))
                    continue
                denied = refusal(self._settings, err, {TOPIC: ("READ", self._topic)})  # a grant revoked meanwhile
                if denied is not None:
                    raise denied
                raise JournalError(f"reading topic {self._topic} partition {msg.partition()}: {describe(err)}")
            partition, offset = msg.partition(), msg.offset()
            assert partition is not None and offset is not None  # a message without an error has both
            records.append(stored_record(self._topic, partition, offset, msg.key(), msg.value()))
            self._position[partition] = offset + 1
        return records

    def close(self) -> None:
        """Close the consumer once no poll is in flight (one waits at most its timeout)."""
        with self._use:
            if self._closed:
                return
            self._closed = True
            close_client(self._consumer)


class CatchUpFollower:
    """Partition 0 of a one-partition topic as it is committed: the first ``poll()`` reads it to its
    end (one offset query), every later one hands on only what was committed since, from one
    long-lived fetch stream (:class:`StreamingFollower`): no offset query and no reread per poll."""

    def __init__(self, pool: ReaderPool, topic: str, *, fetch_wait_ms: int = 500) -> None:
        self._pool = pool
        self._topic = topic
        self._fetch_wait_ms = fetch_wait_ms
        self._stream: StreamingFollower | None = None
        self._use = threading.Lock()  # polled on one thread, closed on another: as StreamingFollower
        self._closed = False

    def poll(self) -> list[StoredRecord]:
        """The records committed since the last poll (the first: every retained one); never waits.
        Nothing once closed: a poll after close would open a consumer nobody closes."""
        with self._use:
            if self._closed:
                return []
            if self._stream is not None:
                return self._stream.poll(0)
            ends: dict[int, int] = {}
            records = list(self._pool.read_from(self._topic, {0: None}, ends, stable=False))
            self._stream = StreamingFollower(
                self._pool, self._topic, 1, {0: ends.get(0, 0)}, fetch_wait_ms=self._fetch_wait_ms
            )
            return records

    def close(self) -> None:
        """Close the stream once no poll is in flight (the first reads the topic to its end)."""
        with self._use:
            self._closed = True
            if self._stream is not None:
                self._stream.close()
                self._stream = None
