"""The embedded default backend: append-only segment files on one machine.

Layout of a journal directory::

    LOCK                       one writer at a time (flock), holds the writer's pid
    log/<base offset>.seg      event frames, results frames and commit markers: the audit trail
    snapshots/<gen>.snap       snapshot frames (the compacted stream), generation <gen>

A frame is ``b"RJ" | type:u8 | key_len:u16 | value_len:u32 | crc32:u32 | key | value``
(little-endian; value_len ``0xFFFFFFFF`` is a tombstone; type 1 an event, 2 a
snapshot, 3 a COMMIT, 4 a results record: the results stream lives in the log, so a
final turn's results record commits under the same COMMIT as its events; readers
before 0.4 report a type-4 frame as an unreadable record). A commit first
appends its snapshot frames to the current ``.snap`` file, durably, then
appends its event frames and a COMMIT frame to the log in one durable write
(both files are opened ``O_DSYNC``: a write returns once it is on disk). The
COMMIT frame is the single commit point. Its value names

- the snapshot generation and length it commits, so ``.snap`` bytes past the
  last commit (a crash between the two writes) are cut on open;
- the batch's first offset and the CRC-32 of the batch's event frames, so a
  batch whose COMMIT reached the disk while an earlier page of it did not (a
  power loss mid-write) is recognised and cut on open, never half-visible.

Readers hand out event records only once they have seen the COMMIT that covers
them. An offset is a byte position in the concatenated log; like Kafka's
offsets it is monotonic but not contiguous. The per-frame CRC lets a reader
detect a corrupt record, report it by file and position, and resynchronise on
the next valid frame.

Torn tail or damage. Only the bytes after the log's last readable COMMIT frame,
and that last commit itself when its batch fails its CRC (a power loss landed
the marker before an earlier page), are a torn tail: readers withhold them and
the writer cuts them on open. Anything else is damage, reported and never cut:

- a committed batch that fails its CRC (or whose commit marker is unreadable)
  with a readable commit after it: readers step over the whole batch and report
  it as one bad record naming the segment, its position and the rollouts whose
  records it holds; the writer logs it on open and keeps every later commit;
- a sealed segment shorter than the next segment's base offset says (a file cut
  short): readers report the first missing offset; the writer logs it on open;
- a snapshot generation file that is missing or shorter than the log says: the
  writer records the loss in ``snapshots/<gen>.lost``, starts a fresh generation
  and commits it; ``damage()`` reports the loss from then on (a reader finds it
  unrecorded too), and restore replays every rollout the event log names and
  the snapshot stream does not from its first event.

Snapshots live apart from events so that reading the snapshot stream (every
restore does) costs the size of the live snapshot set, not of the history.
Compaction writes the newest two values of each live key, in their original
order, into generation ``gen + 1`` (tmp file, fsync, rename) and then commits
that generation with a COMMIT frame of its own; a compaction the log never
committed is discarded on open. A compaction that fails (a full disk) leaves
the journal as it was: the new file is removed, a COMMIT frame written part
way is cut back, generation ``gen`` stays committed and open for appends. It
is logged as an error and kept in ``compaction_error`` / ``compaction_failures``,
and a commit retries it once the snapshot file has grown by another
``min_compaction_bytes``.
"""

from __future__ import annotations

import fcntl
import io
import itertools
import logging
import os
import struct
import zlib
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, TextIO

from .backend import Backend, OutRecord, StoredRecord, Stream, compacted
from .errors import (
    ConfigurationError,
    FatalJournalError,
    JournalDamageError,
    JournalError,
    RecordLocation,
    SnapshotsLostError,
    WriterLockedError,
)

log = logging.getLogger(__name__)

FRAME_MAGIC = b"RJ"
_HEADER = struct.Struct("<2sBHII")
HEADER_LEN = _HEADER.size  # 13
_TOMBSTONE_LEN = 0xFFFFFFFF
MAX_VALUE_LEN = 256 * 1024 * 1024
MAX_KEY_LEN = 0xFFFF

