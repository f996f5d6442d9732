"""Group commit under concurrency: every append a caller was handed resolves, whatever closes meanwhile."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from rollout_journal.journal.backend import OutRecord, Stream, partition_for
from rollout_journal.journal.errors import JournalClosedError, PartitionRevokedError
from rollout_journal.journal.file.backend import FileBackend
from rollout_journal.journal.group_commit import CommitFuture, GroupCommitter


@pytest.fixture
def fast_switching():
    """Threads switch as often as the interpreter allows, so a check-then-act race shows."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def committer_over(backend: FileBackend) -> GroupCommitter:
    return GroupCommitter(
        backend,
        linger_ms=0.0,
        max_batch_appends=64,
        max_commit_attempts=1,
        on_committed=lambda records, locations: None,
    )


def hammered(committer: GroupCommitter, meanwhile: Callable[[], None], writers: int = 4) -> list[CommitFuture]:
    """``writers`` threads submit appends until refused; once they are in full swing, ``meanwhile``
    runs. Returns every future a caller was handed, after all the writers stopped."""
    handed_out: list[CommitFuture] = []
    started = threading.Barrier(writers + 1)

    def hammer(writer: int) -> None:
        record = OutRecord(Stream.EVENTS, f"r{writer}", b"turn", f"r{writer}")
        started.wait()
        while True:
            try:
                handed_out.append(committer.submit(lambda: [record]))
            except JournalClosedError:
                return  # refused outright: the caller knows at once

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(writers)]
    for thread in threads:
        thread.start()
    started.wait()
    while len(handed_out) < 500:
        time.sleep(0)
    meanwhile()
    for thread in threads:
        thread.join()  # each stops at its first refusal
    return handed_out


def test_an_append_racing_close_resolves_or_is_refused_never_left_pending(tmp_path: Path, fast_switching) -> None:
    for round_ in range(20):
        backend = FileBackend(tmp_path / f"journal-{round_}", fsync=False)
        committer = committer_over(backend)
        handed_out = hammered(committer, committer.close)  # close while four threads keep submitting
        backend.close()
        # close() joined the committer thread: nothing can resolve a future after it.
        pending = [f for f in handed_out if not f.done()]
        assert not pending, f"round {round_}: {len(pending)} of {len(handed_out)} appends never resolve"
        for future in handed_out:
            error = future.exception()
            assert error is None or isinstance(error, JournalClosedError), error


def test_after_a_fatal_commit_error_every_queued_append_fails_and_new_ones_are_refused(
    tmp_path: Path, fast_switching
) -> None:
    backend = FileBackend(tmp_path / "journal", fsync=False)
    committer = committer_over(backend)
    handed_out = hammered(committer, backend.close)  # the writer breaks underneath: the next commit fails fatally
    # A close racing the fatal stop once lost its sentinel to the stop's drain and hung for good;
    # the join's bound only keeps such a regression from hanging the suite.
    closer = threading.Thread(target=committer.close, daemon=True)
    closer.start()
    closer.join(timeout=60)
    assert not closer.is_alive(), "close() hangs after a fatal commit error"
    assert all(f.done() for f in handed_out)
    assert any(f.exception() is not None for f in handed_out), "commits after the break must fail"
    with pytest.raises(JournalClosedError, match="fatal error"):
        committer.submit(list)


class Recorded:
    """A JournalMetrics that keeps what it heard."""

    def __init__(self) -> None:
        self.commits: list[float] = []
        self.fenced = 0
        self.transactions = 0
        self.reinits = 0

    def commit_seconds(self, seconds: float) -> None:
        self.commits.append(seconds)

    def transaction_committed(self) -> None:
        self.transactions += 1

    def transaction_reinitialized(self) -> None:
        self.reinits += 1

    def appends_fenced(self, count: int) -> None:
        self.fenced += count


