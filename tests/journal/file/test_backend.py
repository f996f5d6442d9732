"""File-backend specifics: torn tails, on-disk corruption, truncation, the writer lock, compaction."""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import re
import resource
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout_journal.journal.backend import OutRecord, Stream
from rollout_journal.journal.errors import ConfigurationError, CorruptRecordError, WriterLockedError
from rollout_journal.journal.events import RolloutAcknowledged, RolloutFinished
from rollout_journal.journal.file.backend import FileBackend
from rollout_journal.journal.journal import Cursor, Journal, ReadReport
from rollout_journal.journal.restore import load_rollouts
from rollout_journal.journal.snapshots import BUCKET_MARK, SnapshotDraft
from rollout_journal.participants.workload.config import WorkloadConfig
from rollout_journal.participants.workload.run import run_workload
from rollout_journal.participants.workload.runner import workload_specs
from rollout_journal.replay.cli.main import main as cli
from rollout_journal.replay.exit_codes import EXIT_JOURNAL_DAMAGED
from tests.support.journal_conformance import header, model_call, started, turn_done
from tests.support.recovery_support import assert_identical, reference_outcomes


def _segment(root: Path) -> Path:
    return sorted((root / "log").glob("*.seg"))[-1]


def _flip(path: Path, position: int) -> None:
    """Bit rot: one byte of a file on disk inverted."""
    with open(path, "r+b") as f:
        f.seek(position)
        byte = f.read(1)
        f.seek(position)
        f.write(bytes([byte[0] ^ 0xFF]))


def _seqs(journal: Journal, rollouts: list[str], report: ReadReport) -> dict[str, list[int]]:
    seqs: dict[str, list[int]] = {rid: [] for rid in rollouts}
    for item in journal.read_rollouts({rid: Cursor() for rid in rollouts}, report):
        seqs[item.event.header.rollout_id].append(item.event.header.seq)
    return seqs


def _errors_logged(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)


def test_a_torn_tail_is_cut_on_open_and_committed_turns_stay(tmp_path: Path) -> None:
    root = tmp_path / "j"
    with Journal(FileBackend(root)) as j:
        j.append_sync([started("r1", 0), turn_done("r1", 1)])
        last = j.append_sync([model_call("r1", 2, turn=2), turn_done("r1", 3, turn=2)])
    seg = _segment(root)
    size = seg.stat().st_size
    with open(seg, "r+b") as f:  # a crash in the middle of the last commit's write
        f.truncate(size - 7)
    with Journal(FileBackend(root)) as j:
        assert [e.event.header.seq for e in j.read_rollout("r1")] == [0, 1]
        assert seg.stat().st_size == last.locations[0].offset  # cut back to the last commit marker
        j.append_sync([model_call("r1", 2, turn=2)])
        assert [e.event.header.seq for e in j.read_rollout("r1")] == [0, 1, 2]


def test_a_flipped_byte_on_disk_is_named_by_file_and_position(tmp_path: Path) -> None:
    root = tmp_path / "j"
    with Journal(FileBackend(root)) as j:
        j.append_sync([started("r1", 0)])
        victim = j.append_sync([turn_done("r1", 1)]).locations[0]
        j.append_sync([turn_done("r1", 2, turn=2)])
    with open(victim.source, "r+b") as f:
        f.seek(victim.offset + 20)
        byte = f.read(1)
        f.seek(victim.offset + 20)
        f.write(bytes([byte[0] ^ 0xFF]))
    with Journal(FileBackend(root, read_only=True)) as j:
        with pytest.raises(CorruptRecordError) as info:
            list(j.read_rollout("r1"))
        assert f"position {victim.offset}" in str(info.value) and victim.source in str(info.value)
        report = ReadReport()
        assert [e.event.header.seq for e in j.read_rollout("r1", report=report)] == [0, 2]
        assert "CRC" in str(report.errors[0])


