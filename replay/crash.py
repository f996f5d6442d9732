"""Crash a workload for real: run it in a child process and SIGKILL it.

The demo and the recovery benchmark crash their workloads this way, so the kill
lands wherever the child happens to be (generating, appending, mid-commit), not
at a turn boundary the code chose. The child is ``rollout-journal run
--progress-lines``, which prints one line per durable turn.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import yaml

from journal import RolloutJournalError
from participants.config import WorkloadConfig

PROGRESS_LINE = "turn-committed"


class WorkloadChildError(RolloutJournalError):
    """The workload's child process failed on its own, before it could be killed."""


def crash_midway(config: WorkloadConfig, kill_after: int, *, extra_delay_s: float = 0.0,
                 timeout_s: float = 120.0) -> int | None:
    """Run ``config`` in a child process and SIGKILL it once ``kill_after`` turns are durable,
    plus ``extra_delay_s`` (so that the kill can land anywhere in the turns then in flight).

    Returns the turns the child reported durable before the kill (``kill_after``), or None
    when the child finished the whole workload first. Raises :class:`WorkloadChildError`
    when it exited any other way.
    """
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(config.model_dump(), f)
        config_path = f.name
    child = subprocess.Popen(
        [sys.executable, "-m", "replay.cli", "run", config_path, "--progress-lines"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    committed = 0
    try:
        assert child.stdout is not None
        for line in child.stdout:
            if line.startswith(PROGRESS_LINE):
                committed += 1
                if committed >= kill_after:
                    if extra_delay_s > 0:
                        time.sleep(extra_delay_s)
                    child.send_signal(signal.SIGKILL)
                    break
        child.wait(timeout=timeout_s)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        os.unlink(config_path)
    if child.returncode == 0:
        return None
    if child.returncode != -signal.SIGKILL:
        assert child.stderr is not None
        raise WorkloadChildError(
            f"the workload child exited with {child.returncode} before the crash point "
            f"({committed} turns committed): {child.stderr.read()[-2000:]}")
    return committed
