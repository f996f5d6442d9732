"""The storage contract every journal backend honours (Kafka, files).

A backend stores opaque keyed records on its streams and knows nothing of
events, rollouts or fencing; ``rollout_journal.journal.Journal`` builds those on top. It must:

- ``commit`` a batch atomically: after a crash either every record of the batch
  is readable or none is, on every stream it touches (a final turn's events and
  its results record commit together);
- hand back committed records only (Kafka ``read_committed``; the file
  backend's commit markers), in log order per partition;
- report a record it cannot read as a ``StoredRecord`` with ``error`` set,
  and keep reading after it, so one bad record never hides the good ones;
- report damage that is no one record (a lost file) through ``damage``;
- where asked (``read_events(..., held=[])``), say when a read ended short of records another
  writer's transaction still holds back (:class:`HeldBack`; Kafka's read-only reads).
"""

from __future__ import annotations

import enum
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from rollout_journal.journal.errors import ConfigurationError, JournalDamageError, RecordLocation
from rollout_journal.journal.metrics import JournalMetrics


class Stream(enum.Enum):
    EVENTS = "events"  # long retention: the audit trail; key = rollout_id
    SNAPSHOTS = "snapshots"  # compacted: latest value per key survives; None value = tombstone
    RESULTS = "results"  # a finished rollout's training record, committed with its final turn; key = rollout_id
    # compacted, one partition: every workload registration, key = workload name (a backend that
    # ``keeps_workloads``; elsewhere registrations live on the snapshot stream only)
    WORKLOADS = "workloads"
    # compacted: each rollout's RolloutSummary, key = <rollout>/e<epoch>, committed with the events it
    # folds (a backend that ``keeps_summaries``; see ``journal.summary``)
    SUMMARIES = "summaries"


@dataclass(frozen=True, slots=True)
class OutRecord:
    stream: Stream
    key: str
    value: bytes | None  # None: a tombstone (the compacted snapshots and summaries streams only)
    partition_key: str  # records sharing it share a partition (the rollout id)
    continuation: bool = False  # a later piece of a chunked event: the append's receipt names its first piece


@dataclass(frozen=True, slots=True)
class StoredRecord:
    key: str
    value: bytes | None
    location: RecordLocation
    error: str | None = None  # set when the backend could not read the record's bytes


@dataclass(frozen=True, slots=True)
class HeldBack:
    """A read of ``partition`` of ``topic`` ended at ``stable_offset`` (Kafka's last stable offset:
    where the oldest transaction still open on it began) while the log reaches ``high_watermark``:
    whatever was committed past that offset, by anyone, is missing from the read until the
    transaction ends. A writer killed inside a transaction leaves it open until the broker aborts it
    (``transaction_timeout_ms`` plus the broker's abort scan interval)."""

    topic: str
    partition: int
    stable_offset: int
    high_watermark: int
    transaction_timeout_ms: int

    def __str__(self) -> str:
        return held_back_warnings([self])[0]


def held_back_warnings(held: Iterable[HeldBack]) -> list[str]:
    """What to tell a reader of ``held``: one line per topic, naming its partitions."""
    by_topic: dict[str, dict[int, HeldBack]] = {}
    for h in held:
        by_topic.setdefault(h.topic, {}).setdefault(h.partition, h)
    lines = []
    for topic, partitions in sorted(by_topic.items()):
        found = [partitions[p] for p in sorted(partitions)]
        timeout_ms = max(h.transaction_timeout_ms for h in found)
        if len(found) == 1:
            where = f"partition {found[0].partition}: records past offset {found[0].stable_offset} are"
            what, its = "a transaction still open (a killed writer's, most likely)", "it"
        else:
            where = (
                f"partitions {', '.join(str(h.partition) for h in found)}: records past offsets "
                f"{', '.join(str(h.stable_offset) for h in found)} (in that order) are"
            )
            what, its = "transactions still open (killed writers', most likely)", "them"
        lines.append(
            f"{topic} {where} behind {what}; turns committed after {its} show once the broker aborts {its} "
            f"(within transaction_timeout_ms={timeout_ms} plus the broker's abort interval); rerun then"
        )
    return lines