def test_the_committer_reports_each_commit_and_each_fenced_append(tmp_path: Path) -> None:
    """Two appends commit, one whose partition moved on is refused: the metrics hear one commit
    per batch that made something durable, and one fenced append."""
    backend = FileBackend(tmp_path / "journal", fsync=False)
    metrics = Recorded()
    committer = GroupCommitter(
        backend,
        linger_ms=0.0,
        max_batch_appends=64,
        max_commit_attempts=1,
        on_committed=lambda records, locations: None,
        metrics=metrics,
    )

    def moved_on() -> None:
        raise PartitionRevokedError("partition 0 was revoked", 0)

    try:
        first = committer.submit(lambda: [OutRecord(Stream.EVENTS, "a", b"turn", "a")])
        first.result()
        refused = committer.submit(lambda: [OutRecord(Stream.EVENTS, "b", b"turn", "b")], check=moved_on)
        with pytest.raises(PartitionRevokedError):
            refused.result()
        committer.submit(lambda: [OutRecord(Stream.EVENTS, "c", b"turn", "c")]).result()
        committer.submit(lambda: []).result()  # a flush writes nothing: no commit to time
    finally:
        committer.close()
        backend.close()
    assert len(metrics.commits) == 2 and all(seconds >= 0 for seconds in metrics.commits)
    assert metrics.fenced == 1
    assert (metrics.transactions, metrics.reinits) == (0, 0)  # files have no transactions


def test_commits_keep_the_interval_however_often_appends_are_waited_for(tmp_path: Path) -> None:
    """Every append is waited for at once (each wait makes its batch due), from four threads: the
    commits still start at least ``commit_interval_ms`` apart, and the appends share them."""
    backend = FileBackend(tmp_path / "journal", fsync=False)
    started: list[float] = []
    commit = backend.commit

    def timed_commit(records):  # type: ignore[no-untyped-def]
        started.append(time.monotonic())
        return commit(records)

    backend.commit = timed_commit  # type: ignore[method-assign]
    committer = GroupCommitter(
        backend,
        linger_ms=0.0,
        max_batch_appends=64,
        max_commit_attempts=1,
        on_committed=lambda records, locations: None,
        commit_interval_ms=200.0,
    )
    receipts = []

    def writer(i: int) -> None:
        for turn in range(5):
            record = OutRecord(Stream.EVENTS, f"r{i}", f"turn {turn}".encode(), f"r{i}")
            receipts.append(committer.submit(lambda record=record: [record]).result(timeout=60))

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    finally:
        committer.close()
        backend.close()
    assert len(receipts) == 20
    gaps = [b - a for a, b in zip(started, started[1:])]
    assert gaps and min(gaps) >= 0.2 - 1e-3, gaps  # the clock's own resolution aside
    assert len(started) < 20 and max(r.batch_appends for r in receipts) > 1


def test_an_append_spanning_partitions_whose_caller_gave_up_fails_alone(tmp_path: Path) -> None:
    """On a backend that commits per partition, an append spanning partitions (a caller's bug)
    fails alone. When its caller had cancelled its future first, failing it raised in the
    committer thread, which stopped the whole journal: every later append was refused."""
    backend = FileBackend(tmp_path / "journal", fsync=False)
    # The committer's split reads only these two: a fleet member's Kafka backend, as far as it sees.
    backend.writes_per_partition, backend.partitions = True, 4
    committer = committer_over(backend)
    keys = [f"r{i}" for i in range(64)]
    first, other = (
        keys[0],
        next(k for k in keys if partition_for(k, backend.partitions) != partition_for(keys[0], backend.partitions)),
    )
    building, release = threading.Event(), threading.Event()

    def held() -> list[OutRecord]:
        building.set()
        assert release.wait(30), "the test never released the committer"
        return [OutRecord(Stream.EVENTS, first, b"turn", first)]

    try:
        holding = committer.submit(held)
        assert building.wait(30)
        spanning = committer.submit(lambda: [OutRecord(Stream.EVENTS, k, b"turn", k) for k in (first, other)])
        assert spanning.cancel()  # its caller gave up while the committer was busy
        release.set()
        holding.result(30)
        after = committer.submit(lambda: [OutRecord(Stream.EVENTS, first, b"next turn", first)])
        assert len(after.result(30).locations) == 1, "the journal stopped after one caller's cancelled append"
    finally:
        release.set()
        committer.close()
        backend.close()