EVENT, SNAPSHOT, COMMIT, RESULT = 1, 2, 3, 4
# A frame's CRC-32 covers its type byte, then key and value: the type's part, computed once.
_TYPE_CRC = {t: zlib.crc32(bytes((t,))) for t in (EVENT, SNAPSHOT, COMMIT, RESULT)}
_TAIL_SCAN = 1 << 20  # bytes read at a time when looking backwards for the last commit marker


class _Frame(NamedTuple):
    """One frame as read (a tuple: every record read makes one, and a frozen dataclass's
    construction cost as much as checking the frame's CRC)."""

    position: int  # global offset
    type: int
    key: str
    value: bytes | None
    end: int  # global offset just past the frame
    error: str | None = None


@dataclass(frozen=True, slots=True)
class CommitMark:
    """What a COMMIT frame commits."""

    snap_generation: int
    snap_length: int
    batch_start: int  # global offset of the batch's first event frame (= the COMMIT's own if none)
    batch_crc: int  # CRC-32 of the batch's event frames

    def encode(self) -> bytes:
        return f"{self.snap_generation}:{self.snap_length}:{self.batch_start}:{self.batch_crc}".encode()

    @classmethod
    def decode(cls, value: bytes | None) -> CommitMark:
        try:
            generation, length, start, crc = (value or b"").decode().split(":")
            return cls(int(generation), int(length), int(start), int(crc))
        except ValueError:
            raise JournalError(f"unreadable commit marker {value!r}") from None


EMPTY = CommitMark(0, 0, 0, 0)


def encode_frame(type_: int, key: str, value: bytes | None) -> bytes:
    key_bytes = key.encode()
    if len(key_bytes) > MAX_KEY_LEN:
        raise ValueError(f"record key {key[:40]!r}... is {len(key_bytes)} bytes; the file journal allows {MAX_KEY_LEN}")
    if value is not None and len(value) > MAX_VALUE_LEN:
        raise ValueError(f"record {key!r} is {len(value)} bytes; the file journal allows {MAX_VALUE_LEN}")
    value_len = _TOMBSTONE_LEN if value is None else len(value)
    body = key_bytes + (value or b"")
    crc = zlib.crc32(bytes((type_,)) + body)
    return _HEADER.pack(FRAME_MAGIC, type_, len(key_bytes), value_len, crc) + body


def _segment_name(base: int) -> str:
    return f"{base:020d}.seg"


def _parse(data: bytes, pos: int, base: int) -> _Frame:
    """The frame at ``data[pos:]`` (``base`` = global offset of ``data[0]``), or one with ``error`` set."""
    where = base + pos
    if len(data) - pos < HEADER_LEN:
        return _Frame(where, 0, "", None, where, error=f"truncated frame header ({len(data) - pos} bytes)")
    magic, type_, key_len, value_len, crc = _HEADER.unpack_from(data, pos)
    if magic != FRAME_MAGIC:
        return _Frame(where, 0, "", None, where, error=f"bad frame magic {magic.hex()}")
    if type_ not in (EVENT, SNAPSHOT, COMMIT, RESULT):
        return _Frame(where, 0, "", None, where, error=f"unknown frame type {type_}")
    tombstone = value_len == _TOMBSTONE_LEN
    body_len = key_len + (0 if tombstone else value_len)
    if not tombstone and value_len > MAX_VALUE_LEN:
        return _Frame(where, 0, "", None, where, error=f"implausible value length {value_len}")
    start = pos + HEADER_LEN
    if start + body_len > len(data):
        return _Frame(where, 0, "", None, where, error=f"truncated frame body (needs {body_len} bytes)")
    end = start + body_len
    body = memoryview(data)[start:end]  # checked and decoded in place: the value is the one copy made
    if zlib.crc32(body, _TYPE_CRC[type_]) != crc:  # the key may be damaged too: named, as unverified
        key = bytes(body[:key_len]).decode(errors="replace")[:80]
        return _Frame(where, type_, "", None, where, error=f"CRC mismatch (record key {key!r}, unverified)")
    try:
        key = str(body[:key_len], "utf-8")
    except UnicodeDecodeError:
        return _Frame(where, type_, "", None, where, error="key is not UTF-8")
    value = None if tombstone else data[start + key_len:end]
    return _Frame(where, type_, key, value, base + end)


