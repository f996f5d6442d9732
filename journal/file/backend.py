"""The embedded default backend: append-only segment files on one machine.

Layout of a journal directory::

    LOCK                       one writer at a time (flock), holds the writer's pid
    log/<base offset>.seg      event frames, results frames and commit markers: the audit trail
    snapshots/<gen>.snap       snapshot frames (the compacted stream), generation <gen>

:class:`FileBackend` composes three parts, each in a module of its own: the frame format
(:mod:`~rollout_journal.journal.file.frames`: every file is a run of CRC-checked frames), the
segment log (:mod:`~rollout_journal.journal.file.segments`: commits, torn tails and damage) and
the snapshot generations (:mod:`~rollout_journal.journal.file.snapshots`: the compacted stream,
its compaction and lost generations). A commit first appends its snapshot frames to the current
``.snap`` file, durably, then appends its event frames and a COMMIT frame to the log in one
durable write. The COMMIT frame is the single commit point; it names the snapshot generation
and length it commits, so either file's bytes past the last commit are cut on open.

A commit retries a failed compaction once the snapshot file has grown by another
``min_compaction_bytes``.
"""

from __future__ import annotations

import fcntl
import os
import zlib
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import TextIO

from rollout_journal.journal.backend import Backend, HeldBack, OutRecord, StoredRecord, Stream
from rollout_journal.journal.errors import (
    ConfigurationError,
    FatalJournalError,
    JournalDamageError,
    RecordLocation,
    WriterLockedError,
)
from rollout_journal.journal.file.frames import EVENT, RESULT, SNAPSHOT, CommitMark, encode_frame
from rollout_journal.journal.file.segments import SegmentLog
from rollout_journal.journal.file.snapshots import SnapshotGenerations


