"""Scans in worker processes (``rollout_journal.replay.partition_scan``): the same rows as one process, a
worker's error raised as itself, a killed worker named, and a journal whose rollout straddles
partitions read as one. Errors cross the process boundary whole."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from bench.common import turn_events
from rollout_journal.journal.errors import (
    CorruptRecordError,
    JournalStoppedError,
    NotAuthorizedError,
    PartitionFencedError,
    RecordLocation,
    UnknownSchemaError,
)
from rollout_journal.journal.events import AttemptStarted, Header, Message
from rollout_journal.journal.journal import ReadReport
from rollout_journal.journal.open import open_journal
from rollout_journal.replay.errors import NoSuchRolloutError
from rollout_journal.replay.listing import list_rollouts
from rollout_journal.replay.partition_scan import PartitionScan, ScanWorkerError, jobs_for
from rollout_journal.replay.progress import Progress
from rollout_journal.replay.source import ReplaySource, open_replay
from tests.support.paths import REPO_ROOT
from tests.support.processes import children_of

HERE = RecordLocation("ns.events", 1, 42)


@pytest.mark.parametrize(
    "error",
    [
        CorruptRecordError(HERE, "bad CRC"),
        UnknownSchemaError(HERE, b"\x01" * 8),
        NotAuthorizedError("WRITE", "topic", "ns.events", "user ns-a", "grant it"),
        PartitionFencedError("fenced", 3),
        JournalStoppedError(RuntimeError("broker gone")),
        NoSuchRolloutError("r-1", "kafka://h:1/ns"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_an_error_pickles_whole(error: Exception) -> None:
    """Class, message and fields survive a pickle, whatever the class's ``__init__`` takes."""
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error)
    assert {k: str(v) for k, v in vars(back).items()} == {k: str(v) for k, v in vars(error).items()}


def write_journal(location: str, rollouts: int, turns: int) -> list[str]:
    rng = np.random.default_rng(1)
    ids = [f"ps-g{r // 2}-s{r % 2}" for r in range(rollouts)]
    with open_journal(location, writer=f"ps-{uuid.uuid4().hex[:6]}") as journal:
        for rid in ids:
            header = Header(rid, rid.rsplit("-", 1)[0], 1, 1, 0, 0, Header.now_ms(), "test")
            journal.append_sync([AttemptStarted(header, 0, "topology", "new rollout", [Message("user", "task")])])
            for t in range(turns):
                journal.append_sync(turn_events(rid, t, 1 + 3 * t, rng, prompt_delta=8, output=4))
    return ids


def listed(location: str, jobs: int) -> tuple[dict, list[str], int]:
    """What ``replay list --scan`` folds from every event (the scan these workers share)."""
    with open_replay(location) as source:
        listing = list_rollouts(source, jobs=jobs, scan=True)
    return listing.as_json(), [str(e) for e in listing.report.errors], listing.report.records_read


@pytest.mark.kafka
def test_workers_list_what_one_process_lists(kafka_bootstrap: str) -> None:
    location = f"kafka://{kafka_bootstrap}/ps{uuid.uuid4().hex[:8]}?partitions=4"
    ids = write_journal(location, rollouts=8, turns=3)
    one, errors, read = listed(location, jobs=1)
    assert [r["rollout_id"] for r in one["rollouts"]] and {r["rollout_id"] for r in one["rollouts"]} == set(ids)
    for jobs in (2, 4):
        assert listed(location, jobs) == (one, errors, read)