def _resync(data: bytes, pos: int, base: int) -> int:
    """Position of the next valid frame at or after ``pos`` (``len(data)`` if none)."""
    while True:
        pos = data.find(FRAME_MAGIC, pos)
        if pos < 0:
            return len(data)
        if _parse(data, pos, base).error is None:
            return pos
        pos += 1


def _frames(data: bytes, base: int, start: int = 0, *, aligned: bool = True) -> Iterator[_Frame]:
    """Every frame of ``data`` from ``start``; a bad frame is reported, then reading
    resynchronises on the next valid frame. Unless ``aligned``, ``start`` may lie
    inside a frame (any offset may be asked for, as with Kafka): reading begins at the
    next frame. A truncated last frame with nothing valid after it is a torn tail,
    not an error."""
    pos, size = start, len(data)
    if not aligned and pos < size and _parse(data, pos, base).error is not None:
        pos = _resync(data, pos, base)
    while pos < size:
        frame = _parse(data, pos, base)
        if frame.error is None:
            yield frame
            pos = frame.end - base
            continue
        following = _resync(data, pos + 1, base)
        if frame.error.startswith("truncated") and following >= size:
            return
        yield frame
        pos = following


def _batch_intact(data: bytes, base: int, commit: _Frame, mark: CommitMark) -> bool:
    """Whether the batch a COMMIT frame closes is on disk whole (its CRC matches)."""
    if mark.batch_start < base:
        return True  # the batch began before the bytes we read: only a log's last batch can be torn
    return zlib.crc32(data[mark.batch_start - base:commit.position - base]) == mark.batch_crc


def _mark_of(frame: _Frame) -> CommitMark | None:
    """What a readable COMMIT frame commits; None for any other frame."""
    if frame.error is not None or frame.type != COMMIT:
        return None
    try:
        return CommitMark.decode(frame.value)
    except JournalError:
        return None


def _damage(position: int, frames: Sequence[_Frame], what: str) -> _Frame:
    """One error frame for a run of records stepped over: where, whose (the frames' keys), why."""
    keys = sorted({f.key for f in frames if f.error is None and f.key})
    whose = f" (records of rollouts {', '.join(keys)})" if keys else ""
    causes = "; ".join(f"position {f.position}: {f.error}" for f in frames if f.error is not None)
    return _Frame(position, 0, "", None, position, error=f"{what}{whose}{f' [{causes}]' if causes else ''}")


def _failed_batch(commit: _Frame, batch: list[_Frame]) -> _Frame:
    start = CommitMark.decode(commit.value).batch_start
    return _damage(start, batch, f"the batch committed at position {commit.position} fails its CRC check; "
                                 f"its {len(batch)} records are skipped")


