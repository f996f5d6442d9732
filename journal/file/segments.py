"""The file journal's segment log: ``log/<base offset>.seg``, event frames, results frames and
commit markers, the audit trail.

A commit appends its event frames and a COMMIT frame to the log in one durable write
(the segment is opened ``O_DSYNC``: a write returns once it is on disk). The COMMIT
frame is the single commit point. Its :class:`~rollout_journal.journal.file.frames.CommitMark`
names the batch's first offset and the CRC-32 of the batch's event frames, so a batch
whose COMMIT reached the disk while an earlier page of it did not (a power loss
mid-write) is recognised and cut on open, never half-visible.

Readers hand out event records only once they have seen the COMMIT that covers
them. An offset is a byte position in the concatenated log; like Kafka's
offsets it is monotonic but not contiguous.

Torn tail or damage. Only the bytes after the log's last readable COMMIT frame,
and that last commit itself when its batch fails its CRC (a power loss landed
the marker before an earlier page), are a torn tail: readers withhold them and
the writer cuts them on open. Anything else is damage, reported and never cut:

- a committed batch that fails its CRC (or whose commit marker is unreadable)
  with a readable commit after it: readers step over the whole batch and report
  it as one bad record naming the segment, its position and the rollouts whose
  records it holds; the writer logs it on open and keeps every later commit;
- a sealed segment shorter than the next segment's base offset says (a file cut
  short): readers report the first missing offset; the writer logs it on open.
"""

from __future__ import annotations

import io
import itertools
import logging
import os
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from rollout_journal.journal.errors import ConfigurationError
from rollout_journal.journal.file.durable import for_writing, fsync_dir, open_append, write_all
from rollout_journal.journal.file.frames import (
    COMMIT,
    EMPTY,
    FRAME_MAGIC,
    CommitMark,
    Frame,
    batch_intact,
    encode_frame,
    mark_of,
    parse_frame,
    read_frames,
)

log = logging.getLogger(__name__)

_TAIL_SCAN = 1 << 20  # bytes read at a time when looking backwards for the last commit marker


def segment_name(base: int) -> str:
    return f"{base:020d}.seg"


def _damage(position: int, frames: Sequence[Frame], what: str) -> Frame:
    """One error frame for a run of records stepped over: where, whose (the frames' keys), why."""
    keys = sorted({f.key for f in frames if f.error is None and f.key})
    whose = f" (records of rollouts {', '.join(keys)})" if keys else ""
    causes = "; ".join(f"position {f.position}: {f.error}" for f in frames if f.error is not None)
    return Frame(position, 0, "", None, position, error=f"{what}{whose}{f' [{causes}]' if causes else ''}")


def _failed_batch(commit: Frame, batch: list[Frame]) -> Frame:
    start = CommitMark.decode(commit.value).batch_start
    return _damage(
        start,
        batch,
        f"the batch committed at position {commit.position} fails its CRC check; its {len(batch)} records are skipped",
    )


def committed(data: bytes, base: int, next_base: int | None, *, aligned: bool = True) -> Iterator[Frame]:
    """The committed frames of one segment's bytes (``base`` = global offset of ``data[0]``),
    in order, with one error frame for each piece of damage, stepped over whole.

    ``next_base`` is where the next segment begins; None for the log's last segment, the
    only place a torn tail can be: there a last commit whose batch fails its CRC and any
    frames after the last commit are withheld silently (not committed, cut by the writer).
    """
    pending: list[Frame] = []  # frames (and bad frames) since the last commit marker
    suspect: tuple[Frame, list[Frame]] | None = None  # a commit whose batch fails its CRC, and that batch
    good_end = base  # just past the last whole frame
    for frame in read_frames(data, base, aligned=aligned):
        if frame.error is None:
            good_end = frame.end
        mark = mark_of(frame)
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
            yield _damage(
                orphans[0].position,
                orphans,
                f"{len(orphans)} frames before position {mark.batch_start} have no readable commit marker; skipped",
            )
        if batch_intact(data, base, frame, mark):
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
        yield _damage(
            first_missing,
            pending,
            f"sealed segment ends at position {end}, short of position {next_base} where the next "
            f"segment begins: the {next_base - first_missing} bytes from position {first_missing} on "
            "are lost (the file was cut short)",
        )
    elif pending:
        yield _damage(
            pending[0].position,
            pending,
            f"{len(pending)} records at the end of a sealed segment have no commit marker; skipped",
        )
    if end > next_base:
        yield _damage(
            next_base,
            [],
            f"sealed segment runs {end - next_base} bytes past position {next_base}, "
            "where the next segment begins; the overlapping offsets are ambiguous",
        )


