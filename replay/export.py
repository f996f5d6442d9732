"""``export``: copy a journal (a Kafka namespace, typically) into a file journal for
offline use, byte for byte, and prove the copy.

Both streams are copied record by record with their keys and values unchanged:
the events, partition after partition (a rollout lives in one partition, so its
events keep their order), and the compacted snapshot stream as it is retained
now (tombstones included). The copy is written in bounded batches with the
file journal's own commits, and its snapshot stream is not compacted while it
is written. Afterwards the copy is read back and each stream's record count and
SHA-256 (over every key and value, length-prefixed, in order) compared with what
was read from the source; ``EXPORT.json`` in the copy records both.

Snapshots keep the replay offsets of the source (Kafka record offsets). In the
copy, a restore that starts from such an offset starts earlier than it needs
to (a file offset is a byte position, always at or past the record's Kafka
offset), and steps over what the snapshot covers by sequence number: slower,
never wrong.
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout_journal.journal.backend import OutRecord, StoredRecord, Stream
from rollout_journal.journal.errors import ConfigurationError, CorruptRecordError
from rollout_journal.journal.file.backend import FileBackend
from rollout_journal.journal.journal import ReadReport
from rollout_journal.replay.errors import ExportError
from rollout_journal.replay.progress import Progress
from rollout_journal.replay.source import ReplaySource

MANIFEST = "EXPORT.json"
_NEVER = 1 << 62  # min_compaction_bytes of the copy while it is written: no compaction
_LENGTH = struct.Struct("<q")


class StreamDigest:
    """Count and SHA-256 of a stream's records, in order (key and value length-prefixed;
    a tombstone is length -1)."""

    def __init__(self) -> None:
        self.records = 0
        self.bytes = 0
        self._sha = hashlib.sha256()

    def add(self, key: str, value: bytes | None) -> None:
        encoded = key.encode()
        self._sha.update(_LENGTH.pack(len(encoded)) + encoded)
        if value is None:
            self._sha.update(_LENGTH.pack(-1))
        else:
            self._sha.update(_LENGTH.pack(len(value)))
            self._sha.update(value)
            self.bytes += len(value)
        self.records += 1

    @property
    def sha256(self) -> str:
        return self._sha.hexdigest()


@dataclass
class StreamCheck:
    """One stream: what was read from the source and what reads back from the copy."""

    source_records: int
    copy_records: int
    source_sha256: str
    copy_sha256: str
    bytes: int

    @property
    def ok(self) -> bool:
        return self.source_records == self.copy_records and self.source_sha256 == self.copy_sha256

    def as_json(self) -> dict[str, Any]:
        return dict(self.__dict__) | {"ok": self.ok}


@dataclass
class ExportReport:
    source: str
    out: str
    source_partitions: int
    events: StreamCheck | None = None
    snapshots: StreamCheck | None = None
    seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)  # unreadable source records, named
    report: ReadReport = field(default_factory=ReadReport)

    @property
    def verified(self) -> bool:
        return self.events is not None and self.snapshots is not None and self.events.ok and self.snapshots.ok

    def as_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "out": self.out,
            "source_partitions": self.source_partitions,
            "events": self.events.as_json() if self.events else None,
            "snapshots": self.snapshots.as_json() if self.snapshots else None,
            "verified": self.verified,
            "skipped": self.skipped,
            "seconds": round(self.seconds, 3),
        }

    def text(self) -> Iterator[str]:
        yield (
            f"exported {self.source} ({self.source_partitions} partitions) to file journal {self.out} "
            f"in {self.seconds:.1f} s"
        )
        for name, check in (("events", self.events), ("snapshots", self.snapshots)):
            if check is None:
                continue
            verdict = "match" if check.ok else "DIFFER"
            yield (
                f"{name:<9} records {check.source_records} read, {check.copy_records} in the copy; sha256 "
                f"{check.source_sha256[:16]} / {check.copy_sha256[:16]}: {verdict} ({check.bytes} value bytes)"
            )
        yield "copy verified: counts and checksums match" if self.verified else "copy NOT verified"


def export_journal(
    source: ReplaySource, out: str | Path, *, batch_bytes: int = 8 << 20, progress: Progress | None = None
) -> ExportReport:
    """Copy ``source`` into a new file journal at ``out`` (which must not exist, or be empty)
    and verify the copy. A source record that cannot be read is skipped, named in
    ``ExportReport.skipped`` and ``report``; the copy then holds every other record."""
    started = time.perf_counter()
    root = Path(out)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise ConfigurationError(f"export destination {root} exists and is not an empty directory; name a new one")
    backend = source.journal.backend
    result = ExportReport(source.location, str(root), backend.partitions)
    read_events, read_snapshots = StreamDigest(), StreamDigest()
    copy = FileBackend(root, min_compaction_bytes=_NEVER)
    try:
        _copy(copy, source.stored_events(progress, result.report), Stream.EVENTS, read_events, result, batch_bytes)
        _copy(copy, backend.read_snapshots(), Stream.SNAPSHOTS, read_snapshots, result, batch_bytes)
    finally:
        copy.close()
    written_events, written_snapshots = StreamDigest(), StreamDigest()
    reread = FileBackend(root, read_only=True)
    try:
        for record in reread.read_events(0, 0):
            _check_readable(record, root)
            written_events.add(record.key, record.value)
        for record in reread.read_snapshots():
            _check_readable(record, root)
            written_snapshots.add(record.key, record.value)
    finally:
        reread.close()
    result.events = StreamCheck(
        read_events.records, written_events.records, read_events.sha256, written_events.sha256, read_events.bytes
    )
    result.snapshots = StreamCheck(
        read_snapshots.records,
        written_snapshots.records,
        read_snapshots.sha256,
        written_snapshots.sha256,
        read_snapshots.bytes,
    )
    result.seconds = time.perf_counter() - started
    (root / MANIFEST).write_text(json.dumps(result.as_json(), indent=2) + "\n")
    return result


def _copy(
    copy: FileBackend,
    records: Iterable[StoredRecord],
    stream: Stream,
    digest: StreamDigest,
    result: ExportReport,
    batch_bytes: int,
) -> None:
    batch: list[OutRecord] = []
    size = 0
    for record in records:
        if record.error is not None:
            problem = CorruptRecordError(record.location, record.error)
            result.report.errors.append(problem)
            result.skipped.append(str(problem))
            continue
        if stream is Stream.EVENTS and record.value is None:
            problem = CorruptRecordError(record.location, "event record without a value")
            result.report.errors.append(problem)
            result.skipped.append(str(problem))
            continue
        digest.add(record.key, record.value)
        batch.append(OutRecord(stream, record.key, record.value, record.key))
        size += len(record.key) + len(record.value or b"")
        if size >= batch_bytes:
            copy.commit(batch)
            batch, size = [], 0
    if batch:
        copy.commit(batch)


def _check_readable(record: StoredRecord, root: Path) -> None:
    if record.error is not None:
        raise ExportError(f"the copy at {root} does not read back: {record.location}: {record.error}")
