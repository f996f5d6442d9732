"""The newcomer's demo: crash a workload with SIGKILL mid-run, resume it, and
show that no finished turn was thrown away and the results are identical to an
uninterrupted run."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from journal.open import is_kafka_url, open_journal
from journal.restore import load_rollouts
from participants.config import WorkloadConfig
from participants.rollout_state import restore_state
from participants.runner import RunReport, workload_specs
from participants.workload import run_workload

PROGRESS_LINE = "turn-committed"


@dataclass
class DemoRow:
    rollout_id: str
    turns_at_crash: int
    finished_at_crash: bool
    naive_redo: int  # a restart from turn 1 throws away every turn of an unfinished rollout
    redone_here: int  # committed turns this restart executed again (restart_only environments)
    turns_after: int


@dataclass
class DemoReport:
    backend: str
    journal: str
    rows: list[DemoRow] = field(default_factory=list)
    identical_to_uninterrupted: bool = False
    differences: list[str] = field(default_factory=list)
    killed_after_turns: int = 0
    restore_seconds: float = 0.0

    def as_json(self) -> dict:
        return {
            "backend": self.backend,
            "journal": self.journal,
            "rollouts": len(self.rows),
            "turns_committed_at_crash": sum(r.turns_at_crash for r in self.rows),
            "turns_redone": sum(r.redone_here for r in self.rows),
            "turns_thrown_away": sum(r.redone_here for r in self.rows),
            "naive_turns_thrown_away": sum(r.naive_redo for r in self.rows),
            "turns_lost": max(0, self.killed_after_turns - sum(r.turns_at_crash for r in self.rows)),
            "identical_to_uninterrupted": self.identical_to_uninterrupted,
            "differences": self.differences,
            "killed_after_turns": self.killed_after_turns,
            "restore_seconds": round(self.restore_seconds, 4),
            "per_rollout": [r.__dict__ for r in self.rows],
        }


def default_demo_config(journal: str | None) -> WorkloadConfig:
    example = Path(__file__).resolve().parent.parent / "examples" / "demo.yaml"
    base = WorkloadConfig.load(example) if example.exists() else WorkloadConfig(allow_early_submit=False, turn_delay_ms=40)
    if journal is None:
        journal = str(Path("runs") / f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    return base.model_copy(update={"journal": journal})


def crash_midway(config: WorkloadConfig, kill_after: int) -> int:
    """Run the workload in a child process and SIGKILL it once ``kill_after`` turns are durable."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(config.model_dump(), f)
        config_path = f.name
    child = subprocess.Popen(
        [sys.executable, "-m", "replay.cli", "run", config_path, "--progress-lines"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    committed = 0
    try:
        for line in child.stdout:
            if line.startswith(PROGRESS_LINE):
                committed += 1
                if committed >= kill_after:
                    child.send_signal(signal.SIGKILL)
                    break
        child.wait(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
        os.unlink(config_path)
    if child.returncode != -signal.SIGKILL:
        raise RuntimeError(
            f"the workload child exited with {child.returncode} before the crash point "
            f"({committed} turns committed): {child.stderr.read()[-2000:]}"
        )
    return committed


def journal_at_crash(config: WorkloadConfig) -> dict[str, tuple[int, bool]]:
    """Turns committed and finished flag per rollout, read from the journal."""
    specs = {s.rollout_id: s for s in workload_specs(config)}
    with open_journal(config.journal, writer=config.writer + "-inspect", read_only=True) as journal:
        plan = load_rollouts(journal)
    out = {}
    for rid, spec in specs.items():
        history = plan.rollouts.get(rid)
        if history is None:
            out[rid] = (0, False)
            continue
        state = restore_state(history, spec.group_id)
        out[rid] = (state.next_turn, state.finished)
    return out


def compare(reference: RunReport, resumed: RunReport) -> list[str]:
    differences = []
    for rid, expected in reference.outcomes().items():
        got = resumed.rollouts[rid].outcome
        if got != expected:
            keys = sorted(k for k in expected if got is None or got.get(k) != expected.get(k))
            differences.append(f"{rid}: {', '.join(keys)} differ")
    return differences


def run_demo(journal: str | None = None, *, seed: int | None = None, kill_after: int | None = None,
             say: Callable[[str], None] = lambda message: None) -> DemoReport:
    """``say`` receives one line per step (the CLI prints them to stderr as progress)."""
    config = default_demo_config(journal)
    total_turns = config.groups * config.siblings * config.max_turns
    rng = random.Random(seed)
    if not kill_after:
        # Rollouts run in waves of `concurrency`, roughly in step. Kill inside a wave, not at its
        # end, where every started rollout has just finished and a naive restart would lose nothing.
        wave = config.concurrency * config.max_turns
        waves = max(1, total_turns // wave)
        kill_after = rng.randrange(waves) * wave + rng.randint(config.concurrency, max(config.concurrency, wave - config.concurrency))
        kill_after = min(kill_after, total_turns - 1)  # a wave larger than the workload: still die before the end
    report = DemoReport("kafka" if is_kafka_url(config.journal) else "file", config.journal)
    say(f"1/4 uninterrupted reference run of {config.groups}x{config.siblings} rollouts, journaling off")
    reference = run_workload(config.model_copy(update={"journaling": False, "turn_delay_ms": 0.0}), resume=False)
    say(f"2/4 running the workload in a child process, journal {config.journal}; SIGKILL after {kill_after} committed turns")
    report.killed_after_turns = crash_midway(config, kill_after)
    say("3/4 reading what the journal holds at the crash")
    at_crash = journal_at_crash(config)
    say("4/4 resuming: attempt N+1 of every unfinished rollout")
    resumed = run_workload(config, resume=True)
    report.restore_seconds = resumed.restore_seconds
    for rid, (turns, finished) in sorted(at_crash.items()):
        r = resumed.rollouts[rid]
        report.rows.append(DemoRow(
            rollout_id=rid, turns_at_crash=turns, finished_at_crash=finished,
            naive_redo=0 if finished else turns,
            redone_here=turns if r.restarted_from_zero else 0,
            turns_after=r.outcome["turns"] if r.outcome else 0,
        ))
    report.differences = compare(reference, resumed)
    committed = sum(row.turns_at_crash for row in report.rows)
    if committed < report.killed_after_turns:  # the child reported more turns durable than the journal holds
        report.differences.append(f"{report.killed_after_turns - committed} turns reported durable are not in the journal")
    report.identical_to_uninterrupted = not report.differences
    return report


def format_table(report: DemoReport) -> str:
    head = f"{'rollout':<16} {'turns done at crash':>20} {'restart-from-1 redoes':>22} {'this restart redid':>19}"
    lines = [head, "-" * len(head)]
    for r in report.rows:
        state = " (finished)" if r.finished_at_crash else ""
        lines.append(f"{r.rollout_id:<16} {str(r.turns_at_crash) + state:>20} {r.naive_redo:>22} {r.redone_here:>19}")
    j = report.as_json()
    lines.append("-" * len(head))
    lines.append(f"{'total':<16} {j['turns_committed_at_crash']:>20} {j['naive_turns_thrown_away']:>22} {j['turns_redone']:>19}")
    verdict = "identical to an uninterrupted run" if report.identical_to_uninterrupted else \
        "DIFFERENT from an uninterrupted run: " + "; ".join(report.differences)
    lines.append("")
    lines.append(f"backend {report.backend}, journal {report.journal}; killed with SIGKILL after "
                 f"{report.killed_after_turns} committed turns; restore took {report.restore_seconds * 1000:.1f} ms")
    lines.append(f"turns thrown away: {j['turns_thrown_away']} (a restart from turn 1 would throw away "
                 f"{j['naive_turns_thrown_away']}); tokens, resource states and rewards: {verdict}")
    return "\n".join(lines)
