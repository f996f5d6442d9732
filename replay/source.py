"""How every replay command reads its journal.

``--journal PATH_OR_URL`` names a file journal directory or a Kafka namespace
(``kafka://host:port/namespace``); :func:`open_replay` opens it read-only, so a
running writer is neither locked out nor fenced. Reads stream: one partition at
a time, one event at a time, in log order, fenced as restore fences them, and
count their progress in the journal's own offsets. Memory stays with what a
command keeps, never with the journal's length.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Self, TypeVar

from rollout_journal.journal.backend import StoredRecord
from rollout_journal.journal.events import WorkloadRegistered
from rollout_journal.journal.journal import Cursor, Journal, JournaledEvent, ReadReport, read_events_noting
from rollout_journal.journal.open import open_journal
from rollout_journal.journal.snapshots import SnapshotIndex
from rollout_journal.replay.errors import NoSuchRolloutError
from rollout_journal.replay.progress import NoProgress, OffsetCounter, Progress

Located = TypeVar("Located", JournaledEvent, StoredRecord)

READER = "replay"  # the writer slot named in a read-only open; it never writes


@dataclass
class ReplaySource:
    """A journal opened for replay, and what a command reads from it."""

    location: str
    journal: Journal
    _index: SnapshotIndex | None = field(default=None, repr=False)
    reopenable: bool = False  # ``location`` opens this journal again (scan workers do): set by open_replay

    @property
    def unit(self) -> str:
        """What the journal's offsets count: bytes of a file journal, records of a Kafka topic."""
        return "B" if self.journal.backend.kind == "file" else "offsets"

    def scan(
        self,
        report: ReadReport,
        progress: Progress | None = None,
        fields: Mapping[type, tuple[str, ...]] | None = None,
        partitions: list[int] | None = None,
    ) -> Iterator[JournaledEvent]:
        """Every committed, unfenced event of the journal (of ``partitions`` only, if given),
        partition by partition. Records that do not decode go to ``report`` (and are stepped
        over). ``fields``: decode only those fields of those record types (``Journal.scan``)."""
        counted = range(self.journal.backend.partitions) if partitions is None else partitions
        return self._counted(self.journal.scan(report, fields, partitions), counted, progress)

    def end_offsets(self) -> dict[int, int]:
        """Each events partition's end, in the journal's offsets (what a scan of it will count)."""
        backend = self.journal.backend
        return {p: backend.end_offset(p) for p in range(backend.partitions)}

    def rollout_events(
        self, rollout_id: str, report: ReadReport, progress: Progress | None = None
    ) -> Iterator[JournaledEvent]:
        """One rollout's events from its first, in order, fenced: its partition is read from where
        its summary says its events begin (from the start without one). Raises
        :class:`NoSuchRolloutError` once that read found none."""
        found = False
        journal = self.journal
        partition = journal.partition_of(rollout_id)
        events = journal.read_rollout(rollout_id, Cursor(journal.first_offset(rollout_id)), report)
        for item in self._counted(events, [partition], progress):
            found = True
            yield item
        if not found:
            raise NoSuchRolloutError(rollout_id, self.location)

    def stored_events(
        self, progress: Progress | None = None, report: ReadReport | None = None
    ) -> Iterator[StoredRecord]:
        """Every committed event record as stored (undecoded, unfenced), partition by partition:
        what a byte-for-byte copy reads. A partition an open transaction held back goes to ``report``."""
        backend = self.journal.backend
        partitions = range(backend.partitions)

        records = (record for p in partitions for record in read_events_noting(backend, p, 0, report))
        return self._counted(records, partitions, progress)

    def snapshot_index(self) -> SnapshotIndex:
        """The compacted stream: newest snapshot and fence per rollout, workload registrations (read once)."""
        if self._index is None:
            self._index = self.journal.snapshots()
        return self._index

    def registrations(self) -> dict[str, WorkloadRegistered]:
        """Workload (and fork) registrations by name."""
        return self.snapshot_index().workloads

    def _counted(
        self, items: Iterator[Located], partitions: range | list[int], progress: Progress | None
    ) -> Iterator[Located]:
        progress = progress or NoProgress()
        backend = self.journal.backend
        progress.start(sum(backend.end_offset(p) for p in partitions), self.unit)
        counter = OffsetCounter(progress, {p: 0 for p in partitions})
        try:
            for item in items:
                counter.saw(item.location)
                yield item
        finally:
            counter.flush()
            progress.finish()

    def close(self) -> None:
        self.journal.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_replay(location: str) -> ReplaySource:
    """The journal at ``location`` (a directory or ``kafka://host:port/namespace``), read-only."""
    return ReplaySource(location, open_journal(location, writer=READER, read_only=True), reopenable=True)
