"""Shared pieces of the recovery tests: journals on both backends, a workload
child process that can be SIGKILLed at any point, and the checks that a crash
lost nothing and applied nothing twice."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

from journal.journal import ReadReport
from journal.open import open_journal
from journal.restore import load_rollouts
from participants.config import WorkloadConfig
from participants.rollout_state import restore_state
from participants.runner import RunReport, workload_specs
from participants.workload import run_workload
from replay.audit import audit_events

_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(["participants.workload", "torch"])  # children start in milliseconds


def reference_outcomes(config: WorkloadConfig) -> dict[str, dict]:
    """The uninterrupted run, journaling off."""
    return run_workload(config.model_copy(update={"journaling": False, "turn_delay_ms": 0.0}), resume=False).outcomes()


def _child(config_json: str, resume: bool, progress_path: str, environ: dict[str, str]) -> None:
    os.environ.update(environ)  # the forkserver's environment is the one it started with
    config = WorkloadConfig.model_validate_json(config_json)
    with open(progress_path, "a", buffering=1) as progress:
        run_workload(config, resume=resume, on_turn=lambda rid, turn: progress.write(f"{rid} {turn}\n"))


def committed_by_progress(progress_path: Path) -> dict[str, int]:
    """Turns per rollout the child reported durable (complete lines only)."""
    done: dict[str, int] = {}
    if progress_path.exists():
        for line in progress_path.read_text().splitlines(keepends=True):
            if line.endswith("\n"):
                rid, turn = line.split()
                done[rid] = max(done.get(rid, 0), int(turn) + 1)
    return done


def run_child_and_kill(config: WorkloadConfig, *, resume: bool, kill_after_turns: int, extra_delay_s: float,
                       progress_path: Path, timeout_s: float = 120.0, environ: dict[str, str] | None = None) -> bool:
    """Run the workload in a child (with ``environ`` added to its environment); SIGKILL it
    once ``kill_after_turns`` more turns are durable (plus a delay, so the kill lands
    anywhere). True if it was killed."""
    before = sum(1 for _ in progress_path.open()) if progress_path.exists() else 0
    child = _CTX.Process(target=_child, args=(config.model_dump_json(), resume, str(progress_path), environ or {}))
    child.start()
    deadline = time.monotonic() + timeout_s
    try:
        while child.is_alive() and time.monotonic() < deadline:
            lines = sum(1 for _ in progress_path.open()) if progress_path.exists() else 0
            if lines - before >= kill_after_turns:
                time.sleep(extra_delay_s)
                try:
                    os.kill(child.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # it finished first
                break
            time.sleep(0.002)
        child.join(timeout_s)
    finally:
        if child.is_alive():
            child.kill()
            child.join()
    assert child.exitcode in (0, -signal.SIGKILL), f"workload child failed with exit code {child.exitcode}"
    return child.exitcode == -signal.SIGKILL


def journal_turns(config: WorkloadConfig) -> dict[str, tuple[int, bool]]:
    """(committed turns, finished) per rollout, as a restore would see them."""
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
        _, summary = audit_events((item for item in journal.scan(report) if item.event.header.rollout_id in rollouts),
                                  report)
    assert not report.errors, report.errors
    assert summary.chain_ok, [str(p) for p in summary.problems]


def assert_identical(report: RunReport, reference: dict[str, dict]) -> None:
    outcomes = report.outcomes()
    assert outcomes.keys() == reference.keys()
    for rid, expected in reference.items():
        assert outcomes[rid] == expected, f"{rid} differs from the uninterrupted run"
