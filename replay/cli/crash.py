"""Crash a workload for real: run it in a child process and SIGKILL it.

The demo and the recovery benchmark crash their workloads this way, so the kill
lands wherever the child's rollouts happen to be (generating, appending,
mid-commit), not at a turn boundary the code chose for all of them. The child is ``rollout-journal run
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
from collections.abc import Callable

import yaml

from rollout_journal.journal import RolloutJournalError
from rollout_journal.participants.workload.config import WorkloadConfig

PROGRESS_LINE = "turn-committed"


class WorkloadChildError(RolloutJournalError):
    """The workload's child process failed on its own, before it could be killed. ``exit_code``:
    the child's, when it ended with one (the command that ran it ends with the same)."""

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class SelfKill:
    """SIGKILLs this process ``delay_s`` after its ``after_turns``-th durable turn: a crash drill.

    Call :meth:`turn_durable` once per durable turn, and :meth:`disarm` when the workload has
    ended. With no delay the kill lands inside the Nth call, while the rollouts' other turns are
    wherever they are (generating, appending, mid-commit); with one, a timer thread sends it
    while the workload goes on, so it lands wherever the workload then is. ``after_turns=0``
    arms it at once. A workload that ends first is not killed: no crash happened, and
    :meth:`disarm` says why."""

    def __init__(self, after_turns: int, delay_s: float = 0.0) -> None:
        if after_turns < 0 or not delay_s >= 0:
            raise ValueError(f"a crash after {after_turns} turns and {delay_s} s is not a crash drill")
        self.after_turns = after_turns
        self.delay_s = delay_s
        self.turns = 0
        self._lock = threading.Lock()
        self._disarmed = False
        self._timer: threading.Timer | None = None
        if after_turns == 0:
            self._arm()

    def turn_durable(self) -> None:
        self.turns += 1
        if self.turns == self.after_turns:
            self._arm()

    def counting(self, on_turn: Callable[[str, int], None]) -> Callable[[str, int], None]:
        """``on_turn`` (a workload's durable-turn callback), then this drill's count: whatever
        ``on_turn`` reports of a turn is out before the kill that turn may arm."""

        def counted(rollout_id: str, turn: int) -> None:
            on_turn(rollout_id, turn)
            self.turn_durable()

        return counted

    def disarm(self) -> str:
        """No kill from now on (the workload ended); why the drill did not crash it."""
        with self._lock:
            self._disarmed = True
            if self._timer is not None:
                self._timer.cancel()
        if self.turns < self.after_turns:
            return (
                f"the workload ended after {self.turns} durable turns, before the crash point "
                f"({self.after_turns}): it was not killed"
            )
        return (
            f"the workload ended within {self.delay_s:g} s of its durable turn {self.after_turns}, "
            "before the kill: it was not killed"
        )

    def _arm(self) -> None:
        if self.delay_s == 0:
            self._fire()
            return
        self._timer = threading.Timer(self.delay_s, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        with self._lock:  # held until the signal has killed us, so disarm() cannot slip in between
            if not self._disarmed:
                os.kill(os.getpid(), signal.SIGKILL)


def crash_midway(
    config: WorkloadConfig, kill_after: int, *, extra_delay_s: float = 0.0, timeout_s: float = 300.0
) -> int | None:
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
        [
            sys.executable,
            "-m",
            "rollout_journal.replay.cli.main",
            "run",
            config_path,
            "--progress-lines",
            "--crash-after",
            str(kill_after),
            "--crash-delay",
            repr(extra_delay_s),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        raise WorkloadChildError(
            f"the workload child was still running after {timeout_s:g} s; it should have crashed {kill_after} turns in"
        ) from None
    finally:
        os.unlink(config_path)
    committed = sum(1 for line in stdout.splitlines() if line.startswith(PROGRESS_LINE))
    if child.returncode == 0:
        return None
    if child.returncode != -signal.SIGKILL:
        raise WorkloadChildError(
            f"the workload child exited with {child.returncode} before the crash point "
            f"({committed} turns committed): {stderr[-2000:]}",
            child.returncode if child.returncode > 0 else None,
        )
    return committed
