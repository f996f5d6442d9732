"""The file journal's snapshot generations: ``snapshots/<gen>.snap``, the compacted stream.

A commit first appends its snapshot frames to the current ``.snap`` file, durably
(it is opened ``O_DSYNC``), then the log's COMMIT frame names the snapshot generation
and length it commits, so ``.snap`` bytes past the last commit (a crash between the
two writes) are cut on open.

Snapshots live apart from events so that reading the snapshot stream (every
restore does) costs the size of the live snapshot set, not of the history.
Compaction writes the newest two values of each live key, in their original
order, into generation ``gen + 1`` (tmp file, fsync, rename) and then commits
that generation with a COMMIT frame of its own; a compaction the log never
committed is discarded on open. A compaction that fails (a full disk) leaves
the journal as it was: the new file is removed, a COMMIT frame written part
way is cut back, generation ``gen`` stays committed and open for appends. It
is logged as an error and kept in ``error`` / ``failures``.

A snapshot generation file that is missing or shorter than the log says is damage:
the writer records the loss in ``snapshots/<gen>.lost``, starts a fresh generation
and commits it; :meth:`SnapshotGenerations.damage` reports the loss from then on (a
reader finds it unrecorded too), and restore replays every rollout the event log
names and the snapshot stream does not from its first event.
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from rollout_journal.journal.backend import StoredRecord, compacted
from rollout_journal.journal.errors import JournalDamageError, RecordLocation, SnapshotsLostError
from rollout_journal.journal.file.durable import for_writing, fsync_dir, open_append, write_all
from rollout_journal.journal.file.frames import SNAPSHOT, CommitMark, encode_frame, read_frames
from rollout_journal.journal.file.segments import SegmentLog

log = logging.getLogger(__name__)


class SnapshotGenerations:
    """The ``snapshots/`` directory of a journal at ``root``, committed through ``segments``: a writer
    (after :meth:`open_for_writing`) appends to the committed generation and compacts it into
    the next; a reader reads the generation the log commits now."""

    def __init__(self, root: Path, segments: SegmentLog, *, fsync: bool) -> None:
        self.root = root
        self.dir = root / "snapshots"
        self.fsync = fsync
        self._log = segments
        self._file: io.FileIO | None = None  # the generation a writer appends to
        self.compacted_size = 0  # the generation's length when it was written (or compacted)
        self.failures = 0  # compactions that failed (and changed nothing)
        self.error: Exception | None = None  # why the last one failed; None once one succeeds

    def path(self, generation: int) -> Path:
        return self.dir / f"{generation:010d}.snap"

    def _generations(self) -> list[int]:
        return sorted(int(p.stem) for p in self.dir.glob("*.snap")) if self.dir.is_dir() else []

    def _lost_path(self, generation: int) -> Path:
        return self.dir / f"{generation:010d}.lost"

    @property
    def active_source(self) -> str:
        """The file a writer's next snapshot frames land in, as a record location names it."""
        return str(self.path(self._log.last_mark.snap_generation))

    # -- opening -------------------------------------------------------------
    def open_for_writing(self) -> None:
        """Keep exactly the committed snapshot generation, cut to its committed length."""
        mark = self._log.last_mark
        path = self.path(mark.snap_generation)
        for generation in self._generations():
            if generation != mark.snap_generation:  # older, or a compaction the log never committed
                self.path(generation).unlink()
        size = path.stat().st_size if path.exists() else None
        if size is None and not mark.snap_length:
            path.touch()
            size = 0
        if size is None or size < mark.snap_length:
            self._start_after_lost_generation(mark, size)
            return
        if size > mark.snap_length:
            log.warning(
                "file journal %s: cutting %d uncommitted snapshot bytes (torn tail after a crash)",
                path,
                size - mark.snap_length,
            )
            with open(path, "r+b") as f:
                f.truncate(mark.snap_length)
                os.fsync(f.fileno())
        self._file = open_append(path, fsync=self.fsync)
        self.compacted_size = mark.snap_length

    def _start_after_lost_generation(self, mark: CommitMark, size: int | None) -> None:
        """The committed snapshot generation is gone (or cut short): record the loss for good,
        so every later restore knows to look in the event log, then start and commit an empty
        generation. A crash half way repeats this on the next open."""
        lost = self.path(mark.snap_generation)
        found = "missing" if size is None else f"{size} bytes long"
        note = (
            f"snapshot generation {mark.snap_generation} ({lost}) was {found} although the log commits "
            f"{mark.snap_length} bytes of it; found by writer pid {os.getpid()} at log offset {self._log.end}; "
            "restore replays every rollout the snapshot stream lacks from the event log"
        )
        log.error("file journal %s: %s. Starting snapshot generation %d.", self.root, note, mark.snap_generation + 1)
        record = self._lost_path(mark.snap_generation)
        with open(record, "w") as f:
            f.write(note + "\n")
            f.flush()
            os.fsync(f.fileno())
        generation = mark.snap_generation + 1
        self.path(generation).touch()
        fsync_dir(self.dir)  # the record and the new file, before the log names the new file
        self._file = open_append(self.path(generation), fsync=self.fsync)
        self._log.commit_snapshot_generation(generation, 0)
        self.compacted_size = 0
        lost.unlink(missing_ok=True)

    def _record_dropped(self, generation: int, dropped: list[StoredRecord]) -> None:
        """Compaction drops records it cannot read; one may have been the only thing naming a
        rollout (its fence, or the bucket that names it acknowledged). Record the loss for good,
        as a lost generation is (``<gen>.lost``), before the compacted generation is committed: every
        later restore then looks in the event log for the rollouts the stream lacks."""
        note = (
            f"compaction of snapshot generation {generation} dropped {len(dropped)} unreadable record(s) "
            f"(first at {dropped[0].location}: {dropped[0].error}); restore replays every rollout the snapshot "
            "stream lacks from the event log"
        )
        record = self._lost_path(generation)
        with open(record, "w") as f:
            f.write(note + "\n")
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(self.dir)

    # -- writing -------------------------------------------------------------
    def append(self, frames: bytes) -> None:
        """Append snapshot frames, durably; the log's next COMMIT frame makes them visible."""
        write_all(for_writing(self._file, self.root), frames)

    def compact(self, keep_per_key: int = 2) -> None:
        """Write the next generation with the newest ``keep_per_key`` values of each live key,
        in their original order (tombstoned keys dropped), and commit it. If it fails, nothing
        changed (see the module docstring): the error is logged, counted in ``failures``, kept
        in ``error`` and raised. A reader (or a closed writer) raises ``ConfigurationError``
        and touches nothing."""
        # Before any file is written: a reader's generation number is not the writer's, and
        # its clean-up after the failed commit would delete the writer's live generation.
        self._log.check_writing("compact snapshots")
        old = self.path(self._log.last_mark.snap_generation)
        generation = self._log.last_mark.snap_generation + 1
        path = self.path(generation)
        tmp = path.with_suffix(".tmp")
        new_file = None
        try:
            skipped: list[StoredRecord] = []
            latest = compacted(self.read(), keep_per_key, skipped.append)
            for record in skipped:
                log.warning(
                    "file journal %s: compaction drops unreadable snapshot record at %s: %s",
                    self.root,
                    record.location,
                    record.error,
                )
            if skipped:  # what they held (a fence, a bucket of acknowledged rollouts) is gone with them
                self._record_dropped(self._log.last_mark.snap_generation, skipped)
            kept = sorted((r for records in latest.values() for r in records), key=lambda r: r.location.offset)
            with open(tmp, "wb") as f:
                for record in kept:
                    f.write(encode_frame(SNAPSHOT, record.key, record.value))
                f.flush()
                os.fsync(f.fileno())
                length = f.tell()
            os.replace(tmp, path)
            fsync_dir(self.dir)
            new_file = open_append(path, fsync=self.fsync)  # opened before the commit: after it, nothing may fail
            self._log.commit_snapshot_generation(generation, length)
        except Exception as exc:
            if new_file is not None:
                new_file.close()
            for leftover in (tmp, path):  # the log never named them: as if the compaction never began
                try:
                    leftover.unlink(missing_ok=True)
                except OSError as cleanup:
                    log.warning(
                        "file journal %s: could not remove %s (%s); the next open removes it",
                        self.root,
                        leftover,
                        cleanup,
                    )
            self.failures += 1
            self.error = exc
            log.error(
                "file journal %s: snapshot compaction into generation %d failed: %s; the journal is "
                "unchanged, generation %d stays committed, and compaction is retried later",
                self.root,
                generation,
                exc,
                generation - 1,
            )
            raise
        for_writing(self._file, self.root).close()
        self._file = new_file
        self.compacted_size = length
        self.error = None
        try:
            old.unlink()
        except OSError as exc:  # not committed any more: the next open removes it
            log.warning("file journal %s: could not remove the old snapshot generation %s: %s", self.root, old, exc)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    # -- reading -----------------------------------------------------------
    def _committed(self) -> tuple[CommitMark, Path, int | None]:
        """The committed snapshot generation's mark, file and size (None: missing)."""
        for _ in range(3):  # a concurrent writer's compaction may retire the file we were told of
            mark = self._log.committed_mark()
            path = self.path(mark.snap_generation)
            try:
                return mark, path, path.stat().st_size
            except FileNotFoundError:
                if mark.snap_length == 0:
                    return mark, path, 0
        return mark, path, None

    def read(self) -> Iterator[StoredRecord]:
        """The committed generation's records. A lost one reads as what is left of it (nothing,
        if it is missing); :meth:`damage` says so."""
        for _ in range(3):  # a concurrent writer's compaction may retire the file we were told of
            mark = self._log.committed_mark()
            path = self.path(mark.snap_generation)
            try:
                with open(path, "rb") as f:
                    data = f.read(mark.snap_length)
                break
            except FileNotFoundError:
                data = b""
        for frame in read_frames(data, 0):
            yield frame.stored(path)

    def damage(self) -> list[JournalDamageError]:
        """Lost snapshot generations, recorded by a writer (``snapshots/<gen>.lost``) or, on a
        reader, the committed one missing or short now."""
        found: list[JournalDamageError] = []
        lost_generations = set()
        for record in sorted(self.dir.glob("*.lost")) if self.dir.is_dir() else []:
            try:
                generation, note = int(record.stem), record.read_text().strip()
            except (OSError, ValueError) as exc:
                generation, note = -1, f"unreadable loss record {record}: {exc}"
            lost_generations.add(generation)
            found.append(SnapshotsLostError(RecordLocation(str(self.path(generation)), 0, 0), note))
        if not self._log.writing:
            mark, path, size = self._committed()
            if (size is None or size < mark.snap_length) and mark.snap_generation not in lost_generations:
                state = "is missing" if size is None else f"holds {size} bytes"
                found.append(
                    SnapshotsLostError(
                        RecordLocation(str(path), 0, 0),
                        (
                            f"snapshot generation {mark.snap_generation} {state} although the log commits "
                            f"{mark.snap_length} bytes of it; restore replays every rollout the snapshot stream lacks "
                            "from the event log (a writer opening the journal records the loss and starts a new generation)"
                        ),
                    )
                )
        return found