def test_a_segment_truncated_in_the_middle_is_reported_and_later_segments_read(tmp_path: Path) -> None:
    root = tmp_path / "j"
    with Journal(FileBackend(root, segment_bytes=2048)) as j:
        for t in range(12):
            j.append_sync([model_call("r1", t, turn=t)])
    segments = sorted((root / "log").glob("*.seg"))
    assert len(segments) > 2
    middle = segments[1]
    data = middle.read_bytes()
    middle.write_bytes(data[: len(data) // 2])  # lost the second half of a sealed segment
    with Journal(FileBackend(root, read_only=True)) as j:
        report = ReadReport()
        seqs = [e.event.header.seq for e in j.read_rollout("r1", report=report)]
    assert seqs == sorted(seqs) and seqs[0] == 0 and seqs[-1] == 11
    assert len(seqs) < 12, "records of the truncated half cannot come back"
    assert len(report.errors) == 1  # and their loss is said


def test_only_one_writer_at_a_time(tmp_path: Path) -> None:
    first = FileBackend(tmp_path / "j")
    try:
        with pytest.raises(WriterLockedError, match=str(os.getpid())):
            FileBackend(tmp_path / "j")
        FileBackend(tmp_path / "j", read_only=True).close()  # readers are welcome
    finally:
        first.close()
    FileBackend(tmp_path / "j").close()


def test_snapshot_compaction_keeps_the_newest_two_and_drops_tombstones(tmp_path: Path) -> None:
    root = tmp_path / "j"
    backend = FileBackend(root, min_compaction_bytes=1 << 40)
    with Journal(backend) as j:
        for v in range(5):
            for r in ("a", "b"):
                j.append_sync(
                    [turn_done(r, v, turn=v)], SnapshotDraft(header(r, v, turn=v), "running", v, f"{r}{v}".encode())
                )
        j.tombstone("b").result()
        backend.compact_snapshots()
        kept = [(rec.key, j.codec.decode(rec.value, rec.location).state) for rec in backend.read_snapshots()]
        # a rollout's snapshots alternate between two keys: each keeps its newest two
        assert kept == [("a/snapshot/1", b"a1"), ("a", b"a2"), ("a/snapshot/1", b"a3"), ("a", b"a4")]
        j.append_sync([turn_done("a", 5, turn=5)], SnapshotDraft(header("a", 5, turn=5), "running", 5, b"a5"))
        assert j.snapshots().snapshots["a"].state == b"a5"
    with Journal(FileBackend(root)) as j:
        assert set(j.snapshots().snapshots) == {"a"}


def test_snapshot_bytes_without_a_commit_marker_are_cut_on_open(tmp_path: Path) -> None:
    root = tmp_path / "j"
    with Journal(FileBackend(root)) as j:
        j.append_sync([started("r1", 0)], SnapshotDraft(header("r1", 0), "running", 0, b"committed"))
    snap = sorted((root / "snapshots").glob("*.snap"))[-1]
    size = snap.stat().st_size
    with open(snap, "ab") as f:  # the crash came after the snapshot file's fsync, before the log's commit marker
        f.write(b"RJ\x02" + b"\x00" * 40)
    with Journal(FileBackend(root)) as j:
        assert snap.stat().st_size == size
        assert j.snapshots().snapshots["r1"].state == b"committed"


def test_a_compaction_the_log_never_committed_is_discarded(tmp_path: Path) -> None:
    root = tmp_path / "j"
    with Journal(FileBackend(root)) as j:
        for v in range(3):
            j.append_sync(
                [turn_done("r1", v, turn=v)], SnapshotDraft(header("r1", v, turn=v), "running", v, b"v%d" % v)
            )
    # the process died after renaming a compacted generation into place, before its commit marker
    (root / "snapshots" / "0000000001.snap").write_bytes(b"RJ\x02 half a compaction")
    with Journal(FileBackend(root)) as j:
        assert [p.name for p in sorted((root / "snapshots").glob("*.snap"))] == ["0000000000.snap"]
        assert j.snapshots().snapshots["r1"].state == b"v2"
        j.backend.compact_snapshots()  # a committed compaction switches generations
        j.append_sync([turn_done("r1", 3, turn=3)], SnapshotDraft(header("r1", 3, turn=3), "running", 3, b"v3"))
    assert [p.name for p in sorted((root / "snapshots").glob("*.snap"))] == ["0000000001.snap"]
    with Journal(FileBackend(root, read_only=True)) as j:
        assert j.snapshots().snapshots["r1"].state == b"v3"


def test_a_batch_whose_commit_reached_the_disk_before_its_records_is_cut(tmp_path: Path) -> None:
    root = tmp_path / "j"
    with Journal(FileBackend(root)) as j:
        j.append_sync([started("r1", 0)])
        torn = j.append_sync([model_call("r1", 1), turn_done("r1", 2)])
    segment = _segment(root)
    data = bytearray(segment.read_bytes())
    first = torn.locations[0].offset
    data[first : first + 64] = bytes(64)  # a power loss: the page with the batch's first record never landed
    segment.write_bytes(bytes(data))
    with Journal(FileBackend(root, read_only=True)) as j:  # a reader before the writer reopens: withheld
        report = ReadReport()
        assert [e.event.header.seq for e in j.read_rollout("r1", report=report)] == [0]
    with Journal(FileBackend(root)) as j:  # the writer cuts it
        assert segment.stat().st_size == first
        assert [e.event.header.seq for e in j.read_rollout("r1")] == [0]


def test_a_reader_cannot_compact_the_writers_snapshots(tmp_path: Path) -> None:
    """A read-only backend asked to compact refuses before it touches a file: it once wrote its
    generation over the live writer's, failed to commit, and deleted that file on the way out."""
    root = tmp_path / "j"
    with Journal(FileBackend(root)) as j:
        j.append_sync([turn_done("r1", 0)], SnapshotDraft(header("r1", 0), "running", 0, b"v0"))
        j.backend.compact_snapshots()  # the writer now lives in generation 1
        live = root / "snapshots" / "0000000001.snap"
        before = live.read_bytes()
        reader = FileBackend(root, read_only=True)
        try:
            with pytest.raises(ConfigurationError, match="read-only"):
                reader.compact_snapshots()
        finally:
            reader.close()
        assert live.read_bytes() == before
        assert reader.compaction_failures == 0
        j.append_sync([turn_done("r1", 1, turn=1)], SnapshotDraft(header("r1", 1, turn=1), "running", 1, b"v1"))
    with Journal(FileBackend(root, read_only=True)) as j:
        assert j.snapshots().snapshots["r1"].state == b"v1"
        assert j.backend.damage() == []


def test_a_reader_and_a_closed_writer_refuse_to_commit_and_say_why(tmp_path: Path) -> None:
    """Neither has a file to append to: the refusal names the journal and the action, and the
    journal holds what the writer committed, nothing more."""
    root = tmp_path / "j"
    record = OutRecord(Stream.SNAPSHOTS, "r1", b"v1", "r1")
    writer = FileBackend(root)
    writer.commit([OutRecord(Stream.SNAPSHOTS, "r1", b"v0", "r1")])
    end = writer.end_offset()
    reader = FileBackend(root, read_only=True)
    try:
        with pytest.raises(
            ConfigurationError, match=re.escape(f"file journal {root} is open read-only (or closed); cannot commit")
        ):
            reader.commit([record])
    finally:
        reader.close()
    writer.close()
    for closed in (writer, reader):
        with pytest.raises(ConfigurationError, match="cannot commit"):
            closed.commit([record])
        with pytest.raises(ConfigurationError, match="cannot compact snapshots"):
            closed.compact_snapshots()
    reopened = FileBackend(root, read_only=True)
    try:
        assert reopened.end_offset() == end
        assert [r.value for r in reopened.read_snapshots()] == [b"v0"]
    finally:
        reopened.close()


def test_compaction_keeps_the_order_so_a_corrupt_newest_snapshot_falls_back(tmp_path: Path) -> None:
    root = tmp_path / "j"
    with Journal(FileBackend(root)) as j:
        for v in range(4):
            for r in ("a", "b"):
                j.append_sync(
                    [turn_done(r, v, turn=v)], SnapshotDraft(header(r, v, turn=v), "running", v, f"{r}{v}".encode())
                )
        j.backend.compact_snapshots()
        j.backend.commit([OutRecord(Stream.SNAPSHOTS, "a", b"\xc3\x01garbage", "a")])
        index = j.snapshots()
        assert index.snapshots["a"].state == b"a3" and index.snapshots["b"].state == b"b3"
        assert len(index.errors) == 1


def test_reading_snapshots_does_not_scan_the_event_history(tmp_path: Path) -> None:
    root = tmp_path / "j"
    with Journal(FileBackend(root)) as j:
        j.append_sync([started("r1", 0)], SnapshotDraft(header("r1", 0), "running", 0, b"s"))
        for t in range(200):
            j.append_sync([model_call("r1", t + 1, turn=t, tokens=512)])
    log_bytes = sum(p.stat().st_size for p in (root / "log").glob("*.seg"))
    snap_bytes = sum(p.stat().st_size for p in (root / "snapshots").glob("*.snap"))
    assert snap_bytes * 100 < log_bytes  # restore reads only the small snapshot stream


# -- damage in the middle of the log is reported, never cut (issue 7, items 1 and 2) ----------------


def test_a_flipped_byte_mid_segment_is_reported_and_every_later_commit_survives_the_writer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "j"
    with Journal(FileBackend(root)) as j:
        j.append_sync([started("alpha", 0), started("bravo", 0)])
        damaged = j.append_sync([turn_done("alpha", 1), turn_done("bravo", 1)])
        for seq in range(2, 6):
            j.append_sync([turn_done("alpha", seq, turn=seq), turn_done("bravo", seq, turn=seq)])
    segment = _segment(root)  # the active segment: the writer scans it on open
    size = segment.stat().st_size
    batch = damaged.locations[0].offset
    _flip(segment, damaged.locations[1].offset + 20)  # inside bravo's record of the second commit

    with caplog.at_level(logging.ERROR, logger="rollout_journal.journal.file"), Journal(FileBackend(root)) as j:
        assert segment.stat().st_size == size, "the writer cut committed turns after the damage"
        j.append_sync([turn_done("alpha", 6, turn=6)])
    logged = _errors_logged(caplog)
    assert str(segment) in logged and f"position {batch}" in logged and "alpha" in logged and "bravo" in logged

    with Journal(FileBackend(root, read_only=True)) as j:
        report = ReadReport()
        seqs = _seqs(j, ["alpha", "bravo"], report)
    assert seqs == {"alpha": [0, 2, 3, 4, 5, 6], "bravo": [0, 2, 3, 4, 5]}  # the bad batch, and only it, stepped over
    (error,) = report.errors
    assert str(segment) in str(error) and f"position {batch}" in str(error)
    assert "alpha" in str(error) and "bravo" in str(error)


def test_a_short_sealed_segment_is_reported_with_its_first_missing_offset_and_never_cut(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "j"
    with Journal(FileBackend(root, segment_bytes=2048)) as j:
        locations = [j.append_sync([model_call("r1", t, turn=t)]).locations[0] for t in range(12)]
    segments = sorted((root / "log").glob("*.seg"))
    assert len(segments) > 2
    middle, following = segments[1], segments[2]
    data = middle.read_bytes()
    cut = len(data) // 2
    middle.write_bytes(data[:cut])  # a sealed segment lost its second half
    # each append is one commit; a record survives if its commit (which ends where the next record or
    # segment begins) lies wholly before the cut
    ends = [
        nxt.offset if nxt.source == loc.source else int(following.stem) for loc, nxt in itertools.pairwise(locations)
    ]
    lost = [
        loc.offset for loc, end in zip(locations, ends) if loc.source == str(middle) and end > int(middle.stem) + cut
    ]
    survivors = [t for t, loc in enumerate(locations) if loc.offset not in lost]

    with Journal(FileBackend(root, read_only=True)) as j:
        report = ReadReport()
        assert _seqs(j, ["r1"], report) == {"r1": survivors}
    (error,) = report.errors
    assert (
        str(middle) in str(error) and f"position {min(lost)}" in str(error) and str(int(following.stem)) in str(error)
    )

    sizes = {p: p.stat().st_size for p in segments}
    # the writer reports it and cuts nothing
    with (
        caplog.at_level(logging.ERROR, logger="rollout_journal.journal.file"),
        Journal(FileBackend(root, segment_bytes=2048)) as j,
    ):
        assert {p: p.stat().st_size for p in segments} == sizes
        j.append_sync([model_call("r1", 12, turn=12)])
    assert str(middle) in _errors_logged(caplog) and str(min(lost)) in _errors_logged(caplog)
    with Journal(FileBackend(root, read_only=True)) as j:
        report = ReadReport()
        assert _seqs(j, ["r1"], report) == {"r1": [*survivors, 12]}
        assert len(report.errors) == 1


# -- a failed compaction leaves the journal as it was (issue 7, item 3) ---------------------------


@contextlib.contextmanager
def _file_size_limit(limit: int) -> Iterator[None]:
    """A real write failure: past ``limit`` bytes a write is cut short, then fails with EFBIG."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # or the kernel's SIGXFSZ kills the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def _snapshot_files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((root / "snapshots").iterdir())}


def _turn_with_snapshot(rollout: str, turn: int) -> tuple[list, SnapshotDraft]:
    events = [model_call(rollout, 2 * turn, turn=turn, tokens=512), turn_done(rollout, 2 * turn + 1, turn=turn)]
    return events, SnapshotDraft(header(rollout, 2 * turn + 1, turn=turn), "running", 2 * turn + 1, b"state %d" % turn)


def test_a_compaction_whose_commit_marker_is_cut_short_leaves_the_journal_as_it_was(tmp_path: Path) -> None:
    root = tmp_path / "j"
    backend = FileBackend(root, min_compaction_bytes=1 << 40)
    with Journal(backend) as j:
        for turn in range(4):
            j.append_sync(*_turn_with_snapshot("r1", turn))
        segment = _segment(root)
        size, snapshots = segment.stat().st_size, _snapshot_files(root)
        assert sum(map(len, snapshots.values())) < size  # the compacted generation fits under the limit below
        # the new generation is written; its COMMIT frame lands 5 bytes, then EFBIG
        with _file_size_limit(size + 5), pytest.raises(OSError) as failure:
            backend.compact_snapshots()
        assert failure.value.errno == errno.EFBIG
        assert segment.stat().st_size == size and _snapshot_files(root) == snapshots  # exactly as it was
        assert backend.compaction_failures == 1 and backend.compaction_error is failure.value

        j.append_sync(*_turn_with_snapshot("r1", 4))  # the writer goes on committing...
        backend.compact_snapshots()  # ...and compacts later
        assert backend.compaction_error is None
        j.append_sync(*_turn_with_snapshot("r1", 5))
    with Journal(FileBackend(root, read_only=True)) as j:
        report = ReadReport()
        assert _seqs(j, ["r1"], report) == {"r1": list(range(12))}
        assert report.clean, report.errors
        assert j.snapshots().snapshots["r1"].state == b"state 5"


def test_a_failed_automatic_compaction_is_logged_counted_cleaned_up_and_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "j"
    backend = FileBackend(root, min_compaction_bytes=1, max_dirty_ratio=0.0)  # compact after every snapshot
    with Journal(backend) as j:
        j.append_sync(*_turn_with_snapshot("r1", 0))
        snapshots = _snapshot_files(root)

        def no_space(src: object, dst: object) -> None:  # fault injection: the rename hits a full disk
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "replace", no_space)
        with caplog.at_level(logging.ERROR, logger="rollout_journal.journal.file"):
            j.append_sync(*_turn_with_snapshot("r1", 1))  # the turn commits although its compaction fails
        monkeypatch.undo()
        assert str(root) in _errors_logged(caplog) and "No space left on device" in _errors_logged(caplog)
        assert backend.compaction_failures == 1 and backend.compaction_error.errno == errno.ENOSPC
        assert [n for n in _snapshot_files(root) if n not in snapshots] == [], "a half-done generation was left"
        assert j.snapshots().snapshots["r1"].state == b"state 1"

        j.append_sync(*_turn_with_snapshot("r1", 2))  # the next commit compacts
        assert backend.compaction_error is None and backend.compaction_failures == 1
        assert list(_snapshot_files(root)) != list(snapshots)
    with Journal(FileBackend(root, read_only=True)) as j:
        assert j.snapshots().snapshots["r1"].state == b"state 2"


# -- restore without any snapshot --------------------------------------------------------------


def test_a_rollout_whose_every_snapshot_is_corrupt_replays_from_its_first_event_identically(tmp_path: Path) -> None:
    config = WorkloadConfig(
        name="wl",
        groups=1,
        siblings=2,
        max_turns=5,
        environment="workplace",
        seed=3,
        allow_early_submit=False,
        journal=str(tmp_path / "journal"),
        snapshot_every_turns=1,
    )
    a, b = (s.rollout_id for s in workload_specs(config))
    reference = reference_outcomes(config)
    run_workload(config, resume=False, stop_after={a: 3, b: 2})
    with Journal(FileBackend(config.journal)) as j:  # both retained snapshots of `a` go bad
        for _ in range(2):
            j.backend.commit([OutRecord(Stream.SNAPSHOTS, a, b"\xc3\x01not a snapshot", a)])

    resumed = run_workload(config, resume=True)

    assert len(resumed.read_errors) == 2 and resumed.rollouts[a].turns_committed_before == 3
    assert_identical(resumed, reference)  # its system and task prompt are not in its events


# -- a missing snapshot generation: replay the log instead (issue 7, item 23) ----------------------


def _journal_with_snapshots(root: Path) -> None:
    with Journal(FileBackend(root)) as j:
        for rid in ("alpha", "bravo"):
            j.append_sync([started(rid, 0)])
            for turn in range(3):
                j.append_sync(*_turn_with_snapshot_after_start(rid, turn))


def _turn_with_snapshot_after_start(rollout: str, turn: int) -> tuple[list, SnapshotDraft]:
    seq = 1 + 2 * turn
    events = [model_call(rollout, seq, turn=turn), turn_done(rollout, seq + 1, turn=turn)]
    return events, SnapshotDraft(header(rollout, seq + 1, turn=turn), "running", seq + 1, b"state %d" % turn)


def _delete_snapshot_generation(root: Path) -> Path:
    (snap,) = (root / "snapshots").glob("*.snap")
    snap.unlink()
    return snap


def test_a_missing_snapshot_generation_falls_back_to_replaying_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "j"
    _journal_with_snapshots(root)
    snap = _delete_snapshot_generation(root)

    def restored() -> tuple[dict[str, list[int]], ReadReport]:
        with Journal(FileBackend(root, read_only=True)) as j:
            plan = load_rollouts(j)
        assert all(h.snapshot is None for h in plan.rollouts.values())  # replayed from their first event
        return {rid: [e.event.header.seq for e in h.events] for rid, h in plan.rollouts.items()}, plan.report

    seqs, report = restored()  # a reader, before any writer reopened the journal
    assert seqs == {"alpha": list(range(7)), "bravo": list(range(7))}
    assert any(str(snap) in str(e) for e in report.errors)

    # the writer opens it, says so and starts a fresh generation
    with caplog.at_level(logging.ERROR, logger="rollout_journal.journal.file"), Journal(FileBackend(root)) as j:
        j.append_sync([model_call("alpha", 7, turn=3)])
    assert str(snap) in _errors_logged(caplog)
    seqs, report = restored()  # and it keeps saying so: the lost snapshots stay lost
    assert seqs == {"alpha": list(range(8)), "bravo": list(range(7))}
    assert any(str(snap) in str(e) for e in report.errors)


# The journals of these tests hold synthetic model calls of a made-up policy: `show` decodes no text for them.
@pytest.mark.parametrize("command", [["list"], ["show", "{root}", "alpha", "--no-decode"]], ids=["list", "show"])
def test_list_and_show_say_when_a_snapshot_generation_is_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture, command: list[str]
) -> None:
    root = tmp_path / "j"
    _journal_with_snapshots(root)
    snap = _delete_snapshot_generation(root)
    argv = [command[0], str(root), *command[2:]]
    assert cli(argv) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert any(str(snap) in line for line in notes), notes


@pytest.mark.parametrize("command", [["list"], ["show", "{root}", "r1", "--no-decode"]], ids=["list", "show"])
def test_list_and_show_say_when_a_segment_is_short(
    tmp_path: Path, capsys: pytest.CaptureFixture, command: list[str]
) -> None:
    root = tmp_path / "j"
    with Journal(FileBackend(root, segment_bytes=2048)) as j:
        j.append_sync([started("r1", 0)])
        for t in range(1, 12):
            j.append_sync([model_call("r1", t, turn=t)])
    middle = sorted((root / "log").glob("*.seg"))[1]
    middle.write_bytes(middle.read_bytes()[:-100])
    # records were lost: what the command shows lacks them, so it ends with a line naming where, and fails
    assert cli([command[0], str(root), *command[2:]]) == EXIT_JOURNAL_DAMAGED
    closing = capsys.readouterr().err.splitlines()[-1]
    assert closing.startswith("rollout-journal: ") and str(middle) in closing, closing


def test_a_workload_resumes_identically_after_its_snapshot_generation_was_deleted(tmp_path: Path) -> None:
    config = WorkloadConfig(
        name="wl",
        groups=1,
        siblings=3,
        max_turns=5,
        environment="workplace",
        seed=3,
        allow_early_submit=False,
        journal=str(tmp_path / "journal"),
        snapshot_every_turns=1,
    )
    a, b, c = (s.rollout_id for s in workload_specs(config))
    reference = reference_outcomes(config)
    run_workload(config, resume=False, stop_after={a: 5, b: 2, c: 4})  # the crash
    snap = _delete_snapshot_generation(tmp_path / "journal")

    resumed = run_workload(config, resume=True, stop_after={b: 3})  # and a second crash during the resume
    assert any(str(snap) in e for e in resumed.read_errors), resumed.read_errors
    rows = resumed.rollouts
    assert (rows[a].reused_result, rows[b].turns_committed_before, rows[c].turns_committed_before) == (True, 2, 4)
    assert not any(r.restarted_from_zero for r in rows.values())

    final = run_workload(config, resume=True)
    assert final.rollouts[b].turns_committed_before == 3 and final.rollouts[a].reused_result
    assert_identical(final, reference)


def test_a_file_journal_has_one_writer_so_partitions_are_neither_taken_nor_released(tmp_path: Path) -> None:
    with Journal(FileBackend(tmp_path / "j")) as journal:
        with pytest.raises(ConfigurationError, match="a file journal has one writer; partitions cannot be taken"):
            journal.take_partition(0)
        with pytest.raises(ConfigurationError, match="a file journal has one writer; partitions cannot be released"):
            journal.release_partition(0)


def test_an_unreadable_record_before_a_rollouts_first_event_leaves_its_first_offset_unknown(tmp_path: Path) -> None:
    """The restore notes where a rollout's first event (seq 0) lies as it passes over it, for the
    rollout's summary (where ``replay show`` starts reading). An unreadable record of the rollout
    before it may be that first event, or its first piece (every piece of a chunked event peeks as
    seq 0): the offset is then unknown (-1, read from the start), never the later record's."""
    with Journal(FileBackend(tmp_path / "j")) as j:
        j.append_sync([started("other", 0)])
        j.backend.commit([OutRecord(Stream.EVENTS, "a", b"\xc3\x01garbage", "a")])  # as a damaged first piece
        j.append_sync([started("a", 0), turn_done("a", 1)], SnapshotDraft(header("a", 1), "running", 1, b"s"))
    with Journal(FileBackend(tmp_path / "j")) as j:
        history = load_rollouts(j, ReadReport()).rollouts["a"]
    assert history.snapshot is not None and history.events == []
    assert history.first_offset == -1


def test_a_bucket_compaction_drops_as_unreadable_leaves_its_rollouts_to_the_event_log(tmp_path: Path) -> None:
    """A flipped byte in the bucket that names two acknowledged rollouts (their fences folded away):
    compaction cannot copy the frame and drops it. The loss is recorded for good, so every later
    restore still finds both rollouts in the event log, ending in their acknowledgement (never run
    again), instead of losing them from the journal without a word."""
    root = tmp_path / "j"
    with Journal(FileBackend(root), acknowledgement_bucket_size=2) as j:
        for r in ("a", "b", "c"):
            j.append_sync([started(r, 0), turn_done(r, 1)])
            j.append_sync(
                [RolloutFinished(header(r, 2), 1.0, 1, "{}")], SnapshotDraft(header(r, 2), "finished", 2, b"done")
            )
            j.acknowledge(RolloutAcknowledged(header(r, 3), "trainer")).result()  # c's folds a and b
        [bucket] = [s for s in j.backend.read_snapshots() if BUCKET_MARK in s.key]
        _flip(Path(bucket.location.source), bucket.location.offset + 40)
        j.backend.compact_snapshots()
        assert not [s for s in j.backend.read_snapshots() if BUCKET_MARK in s.key]  # gone with the compaction

    with Journal(FileBackend(root)) as reopened:
        plan = load_rollouts(reopened)
        assert [type(d).__name__ for d in reopened.backend.damage()] == ["SnapshotsLostError"]
    assert set(plan.acknowledged) == {"c"} and set(plan.rollouts) == {"a", "b"}
    for r in ("a", "b"):  # from their first event to their acknowledgement
        assert isinstance(plan.rollouts[r].events[-1].event, RolloutAcknowledged)
