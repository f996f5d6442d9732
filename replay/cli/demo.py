"""The newcomer's demo: crash a workload with SIGKILL mid-run, resume it, and
show that no finished turn was thrown away and the results are identical to an
uninterrupted run. What the restart redid is read from the journal
(:mod:`rollout_journal.replay.redone`), and the restore's time is shown phase by phase."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rollout_journal.journal.deadlines import Deadline
from rollout_journal.journal.open import is_kafka_url
from rollout_journal.participants.workload.config import WorkloadConfig
from rollout_journal.participants.workload.run import run_workload
from rollout_journal.participants.workload.runner import RestoreTiming, RunReport
from rollout_journal.replay.cli.crash import WorkloadChildError, crash_midway
from rollout_journal.replay.redone import AtCrash, workload_at_crash, workload_redone


@dataclass
class DemoRow:
    rollout_id: str
    turns_at_crash: int
    finished_at_crash: bool
    naive_redo: int  # a restart from turn 1 throws away every turn of an unfinished rollout
    redone_here: int  # committed turns this restart executed again, as the journal shows them
    redone_tokens_here: int  # output tokens of the model calls of those turns
    turns_after: int


@dataclass
class DemoReport:
    backend: str
    journal: str
    rows: list[DemoRow] = field(default_factory=list)
    identical_to_uninterrupted: bool = False
    differences: list[str] = field(default_factory=list)
    killed_after_turns: int = 0
    restore: RestoreTiming = field(default_factory=RestoreTiming)

    def as_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "journal": self.journal,
            "rollouts": len(self.rows),
            "turns_committed_at_crash": sum(r.turns_at_crash for r in self.rows),
            "turns_redone": sum(r.redone_here for r in self.rows),
            "tokens_redone": sum(r.redone_tokens_here for r in self.rows),
            "turns_thrown_away": sum(r.redone_here for r in self.rows),
            "naive_turns_thrown_away": sum(r.naive_redo for r in self.rows),
            "turns_lost": max(0, self.killed_after_turns - sum(r.turns_at_crash for r in self.rows)),
            "identical_to_uninterrupted": self.identical_to_uninterrupted,
            "differences": self.differences,
            "killed_after_turns": self.killed_after_turns,
            "restore_seconds": round(self.restore.total_s, 4),
            "restore_ms": self.restore.as_ms(),
            "per_rollout": [asdict(r) for r in self.rows],
        }


# examples/demo.yaml, for an installed copy that has no examples/ beside it (tests/replay/test_examples.py
# keeps the two equal).
BUILT_IN_DEMO = {
    "name": "demo",
    "groups": 4,
    "siblings": 3,
    "max_turns": 6,
    "environment": "workplace",
    "seed": 7,
    "allow_early_submit": False,
    "turn_delay_ms": 40,
    "snapshot_every_turns": 2,
    "concurrency": 5,
    "journal": "runs/journal",
    "model": {"temperature": 1.0, "max_tokens": 48},
}
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "demo.yaml"  # the repository's, beside the packages


def default_demo_config(journal: str | None) -> WorkloadConfig:
    base = WorkloadConfig.load(EXAMPLE) if EXAMPLE.exists() else WorkloadConfig.model_validate(BUILT_IN_DEMO)
    if journal is None:
        journal = str(Path("runs") / f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    return base.model_copy(update={"journal": journal})


def compare(reference: RunReport, resumed: RunReport) -> list[str]:
    differences = []
    for rid, expected in reference.outcomes().items():
        got = resumed.rollouts[rid].outcome
        if got == expected:
            continue
        if expected is None:  # unfinished in the reference run: there are no keys to compare
            differences.append(f"{rid}: unfinished in the uninterrupted run, finished after the crash")
            continue
        keys = sorted(k for k in expected if got is None or got.get(k) != expected.get(k))
        differences.append(f"{rid}: {', '.join(keys)} differ")
    return differences


def run_demo(
    journal: str | None = None,
    *,
    seed: int | None = None,
    kill_after: int | None = None,
    config: WorkloadConfig | None = None,
    say: Callable[[str], None] = lambda message: None,
) -> DemoReport:
    """Crash ``config`` (default: examples/demo.yaml) and resume it. ``journal`` overrides its
    journal; ``say`` receives one line per step (the CLI prints them to stderr as progress)."""
    if config is None:
        config = default_demo_config(journal)
    elif journal is not None:
        config = config.model_copy(update={"journal": journal})
    total_turns = config.groups * config.siblings * config.max_turns
    rng = random.Random(seed)
    if not kill_after:
        # Rollouts run in waves of `concurrency`, roughly in step. Kill inside a wave, not at its
        # end, where every started rollout has just finished and a naive restart would lose nothing.
        wave = config.concurrency * config.max_turns
        waves = max(1, total_turns // wave)
        kill_after = rng.randrange(waves) * wave + rng.randint(
            config.concurrency, max(config.concurrency, wave - config.concurrency)
        )
        kill_after = min(kill_after, total_turns - 1)  # a wave larger than the workload: still die before the end
    report = DemoReport("kafka" if is_kafka_url(config.journal) else "file", config.journal)
    say(f"1/4 uninterrupted reference run of {config.groups}x{config.siblings} rollouts, journaling off")
    reference = run_workload(config.model_copy(update={"journaling": False, "turn_delay_ms": 0.0}), resume=False)
    say(
        f"2/4 running the workload in a child process, journal {config.journal}; SIGKILL after {kill_after} committed turns"
    )
    killed_after = crash_midway(config, kill_after)
    if killed_after is None:
        raise WorkloadChildError(
            f"the workload child finished all {total_turns} turns before the crash point "
            f"({kill_after} turns); choose a smaller --kill-after"
        )
    report.killed_after_turns = killed_after
    say("3/4 reading what the journal holds at the crash")
    at_crash = _at_crash(config, killed_after)
    say("4/4 resuming: attempt N+1 of every unfinished rollout")
    resumed = run_workload(config, resume=True)
    report.restore = resumed.restore
    redone = workload_redone(config, at_crash)
    for rid, before in sorted(at_crash.items()):
        outcome = resumed.rollouts[rid].outcome
        report.rows.append(
            DemoRow(
                rollout_id=rid,
                turns_at_crash=before.turns,
                finished_at_crash=before.finished,
                naive_redo=0 if before.finished else before.turns,
                redone_here=redone[rid].turns,
                redone_tokens_here=redone[rid].tokens,
                turns_after=outcome["turns"] if outcome else 0,
            )
        )
    report.differences = compare(reference, resumed)
    committed = sum(row.turns_at_crash for row in report.rows)
    if committed < report.killed_after_turns:  # the child reported more turns durable than the journal holds
        report.differences.append(
            f"{report.killed_after_turns - committed} turns reported durable are not in the journal"
        )
    report.identical_to_uninterrupted = not report.differences
    return report


def _at_crash(config: WorkloadConfig, reported: int, patience_s: float = 10.0) -> dict[str, AtCrash]:
    """What the journal holds at the crash, read again (``patience_s`` at most) until it holds the
    ``reported`` turns the child said were durable. On Kafka, a commit returns before the broker
    has written its transaction's markers to the partitions, and a read-committed reader sees the
    transaction only after that: a reader opened at once could report turns lost that are not."""
    deadline = Deadline(patience_s)
    while True:
        at_crash = workload_at_crash(config)
        if sum(a.turns for a in at_crash.values()) >= reported or deadline.passed():
            return at_crash
        deadline.sleep(0.2)


def format_table(report: DemoReport) -> str:
    head = f"{'rollout':<16} {'turns done at crash':>20} {'restart-from-1 redoes':>22} {'this restart redid':>19}"
    lines = [head, "-" * len(head)]
    for r in report.rows:
        state = " (finished)" if r.finished_at_crash else ""
        lines.append(f"{r.rollout_id:<16} {str(r.turns_at_crash) + state:>20} {r.naive_redo:>22} {r.redone_here:>19}")
    j = report.as_json()
    lines.append("-" * len(head))
    lines.append(
        f"{'total':<16} {j['turns_committed_at_crash']:>20} {j['naive_turns_thrown_away']:>22} {j['turns_redone']:>19}"
    )
    verdict = (
        "identical to an uninterrupted run"
        if report.identical_to_uninterrupted
        else "DIFFERENT from an uninterrupted run: " + "; ".join(report.differences)
    )
    ms = j["restore_ms"]
    lines.append("")
    committed = j["turns_committed_at_crash"]
    together = (
        ""
        if committed == report.killed_after_turns
        else f" (the kill was due once {report.killed_after_turns} were; turns made durable in the same group"
        " commit as that one count too)"
    )
    lines.append(
        f"backend {report.backend}, journal {report.journal}; killed with SIGKILL with {committed} turns "
        f"committed{together}"
    )
    lines.append(
        f"restore took {ms['total']:.1f} ms: reading the journal {ms['read']:.1f}, folding events "
        f"{ms['fold']:.1f}, rebuilding environments {ms['rebuild']:.1f}, writing the fences {ms['fence']:.1f}"
    )
    lines.append(
        f"turns thrown away (redone after the restart, as the journal shows): {j['turns_thrown_away']} "
        f"({j['tokens_redone']} tokens); a restart from turn 1 would throw away {j['naive_turns_thrown_away']}"
    )
    lines.append(f"tokens, resource states and rewards: {verdict}")
    return "\n".join(lines)
