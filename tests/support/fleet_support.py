"""Shared pieces of the fleet tests and the fleet benchmark: real ``rollout-journal worker``
processes on one Kafka namespace, what each reports, and what the journal holds after them.

A worker runs with ``--progress-lines``: one stdout line per durable turn
(``turn-committed <rollout> <turn>``) and per membership change (``partitions-assigned
0,3``, ``partitions-revoked ...``, ``partitions-lost ...``); each line is timestamped as
it arrives.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from rollout_journal.journal.events import ROLLOUT_EVENT_TYPES, AttemptStarted, EventChunk, RolloutEvent, TurnCompleted
from rollout_journal.journal.journal import ReadReport
from rollout_journal.journal.open import open_journal
from rollout_journal.journal.restore import load_rollouts
from rollout_journal.participants.rollout.state import restore_state
from rollout_journal.participants.workload.config import WorkloadConfig
from rollout_journal.participants.workload.specs import workload_specs
from tests.support.paths import REPO_ROOT


def child_environment() -> dict[str, str]:
    """The test's environment for a child, without KAFKA_BOOTSTRAP_SERVERS (it would replace the
    servers a URL names: a worker of a 3-broker cluster would join the session's broker)."""
    env = {k: v for k, v in os.environ.items() if k != "KAFKA_BOOTSTRAP_SERVERS"}
    env["PYTHONPATH"] = f"{REPO_ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


@dataclass
class WorkerProcess:
    """A ``rollout-journal worker`` child and the lines it printed, with their arrival times."""

    name: str
    process: subprocess.Popen
    err_path: Path
    lines: list[tuple[float, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def follow(self) -> None:
        """Collect the worker's lines (and copy them to ``<name>.out`` beside its stderr, to look at)."""
        assert self.process.stdout is not None
        with self.err_path.with_suffix(".out").open("w", buffering=1) as copy:
            for line in self.process.stdout:
                with self.lock:
                    self.lines.append((time.monotonic(), line.rstrip("\n")))
                copy.write(f"{time.monotonic():.3f} {line}")

    def seen(self, prefix: str, since: float = 0.0) -> list[tuple[float, str]]:
        with self.lock:
            return [(t, line) for t, line in self.lines if line.startswith(prefix) and t >= since]

    def committed(self, since: float = 0.0) -> list[tuple[float, str, int]]:
        """(time, rollout, turn) of every turn this worker reported durable."""
        out = []
        for t, line in self.seen("turn-committed ", since):
            _, rollout, turn = line.split()
            out.append((t, rollout, int(turn)))
        return out

    def partitions(self) -> set[int]:
        """The partitions it holds now, by its own account."""
        owned: set[int] = set()
        for _, line in self.seen("partitions-"):
            kind, numbers = line.split()
            parts = {int(p) for p in numbers.split(",") if p != "-"}
            owned = owned | parts if kind == "partitions-assigned" else owned - parts
        return owned

    def report(self) -> dict:
        """The worker's report, printed when it stopped (``worker-report {json}``)."""
        found = self.seen("worker-report ")
        assert found, f"worker {self.name} printed no report; stderr:\n{self.stderr()[-2000:]}"
        return json.loads(found[-1][1].removeprefix("worker-report "))

    def signal(self, sig: int) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, sig)

    def stop(self, timeout_s: float = 120.0) -> int:
        """SIGTERM, and wait for the worker to hand its partitions on and exit."""
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"worker {self.name} did not stop within {timeout_s} s of SIGTERM") from None

    def stderr(self) -> str:
        return self.err_path.read_text()


def start_worker(url: str, name: str, log_dir: Path, *extra: str, progress_lines: bool = True) -> WorkerProcess:
    """``extra``: more options for the worker (``--metrics-port``, ``--instance-id``). Without
    ``progress_lines`` its membership events are logged to its stderr instead, as an operator sees them."""
    command = [sys.executable, "-m", "rollout_journal.replay.cli.main", "worker", "--journal", url, "--name", name]
    return start_followed(
        [*command, *(["--progress-lines"] if progress_lines else []), "--json", *extra], name, log_dir
    )


