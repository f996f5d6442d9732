"""Faults under a transactional writer: a partition leader SIGKILLed on a real 3-broker
cluster, and real processes racing on one writer slot.

The leader-kill drill and what must hold after it (no committed batch lost, none partly visible,
none twice), with the policy by which the writer redoes a batch, are written once, in
``tests/support/kafka_drills.py``; the racing writers are below.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_journal.replay.exit_codes import EXIT_WRITER_TAKEN as EXIT_FENCED
from tests.support.kafka_drills import leader_kill_drill, wait_for
from tests.support.paths import REPO_ROOT

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_killed_partition_leader_loses_no_committed_batch_and_duplicates_none(kafka_cluster3) -> None:
    leader_kill_drill(kafka_cluster3)  # its assertions: tests/support/kafka_drills.py


# -- a fenced process stops, promptly and clearly --------------------------------------------------


# Paced so that no process can finish the workload while the race is on: 400 turns at 250 ms
# take 100 s or more, while five interpreters starting on a loaded 2-core machine can take
# many seconds (at 20 ms, 8 s). One that finished first would exit 0 unfenced: a second "survivor".
RACE_WORKLOAD = """\
name: race
groups: 2
siblings: 2
max_turns: 400
environment: counter
seed: 3
allow_early_submit: false
turn_delay_ms: 250
snapshot_every_turns: 2
journal: {journal}
writer: slot-0
"""


def _cli(args: list[str], out_dir: Path, name: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen(
        [sys.executable, "-m", "rollout_journal.replay.cli.main", *args, "--progress-lines"],
        cwd=REPO_ROOT,
        env=env,
        stdout=(out_dir / f"{name}.out").open("w"),
        stderr=(out_dir / f"{name}.err").open("w"),
        stdin=subprocess.DEVNULL,
    )


def test_resumes_racing_on_one_slot_all_but_one_exit_fenced_with_one_line(
    kafka_bootstrap: str, kafka_namespace: str, tmp_path: Path
) -> None:
    """Real `rollout-journal` processes on one Kafka writer slot: each newer one fences the older.
    Every loser stops on its own with EXIT_FENCED and a one-line reason, never a traceback or a hang."""
    config = tmp_path / "race.yaml"
    config.write_text(RACE_WORKLOAD.format(journal=f"kafka://{kafka_bootstrap}/{kafka_namespace}"))
    procs = {"run": _cli(["run", str(config)], tmp_path, "run")}
    try:
        wait_for(
            lambda: (tmp_path / "run.out").read_text().count("turn-committed") >= 8 or procs["run"].poll() is not None,
            120,
            "the first run's turns",
        )
        assert procs["run"].poll() is None, (tmp_path / "run.err").read_text()
        for i in range(4):
            procs[f"resume-{i}"] = _cli(["resume", str(config)], tmp_path, f"resume-{i}")
        # Only the newest producer of the slot may go on; every other process must end by itself.
        wait_for(lambda: sum(p.poll() is None for p in procs.values()) <= 1, 240, "every fenced process to exit")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)
    survivors = [name for name, p in procs.items() if p.returncode in (0, -signal.SIGKILL)]
    losers = {name: p.returncode for name, p in procs.items() if name not in survivors}
    assert len(survivors) == 1, {name: p.returncode for name, p in procs.items()}
    assert len(losers) == 4
    for name, code in losers.items():
        err = (tmp_path / f"{name}.err").read_text()
        assert code == EXIT_FENCED, f"{name} exited {code}:\n{err}"
        lines = err.rstrip("\n").splitlines()
        assert len(lines) == 1, f"{name} said more than one line:\n{err}"  # no traceback, no log noise
        assert (
            lines[0].startswith("rollout-journal: ")
            and "fenced" in lines[0]
            and f"{kafka_namespace}.slot-0" in lines[0]
        )
