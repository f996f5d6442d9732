"""Shared pieces of the recovery tests: journals on both backends, a workload
child process that can be SIGKILLed at any point, and the checks that a crash
lost nothing and applied nothing twice."""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path

from rollout_journal.journal.journal import ReadReport
from rollout_journal.journal.open import open_journal
from rollout_journal.journal.restore import load_rollouts
from rollout_journal.participants.rollout.state import restore_state
from rollout_journal.participants.workload.config import WorkloadConfig
from rollout_journal.participants.workload.run import run_workload
from rollout_journal.participants.workload.runner import RunReport
from rollout_journal.participants.workload.specs import workload_specs
from rollout_journal.replay.audit import audit_events
from rollout_journal.replay.cli.crash import SelfKill

_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(["rollout_journal.participants.workload.run", "torch"])  # children start in milliseconds


def reference_outcomes(config: WorkloadConfig) -> dict[str, dict | None]:
    """The uninterrupted run, journaling off."""
    return run_workload(config.model_copy(update={"journaling": False, "turn_delay_ms": 0.0}), resume=False).outcomes()


def _child(
    config_json: str,
    resume: bool,
    progress_path: str,
    environ: dict[str, str],
    kill_after_turns: int | None = None,
    extra_delay_s: float = 0.0,
) -> None:
    """Run the workload, appending a line per durable turn to ``progress_path``; with
    ``kill_after_turns``, SIGKILL this process that many turns later (plus ``extra_delay_s``),
    as ``rollout-journal run --crash-after`` does."""
    os.environ.update(environ)  # the forkserver's environment is the one it started with
    config = WorkloadConfig.model_validate_json(config_json)
    crash = SelfKill(kill_after_turns, extra_delay_s) if kill_after_turns is not None else None
    with open(progress_path, "a", buffering=1) as progress:

        def report(rid: str, turn: int) -> None:
            progress.write(f"{rid} {turn}\n")  # line-buffered: on disk before any kill

        run_workload(config, resume=resume, on_turn=report if crash is None else crash.counting(report))
    if crash is not None:
        crash.disarm()  # finished first: exit 0, no kill reported that did not land


def committed_by_progress(progress_path: Path) -> dict[str, int]:
    """Turns per rollout the child reported durable (complete lines only)."""
    done: dict[str, int] = {}
    if progress_path.exists():
        for line in progress_path.read_text().splitlines(keepends=True):
            if line.endswith("\n"):
                rid, turn = line.split()
                done[rid] = max(done.get(rid, 0), int(turn) + 1)
    return done


def run_child_and_kill(
    config: WorkloadConfig,
    *,
    resume: bool,
    kill_after_turns: int,
    extra_delay_s: float,
    progress_path: Path,
    timeout_s: float = 240.0,
    environ: dict[str, str] | None = None,
) -> bool:
    """Run the workload in a child (with ``environ`` added to its environment), SIGKILLed
    once ``kill_after_turns`` more turns are durable (plus a delay, so the kill lands
    anywhere). True if it was killed.

    The child kills itself, counting its own durable turns: a parent polling the progress
    file, starved of CPU on a loaded machine, can wake to find the child finished all its
    turns (no crash at all, and tests asserting one fail)."""
    child = _CTX.Process(
        target=_child,
        args=(config.model_dump_json(), resume, str(progress_path), environ or {}, kill_after_turns, extra_delay_s),
    )
    child.start()
    try:
        child.join(timeout_s)
    finally:
        hung = child.is_alive()
        if hung:
            child.kill()
            child.join()
    assert not hung, f"the workload child was still running after {timeout_s:g} s (it kills itself; it hung)"
    assert child.exitcode in (0, -signal.SIGKILL), f"workload child failed with exit code {child.exitcode}"
    return child.exitcode == -signal.SIGKILL


def journal_turns(config: WorkloadConfig) -> dict[str, tuple[int, bool]]:
    """(committed turns, finished) per rollout, as ``replay list`` sees them: on Kafka to the last
    stable offset, so only where no killed writer's transaction is still open below a later writer's
    commits (a restore reads past it; see ``test_sigkill_at_random_points_loses_no_committed_turn``)."""
    if "://" not in config.journal and not (Path(config.journal) / "log").exists():
        return {spec.rollout_id: (0, False) for spec in workload_specs(config)}  # killed before it began
    with open_journal(config.journal, writer=f"{config.writer}-inspect", read_only=True) as journal:
        plan = load_rollouts(journal)
    out = {}
    for spec in workload_specs(config):
        history = plan.rollouts.get(spec.rollout_id)
        state = restore_state(history, spec.group_id) if history else None
        out[spec.rollout_id] = (state.next_turn, state.finished) if state else (0, False)
    return out


def assert_no_mutation_applied_twice(config: WorkloadConfig) -> None:
    """Every resource's journaled mutations form one unbroken hash chain per life (a
    restart-only resource starts a new one), with no idempotency key applied twice: what
    ``rollout-journal audit`` checks, on this workload's rollouts."""
    rollouts = {s.rollout_id for s in workload_specs(config)}
    report = ReadReport()
    with open_journal(config.journal, writer=f"{config.writer}-audit", read_only=True) as journal:
        _, summary = audit_events(
            (item for item in journal.scan(report) if item.event.header.rollout_id in rollouts), report
        )
    assert not report.errors, report.errors
    assert summary.chain_ok, [str(p) for p in summary.problems]


def assert_identical(report: RunReport, reference: dict[str, dict]) -> None:
    outcomes = report.outcomes()
    assert outcomes.keys() == reference.keys()
    for rid, expected in reference.items():
        assert outcomes[rid] == expected, f"{rid} differs from the uninterrupted run"