@pytest.mark.kafka
def test_a_rollout_in_two_partitions_is_listed_as_one_process_lists_it(kafka_bootstrap: str) -> None:
    """A record copied into another partition (a foreign producer, a damaged journal): its rollout
    straddles partitions, which no worker sees whole, so the listing is read in one process."""
    from confluent_kafka import Producer

    namespace = f"ps{uuid.uuid4().hex[:8]}"
    location = f"kafka://{kafka_bootstrap}/{namespace}?partitions=2"
    ids = write_journal(location, rollouts=4, turns=2)
    with open_replay(location) as source:
        home = source.journal.partition_of(ids[0])
        stray = next(r for r in source.journal.backend.read_events(home, 0) if r.key == ids[0])
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    producer.produce(f"{namespace}.events", stray.value, stray.key.encode(), partition=1 - home)
    assert producer.flush(30) == 0
    one = listed(location, jobs=1)
    assert any(r["damaged"] for r in one[0]["rollouts"])  # the copy is a record appearing twice
    assert listed(location, jobs=2) == one


def test_jobs_for_goes_parallel_only_where_it_pays(tmp_path: Path) -> None:
    location = str(tmp_path / "j")
    write_journal(location, rollouts=1, turns=1)
    with open_replay(location) as source:
        assert jobs_for(source, None, {0: 10**9}) == 1  # a file journal: one partition
        assert jobs_for(source, 3, {0: 5, 1: 5}) == 2  # no more workers than partitions
        with pytest.raises(ValueError, match="at least 1"):
            jobs_for(source, 0, {0: 5})
        # A source made around an open journal names no place a worker could open it from
        assert jobs_for(ReplaySource("a journal", source.journal), 2, {0: 5, 1: 5}) == 1


def fail_on_partition_1(source: ReplaySource, partition: int, report: ReadReport, progress: Progress) -> int:
    if partition == 1:
        raise CorruptRecordError(HERE, "planted by the test")
    return partition


def die_on_partition_1(source: ReplaySource, partition: int, report: ReadReport, progress: Progress) -> int:
    if partition == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return partition


def test_a_workers_error_is_raised_as_itself(tmp_path: Path) -> None:
    location = str(tmp_path / "j")
    write_journal(location, rollouts=1, turns=1)
    with open_replay(location) as source:
        assert [p for p, *_ in PartitionScan(source, fail_on_partition_1, 2, {0: 1, 2: 1}).run()] == [0, 2]
        with pytest.raises(CorruptRecordError, match="planted by the test") as raised:
            PartitionScan(source, fail_on_partition_1, 2, {0: 1, 1: 1, 2: 1}).run()
    assert raised.value.location == HERE


def test_a_killed_worker_is_named_with_its_partitions(tmp_path: Path) -> None:
    location = str(tmp_path / "j")
    write_journal(location, rollouts=1, turns=1)
    with open_replay(location) as source:
        with pytest.raises(ScanWorkerError, match=r"partitions \[1, 3\] died \(exit code -9\)"):
            PartitionScan(source, die_on_partition_1, 2, {0: 1, 1: 1, 2: 1, 3: 1}).run()


@pytest.mark.kafka
def test_a_journal_the_caller_opened_is_listed_in_one_process(kafka_bootstrap: str, monkeypatch) -> None:
    """Workers reopen a journal by its location; a source whose location is a label (the 0.1
    API's ``rollout_journal.replay.inspect.list_rollouts(journal)``, ``rollout_journal.replay.redone``) cannot be reopened, so
    it is listed in one process, at any size, not refused as "no file journal at kafka journal"."""
    from rollout_journal.replay import inspect, partition_scan

    location = f"kafka://{kafka_bootstrap}/ps{uuid.uuid4().hex[:8]}?partitions=4"
    ids = write_journal(location, rollouts=8, turns=1)
    with open_journal(location, writer="ps-reader", read_only=True) as journal:
        one = inspect.list_rollouts(journal)
        monkeypatch.setattr(partition_scan, "AUTO_MIN_RECORDS", 0)  # as a journal of 200k records would
        assert set(inspect.list_rollouts(journal).rollouts) == set(one.rollouts) == set(ids)
        labelled = ReplaySource("kafka journal", journal)
        assert list_rollouts(labelled, jobs=2).as_json() == list_rollouts(labelled, jobs=1).as_json()