def compacted(
    records: Iterable[StoredRecord], keep: int, on_error: Callable[[StoredRecord], None] = lambda record: None
) -> dict[str, list[StoredRecord]]:
    """What log compaction leaves of a keyed stream: the newest ``keep`` values of each
    key, oldest first; a tombstone drops its key. Unreadable records go to ``on_error``."""
    latest: dict[str, list[StoredRecord]] = {}
    for record in records:
        if record.error is not None:
            on_error(record)
        elif record.value is None:
            latest.pop(record.key, None)
        else:
            kept = latest.setdefault(record.key, [])
            kept.append(record)
            del kept[:-keep]
    return latest


def partition_for(partition_key: str, partitions: int) -> int:
    """Stable partition of a rollout: CRC-32 of its id, the same in every process and backend."""
    return zlib.crc32(partition_key.encode()) % partitions


EVENT_PARTITIONS_A_SUMMARIES_PARTITION = 8


def summaries_partitions(partitions: int) -> int:
    """How many partitions the summaries stream of a namespace of ``partitions`` has: one for every
    8 (rounded up). Each commit writes the summaries of the rollouts it holds; a summaries
    partition per events partition made every transaction span twice the partitions, and a
    transaction's cost grows with them (its markers, its deliveries): docs/benchmarks.md has the
    commit latencies measured both ways."""
    return -(-partitions // EVENT_PARTITIONS_A_SUMMARIES_PARTITION)


def summaries_partition(partition: int, partitions: int) -> int:
    """The summaries partition of events partition ``partition``: neighbours share one, so a worker
    owning a run of partitions writes few."""
    return partition * summaries_partitions(partitions) // partitions


def record_partition(record: OutRecord, partitions: int) -> int:
    """The partition ``record`` lands on: its partition key's (its summaries partition, for a
    summary), or 0 on the one-partition workloads stream."""
    if record.stream is Stream.WORKLOADS:
        return 0
    partition = partition_for(record.partition_key, partitions)
    return summaries_partition(partition, partitions) if record.stream is Stream.SUMMARIES else partition


class Backend(ABC):
    """Durable, ordered, atomic storage of keyed records."""

    kind: str
    partitions: int
    max_record_bytes: int | None = None  # the largest record value it takes (None: no limit below the journal's)
    # Writes only the partitions a consumer group assigns it (a group member's Kafka backend): one
    # partition's appends may fail (revoked, refused) while the others commit.
    writes_per_partition: bool = False
    # How long a commit aborted for a transient cause (a broker or coordinator away) is redone before
    # the writer gives up (Kafka: ``cluster_unavailable_timeout_ms``).
    redo_budget_s: float = 0.0
    # Keeps a stream of workload registrations of its own (``Stream.WORKLOADS``), which a fleet's
    # workers follow instead of the snapshot stream (Kafka's ``<namespace>.workloads``).
    keeps_workloads: bool = False
    # How long another writer's open transaction can hold a read back, short of what was committed
    # after it began, before the storage aborts it (Kafka: the namespace's transaction timeout; the
    # broker's abort scan comes on top). 0: no read ends short of a commit (a file journal).
    transaction_hold_s: float = 0.0
    # Keeps a summary of each rollout (``Stream.SUMMARIES``), written with its events, which a listing
    # reads instead of every event (Kafka's ``<namespace>.summaries``).
    keeps_summaries: bool = False

    @abstractmethod
    def commit(self, records: Sequence[OutRecord]) -> list[RecordLocation]:
        """Write ``records`` atomically and durably; their locations, in order.

        Raises ``AbortableCommitError`` when nothing was written and the batch
        may be redone, ``FatalJournalError`` when this writer must stop.
        """

    def commit_partitions(
        self, batches: Mapping[int, Sequence[OutRecord]]
    ) -> dict[int, list[RecordLocation] | BaseException]:
        """Commit each partition's records; per partition, their locations or the error that
        failed them. A backend with one writer commits them all at once, so they share one
        outcome: it returns every partition's locations, or raises like ``commit``."""
        partitions = list(batches)
        locations = self.commit([record for p in partitions for record in batches[p]])
        out: dict[int, list[RecordLocation] | BaseException] = {}
        start = 0
        for p in partitions:
            out[p] = locations[start : start + len(batches[p])]
            start += len(batches[p])
        return out

    def offset_after(self, location: RecordLocation) -> int:
        """The offset just past a record this backend committed (Kafka: offset + 1)."""
        return location.offset + 1

    @abstractmethod
    def end_offset(self, partition: int) -> int:
        """The offset the next committed event record of ``partition`` will have at least."""

    @abstractmethod
    def read_events(
        self, partition: int, from_offset: int = 0, held: list[HeldBack] | None = None
    ) -> Iterator[StoredRecord]:
        """Committed event records of one partition from ``from_offset`` to the current end.
        ``held`` (if given) receives a :class:`HeldBack` once the read ends short of records an open
        transaction holds back, where the backend can tell (a read-only Kafka backend; any other
        leaves it empty: its reads never end short, or wait instead)."""

    @abstractmethod
    def read_snapshots(self, partitions: Collection[int] | None = None) -> Iterator[StoredRecord]:
        """Every retained snapshot record (of ``partitions`` only, if given), in log order per
        partition (later wins)."""

    def read_workloads(self) -> Iterator[StoredRecord]:
        """Every retained record of the workloads stream, in log order (a backend that ``keeps_workloads``)."""
        raise ConfigurationError(f"a {self.kind} journal keeps its workload registrations on the snapshot stream")

    def read_summaries(
        self, partitions: Collection[int] | None = None, held: list[HeldBack] | None = None
    ) -> Iterator[StoredRecord]:
        """Every retained record of the summaries stream (of the summaries partitions of events
        ``partitions`` only, if given: they hold other rollouts too), in log order per partition (a
        backend that ``keeps_summaries``); ``held`` as for :meth:`read_events`."""
        raise ConfigurationError(f"a {self.kind} journal keeps no summaries; a listing folds its events")

    def read_results(self, partition: int, from_offset: int = 0) -> Iterator[StoredRecord]:
        """Committed results records of one partition from ``from_offset`` to the current end (a
        rollout's results record lies on its own partition, like its events)."""
        raise ConfigurationError(f"a {self.kind} journal keeps no results stream")

    def owner_token(self, partition: int) -> int | None:
        """Which assignment of ``partition`` this backend writes under (a group member's: None when it
        is not assigned the partition now); a backend with one writer owns every partition, always."""
        return 0

    def take_partition(self, partition: int) -> None:
        """Prepare to write ``partition`` once the group assigned it: learn where its previous owner's
        commits end (a fleet's backend)."""
        raise ConfigurationError(f"a {self.kind} journal has one writer; partitions cannot be taken")

    def release_partition(self, partition: int) -> None:
        """Stop writing ``partition``, so that another worker may take it (a fleet's backend)."""
        raise ConfigurationError(f"a {self.kind} journal has one writer; partitions cannot be released")

    def observe(self, metrics: JournalMetrics) -> None:
        """Report what only the backend sees (Kafka: transactions, producer re-creations) to
        ``metrics``; the journal calls it once, at its construction. A backend with nothing of its
        own to report ignores it."""

    def damage(self) -> list[JournalDamageError]:
        """Damage to the storage that no record read will show (a lost snapshot file).
        ``Journal`` adds it to every ``ReadReport`` it fills; it raises nothing by itself."""
        return []

    @abstractmethod
    def close(self) -> None:
        """Release connections, files and locks. Idempotent."""

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
