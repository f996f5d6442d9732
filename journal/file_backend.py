"""The embedded default backend: append-only segment files on one machine.

Layout of a journal directory::

    LOCK                      one writer at a time (flock), holds the writer's pid
    log/<base offset>.seg     frames: event and snapshot records, commit markers
    snapshots.compact         latest snapshot records per key (derived, rewritten)

A frame is ``b"RJ" | type:u8 | key_len:u16 | value_len:u32 | crc32:u32 | key | value``
(little-endian; value_len ``0xFFFFFFFF`` is a tombstone). A commit writes its
records followed by a COMMIT frame and fsyncs once, so a batch is atomic: on
open, bytes after the last COMMIT frame (a torn tail) are cut, and readers
hand out records only once they have seen the marker that commits them. An
offset is a byte position in the concatenated log, like Kafka's offsets it is
monotonic but not contiguous. The CRC lets a reader detect a corrupt record,
report it by file and position, and resynchronise on the next valid frame.
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from .backend import Backend, OutRecord, StoredRecord, Stream
from .errors import ConfigurationError, RecordLocation, WriterLockedError

log = logging.getLogger(__name__)

FRAME_MAGIC = b"RJ"
_HEADER = struct.Struct("<2sBHII")
HEADER_LEN = _HEADER.size  # 13
_TOMBSTONE_LEN = 0xFFFFFFFF
_MAX_VALUE_LEN = 256 * 1024 * 1024

EVENT, SNAPSHOT, COMMIT = 1, 2, 3
_TYPE_OF_STREAM = {Stream.EVENTS: EVENT, Stream.SNAPSHOTS: SNAPSHOT}


@dataclass(frozen=True, slots=True)
class _Frame:
    position: int  # global offset
    type: int
    key: str
    value: bytes | None
    end: int  # global offset just past the frame
    error: str | None = None


def encode_frame(type_: int, key: str, value: bytes | None) -> bytes:
    key_bytes = key.encode()
    value_len = _TOMBSTONE_LEN if value is None else len(value)
    body = key_bytes + (value or b"")
    crc = zlib.crc32(bytes((type_,)) + body)
    return _HEADER.pack(FRAME_MAGIC, type_, len(key_bytes), value_len, crc) + body


def _segment_name(base: int) -> str:
    return f"{base:020d}.seg"


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
        compact_after_bytes: int = 16 * 1024 * 1024,
    ) -> None:
        self.root = Path(root)
        self.read_only = read_only
        self.fsync = fsync
        self.segment_bytes = segment_bytes
        self.compact_after_bytes = compact_after_bytes
        self._log_dir = self.root / "log"
        self._compact_path = self.root / "snapshots.compact"
        self._lock_file = None
        self._active = None
        if read_only:
            if not self._log_dir.is_dir():
                raise ConfigurationError(f"no file journal at {self.root} (missing {self._log_dir})")
        else:
            self._log_dir.mkdir(parents=True, exist_ok=True)
            self._acquire_lock()
            self._cut_torn_tail()
            self._open_active()
        self._snapshot_bytes_since_compaction = 0

    # -- writer side -------------------------------------------------------
    def _acquire_lock(self) -> None:
        path = self.root / "LOCK"
        self._lock_file = open(path, "a+")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.seek(0)
            holder = self._lock_file.read().strip() or "unknown"
            self._lock_file.close()
            self._lock_file = None
            raise WriterLockedError(
                f"file journal {self.root} is locked by writer pid {holder}; "
                "stop that process or open the journal read-only"
            ) from None
        self._lock_file.seek(0)
        self._lock_file.truncate()
        self._lock_file.write(str(os.getpid()))
        self._lock_file.flush()

    def _segments(self) -> list[tuple[int, Path]]:
        out = []
        for path in self._log_dir.glob("*.seg"):
            try:
                out.append((int(path.stem), path))
            except ValueError:
                raise ConfigurationError(f"unexpected file {path} in journal log directory") from None
        return sorted(out)

    def _cut_torn_tail(self) -> None:
        """Cut bytes after the last commit marker of the newest segment."""
        segments = self._segments()
        if not segments:
            return
        base, path = segments[-1]
        last_commit_end = 0
        for frame in self._frames_in(path, base, 0):
            if frame.error is None and frame.type == COMMIT:
                last_commit_end = frame.end - base
        size = path.stat().st_size
        if size > last_commit_end:
            log.warning(
                "file journal %s: cutting %d uncommitted bytes at position %d (torn tail after a crash)",
                path, size - last_commit_end, base + last_commit_end,
            )
            with open(path, "r+b") as f:
                f.truncate(last_commit_end)
                os.fsync(f.fileno())

    def _open_active(self) -> None:
        segments = self._segments()
        if not segments:
            segments = [(0, self._log_dir / _segment_name(0))]
            segments[0][1].touch()
            self._fsync_dir(self._log_dir)
        base, path = segments[-1]
        self._active_base = base
        self._active = open(path, "ab")
        self._end = base + self._active.tell()

    def _roll_segment(self) -> None:
        self._active.close()
        path = self._log_dir / _segment_name(self._end)
        self._active = open(path, "ab")
        self._active_base = self._end
        self._fsync_dir(self._log_dir)

    @staticmethod
    def _fsync_dir(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def commit(self, records: Sequence[OutRecord]) -> list[RecordLocation]:
        if self._active is None:
            raise ConfigurationError(f"file journal {self.root} is open read-only (or closed); cannot commit")
        chunks: list[bytes] = []
        locations: list[RecordLocation] = []
        position = self._end
        source = str(self._log_dir / _segment_name(self._active_base))
        for record in records:
            if record.value is None and record.stream is Stream.EVENTS:
                raise ValueError(f"event record {record.key!r} has no value; only snapshots take tombstones")
            frame = encode_frame(_TYPE_OF_STREAM[record.stream], record.key, record.value)
            locations.append(RecordLocation(source, 0, position))
            chunks.append(frame)
            position += len(frame)
            if record.stream is Stream.SNAPSHOTS:
                self._snapshot_bytes_since_compaction += len(frame)
        chunks.append(encode_frame(COMMIT, "", b""))
        data = b"".join(chunks)
        self._active.write(data)
        self._active.flush()
        if self.fsync:
            os.fsync(self._active.fileno())
        self._end += len(data)
        if self._end - self._active_base >= self.segment_bytes:
            self._roll_segment()
        if self._snapshot_bytes_since_compaction >= self.compact_after_bytes:
            self.compact_snapshots()
        return locations

    def end_offset(self, partition: int = 0) -> int:
        if self._active is not None:
            return self._end
        segments = self._segments()
        return segments[-1][0] + segments[-1][1].stat().st_size if segments else 0

    # -- reading -----------------------------------------------------------
    def _frames_in(self, path: Path, base: int, start: int) -> Iterator[_Frame]:
        """Every frame of one segment from ``start``; a bad frame is reported, then the
        reader resynchronises on the next valid frame. A ``start`` inside a frame
        (any offset may be asked for, as with Kafka) begins at the next frame."""
        with open(path, "rb") as f:
            data = f.read()  # segments are bounded (segment_bytes); one read beats many small ones
        pos, size = start, len(data)
        if 0 < pos < size and self._parse(data, pos, base, path).error is not None:
            pos = self._resync(data, pos, base, path)
        while pos < size:
            frame = self._parse(data, pos, base, path)
            if frame.error is None:
                yield frame
                pos = frame.end - base
                continue
            if frame.error.startswith("truncated") and self._no_valid_frame_after(data, pos + 1, base, path):
                return  # a torn tail: not an error, simply uncommitted bytes
            yield frame
            pos = self._resync(data, pos + 1, base, path)

    def _parse(self, data: bytes, pos: int, base: int, path: Path) -> _Frame:
        where = base + pos
        if len(data) - pos < HEADER_LEN:
            return _Frame(where, 0, "", None, where, error=f"truncated frame header ({len(data) - pos} bytes)")
        magic, type_, key_len, value_len, crc = _HEADER.unpack_from(data, pos)
        if magic != FRAME_MAGIC:
            return _Frame(where, 0, "", None, where, error=f"bad frame magic {magic.hex()}")
        if type_ not in (EVENT, SNAPSHOT, COMMIT):
            return _Frame(where, 0, "", None, where, error=f"unknown frame type {type_}")
        tombstone = value_len == _TOMBSTONE_LEN
        body_len = key_len + (0 if tombstone else value_len)
        if not tombstone and value_len > _MAX_VALUE_LEN:
            return _Frame(where, 0, "", None, where, error=f"implausible value length {value_len}")
        start = pos + HEADER_LEN
        if start + body_len > len(data):
            return _Frame(where, 0, "", None, where, error=f"truncated frame body (needs {body_len} bytes)")
        body = data[start:start + body_len]
        if zlib.crc32(bytes((type_,)) + body) != crc:
            return _Frame(where, type_, "", None, where, error="CRC mismatch")
        try:
            key = body[:key_len].decode()
        except UnicodeDecodeError:
            return _Frame(where, type_, "", None, where, error="key is not UTF-8")
        value = None if tombstone else body[key_len:]
        return _Frame(where, type_, key, value, base + start + body_len)

    def _resync(self, data: bytes, pos: int, base: int, path: Path) -> int:
        while True:
            pos = data.find(FRAME_MAGIC, pos)
            if pos < 0:
                return len(data)
            if self._parse(data, pos, base, path).error is None:
                return pos
            pos += 1

    def _no_valid_frame_after(self, data: bytes, pos: int, base: int, path: Path) -> bool:
        return self._resync(data, pos, base, path) >= len(data)

    def _committed_frames(self, from_offset: int) -> Iterator[tuple[Path, _Frame]]:
        """Frames whose batch has a commit marker, with their segment; bad frames are
        passed through at once."""
        pending: list[tuple[Path, _Frame]] = []
        for base, path in self._segments():
            next_base = base + path.stat().st_size
            if next_base <= from_offset:
                continue
            for frame in self._frames_in(path, base, max(0, from_offset - base)):
                if frame.error is not None:
                    yield path, frame
                elif frame.type == COMMIT:
                    yield from pending
                    pending.clear()
                else:
                    pending.append((path, frame))
        # records still pending belong to a batch being written now (or a torn tail): not committed

    @staticmethod
    def _stored(path: Path, frame: _Frame) -> StoredRecord:
        return StoredRecord(frame.key, frame.value, RecordLocation(str(path), 0, frame.position), frame.error)

    def read_events(self, partition: int = 0, from_offset: int = 0) -> Iterator[StoredRecord]:
        if partition != 0:
            raise ValueError(f"file journal has one partition; asked for partition {partition}")
        for path, frame in self._committed_frames(from_offset):
            if frame.error is not None or frame.type == EVENT:
                yield self._stored(path, frame)

    def read_snapshots(self) -> Iterator[StoredRecord]:
        covered = 0
        if self._compact_path.exists():
            base = 0
            for frame in self._frames_in(self._compact_path, base, 0):
                if frame.error is None and frame.type == COMMIT:
                    covered = int(frame.value.decode()) if frame.value else 0
                    continue
                yield self._stored(self._compact_path, frame)
        for path, frame in self._committed_frames(covered):
            if frame.error is None and frame.type == SNAPSHOT:
                yield self._stored(path, frame)

    def compact_snapshots(self, keep_per_key: int = 2) -> None:
        """Rewrite ``snapshots.compact`` with the newest ``keep_per_key`` values of each
        live key (the previous one is the fallback if the newest proves corrupt);
        tombstoned keys are dropped. Crash-safe: write a temporary file, fsync, rename."""
        latest: dict[str, list[StoredRecord]] = {}
        for record in self.read_snapshots():
            if record.error is not None:
                continue
            if record.value is None:
                latest.pop(record.key, None)
                continue
            kept = latest.setdefault(record.key, [])
            kept.append(record)
            del kept[:-keep_per_key]
        end = self.end_offset()
        tmp = self._compact_path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            for records in latest.values():
                for record in records:
                    f.write(encode_frame(SNAPSHOT, record.key, record.value))
            f.write(encode_frame(COMMIT, "", str(end).encode()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._compact_path)
        self._fsync_dir(self.root)
        self._snapshot_bytes_since_compaction = 0

    def close(self) -> None:
        if self._active is not None:
            self._active.close()
            self._active = None
        if self._lock_file is not None:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None