def start_followed(command: list[str], name: str, log_dir: Path) -> WorkerProcess:
    """``command`` as a child whose stdout lines are followed (a worker's, or anything that prints
    the same lines); its stderr goes to ``<log_dir>/<name>.err``."""
    err_path = log_dir / f"{name}.err"
    process = subprocess.Popen(
        command,
        cwd=REPO_ROOT,
        env=child_environment(),
        stdout=subprocess.PIPE,
        stderr=err_path.open("w"),
        stdin=subprocess.DEVNULL,
        text=True,
    )
    worker = WorkerProcess(name, process, err_path)
    threading.Thread(target=worker.follow, name=f"follow-{name}", daemon=True).start()
    return worker


def submit(url: str, config_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "rollout_journal.replay.cli.main", "submit", str(config_path), "--journal", url],
        cwd=REPO_ROOT,
        env=child_environment(),
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr


def wait_for(
    condition: Callable[[], bool],
    timeout_s: float,
    what: str,
    workers: Sequence[WorkerProcess] = (),
    detail: Callable[[], str] | None = None,
) -> float:
    """Poll ``condition``; its time once true. Fails naming ``what`` (and any worker that died, and
    ``detail()``: what is still missing)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if condition():
            return time.monotonic()
        dead = [w.name for w in workers if w.process.poll() is not None]
        if time.monotonic() > deadline or dead:
            raise AssertionError(
                f"timed out after {timeout_s} s waiting for {what}"
                + (f"; workers exited: {dead}" if dead else "")
                + (f"; {detail()}" if detail is not None else "")
            )
        time.sleep(0.1)


def wait_for_every_rollout(
    workers: Sequence[WorkerProcess], config: WorkloadConfig, timeout_s: float, watched: Sequence[WorkerProcess]
) -> float:
    """:func:`wait_for` every rollout reported finished by one of ``workers``; a timeout names the
    rollouts still missing (``watched``: the workers whose exit fails the wait at once)."""
    return wait_for(
        lambda: every_turn_reported(list(workers), config),
        timeout_s,
        "every rollout to finish",
        watched,
        detail=lambda: f"not reported finished: {', '.join(not_reported_finished(list(workers), config)[:20])}",
    )


def workload_done(url: str) -> bool:
    """What ``rollout-journal status`` says: every rollout finished (reads the whole journal)."""
    from rollout_journal.replay.status import fleet_status

    return fleet_status(url).done


def every_turn_reported(workers: list[WorkerProcess], config: WorkloadConfig) -> bool:
    """Cheap to poll: each rollout is reported finished (see :func:`not_reported_finished`)."""
    return not not_reported_finished(workers, config)


def not_reported_finished(workers: list[WorkerProcess], config: WorkloadConfig) -> list[str]:
    """The rollouts no worker reported finished: neither its last turn durable (the workload runs
    every rollout to ``max_turns``: ``allow_early_submit: false``) nor its result published. The
    second counts because a final turn whose commit's outcome the writer could not learn (a broker
    lost mid-commit) is never reported durable: the partition's next take finds it finished and
    publishes its result (``result-published``), with no turn left to run."""
    last = config.max_turns - 1
    done = {rollout for w in workers for _, rollout, turn in w.committed() if turn == last}
    done |= {line.split()[1] for w in workers for _, line in w.seen("result-published ")}
    return sorted({s.rollout_id for s in workload_specs(config)} - done)


@dataclass
class JournalAudit:
    """What the journal holds of a workload once the fleet finished it."""

    outcomes: dict[str, dict | None]
    turns_written: Counter  # (rollout, turn) -> TurnCompleted records in the raw log, superseded ones included
    turns_standing: Counter  # (rollout, turn) -> TurnCompleted records a fenced read admits
    fenced: list  # events every reader drops (a zombie's that reached the log)
    attempts: dict[str, list[AttemptStarted]]  # per rollout, in log order
    by_writer_after_takeover: list[str]  # events of a superseded attempt written after a newer one started
    # Where the read still ended short of what is committed (an open transaction holding it back) when
    # the audit stopped waiting: a turn missing there may be held back, not lost.
    held_back: list[str] = field(default_factory=list)
    held_back_waited_s: float = 0.0  # how long the audit waited for held-back reads to catch up

    def turn_detail(self, rollout_id: str, turn: int) -> str:
        """What the journal holds of one turn: for a lost one, where to look."""
        epochs = [
            (a.header.epoch, a.header.seq, a.resumed_from_turn, a.header.writer)
            for a in self.attempts.get(rollout_id, [])
        ]
        return (
            f"{rollout_id} turn {turn}: written {self.turns_written[rollout_id, turn]}, "
            f"standing {self.turns_standing[rollout_id, turn]}; attempts (epoch, seq, resumed from turn, writer): {epochs}"
        )


def audit_journal(url: str, config: WorkloadConfig, *, hold_margin_s: float = 10.0) -> JournalAudit:
    """The journal's view of ``config``'s workload, once every read reaches what is committed: a
    read held back by an open transaction (a writer stopped mid-transaction, which the broker
    aborts within the transaction timeout) is done again, until then plus ``hold_margin_s``."""
    started = time.monotonic()
    audit, hold_s = _audit_once(url, config)
    deadline = started + hold_s + hold_margin_s
    while audit.held_back and time.monotonic() < deadline:
        time.sleep(2.0)
        audit, _ = _audit_once(url, config)
        audit.held_back_waited_s = round(time.monotonic() - started, 1)
    return audit


def _audit_once(url: str, config: WorkloadConfig) -> tuple[JournalAudit, float]:
    """One audit read, and how long the backend may hold a read back (its transaction timeout)."""
    rollouts = {s.rollout_id for s in workload_specs(config)}
    report = ReadReport()
    written: Counter = Counter()
    standing: Counter = Counter()
    attempts: dict[str, list[AttemptStarted]] = {}
    late: list[str] = []
    with open_journal(url, writer="audit", read_only=True) as journal:
        plan = load_rollouts(journal)
        outcomes = {
            rid: restore_state(plan.rollouts[rid]).outcome if rid in plan.rollouts else None for rid in rollouts
        }
        for partition in range(journal.backend.partitions):
            newest: dict[str, int] = {}
            for stored in journal.backend.read_events(partition):
                assert stored.value is not None, f"no readable record at {stored.location}: {stored.error}"
                record = journal.codec.decode(stored.value, stored.location)
                assert isinstance(record, (*ROLLOUT_EVENT_TYPES, EventChunk)), (
                    f"a {type(record).__name__} at {stored.location}: not a rollout event (or a piece of one)"
                )
                # checked above: an isinstance on a tuple[type, ...] does not narrow
                event = cast(RolloutEvent | EventChunk, record)
                h = event.header
                if h.rollout_id not in rollouts:
                    continue
                if isinstance(event, TurnCompleted):
                    written[h.rollout_id, h.turn] += 1
                if isinstance(event, AttemptStarted):
                    attempts.setdefault(h.rollout_id, []).append(event)
                if h.epoch < newest.get(h.rollout_id, 0) and not isinstance(event, AttemptStarted):
                    late.append(
                        f"{type(event).__name__} of {h.rollout_id} epoch {h.epoch} by {h.writer} at "
                        f"{stored.location}, after epoch {newest[h.rollout_id]} started"
                    )
                newest[h.rollout_id] = max(newest.get(h.rollout_id, 0), h.epoch)
        for item in journal.scan(report):
            h = item.event.header
            if h.rollout_id in rollouts and isinstance(item.event, TurnCompleted):
                standing[h.rollout_id, h.turn] += 1
        hold_s = journal.backend.transaction_hold_s
    fenced = [f for f in report.fenced if f.rollout_id in rollouts]
    held = [str(h) for h in (*plan.report.held_back, *report.held_back)]
    return JournalAudit(outcomes, written, standing, fenced, attempts, late, held), hold_s


def reported_turns(workers: list[WorkerProcess]) -> Counter:
    """(rollout, turn) -> how many workers reported it durable."""
    return Counter((rollout, turn) for w in workers for _, rollout, turn in w.committed())


def workload_yaml(path: Path, **settings: object) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(settings))
    return path