class SegmentLog:
    """The ``log/`` directory of a journal at ``root``. A writer (after :meth:`open_for_writing`)
    appends to its newest segment; a reader only reads what is committed."""

    def __init__(self, root: Path, *, fsync: bool) -> None:
        self.root = root
        self.dir = root / "log"
        self.fsync = fsync
        self._active: io.FileIO | None = None  # the segment a writer appends to; None: read-only or closed
        self.active_base = 0  # base offset of that segment
        self.end = 0  # a writer's end of the log
        self.last_mark = EMPTY  # a writer's last commit
        self.broken: str | None = None  # why this writer can no longer commit safely

    @property
    def writing(self) -> bool:
        return self._active is not None

    @property
    def active_source(self) -> str:
        """The file a writer's next frames land in, as a record location names it."""
        return str(self.dir / segment_name(self.active_base))

    def segments(self) -> list[tuple[int, Path]]:
        out = []
        for path in self.dir.glob("*.seg"):
            try:
                out.append((int(path.stem), path))
            except ValueError:
                raise ConfigurationError(f"unexpected file {path} in journal log directory") from None
        return sorted(out)

    # -- opening -------------------------------------------------------------
    def open_for_writing(self) -> None:
        """Cut the torn tail, then open the newest segment (the first, in a new log) for appends."""
        self.last_mark = self._cut_torn_tail()
        segments = self.segments()
        if not segments:
            segments = [(0, self.dir / segment_name(0))]
            segments[0][1].touch()
            fsync_dir(self.dir)
        base, path = segments[-1]
        self.active_base = base
        active = open_append(path, fsync=self.fsync)
        self._active = active
        self.end = base + active.tell()

    def _cut_torn_tail(self) -> CommitMark:
        """Cut the torn tail of the newest segment (see the module docstring) and log any
        damage before it, which stays; the mark of the last commit kept."""
        segments = self.segments()
        if not segments:
            return EMPTY
        for (base, path), (next_base, _) in itertools.pairwise(segments):
            if base + path.stat().st_size != next_base:  # only a damaged sealed segment is read here
                self._log_damage(path, committed(path.read_bytes(), base, next_base))
        base, path = segments[-1]
        data = path.read_bytes()
        commits = [(frame, mark) for frame in read_frames(data, base) if (mark := mark_of(frame)) is not None]
        keep, mark = 0, None
        if commits and batch_intact(data, base, *commits[-1]):
            keep, mark = commits[-1][0].end - base, commits[-1][1]
        elif len(commits) > 1:  # the last batch is torn (its marker landed, an earlier page did not)
            keep, mark = commits[-2][0].end - base, commits[-2][1]
        self._log_damage(path, committed(data[:keep], base, None))
        if len(data) > keep:
            log.warning(
                "file journal %s: cutting %d uncommitted bytes at position %d (torn tail after a crash)",
                path,
                len(data) - keep,
                base + keep,
            )
            with open(path, "r+b") as f:
                f.truncate(keep)
                os.fsync(f.fileno())
        return mark if mark is not None else self._last_commit_before(base)

    def _log_damage(self, path: Path, frames: Iterator[Frame]) -> None:
        for frame in frames:
            if frame.error is not None:
                log.error(
                    "file journal %s: damage in %s at position %d: %s; readers step over it and the "
                    "writer keeps every commit after it",
                    self.root,
                    path,
                    frame.position,
                    frame.error,
                )

    def _last_commit_before(self, end: int) -> CommitMark:
        segments = self.segments()
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
                    frame = parse_frame(data, pos, base + start)
                    mark = mark_of(frame)
                    if mark is None:
                        continue
                    if not last or torn:
                        return mark
                    if mark.batch_start < base + start:
                        break  # the batch starts before this window: widen it
                    if batch_intact(data, base + start, frame, mark):
                        return mark
                    torn = True
                else:
                    if start == 0:
                        return None
                window *= 4

    # -- writing -------------------------------------------------------------
    def check_writing(self, action: str) -> None:
        """Refuse ``action`` unless this is a writer, still open."""
        for_writing(self._active, self.root, action)

    def append_commit(self, batch: bytes, mark: CommitMark) -> None:
        """Append ``batch`` (event and results frames) and the COMMIT frame of ``mark``, in one
        durable write; a write that fails part way is cut back."""
        data = batch + encode_frame(COMMIT, "", mark.encode())
        active = for_writing(self._active, self.root)
        try:
            write_all(active, data)
        except BaseException:
            self._cut_failed_write()
            raise
        self.end += len(data)
        self.last_mark = mark

    def commit_snapshot_generation(self, generation: int, length: int) -> None:
        """Commit snapshot ``generation`` at ``length`` bytes with a COMMIT frame of its own."""
        self.append_commit(b"", CommitMark(generation, length, self.end, zlib.crc32(b"")))

    def _cut_failed_write(self) -> None:
        """A write that failed part way (a full disk) leaves bytes no commit covers. Cut them
        now: a later commit would turn them into damage in the middle of the log."""
        active = for_writing(self._active, self.root)
        try:
            os.ftruncate(active.fileno(), self.end - self.active_base)
            os.fsync(active.fileno())
        except OSError as exc:
            self.broken = (
                f"file journal {self.root}: a failed write left bytes past position {self.end} of "
                f"{active.name} that could not be cut ({exc}); reopen the journal to cut them"
            )
            log.error("%s", self.broken)

    def roll(self) -> None:
        """Seal the newest segment and start the next one at the log's end."""
        for_writing(self._active, self.root).close()
        path = self.dir / segment_name(self.end)
        self._active = open_append(path, fsync=self.fsync)
        self.active_base = self.end
        fsync_dir(self.dir)

    def close(self) -> None:
        if self._active is not None:
            self._active.close()
            self._active = None

    # -- reading -----------------------------------------------------------
    def committed_frames(self, from_offset: int) -> Iterator[tuple[Path, Frame]]:
        """Event frames whose batch has an intact commit marker, with their segment, and an
        error frame for each piece of damage (see :func:`committed`)."""
        segments = self.segments()
        for i, (base, path) in enumerate(segments):
            next_base = segments[i + 1][0] if i + 1 < len(segments) else None
            if next_base is not None and next_base <= from_offset:
                continue
            skip = max(0, from_offset - base)  # read from the offset, not the segment's start
            with open(path, "rb") as f:
                f.seek(skip)
                data = f.read()  # bounded by segment_bytes: one read beats many small ones
            for frame in committed(data, base + skip, next_base, aligned=skip == 0):
                yield path, frame

    def committed_mark(self) -> CommitMark:
        """The last commit: a writer's own, else the last one on disk now."""
        if self._active is not None:
            return self.last_mark
        segments = self.segments()
        return self._last_commit_before(segments[-1][0] + 1) if segments else EMPTY

    def end_offset(self) -> int:
        if self._active is not None:
            return self.end
        segments = self.segments()
        return segments[-1][0] + segments[-1][1].stat().st_size if segments else 0