def test_a_worker_that_cannot_start_leaves_its_error_to_the_caller(tmp_path: Path) -> None:
    """A failed start (here a task that does not pickle; Ctrl-C while workers start ends the
    same way) is raised as itself, not as the AssertionError of joining a worker never started."""
    location = str(tmp_path / "j")
    write_journal(location, rollouts=1, turns=1)
    with open_replay(location) as source:
        with pytest.raises((pickle.PicklingError, AttributeError)):
            PartitionScan(source, lambda *_: 0, 2, {0: 1, 1: 1, 2: 1}).run()


def die_while_sending_partition_1(
    source: ReplaySource, partition: int, report: ReadReport, progress: Progress
) -> bytes | int:
    """Partition 1's worker is killed half way through handing back a large result (the OOM
    killer's moment: sending a result is when a worker holds the most)."""
    if partition != 1:
        return partition

    def kill_once_sending() -> None:
        while not any(frame.f_code.co_name == "_send" for frame in sys._current_frames().values()):
            time.sleep(0.0005)
        time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=kill_once_sending, daemon=True).start()
    return b"x" * 200_000_000


def test_a_worker_killed_while_sending_is_named_not_waited_for(tmp_path: Path) -> None:
    location = str(tmp_path / "j")
    write_journal(location, rollouts=1, turns=1)
    raised: list[BaseException] = []

    def scan() -> None:
        with open_replay(location) as source:
            try:
                PartitionScan(source, die_while_sending_partition_1, 2, {0: 1, 1: 1}).run()
            except BaseException as exc:  # noqa: BLE001 - checked below
                raised.append(exc)

    caller = threading.Thread(target=scan, daemon=True)
    caller.start()
    caller.join(60)
    assert not caller.is_alive(), "the scan waits forever on the rest of a dead worker's message"
    assert len(raised) == 1 and isinstance(raised[0], ScanWorkerError)
    assert "partitions [1] died (exit code -9)" in str(raised[0])