class FileBackend(Backend):
    """Segment-file journal; ``read_only=True`` opens without the writer lock (offline replay)."""

    kind = "file"
    partitions = 1

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        read_only: bool = False,
        fsync: bool = True,
        segment_bytes: int = 64 * 1024 * 1024,
        min_compaction_bytes: int = 1024 * 1024,
        max_dirty_ratio: float = 0.25,
    ) -> None:
        """``max_dirty_ratio``: compact once superseded snapshot bytes could exceed this share
        of the snapshot file (and it grew by ``min_compaction_bytes``), so reading the snapshot
        stream costs about the live set, whatever the history."""
        self.root = Path(root)
        self.read_only = read_only
        self.fsync = fsync
        self.segment_bytes = segment_bytes
        self.min_compaction_bytes = min_compaction_bytes
        self.max_dirty_ratio = max_dirty_ratio
        self._log = SegmentLog(self.root, fsync=fsync)
        self._snapshots = SnapshotGenerations(self.root, self._log, fsync=fsync)
        self._lock_file: TextIO | None = None
        self._frame_ends: dict[int, int] = {}  # event frame start -> end, for the last commit
        self._compaction_retry_at = 0  # snapshot length before which a failed compaction is not retried
        if read_only:
            if not self._log.dir.is_dir():
                raise ConfigurationError(f"no file journal at {self.root} (missing {self._log.dir})")
            return
        self._log.dir.mkdir(parents=True, exist_ok=True)
        self._snapshots.dir.mkdir(exist_ok=True)
        self._acquire_lock()
        self._log.open_for_writing()
        self._snapshots.open_for_writing()

    @property
    def compaction_failures(self) -> int:
        """Snapshot compactions that failed (and changed nothing)."""
        return self._snapshots.failures

    @property
    def compaction_error(self) -> Exception | None:
        """Why the last snapshot compaction failed; None once one succeeds."""
        return self._snapshots.error

    def _acquire_lock(self) -> None:
        path = self.root / "LOCK"
        lock = open(path, "a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "unknown"
            lock.close()
            raise WriterLockedError(
                f"file journal {self.root} is locked by writer pid {holder}; "
                "stop that process or open the journal read-only"
            ) from None
        self._lock_file = lock
        lock.seek(0)
        lock.truncate()
        lock.write(str(os.getpid()))
        lock.flush()

    def damage(self) -> list[JournalDamageError]:
        """Lost snapshot generations, recorded by a writer (``snapshots/<gen>.lost``) or, on a
        reader, the committed one missing or short now."""
        return self._snapshots.damage()

    # -- writing -------------------------------------------------------------
    def commit(self, records: Sequence[OutRecord]) -> list[RecordLocation]:
        self._log.check_writing("commit")
        if self._log.broken is not None:
            raise FatalJournalError(self._log.broken)
        event_frames: list[bytes] = []
        snap_frames: list[bytes] = []
        locations: list[RecordLocation] = []
        ends: dict[int, int] = {}
        position, snap_position = self._log.end, self._log.last_mark.snap_length
        log_source, snap_source = self._log.active_source, self._snapshots.active_source
        for record in records:
            if record.stream is Stream.WORKLOADS:  # registrations live on the snapshot stream here
                raise ValueError(f"a file journal keeps no workloads stream (record {record.key!r})")
            if record.stream is not Stream.SNAPSHOTS:  # events and results: frames of the log, one commit
                if record.value is None:
                    raise ValueError(
                        f"{record.stream.value} record {record.key!r} has no value; only snapshots take tombstones"
                    )
                frame = encode_frame(EVENT if record.stream is Stream.EVENTS else RESULT, record.key, record.value)
                locations.append(RecordLocation(log_source, 0, position))
                event_frames.append(frame)
                ends[position] = position + len(frame)
                position += len(frame)
            else:
                frame = encode_frame(SNAPSHOT, record.key, record.value)
                locations.append(RecordLocation(snap_source, 0, snap_position))
                snap_frames.append(frame)
                snap_position += len(frame)
        if snap_frames:  # durable before the commit marker that makes them visible
            self._snapshots.append(b"".join(snap_frames))
        batch = b"".join(event_frames)
        mark = CommitMark(self._log.last_mark.snap_generation, snap_position, self._log.end, zlib.crc32(batch))
        self._log.append_commit(batch, mark)
        self._frame_ends = ends
        if self._log.end - self._log.active_base >= self.segment_bytes:
            self._log.roll()
        grown = mark.snap_length - self._snapshots.compacted_size
        if (
            grown >= self.min_compaction_bytes
            and grown >= self.max_dirty_ratio * mark.snap_length
            and mark.snap_length >= self._compaction_retry_at
        ):
            try:
                self.compact_snapshots()
            except Exception:  # noqa: BLE001 - logged and counted there; the batch above is durable: it stands
                self._compaction_retry_at = mark.snap_length + self.min_compaction_bytes
        return locations

    def offset_after(self, location: RecordLocation) -> int:
        return self._frame_ends.get(location.offset, location.offset + 1)

    def end_offset(self, partition: int = 0) -> int:
        return self._log.end_offset()

    def compact_snapshots(self, keep_per_key: int = 2) -> None:
        """Write the next snapshot generation with the newest ``keep_per_key`` values of
        each live key, in their original order; tombstoned keys are dropped. Crash-safe:
        tmp file, fsync, rename, then a COMMIT frame naming the new generation.

        If it fails, nothing changed (see :mod:`~rollout_journal.journal.file.snapshots`): the
        error is logged, counted in ``compaction_failures``, kept in ``compaction_error`` and
        raised. A reader (or a closed writer) raises ``ConfigurationError`` and touches nothing."""
        self._snapshots.compact(keep_per_key)

    # -- reading -----------------------------------------------------------
    def read_events(
        self, partition: int = 0, from_offset: int = 0, held: list[HeldBack] | None = None
    ) -> Iterator[StoredRecord]:
        if partition != 0:
            raise ValueError(f"file journal has one partition; asked for partition {partition}")
        for path, frame in self._log.committed_frames(from_offset):
            if frame.error is not None or frame.type == EVENT:
                yield frame.stored(path)

    def read_results(self, partition: int = 0, from_offset: int = 0) -> Iterator[StoredRecord]:
        """Committed results frames (interleaved with the events in the log, under the same COMMIT
        markers) from ``from_offset``, which may lie inside a frame: reading starts at the next."""
        if partition != 0:
            raise ValueError(f"file journal has one partition; asked for partition {partition}")
        for path, frame in self._log.committed_frames(from_offset):
            if frame.type == RESULT:
                yield frame.stored(path)

    def read_snapshots(self, partitions: Collection[int] | None = None) -> Iterator[StoredRecord]:
        """The committed snapshot generation's records. A lost one reads as what is left of
        it (nothing, if it is missing); ``damage()`` says so. One partition: 0."""
        if partitions is not None and 0 not in partitions:
            return
        yield from self._snapshots.read()

    def close(self) -> None:
        self._log.close()
        self._snapshots.close()
        if self._lock_file is not None:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None
