"""Crash a workload for real: run it in a child process and SIGKILL it.

The demo and the recovery benchmark crash their workloads this way, so the kill
lands wherever the child happens to be (generating, appending, mid-commit), not
at a turn boundary the code chose. The child is ``rollout-journal run
--progress-lines --crash-after N``: it prints one line per durable turn and arms
its own SIGKILL N turns in (:class:`SelfKill`). A parent that watched the lines and
sent the signal itself could, starved of CPU, read them after the workload had
already finished, and miss the crash it was there to cause.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading

import yaml

from journal import RolloutJournalError
from participants.config import WorkloadConfig

PROGRESS_LINE = "turn-committed"


class WorkloadChildError(RolloutJournalError):
    """The workload's child process failed on its own, before it could be killed."""


class SelfKill:
    """SIGKILLs this process ``delay_s`` after its ``after_turns``-th durable turn: a crash drill.

    Call :meth:`turn_durable` once per durable turn. With no delay the kill lands inside that
    call; with one, a timer thread sends it while the workload goes on, so it lands wherever
    the workload then is. A workload that ends first exits normally: no crash happened."""

    def __init__(self, after_turns: int, delay_s: float = 0.0) -> None:
        if after_turns < 1 or delay_s < 0:
            raise ValueError(f"a crash after {after_turns} turns and {delay_s} s is not a crash drill")
        self.after_turns = after_turns
        self.delay_s = delay_s
        self.turns = 0

    def turn_durable(self) -> None:
        self.turns += 1
        if self.turns != self.after_turns:
            return
        if self.delay_s == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        timer = threading.Timer(self.delay_s, os.kill, (os.getpid(), signal.SIGKILL))
        timer.daemon = True
        timer.start()


def crash_midway(config: WorkloadConfig, kill_after: int, *, extra_delay_s: float = 0.0,
                 timeout_s: float = 300.0) -> int | None:
    """Run ``config`` in a child process that SIGKILLs itself once ``kill_after`` turns are
    durable, plus ``extra_delay_s`` (so that the kill can land anywhere in the turns then in flight).

    Returns the turns the child reported durable before it died (at least ``kill_after``), or
    None when it finished the whole workload first. Raises :class:`WorkloadChildError` when it
    exited any other way or ran past ``timeout_s``.
    """
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(config.model_dump(), f)
        config_path = f.name
    child = subprocess.Popen(
        [sys.executable, "-m", "replay.cli", "run", config_path, "--progress-lines",
         "--crash-after", str(kill_after), "--crash-delay", repr(extra_delay_s)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        stdout, stderr = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        raise WorkloadChildError(f"the workload child was still running after {timeout_s:g} s; "
                                 f"it should have crashed {kill_after} turns in") from None
    finally:
        os.unlink(config_path)
    committed = sum(1 for line in stdout.splitlines() if line.startswith(PROGRESS_LINE))
    if child.returncode == 0:
        return None
    if child.returncode != -signal.SIGKILL:
        raise WorkloadChildError(
            f"the workload child exited with {child.returncode} before the crash point "
            f"({committed} turns committed): {stderr[-2000:]}")
    return committed
