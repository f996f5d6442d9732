"""File-backend specifics: torn tails, on-disk corruption, truncation, the writer lock, compaction."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from journal.backend import OutRecord, Stream
from journal.errors import CorruptRecordError, WriterLockedError
from journal.file_backend import FileBackend
from journal.journal import Journal, ReadReport
from journal.snapshots import SnapshotDraft
from tests.journal_conformance import header, model_call, started, turn_done


def _segment(root: Path) -> Path:
    return sorted((root / "log").glob("*.seg"))[-1]


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
                j.append_sync([turn_done(r, v, turn=v)], SnapshotDraft(header(r, v, turn=v), "running", v, f"{r}{v}".encode()))
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
            j.append_sync([turn_done("r1", v, turn=v)], SnapshotDraft(header("r1", v, turn=v), "running", v, b"v%d" % v))
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
    data[first:first + 64] = bytes(64)  # a power loss: the page with the batch's first record never landed
    segment.write_bytes(bytes(data))
    with Journal(FileBackend(root, read_only=True)) as j:  # a reader before the writer reopens: withheld
        report = ReadReport()
        assert [e.event.header.seq for e in j.read_rollout("r1", report=report)] == [0]
    with Journal(FileBackend(root)) as j:  # the writer cuts it
        assert segment.stat().st_size == first
        assert [e.event.header.seq for e in j.read_rollout("r1")] == [0]


def test_compaction_keeps_the_order_so_a_corrupt_newest_snapshot_falls_back(tmp_path: Path) -> None:
    root = tmp_path / "j"
    with Journal(FileBackend(root)) as j:
        for v in range(4):
            for r in ("a", "b"):
                j.append_sync([turn_done(r, v, turn=v)], SnapshotDraft(header(r, v, turn=v), "running", v, f"{r}{v}".encode()))
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