def _committed(data: bytes, base: int, next_base: int | None, *, aligned: bool = True) -> Iterator[_Frame]:
    """The committed frames of one segment's bytes (``base`` = global offset of ``data[0]``),
    in order, with one error frame for each piece of damage, stepped over whole.

    ``next_base`` is where the next segment begins; None for the log's last segment, the
    only place a torn tail can be: there a last commit whose batch fails its CRC and any
    frames after the last commit are withheld silently (not committed, cut by the writer).
    """
    pending: list[_Frame] = []  # frames (and bad frames) since the last commit marker
    suspect: tuple[_Frame, list[_Frame]] | None = None  # a commit whose batch fails its CRC, and that batch
    good_end = base  # just past the last whole frame
    for frame in _frames(data, base, aligned=aligned):
        if frame.error is None:
            good_end = frame.end
        mark = _mark_of(frame)
        if mark is None:
            pending.append(frame)
            continue
        if suspect is not None:  # a commit follows it: not a torn tail but damage
            yield _failed_batch(*suspect)
            suspect = None
        orphans = [f for f in pending if f.position < mark.batch_start]
        batch = [f for f in pending if f.position >= mark.batch_start]
        pending = []
        if orphans:  # a batch whose own COMMIT frame is unreadable
            yield _damage(orphans[0].position, orphans,
                          f"{len(orphans)} frames before position {mark.batch_start} have no readable commit "
                          "marker; skipped")
        if _batch_intact(data, base, frame, mark):
            yield from batch
        else:
            suspect = (frame, batch)
    if next_base is None:
        return  # a torn last batch, or one being written right now: not committed
    end = base + len(data)
    if suspect is not None:
        yield _failed_batch(*suspect)
    if end < next_base:
        first_missing = pending[0].position if pending else good_end
        yield _damage(first_missing, pending,
                      f"sealed segment ends at position {end}, short of position {next_base} where the next "
                      f"segment begins: the {next_base - first_missing} bytes from position {first_missing} on "
                      "are lost (the file was cut short)")
    elif pending:
        yield _damage(pending[0].position, pending,
                      f"{len(pending)} records at the end of a sealed segment have no commit marker; skipped")
    if end > next_base:
        yield _damage(next_base, [], f"sealed segment runs {end - next_base} bytes past position {next_base}, "
                                     "where the next segment begins; the overlapping offsets are ambiguous")


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
        self._lock_file: TextIO | None = None
        self._active: io.FileIO | None = None  # the log segment a writer appends to; None: read-only or closed
        self._snap_file: io.FileIO | None = None  # the snapshot generation a writer appends to
        self._last_mark = EMPTY
        self._frame_ends: dict[int, int] = {}  # event frame start -> end, for the last commit
        self._broken: str | None = None  # why this writer can no longer commit safely
        self.compaction_failures = 0  # snapshot compactions that failed (and changed nothing)
        self.compaction_error: Exception | None = None  # why the last one failed; None once one succeeds
        self._compaction_retry_at = 0  # snapshot length before which a failed compaction is not retried
        if read_only:
            if not self._log_dir.is_dir():
                raise ConfigurationError(f"no file journal at {self.root} (missing {self._log_dir})")
            return
        self._log_dir.mkdir(parents=True, exist_ok=True)
        self._snap_dir.mkdir(exist_ok=True)
        self._acquire_lock()
        self._last_mark = self._cut_torn_tail()
        self._open_active()
        self._open_snapshots()

    # -- opening -------------------------------------------------------------
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

    def _segments(self) -> list[tuple[int, Path]]:
        out = []
        for path in self._log_dir.glob("*.seg"):
            try:
                out.append((int(path.stem), path))
            except ValueError:
                raise ConfigurationError(f"unexpected file {path} in journal log directory") from None
        return sorted(out)

    def _cut_torn_tail(self) -> CommitMark:
        """Cut the torn tail of the newest segment (see the module docstring) and log any
        damage before it, which stays; the mark of the last commit kept."""
        segments = self._segments()
        if not segments:
            return EMPTY
        for (base, path), (next_base, _) in itertools.pairwise(segments):
            if base + path.stat().st_size != next_base:  # only a damaged sealed segment is read here
                self._log_damage(path, _committed(path.read_bytes(), base, next_base))
        base, path = segments[-1]
        data = path.read_bytes()
        commits = [(frame, mark) for frame in _frames(data, base) if (mark := _mark_of(frame)) is not None]
        keep, mark = 0, None
        if commits and _batch_intact(data, base, *commits[-1]):
            keep, mark = commits[-1][0].end - base, commits[-1][1]
        elif len(commits) > 1:  # the last batch is torn (its marker landed, an earlier page did not)
            keep, mark = commits[-2][0].end - base, commits[-2][1]
        self._log_damage(path, _committed(data[:keep], base, None))
        if len(data) > keep:
            log.warning("file journal %s: cutting %d uncommitted bytes at position %d (torn tail after a crash)",
                        path, len(data) - keep, base + keep)
            with open(path, "r+b") as f:
                f.truncate(keep)
                os.fsync(f.fileno())
        return mark if mark is not None else self._last_commit_before(base)

    def _log_damage(self, path: Path, frames: Iterator[_Frame]) -> None:
        for frame in frames:
            if frame.error is not None:
                log.error("file journal %s: damage in %s at position %d: %s; readers step over it and the "
                          "writer keeps every commit after it", self.root, path, frame.position, frame.error)

    def _last_commit_before(self, end: int) -> CommitMark:
        segments = self._segments()
        for base, path in reversed(segments):
            if base >= end:
                continue
            found = self._find_last_commit(path, base, last=path == segments[-1][1])
            if found is not None:
                return found
        return EMPTY

    @staticmethod
    def _find_last_commit(path: Path, base: int, *, last: bool) -> CommitMark | None:
        """The mark of the segment's last readable COMMIT frame, searching backwards. In the
        log's ``last`` segment, a last commit whose batch fails its CRC is a torn tail: the
        commit before it counts."""
        size = path.stat().st_size
        window = _TAIL_SCAN
        with open(path, "rb") as f:
            while True:
                start = max(0, size - window)
                f.seek(start)
                data = f.read(size - start)
                pos, torn = len(data), False
                while (pos := data.rfind(FRAME_MAGIC + bytes((COMMIT,)), 0, pos)) >= 0:
                    frame = _parse(data, pos, base + start)
                    mark = _mark_of(frame)
                    if mark is None:
                        continue
                    if not last or torn:
                        return mark
                    if mark.batch_start < base + start:
                        break  # the batch starts before this window: widen it
                    if _batch_intact(data, base + start, frame, mark):
                        return mark
                    torn = True
                else:
                    if start == 0:
                        return None
                window *= 4

    def _open_active(self) -> None:
        segments = self._segments()
        if not segments:
            segments = [(0, self._log_dir / _segment_name(0))]
            segments[0][1].touch()
            self._fsync_dir(self._log_dir)
        base, path = segments[-1]
        self._active_base = base
        active = self._open_append(path)
        self._active = active
        self._end = base + active.tell()

    def _snap_path(self, generation: int) -> Path:
        return self._snap_dir / f"{generation:010d}.snap"

    def _snap_generations(self) -> list[int]:
        return sorted(int(p.stem) for p in self._snap_dir.glob("*.snap")) if self._snap_dir.is_dir() else []

    def _lost_path(self, generation: int) -> Path:
        return self._snap_dir / f"{generation:010d}.lost"

    def _open_snapshots(self) -> None:
        """Keep exactly the committed snapshot generation, cut to its committed length."""
        mark = self._last_mark
        path = self._snap_path(mark.snap_generation)
        for generation in self._snap_generations():
            if generation != mark.snap_generation:  # older, or a compaction the log never committed
                self._snap_path(generation).unlink()
        size = path.stat().st_size if path.exists() else None
        if size is None and not mark.snap_length:
            path.touch()
            size = 0
        if size is None or size < mark.snap_length:
            self._start_after_lost_generation(mark, size)
            return
        if size > mark.snap_length:
            log.warning("file journal %s: cutting %d uncommitted snapshot bytes (torn tail after a crash)",
                        path, size - mark.snap_length)
            with open(path, "r+b") as f:
                f.truncate(mark.snap_length)
                os.fsync(f.fileno())
        self._snap_file = self._open_append(path)
        self._snap_compacted_size = mark.snap_length

    def _start_after_lost_generation(self, mark: CommitMark, size: int | None) -> None:
        """The committed snapshot generation is gone (or cut short): record the loss for good,
        so every later restore knows to look in the event log, then start and commit an empty
        generation. A crash half way repeats this on the next open."""
        lost = self._snap_path(mark.snap_generation)
        found = "missing" if size is None else f"{size} bytes long"
        note = (f"snapshot generation {mark.snap_generation} ({lost}) was {found} although the log commits "
                f"{mark.snap_length} bytes of it; found by writer pid {os.getpid()} at log offset {self._end}; "
                "restore replays every rollout the snapshot stream lacks from the event log")
        log.error("file journal %s: %s. Starting snapshot generation %d.", self.root, note, mark.snap_generation + 1)
        record = self._lost_path(mark.snap_generation)
        with open(record, "w") as f:
            f.write(note + "\n")
            f.flush()
            os.fsync(f.fileno())
        generation = mark.snap_generation + 1
        self._snap_path(generation).touch()
        self._fsync_dir(self._snap_dir)  # the record and the new file, before the log names the new file
        self._snap_file = self._open_append(self._snap_path(generation))
        self._append_commit(b"", CommitMark(generation, 0, self._end, zlib.crc32(b"")))
        self._snap_compacted_size = 0
        lost.unlink(missing_ok=True)

    def damage(self) -> list[JournalDamageError]:
        """Lost snapshot generations, recorded by a writer (``snapshots/<gen>.lost``) or, on a
        reader, the committed one missing or short now."""
        found: list[JournalDamageError] = []
        lost_generations = set()
        for record in sorted(self._snap_dir.glob("*.lost")) if self._snap_dir.is_dir() else []:
            try:
                generation, note = int(record.stem), record.read_text().strip()
            except (OSError, ValueError) as exc:
                generation, note = -1, f"unreadable loss record {record}: {exc}"
            lost_generations.add(generation)
            found.append(SnapshotsLostError(RecordLocation(str(self._snap_path(generation)), 0, 0), note))
        if self._active is None:
            mark, path, size = self._committed_snapshot()
            if (size is None or size < mark.snap_length) and mark.snap_generation not in lost_generations:
                state = "is missing" if size is None else f"holds {size} bytes"
                found.append(SnapshotsLostError(RecordLocation(str(path), 0, 0), (
                    f"snapshot generation {mark.snap_generation} {state} although the log commits "
                    f"{mark.snap_length} bytes of it; restore replays every rollout the snapshot stream lacks "
                    "from the event log (a writer opening the journal records the loss and starts a new generation)")))
        return found

    def _roll_segment(self) -> None:
        self._for_writing(self._active).close()
        path = self._log_dir / _segment_name(self._end)
        self._active = self._open_append(path)
        self._active_base = self._end
        self._fsync_dir(self._log_dir)

    @staticmethod
    def _fsync_dir(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # -- writing -------------------------------------------------------------
    def _for_writing(self, file: io.FileIO | None, action: str = "write") -> io.FileIO:
        """``file``, the log segment or snapshot generation a writer appends to (``_active``,
        ``_snap_file``); a reader (or a closed writer) has none and refuses here, before it
        touches a file."""
        if file is None:
            raise ConfigurationError(f"file journal {self.root} is open read-only (or closed); cannot {action}")
        return file

    def commit(self, records: Sequence[OutRecord]) -> list[RecordLocation]:
        self._for_writing(self._active, "commit")
        if self._broken is not None:
            raise FatalJournalError(self._broken)
        event_frames: list[bytes] = []
        snap_frames: list[bytes] = []
        locations: list[RecordLocation] = []
        ends: dict[int, int] = {}
        position, snap_position = self._end, self._last_mark.snap_length
        log_source = str(self._log_dir / _segment_name(self._active_base))
        snap_source = str(self._snap_path(self._last_mark.snap_generation))
        for record in records:
            if record.stream is not Stream.SNAPSHOTS:  # events and results: frames of the log, one commit
                if record.value is None:
                    raise ValueError(f"{record.stream.value} record {record.key!r} has no value; only snapshots "
                                     "take tombstones")
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
            self._write(self._for_writing(self._snap_file), b"".join(snap_frames))
        batch = b"".join(event_frames)
        mark = CommitMark(self._last_mark.snap_generation, snap_position, self._end, zlib.crc32(batch))
        self._append_commit(batch, mark)
        self._frame_ends = ends
        if self._end - self._active_base >= self.segment_bytes:
            self._roll_segment()
        grown = mark.snap_length - self._snap_compacted_size
        if grown >= self.min_compaction_bytes and grown >= self.max_dirty_ratio * mark.snap_length \
                and mark.snap_length >= self._compaction_retry_at:
            try:
                self.compact_snapshots()
            except Exception:  # noqa: BLE001 - logged and counted there; the batch above is durable: it stands
                self._compaction_retry_at = mark.snap_length + self.min_compaction_bytes
        return locations

    def _open_append(self, path: Path) -> io.FileIO:
        """An unbuffered append file. With fsync on it is opened ``O_DSYNC``: each write
        returns once its data and the file size that reaches it are durable, one system
        call per commit instead of write + fdatasync (the committer thread gives up and
        takes back the GIL at each one)."""
        sync = os.O_DSYNC if self.fsync else 0
        return open(path, "ab", buffering=0, opener=lambda name, flags: os.open(name, flags | sync, 0o644))

    @staticmethod
    def _write(file: io.FileIO, data: bytes) -> None:
        view = memoryview(data)
        while view:  # a regular file takes it all at once, barring a full disk or a signal
            view = view[file.write(view):]

    def _append_commit(self, batch: bytes, mark: CommitMark) -> None:
        data = batch + encode_frame(COMMIT, "", mark.encode())
        active = self._for_writing(self._active)
        try:
            self._write(active, data)
        except BaseException:
            self._cut_failed_write()
            raise
        self._end += len(data)
        self._last_mark = mark

    def _cut_failed_write(self) -> None:
        """A write that failed part way (a full disk) leaves bytes no commit covers. Cut them
        now: a later commit would turn them into damage in the middle of the log."""
        active = self._for_writing(self._active)
        try:
            os.ftruncate(active.fileno(), self._end - self._active_base)
            os.fsync(active.fileno())
        except OSError as exc:
            self._broken = (f"file journal {self.root}: a failed write left bytes past position {self._end} of "
                            f"{active.name} that could not be cut ({exc}); reopen the journal to cut them")
            log.error("%s", self._broken)

    def offset_after(self, location: RecordLocation) -> int:
        return self._frame_ends.get(location.offset, location.offset + 1)

    def end_offset(self, partition: int = 0) -> int:
        if self._active is not None:
            return self._end
        segments = self._segments()
        return segments[-1][0] + segments[-1][1].stat().st_size if segments else 0

    def compact_snapshots(self, keep_per_key: int = 2) -> None:
        """Write the next snapshot generation with the newest ``keep_per_key`` values of
        each live key, in their original order; tombstoned keys are dropped. Crash-safe:
        tmp file, fsync, rename, then a COMMIT frame naming the new generation.

        If it fails, nothing changed (see the module docstring): the error is logged,
        counted in ``compaction_failures``, kept in ``compaction_error`` and raised.
        A reader (or a closed writer) raises ``ConfigurationError`` and touches nothing."""
        # Before any file is written: a reader's generation number is not the writer's, and
        # its clean-up after the failed commit would delete the writer's live generation.
        self._for_writing(self._active, "compact snapshots")
        old = self._snap_path(self._last_mark.snap_generation)
        generation = self._last_mark.snap_generation + 1
        path = self._snap_path(generation)
        tmp = path.with_suffix(".tmp")
        new_file = None
        try:
            skipped: list[StoredRecord] = []
            latest = compacted(self.read_snapshots(), keep_per_key, skipped.append)
            for record in skipped:
                log.warning("file journal %s: compaction drops unreadable snapshot record at %s: %s",
                            self.root, record.location, record.error)
            kept = sorted((r for records in latest.values() for r in records), key=lambda r: r.location.offset)
            with open(tmp, "wb") as f:
                for record in kept:
                    f.write(encode_frame(SNAPSHOT, record.key, record.value))
                f.flush()
                os.fsync(f.fileno())
                length = f.tell()
            os.replace(tmp, path)
            self._fsync_dir(self._snap_dir)
            new_file = self._open_append(path)  # opened before the commit: after it, nothing may fail
            self._append_commit(b"", CommitMark(generation, length, self._end, zlib.crc32(b"")))
        except Exception as exc:
            if new_file is not None:
                new_file.close()
            for leftover in (tmp, path):  # the log never named them: as if the compaction never began
                try:
                    leftover.unlink(missing_ok=True)
                except OSError as cleanup:
                    log.warning("file journal %s: could not remove %s (%s); the next open removes it",
                                self.root, leftover, cleanup)
            self.compaction_failures += 1
            self.compaction_error = exc
            log.error("file journal %s: snapshot compaction into generation %d failed: %s; the journal is "
                      "unchanged, generation %d stays committed, and compaction is retried later",
                      self.root, generation, exc, generation - 1)
            raise
        self._for_writing(self._snap_file).close()
        self._snap_file = new_file
        self._snap_compacted_size = length
        self.compaction_error = None
        try:
            old.unlink()
        except OSError as exc:  # not committed any more: the next open removes it
            log.warning("file journal %s: could not remove the old snapshot generation %s: %s", self.root, old, exc)

    # -- reading -----------------------------------------------------------
    def _committed_frames(self, from_offset: int) -> Iterator[tuple[Path, _Frame]]:
        """Event frames whose batch has an intact commit marker, with their segment, and an
        error frame for each piece of damage (see ``_committed``)."""
        segments = self._segments()
        for i, (base, path) in enumerate(segments):
            next_base = segments[i + 1][0] if i + 1 < len(segments) else None
            if next_base is not None and next_base <= from_offset:
                continue
            skip = max(0, from_offset - base)  # read from the offset, not the segment's start
            with open(path, "rb") as f:
                f.seek(skip)
                data = f.read()  # bounded by segment_bytes: one read beats many small ones
            for frame in _committed(data, base + skip, next_base, aligned=skip == 0):
                yield path, frame

    @staticmethod
    def _stored(path: Path, frame: _Frame) -> StoredRecord:
        return StoredRecord(frame.key, frame.value, RecordLocation(str(path), 0, frame.position), frame.error)

    def read_events(self, partition: int = 0, from_offset: int = 0) -> Iterator[StoredRecord]:
        if partition != 0:
            raise ValueError(f"file journal has one partition; asked for partition {partition}")
        for path, frame in self._committed_frames(from_offset):
            if frame.error is not None or frame.type == EVENT:
                yield self._stored(path, frame)

    def read_results(self, partition: int = 0, from_offset: int = 0) -> Iterator[StoredRecord]:
        """Committed results frames (interleaved with the events in the log, under the same COMMIT
        markers) from ``from_offset``, which may lie inside a frame: reading starts at the next."""
        if partition != 0:
            raise ValueError(f"file journal has one partition; asked for partition {partition}")
        for path, frame in self._committed_frames(from_offset):
            if frame.type == RESULT:
                yield self._stored(path, frame)

    def _committed_mark(self) -> CommitMark:
        if self._active is not None:
            return self._last_mark
        segments = self._segments()
        return self._last_commit_before(segments[-1][0] + 1) if segments else EMPTY

    def _committed_snapshot(self) -> tuple[CommitMark, Path, int | None]:
        """The committed snapshot generation's mark, file and size (None: missing)."""
        for _ in range(3):  # a concurrent writer's compaction may retire the file we were told of
            mark = self._committed_mark()
            path = self._snap_path(mark.snap_generation)
            try:
                return mark, path, path.stat().st_size
            except FileNotFoundError:
                if mark.snap_length == 0:
                    return mark, path, 0
        return mark, path, None

    def read_snapshots(self, partitions: Collection[int] | None = None) -> Iterator[StoredRecord]:
        """The committed snapshot generation's records. A lost one reads as what is left of
        it (nothing, if it is missing); ``damage()`` says so. One partition: 0."""
        if partitions is not None and 0 not in partitions:
            return
        for _ in range(3):  # a concurrent writer's compaction may retire the file we were told of
            mark = self._committed_mark()
            path = self._snap_path(mark.snap_generation)
            try:
                with open(path, "rb") as f:
                    data = f.read(mark.snap_length)
                break
            except FileNotFoundError:
                data = b""
        for frame in _frames(data, 0):
            yield self._stored(path, frame)

    def close(self) -> None:
        for name in ("_active", "_snap_file"):
            file = getattr(self, name)
            if file is not None:
                file.close()
                setattr(self, name, None)
        if self._lock_file is not None:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None
