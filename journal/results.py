"""Following the results stream: the training records of finished rollouts, as they commit.

A worker publishes a rollout's ``TrainingRecord`` in the same commit as its final
turn (a Kafka transaction over ``<ns>.events``, ``<ns>.snapshots`` and
``<ns>.results``; the file journal's COMMIT marker over its log frames). So a
follower sees a record once its final turn is durable, and never one whose turn
was aborted: the Kafka follower reads ``read_committed``, the file follower only
frames under a commit marker.

Positions are per partition "the next offset to read" (the offset after a record
read: Kafka offsets are not contiguous, and a file journal's offset may point
inside a frame, where reading starts at the next one). What a trainer checkpoints
is built on these by :class:`rollout_journal.participants.trainer.TrainerFeed`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from rollout_journal.journal.backend import Backend, StoredRecord
from rollout_journal.journal.codec import Codec
from rollout_journal.journal.deadlines import Deadline
from rollout_journal.journal.errors import CorruptRecordError, JournalError, RecordLocation
from rollout_journal.journal.event_chunks import ChunkJoiner
from rollout_journal.journal.events import EventChunk, TrainingRecord

log = logging.getLogger(__name__)

__all__ = ["PublishedResult", "ResultsFollower", "PollingResultsFollower", "ResultsDecoder", "follow_results"]


class ResultsFollower(Protocol):
    """Committed results records from given positions on, as they commit."""

    def poll(self, timeout_s: float) -> list[StoredRecord]:
        """The records committed since the last poll (waits up to ``timeout_s`` for the first)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class PublishedResult:
    """A training record as the results stream holds it: where its (first) record lies, and the
    offset after its last piece (what a reader resumes from once it is consumed)."""

    record: TrainingRecord
    location: RecordLocation
    next_offset: int


class PollingResultsFollower:
    """Follows a backend's results by reading each partition from where the last read ended
    (the file journal: a read costs the log written since)."""

    def __init__(self, backend: Backend, offsets: Mapping[int, int], interval_s: float = 0.05) -> None:
        self.backend = backend
        self.offsets = {p: offsets.get(p, 0) for p in range(backend.partitions)}
        self.interval_s = interval_s

    def poll(self, timeout_s: float) -> list[StoredRecord]:
        deadline = Deadline(timeout_s)
        while True:
            records: list[StoredRecord] = []
            for partition, offset in self.offsets.items():
                for record in self.backend.read_results(partition, offset):
                    records.append(record)
                    self.offsets[partition] = record.location.offset + 1
            if records or deadline.passed():
                return records
            deadline.sleep(self.interval_s)

    def close(self) -> None:
        pass


def follow_results(backend: Backend, offsets: Mapping[int, int] | None = None) -> ResultsFollower:
    """A follower of ``backend``'s results from ``offsets`` (per partition; missing: its start).
    Kafka gets a streaming ``read_committed`` consumer of its own, any other backend polls."""
    follow: Callable[[dict[int, int]], ResultsFollower] | None = getattr(backend, "follow_results", None)
    if follow is not None:
        return follow(dict(offsets or {}))
    return PollingResultsFollower(backend, offsets or {})


class ResultsDecoder:
    """Stored results records -> training records, joining a chunked record's pieces. A record
    that does not decode is logged and reported, never raised: one bad record hides no other."""

    def __init__(self, codec: Codec | None = None, max_record_bytes: int = 64 * 1024 * 1024) -> None:
        self.codec = codec or Codec()
        self._joiners: dict[int, ChunkJoiner] = {}
        self.max_record_bytes = max_record_bytes
        self.errors: list[JournalError] = []

    def joining(self) -> dict[int, int]:
        """Per partition, the offset of the first piece of the oldest record still being joined."""
        out: dict[int, int] = {}
        for partition, joiner in self._joiners.items():
            for first in joiner.first_locations():
                out[partition] = min(out.get(partition, first.offset), first.offset)
        return out

    def add(self, stored: StoredRecord) -> PublishedResult | None:
        where = stored.location
        try:
            if stored.error is not None:
                raise CorruptRecordError(where, stored.error)
            if stored.value is None:
                raise CorruptRecordError(where, "a results record has no value (null)")
            record = self.codec.decode(stored.value, where)
            first = where
            if isinstance(record, EventChunk):
                joiner = self._joiners.setdefault(where.partition, ChunkJoiner(self.max_record_bytes))
                joined = joiner.add(record, where)
                if joined is None:
                    return None
                first = joined.location
                record = self.codec.decode(joined.encoded, first)
            if not isinstance(record, TrainingRecord):
                raise CorruptRecordError(
                    where,
                    f"holds a {type(record).__name__}, not a TrainingRecord: the results "
                    "stream takes training records only",
                )
            return PublishedResult(record, first, where.offset + 1)
        except JournalError as exc:
            log.warning("%s", exc)
            self.errors.append(exc)
            return None