def sleep_and_note_pid(source: ReplaySource, partition: int, report: ReadReport, progress: Progress) -> int:
    Path(os.environ["PS_PID_DIR"], str(os.getpid())).touch()
    time.sleep(120)
    return partition


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_workers_end_with_the_process_that_started_them(tmp_path: Path, how: signal.Signals) -> None:
    """A caller killed mid-scan (SIGTERM from a supervisor or `timeout`, the OOM killer) leaves
    no workers behind: they would scan on, then wait forever to hand back their results, holding
    the caller's stdout and stderr open."""
    location = str(tmp_path / "j")
    write_journal(location, rollouts=1, turns=1)
    pids = tmp_path / "pids"
    pids.mkdir()
    script = (
        "from rollout_journal.replay.source import open_replay; "
        "from rollout_journal.replay.partition_scan import PartitionScan; "
        "from tests.replay.test_partition_scan import sleep_and_note_pid\n"
        "if __name__ == '__main__':\n"
        f"    with open_replay({location!r}) as source:\n"
        "        PartitionScan(source, sleep_and_note_pid, 2, {0: 1, 1: 1}).run()\n"
    )
    caller = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        env=os.environ | {"PS_PID_DIR": str(pids), "PYTHONPATH": str(REPO_ROOT)},
    )
    try:
        deadline = time.monotonic() + 60
        while len(list(pids.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        workers = [int(p.name) for p in pids.iterdir()]
        assert len(workers) == 2
        caller.send_signal(how)
        caller.wait(30)
        deadline = time.monotonic() + 60  # a bound, not a pace: the loop ends as soon as they are gone
        while not all(gone(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [pid for pid in workers if not gone(pid)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert not left, f"workers {left} outlived the scan's process"
    finally:
        caller.kill()
        caller.wait()


def sigint_held(source: ReplaySource, partition: int, report: ReadReport, progress: Progress) -> bool:
    return signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])


def test_every_worker_starts_with_ctrl_c_held(tmp_path: Path) -> None:
    """The first start of a spawn worker launches multiprocessing's resource tracker, which
    unblocks SIGINT in the starting thread once it runs: the first worker then began its
    imports open to Ctrl-C (a KeyboardInterrupt traceback, one run in a few of the Ctrl-C test).
    A fresh interpreter, so that no tracker runs yet, as in the command line."""
    location = str(tmp_path / "j")
    write_journal(location, rollouts=1, turns=1)
    script = (
        "from rollout_journal.replay.source import open_replay; "
        "from rollout_journal.replay.partition_scan import PartitionScan; "
        "from tests.replay.test_partition_scan import sigint_held\n"
        "if __name__ == '__main__':\n"
        f"    with open_replay({location!r}) as source:\n"
        "        print([held for _, held, _ in PartitionScan(source, sigint_held, 2, {0: 1, 1: 1}).run()])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        env=os.environ | {"PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[True, True]"


INTERRUPT_TRIES = 5


def as_from_a_terminal() -> None:
    """(In the child, before it runs the command.) Ctrl-C open and handled as a shell's foreground
    job has it: a child inherits an ignored or blocked SIGINT, and the test process's may be either
    after what earlier tests in it ran; the listing then never saw the signal, five tries in a row."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def sigint_state() -> str:
    """How this process holds SIGINT: what a child started from it inherits."""
    blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    return f"SIGINT {'blocked' if blocked else 'open'}, handler {signal.getsignal(signal.SIGINT)!r}"


def interrupted_listing(location: str) -> tuple[subprocess.Popen, str, list[int]] | None:
    """``replay list --jobs 2`` of ``location``, sent Ctrl-C once its two workers exist: (the
    command, its stderr, the workers' pids); None when the listing had ended before the signal
    could reach it (a loaded machine may run this test's process only after the workers' work)."""
    cli = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollout_journal.replay.cli.main",
            "replay",
            "list",
            "--journal",
            location,
            "--jobs",
            "2",
            "--scan",
        ],
        cwd=REPO_ROOT,
        env=os.environ | {"PYTHONPATH": str(REPO_ROOT)},
        start_new_session=True,
        preexec_fn=as_from_a_terminal,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while len(workers := children_of(cli.pid, cmdline_holds=b"spawn_main")) < 2 and time.monotonic() < deadline:
            if cli.poll() is not None:
                break
            time.sleep(0.005)
        if cli.poll() is None:
            assert len(workers) == 2, f"the listing started {len(workers)} workers in 60 s, not 2"
            # At once: the workers have just been spawned and are importing what they run (half a
            # second here when quiet). A pause before it let the listing end first, five times in
            # a row, on a loaded CI machine.
            os.killpg(cli.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        _, err = cli.communicate(timeout=60)
    finally:
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)
            cli.wait()
    if cli.returncode == 0 and "interrupted" not in err:  # it ended first: no Ctrl-C was seen
        return None
    return cli, err, workers


@pytest.mark.kafka
def test_ctrl_c_while_workers_start_is_one_line_and_ends_them(kafka_bootstrap: str) -> None:
    """Ctrl-C reaches the whole foreground process group: workers still starting must not each
    print a KeyboardInterrupt traceback (the command line's errors are one line), and none is left."""
    location = f"kafka://{kafka_bootstrap}/ps{uuid.uuid4().hex[:8]}?partitions=4"
    write_journal(location, rollouts=8, turns=1)
    for _ in range(INTERRUPT_TRIES):
        if (outcome := interrupted_listing(location)) is not None:
            break
    else:
        pytest.fail(
            f"the listing ended before Ctrl-C reached it {INTERRUPT_TRIES} times: it never saw the signal "
            f"(this test process: {sigint_state()})"
        )
    cli, err, workers = outcome
    assert cli.returncode == 130, err
    assert "Traceback" not in err and "rollout-journal: interrupted" in err, err
    deadline = time.monotonic() + 60  # workers may still be exiting when the command has ended
    while not all(gone(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(gone(pid) for pid in workers)
