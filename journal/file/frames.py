"""The file journal's on-disk frame: its format, its parser, and resynchronising after damage.

A frame is ``b"RJ" | type:u8 | key_len:u16 | value_len:u32 | crc32:u32 | key | value``
(little-endian; value_len ``0xFFFFFFFF`` is a tombstone; type 1 an event, 2 a
snapshot, 3 a COMMIT, 4 a results record: the results stream lives in the log, so a
final turn's results record commits under the same COMMIT as its events; readers
before 0.4 report a type-4 frame as an unreadable record). A COMMIT frame's value is
a :class:`CommitMark`: the snapshot generation and length it commits, and the first
offset and CRC-32 of the batch of event frames it closes.

The per-frame CRC lets a reader detect a corrupt record, report it by file and
position, and resynchronise on the next valid frame.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from rollout_journal.journal.backend import StoredRecord
from rollout_journal.journal.errors import JournalError, RecordLocation

FRAME_MAGIC = b"RJ"
_HEADER = struct.Struct("<2sBHII")
HEADER_LEN = _HEADER.size  # 13
_TOMBSTONE_LEN = 0xFFFFFFFF
MAX_VALUE_LEN = 256 * 1024 * 1024
MAX_KEY_LEN = 0xFFFF

EVENT, SNAPSHOT, COMMIT, RESULT = 1, 2, 3, 4
# A frame's CRC-32 covers its type byte, then key and value: the type's part, computed once.
_TYPE_CRC = {t: zlib.crc32(bytes((t,))) for t in (EVENT, SNAPSHOT, COMMIT, RESULT)}


class Frame(NamedTuple):
    """One frame as read (a tuple: every record read makes one, and a frozen dataclass's
    construction cost as much as checking the frame's CRC)."""

    position: int  # global offset
    type: int
    key: str
    value: bytes | None
    end: int  # global offset just past the frame
    error: str | None = None

    def stored(self, path: Path) -> StoredRecord:
        """The frame as the record a reader hands out, located in ``path``."""
        return StoredRecord(self.key, self.value, RecordLocation(str(path), 0, self.position), self.error)


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


def parse_frame(data: bytes, pos: int, base: int) -> Frame:
    """The frame at ``data[pos:]`` (``base`` = global offset of ``data[0]``), or one with ``error`` set."""
    where = base + pos
    if len(data) - pos < HEADER_LEN:
        return Frame(where, 0, "", None, where, error=f"truncated frame header ({len(data) - pos} bytes)")
    magic, type_, key_len, value_len, crc = _HEADER.unpack_from(data, pos)
    if magic != FRAME_MAGIC:
        return Frame(where, 0, "", None, where, error=f"bad frame magic {magic.hex()}")
    if type_ not in (EVENT, SNAPSHOT, COMMIT, RESULT):
        return Frame(where, 0, "", None, where, error=f"unknown frame type {type_}")
    tombstone = value_len == _TOMBSTONE_LEN
    body_len = key_len + (0 if tombstone else value_len)
    if not tombstone and value_len > MAX_VALUE_LEN:
        return Frame(where, 0, "", None, where, error=f"implausible value length {value_len}")
    start = pos + HEADER_LEN
    if start + body_len > len(data):
        return Frame(where, 0, "", None, where, error=f"truncated frame body (needs {body_len} bytes)")
    end = start + body_len
    body = memoryview(data)[start:end]  # checked and decoded in place: the value is the one copy made
    if zlib.crc32(body, _TYPE_CRC[type_]) != crc:  # the key may be damaged too: named, as unverified
        key = bytes(body[:key_len]).decode(errors="replace")[:80]
        return Frame(where, type_, "", None, where, error=f"CRC mismatch (record key {key!r}, unverified)")
    try:
        key = str(body[:key_len], "utf-8")
    except UnicodeDecodeError:
        return Frame(where, type_, "", None, where, error="key is not UTF-8")
    value = None if tombstone else data[start + key_len : end]
    return Frame(where, type_, key, value, base + end)


def resync(data: bytes, pos: int, base: int) -> int:
    """Position of the next valid frame at or after ``pos`` (``len(data)`` if none)."""
    while True:
        pos = data.find(FRAME_MAGIC, pos)
        if pos < 0:
            return len(data)
        if parse_frame(data, pos, base).error is None:
            return pos
        pos += 1


def read_frames(data: bytes, base: int, start: int = 0, *, aligned: bool = True) -> Iterator[Frame]:
    """Every frame of ``data`` from ``start``; a bad frame is reported, then reading
    resynchronises on the next valid frame. Unless ``aligned``, ``start`` may lie
    inside a frame (any offset may be asked for, as with Kafka): reading begins at the
    next frame. A truncated last frame with nothing valid after it is a torn tail,
    not an error."""
    pos, size = start, len(data)
    if not aligned and pos < size and parse_frame(data, pos, base).error is not None:
        pos = resync(data, pos, base)
    while pos < size:
        frame = parse_frame(data, pos, base)
        if frame.error is None:
            yield frame
            pos = frame.end - base
            continue
        following = resync(data, pos + 1, base)
        if frame.error.startswith("truncated") and following >= size:
            return
        yield frame
        pos = following


def batch_intact(data: bytes, base: int, commit: Frame, mark: CommitMark) -> bool:
    """Whether the batch a COMMIT frame closes is on disk whole (its CRC matches)."""
    if mark.batch_start < base:
        return True  # the batch began before the bytes we read: only a log's last batch can be torn
    return zlib.crc32(data[mark.batch_start - base : commit.position - base]) == mark.batch_crc


def mark_of(frame: Frame) -> CommitMark | None:
    """What a readable COMMIT frame commits; None for any other frame."""
    if frame.error is not None or frame.type != COMMIT:
        return None
    try:
        return CommitMark.decode(frame.value)
    except JournalError:
        return None
