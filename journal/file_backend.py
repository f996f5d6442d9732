"""The embedded default backend: append-only segment files on one machine.

Layout of a journal directory::

    LOCK                       one writer at a time (flock), holds the writer's pid
    log/<base offset>.seg      event frames and commit markers: the audit trail
    snapshots/<gen>.snap       snapshot frames (the compacted stream), generation <gen>

A frame is ``b"RJ" | type:u8 | key_len:u16 | value_len:u32 | crc32:u32 | key | value``
(little-endian; value_len ``0xFFFFFFFF`` is a tombstone). A commit first
appends its snapshot frames to the current ``.snap`` file and fsyncs it, then
appends its event frames and a COMMIT frame to the log and fsyncs that. The
COMMIT frame names the snapshot generation and length it commits, so the log
is the single commit point: on open, log bytes after the last COMMIT (a torn
tail) are cut, and so are ``.snap`` bytes past the committed length. Readers
hand out event records only once they have seen the COMMIT that covers them.

An offset is a byte position in the concatenated log; like Kafka's offsets it
is monotonic but not contiguous. The CRC lets a reader detect a corrupt record,
report it by file and position, and resynchronise on the next valid frame.

Snapshots live apart from events so that reading the snapshot stream (every
restore does) costs the size of the live snapshot set, not of the history.
Compaction writes the newest two values of each live key into generation
``gen + 1`` (tmp file, fsync, rename) and drops tombstoned keys; the next
COMMIT then names the new generation.
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

from .backend import Backend, OutRecord, StoredRecord, Stream, compacted
from .errors import ConfigurationError, RecordLocation, WriterLockedError

log = logging.getLogger(__name__)

FRAME_MAGIC = b"RJ"
_HEADER = struct.Struct("<2sBHII")
HEADER_LEN = _HEADER.size  # 13
_TOMBSTONE_LEN = 0xFFFFFFFF
_MAX_VALUE_LEN = 256 * 1024 * 1024

EVENT, SNAPSHOT, COMMIT = 1, 2, 3
_TAIL_SCAN = 1 << 20  # bytes read at a time when looking backwards for the last commit marker


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


def _commit_value(value: bytes | None) -> tuple[int, int]:
    generation, _, length = (value or b"0:0").decode().partition(":")
    return int(generation), int(length or 0)


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
        self._log_dir = self.root / "log"
        self._snap_dir = self.root / "snapshots"
        self._lock_file = None
        self._active = None
        self._snap_file = None
        if read_only:
            if not self._log_dir.is_dir():
                raise ConfigurationError(f"no file journal at {self.root} (missing {self._log_dir})")
            return
        self._log_dir.mkdir(parents=True, exist_ok=True)
        self._snap_dir.mkdir(exist_ok=True)
        self._acquire_lock()
        self._cut_torn_tail()
        self._open_active()
        self._open_snapshots()

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

    def _snap_path(self, generation: int) -> Path:
        return self._snap_dir / f"{generation:010d}.snap"

    def _snap_generations(self) -> list[int]:
        return sorted(int(p.stem) for p in self._snap_dir.glob("*.snap")) if self._snap_dir.is_dir() else []

    def _committed_snapshots(self) -> tuple[int, int | None]:
        """(generation, committed length) of the snapshot file to read; length None: all of it.

        The newest generation wins: if it is newer than the last commit names, it
        is a compaction's complete output, renamed into place before any commit used it.
        """
        generation, length = self._last_commit()
        generations = self._snap_generations()
        newest = generations[-1] if generations else generation
        if newest > generation:
            return newest, None
        if newest < generation:
            raise ConfigurationError(
                f"file journal {self.root}: snapshot generation {generation} named by the log is missing "
                f"from {self._snap_dir}; the journal directory was altered"
            )
        return generation, length

    def _open_snapshots(self) -> None:
        generation, length = self._committed_snapshots()
        path = self._snap_path(generation)
        path.touch()
        if length is not None and path.stat().st_size > length:
            log.warning("file journal %s: cutting %d uncommitted snapshot bytes (torn tail after a crash)",
                        path, path.stat().st_size - length)
            with open(path, "r+b") as f:
                f.truncate(length)
                os.fsync(f.fileno())
        for older in self._snap_generations():
            if older < generation:
                self._snap_path(older).unlink()
        self._snap_gen = generation
        self._snap_file = open(path, "ab")
        self._snap_end = self._snap_file.tell()
        self._snap_compacted_size = self._snap_end

    def _last_commit(self) -> tuple[int, int]:
        """(snapshot generation, snapshot length) named by the log's last COMMIT frame."""
        if self._snap_file is not None:
            return self._snap_gen, self._snap_end
        for base, path in reversed(self._segments()):
            size = path.stat().st_size
            window = _TAIL_SCAN
            with open(path, "rb") as f:
                while True:
                    start = max(0, size - window)
                    f.seek(start)
                    data = f.read(size - start)
                    pos = len(data)
                    while (pos := data.rfind(FRAME_MAGIC + bytes((COMMIT,)), 0, pos)) >= 0:
                        frame = self._parse(data, pos, base + start, path)
                        if frame.error is None and frame.type == COMMIT:
                            return _commit_value(frame.value)
                    if start == 0:
                        break
                    window *= 4
        return 0, 0

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
        event_frames: list[bytes] = []
        snap_frames: list[bytes] = []
        locations: list[RecordLocation] = []
        position, snap_position = self._end, self._snap_end
        log_source = str(self._log_dir / _segment_name(self._active_base))
        snap_source = str(self._snap_path(self._snap_gen))
        for record in records:
            if record.stream is Stream.EVENTS:
                if record.value is None:
                    raise ValueError(f"event record {record.key!r} has no value; only snapshots take tombstones")
                frame = encode_frame(EVENT, record.key, record.value)
                locations.append(RecordLocation(log_source, 0, position))
                event_frames.append(frame)
                position += len(frame)
            else:
                frame = encode_frame(SNAPSHOT, record.key, record.value)
                locations.append(RecordLocation(snap_source, 0, snap_position))
                snap_frames.append(frame)
                snap_position += len(frame)
        if snap_frames:  # durable before the commit marker that makes them visible
            self._snap_file.write(b"".join(snap_frames))
            self._snap_file.flush()
            if self.fsync:
                os.fsync(self._snap_file.fileno())
        event_frames.append(encode_frame(COMMIT, "", f"{self._snap_gen}:{snap_position}".encode()))
        data = b"".join(event_frames)
        self._active.write(data)
        self._active.flush()
        if self.fsync:
            os.fsync(self._active.fileno())
        self._end += len(data)
        self._snap_end = snap_position
        if self._end - self._active_base >= self.segment_bytes:
            self._roll_segment()
        grown = self._snap_end - self._snap_compacted_size
        if grown >= self.min_compaction_bytes and grown >= self.max_dirty_ratio * self._snap_end:
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
        generation, length = self._committed_snapshots()
        path = self._snap_path(generation)
        if not path.exists():
            return
        with open(path, "rb") as f:
            data = f.read() if length is None else f.read(length)
        pos = 0
        while pos < len(data):
            frame = self._parse(data, pos, 0, path)
            yield self._stored(path, frame)
            pos = frame.end if frame.error is None else self._resync(data, pos + 1, 0, path)

    def compact_snapshots(self, keep_per_key: int = 2) -> None:
        """Write the next snapshot generation with the newest ``keep_per_key`` values of
        each live key (the previous one is the fallback if the newest proves corrupt);
        tombstoned keys are dropped. Crash-safe: tmp file, fsync, rename, then switch."""
        latest = compacted(self.read_snapshots(), keep_per_key)
        generation = self._snap_gen + 1
        tmp = self._snap_path(generation).with_suffix(".tmp")
        with open(tmp, "wb") as f:
            for records in latest.values():
                for record in records:
                    f.write(encode_frame(SNAPSHOT, record.key, record.value))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._snap_path(generation))
        self._fsync_dir(self._snap_dir)
        old = self._snap_path(self._snap_gen)
        self._snap_file.close()
        self._snap_gen = generation
        self._snap_file = open(self._snap_path(generation), "ab")
        self._snap_end = self._snap_compacted_size = self._snap_file.tell()
        old.unlink()

    def close(self) -> None:
        if self._active is not None:
            self._active.close()
            self._active = None
        if self._snap_file is not None:
            self._snap_file.close()
            self._snap_file = None
        if self._lock_file is not None:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None
