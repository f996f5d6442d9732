"""What a crash costs, and what journaling costs.

    python bench/recovery.py [--json] [--quick] [--trials N] [--rounds N]

1. Work redone after a crash, per recovery strategy: this system (resume at
   the last committed turn), a naive restart (every unfinished rollout from
   turn 1) and periodic-snapshot-only recovery (back to the last snapshot).
   Each trial runs a workload in a child process and SIGKILLs it at a random
   moment, resumes it, and reads every figure from the journal
   (``rollout_journal.replay.redone``): what was committed at the crash, and which committed
   turns and tokens the restart journaled again. Environments of every
   recovery kind take part (event-sourced, exportable, restart-only).
2. Restore time, phase by phase: reading the journal, folding the events into
   each rollout, rebuilding environments, writing the fences. On real crashed
   workloads per environment kind, then on synthesized file journals as active
   rollouts grow (100, 1k, 10k), and with snapshots on as history grows 10x (it
   must stay flat) and, apart from it, as each active rollout's state grows 8x
   (41 turns in instead of 5: a state to decode is that much larger, whatever the
   history); synthesized rollouts have no environment to rebuild.
3. Rollout throughput with journaling on vs off (the same rollouts, alternating
   rounds, median of the per-round ratios with a bootstrap 90% interval):
   ``journal_overhead = 1 - on/off``.
4. Coordinated-mode checkpoint pause, p50/p99.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import bootstrap_median_interval, median, pauses_taken, percentile, turn_events  # noqa: E402
from rollout_journal.journal.events import AttemptStarted, Header, RolloutAcknowledged  # noqa: E402
from rollout_journal.journal.file.backend import FileBackend  # noqa: E402
from rollout_journal.journal.journal import Journal  # noqa: E402
from rollout_journal.journal.restore import load_rollouts  # noqa: E402
from rollout_journal.journal.snapshots import SnapshotDraft  # noqa: E402
from rollout_journal.participants.rollout.state import RolloutState, restore_state  # noqa: E402
from rollout_journal.participants.workload.config import WorkloadConfig  # noqa: E402
from rollout_journal.participants.workload.run import build_backend, open_workload_journal, run_workload  # noqa: E402
from rollout_journal.participants.workload.runner import Runner  # noqa: E402
from rollout_journal.participants.workload.specs import workload_specs  # noqa: E402
from rollout_journal.replay.cli.crash import crash_midway  # noqa: E402
from rollout_journal.replay.redone import workload_at_crash, workload_redone  # noqa: E402

STRATEGIES = ("this_system", "naive_restart", "snapshot_only")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- 1. work redone ------------------------------------------------------------
def crash_trial(config: WorkloadConfig, kill_after: int, extra_delay_s: float) -> dict | None:
    """Run ``config`` in a child, SIGKILL it once ``kill_after`` turns are durable (plus
    ``extra_delay_s``), resume it here, and read from the journal what each strategy
    executes again. None when the child finished the workload before the kill.

    Per rollout unfinished at the crash: this system's figure is what the restart's
    attempts journaled at already-committed turn indices; a naive restart redoes every
    committed turn; snapshot-only recovery redoes the turns after the rollout's newest
    snapshot, or all of them where the journal shows the environment had to start over
    (a restart-only resource: no snapshot holds its state, whatever the strategy)."""
    if crash_midway(config, kill_after, extra_delay_s=extra_delay_s) is None:
        return None
    at_crash = workload_at_crash(config)
    resumed = run_workload(config, resume=True)
    redone = workload_redone(config, at_crash)
    environment = {s.rollout_id: s.environment for s in workload_specs(config)}
    rollouts = []
    for rid, before in sorted(at_crash.items()):
        after = redone[rid]
        unfinished = not before.finished
        since_snapshot = (
            (before.turns, before.output_tokens)
            if after.restarted
            else (before.turns - before.snapshot_turns, before.output_tokens - before.snapshot_tokens)
        )
        rollouts.append(
            {
                "rollout_id": rid,
                "environment": environment[rid],
                "turns_at_crash": before.turns,
                "tokens_at_crash": before.output_tokens,
                "finished_at_crash": before.finished,
                "restarted": after.restarted,
                "this_system": [after.turns, after.tokens],
                "naive_restart": [before.turns, before.output_tokens] if unfinished else [0, 0],
                "snapshot_only": list(since_snapshot) if unfinished else [0, 0],
            }
        )
    return {
        "kill_after_turns": kill_after,
        "extra_delay_ms": round(extra_delay_s * 1000, 1),
        "turns_committed_at_crash": sum(r["turns_at_crash"] for r in rollouts),
        "unfinished_rollouts": sum(not r["finished_at_crash"] for r in rollouts),
        "restore_ms": resumed.restore.as_ms(),
        "events_replayed": resumed.events_replayed,
        "rollouts": rollouts,
    }


def strategy_totals(rollouts: list[dict]) -> dict:
    """Redone turns and tokens per strategy, summed over ``rollouts`` (rows of :func:`crash_trial`)."""
    return {
        name: {"redone_turns": sum(r[name][0] for r in rollouts), "redone_tokens": sum(r[name][1] for r in rollouts)}
        for name in STRATEGIES
    }


def redo_config(
    tmp: Path,
    name: str,
    *,
    groups: int,
    siblings: int,
    turns: int,
    environment: str,
    concurrency: int,
    snapshot_every: int = 4,
    seed: int = 11,
) -> WorkloadConfig:
    return WorkloadConfig(
        name=name,
        groups=groups,
        siblings=siblings,
        max_turns=turns,
        seed=seed,
        environment=environment,
        allow_early_submit=False,
        journal=str(tmp / name),
        snapshot_every_turns=snapshot_every,
        concurrency=concurrency,
    )


def redone_work(
    tmp: Path,
    groups: int,
    siblings: int,
    turns: int,
    snapshot_every: int,
    seed: int,
    trials: int,
    environment: str = "workplace,counter,sandbox",
    concurrency: int = 12,
) -> dict:
    """``trials`` crashes of the same workload at random moments: a random number of durable
    turns, then a random delay of up to 20 ms (the kill lands in whatever was in flight)."""
    rng = random.Random(seed)
    total = groups * siblings * turns
    done: list[dict] = []
    while len(done) < trials:
        config = redo_config(
            tmp,
            f"redo{len(done)}-{rng.randrange(10**6)}",
            groups=groups,
            siblings=siblings,
            turns=turns,
            environment=environment,
            concurrency=concurrency,
            snapshot_every=snapshot_every,
            seed=seed,
        )
        kill_after, delay = rng.randint(1, total - 1), rng.uniform(0.0, 0.02)
        trial = crash_trial(config, kill_after, delay)
        if trial is None:
            log(f"  the child finished before its kill point ({kill_after} turns); drawing another")
            continue
        done.append(trial)
        t = strategy_totals(trial["rollouts"])
        log(
            f"  trial {len(done)}/{trials}: killed after {kill_after} turns + {delay * 1000:.1f} ms; redone turns "
            + ", ".join(f"{name} {t[name]['redone_turns']}" for name in STRATEGIES)
            + f"; restore {trial['restore_ms']['total']} ms"
        )
    rows = [r for trial in done for r in trial["rollouts"]]
    return {
        "redo_workload": {
            "groups": groups,
            "siblings": siblings,
            "turns": turns,
            "environment": environment,
            "concurrency": concurrency,
            "snapshot_every_turns": snapshot_every,
            "trials": trials,
        },
        "crashed_rollouts": sum(t["unfinished_rollouts"] for t in done),
        "turns_committed_at_crash": sum(t["turns_committed_at_crash"] for t in done),
        "strategies": strategy_totals(rows),
        "strategies_by_environment": {
            env: strategy_totals([r for r in rows if r["environment"] == env])
            for env in dict.fromkeys(r["environment"] for r in rows)
        },
        "redo_trials": [
            {k: v for k, v in t.items() if k != "rollouts"} | {"strategies": strategy_totals(t["rollouts"])}
            for t in done
        ],
    }


# -- 2. restore time -------------------------------------------------------------
def crashed_restore(tmp: Path, environment: str, groups: int, siblings: int, turns: int) -> dict:
    """Restore phases of a real crashed workload on one environment kind: every rollout started
    (concurrency covers them all), killed once about half the turns are durable."""
    config = redo_config(
        tmp,
        f"restore-{environment}",
        groups=groups,
        siblings=siblings,
        turns=turns,
        environment=environment,
        concurrency=groups * siblings,
    )
    trial = crash_trial(config, kill_after=groups * siblings * turns // 2, extra_delay_s=0.0)
    if trial is None:
        raise RuntimeError(f"restore-{environment}: the child finished before the kill")
    return {
        "rollouts": groups * siblings,
        "unfinished_at_crash": trial["unfinished_rollouts"],
        "events_replayed": trial["events_replayed"],
        "restore_ms": trial["restore_ms"],
    }


def synthesize(root: Path, active: int, turns: int, snapshot_every: int, finished_before: int) -> None:
    """A file journal: ``finished_before`` acknowledged rollouts of past history, then
    ``active`` rollouts each ``turns`` turns in, snapshotted every ``snapshot_every`` turns.
    Rollouts of a cohort advance turn by turn together, as a running workload's do. Each
    snapshot holds the rollout state that folding its events gave (``RolloutState.apply``, as
    the live path does), so restore folds the events after it onto a real state."""
    rng = np.random.default_rng(0)

    def cohort(journal: Journal, ids: list[str], acknowledge: bool) -> None:
        futures = []
        states: dict[str, RolloutState] = {}
        for rid in ids:
            h = Header(rid, rid.rsplit("-", 1)[0], 1, 1, 0, 0, 0, "bench")
            start = AttemptStarted(h, 0, "topo", "new")
            state = states[rid] = RolloutState(rid, rid.rsplit("-", 1)[0])
            state.apply(start)
            futures.append(journal.append([start], SnapshotDraft(h, "running", 0, state.to_bytes())))
        for turn in range(turns):
            for rid in ids:
                state = states[rid]
                events = turn_events(
                    rid, turn, 1 + 3 * turn, rng, prompt_delta=256, output=64, prefix_len=len(state.head_tokens)
                )
                for event in events:
                    state.apply(event)
                snap = None
                if (turn + 1) % snapshot_every == 0:
                    covers = events[-1].header.seq
                    snap = SnapshotDraft(events[-1].header, "running", covers, state.to_bytes())
                futures.append(journal.append(events, snap))
            if len(futures) > 20000:
                for f in futures:
                    f.result()
                futures.clear()
        if acknowledge:
            for rid in ids:
                h = Header(rid, rid.rsplit("-", 1)[0], 1, 1, turns, 1 + 3 * turns, 0, "bench")
                futures.append(journal.acknowledge(RolloutAcknowledged(h, "trainer")))
        for f in futures:
            f.result()

    with Journal(FileBackend(root, fsync=False), linger_ms=5) as journal:
        for first in range(0, finished_before, 1000):  # past cohorts, one after another
            cohort(journal, [f"past-{i}" for i in range(first, min(finished_before, first + 1000))], True)
        cohort(journal, [f"live-{i}" for i in range(active)], False)


def restore_phases(root: Path, repeats: int = 3) -> dict:
    """Read and fold a synthesized journal as the runner does (``load_rollouts``, then
    ``restore_state`` per rollout); medians over ``repeats`` fresh opens, in seconds."""
    reads, folds, totals, replayed, turns = [], [], [], 0, []
    for _ in range(repeats):
        with Journal(FileBackend(root, read_only=True)) as journal:
            started = time.perf_counter()
            plan = load_rollouts(journal)
            read = time.perf_counter() - started
            folding = time.perf_counter()
            turns = [restore_state(history).next_turn for history in plan.rollouts.values()]
            fold = time.perf_counter() - folding
        reads.append(read)
        folds.append(fold)
        totals.append(read + fold)
        replayed = plan.events_replayed
    return {
        "read_s": median(reads),
        "fold_s": median(folds),
        "restore_s": median(totals),
        "events_replayed": replayed,
        "rollouts": len(turns),
        "turns_folded": sum(turns),
    }


# -- 3. journaling overhead ------------------------------------------------------
def throughput(tmp: Path, rounds: int, groups: int, siblings: int, turns: int) -> dict:
    """Turns/s of the same workload with the file journal (durable writes on) and with
    journaling off, in one process with one model.

    Both runs of a round drive the *same* rollouts (same names, so the same seeds, tokens
    and tool calls); only the journal differs. Rounds alternate which goes first, and each
    run starts after a full garbage collection, so neither inherits the other's garbage.
    The overhead is taken round by round and the median kept, so drift of a shared
    machine's speed cancels; a bootstrap interval of that median says how far to trust it.
    Process CPU seconds (all threads) are compared the same way."""
    total = groups * siblings * turns

    def one(name: str, journaling: bool) -> tuple[float, float]:
        journal_dir = tmp / f"{name}-{'on' if journaling else 'off'}"
        config = WorkloadConfig(
            name=name,
            groups=groups,
            siblings=siblings,
            max_turns=turns,
            allow_early_submit=False,
            journal=str(journal_dir),
            journaling=journaling,
        )
        journal = open_workload_journal(config) if journaling else None
        try:
            runner = Runner(config, journal, backend, backend.tokenizer)
            gc.collect()
            wall, cpu = time.perf_counter(), time.process_time()
            report = asyncio.run(runner.run(resume=False))
            if journal is not None:
                journal.flush()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        finally:
            if journal is not None:
                journal.close()
        assert report.turns_run == total
        return total / wall, cpu

    backend = build_backend(WorkloadConfig())
    one("warmup", False)
    one("warmup", True)
    pairs = []
    for round_ in range(rounds):
        order = (False, True) if round_ % 2 == 0 else (True, False)
        result = {journaling: one(f"tp{round_}", journaling) for journaling in order}
        pairs.append((result[True], result[False]))
        log(
            f"  throughput round {round_ + 1}/{rounds}: on {result[True][0]:.1f} turns/s, "
            f"off {result[False][0]:.1f} turns/s"
        )
    overheads = [1 - on[0] / off[0] for on, off in pairs]
    low, high = bootstrap_median_interval(overheads)
    return {
        "turns_per_s_journal_on": round(median([on[0] for on, _ in pairs]), 1),
        "turns_per_s_journal_off": round(median([off[0] for _, off in pairs]), 1),
        "journal_overhead": round(median(overheads), 4),
        "journal_overhead_90ci": [round(low, 4), round(high, 4)],
        "journal_cpu_overhead": round(median([on[1] / off[1] for on, off in pairs]) - 1, 4),
        "throughput_rounds": rounds,
        "throughput_turns_per_run": total,
    }


# -- 4. coordinated pause ----------------------------------------------------------
def coordinated_pauses(tmp: Path, groups: int, siblings: int, turns: int) -> dict:
    config = WorkloadConfig(
        name="coord",
        groups=groups,
        siblings=siblings,
        max_turns=turns,
        environment="counter",
        allow_early_submit=False,
        journal=str(tmp / "coord"),
        checkpoint_mode="coordinated",
        coordinated_every_s=0.05,
        turn_delay_ms=5.0,
    )
    backend = build_backend(config)
    with open_workload_journal(config) as journal:
        runner = Runner(config, journal, backend, backend.tokenizer)
        asyncio.run(runner.run(resume=False))
        pauses, skipped = pauses_taken(runner)
    return {
        "coordinated_checkpoints": len(pauses),
        "coordinated_pause_p50_ms": round(percentile(pauses, 50), 2),
        "coordinated_pause_p99_ms": round(percentile(pauses, 99), 2),
        "coordinated_rollouts_skipped": skipped,
    }


SECTIONS = ("redo", "restore", "throughput", "pause")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="smaller sizes (1k rollouts at most), for a smoke run")
    parser.add_argument("--trials", type=int, default=0, help="SIGKILLed workloads for the work redone (default 6)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="journal-on/off throughput rounds (default 24; each is two runs of 256 turns)",
    )
    parser.add_argument(
        "--only",
        default=",".join(SECTIONS),
        help=f"comma-separated sections to run, of {', '.join(SECTIONS)} (default: all)",
    )
    args = parser.parse_args(argv)
    only = {name.strip() for name in args.only.split(",") if name.strip()}
    if not only or only - set(SECTIONS):
        parser.error(f"--only takes sections of {', '.join(SECTIONS)}; got {args.only!r}")
    sizes = [100, 1000] if args.quick else [100, 1000, 10000]
    report: dict = {}
    with tempfile.TemporaryDirectory(prefix="rj-bench-recovery-") as d:
        tmp = Path(d)
        if "redo" in only:
            log("work redone after a crash (SIGKILL at random moments) ...")
            report.update(
                redone_work(
                    tmp,
                    groups=9,
                    siblings=4,
                    turns=8,
                    snapshot_every=4,
                    seed=11,
                    trials=args.trials or (2 if args.quick else 6),
                )
            )
        if "restore" in only:
            restore_section(tmp, report, sizes, quick=args.quick)
        if "throughput" in only:
            log("rollout throughput, journaling on vs off ...")
            report.update(
                throughput(tmp, rounds=args.rounds or (2 if args.quick else 24), groups=8, siblings=4, turns=8)
            )
        if "pause" in only:
            log("coordinated-mode checkpoint pauses ...")
            report.update(coordinated_pauses(tmp, groups=4, siblings=4, turns=12))
    print(json.dumps(report, indent=2) if args.json else summary(report))
    return 0


def restore_section(tmp: Path, report: dict, sizes: list[int], *, quick: bool) -> None:
    log("restore phases of crashed workloads, per environment kind ...")
    groups = 4 if quick else 16
    by_environment = {}
    for environment in ("workplace", "counter", "sandbox"):
        by_environment[environment] = crashed_restore(tmp, environment, groups=groups, siblings=4, turns=4)
        log(f"  {environment}, {groups * 4} rollouts: restore {by_environment[environment]['restore_ms']} ms")
    report["restore_crashed_by_environment"] = by_environment
    log("restore time vs active rollouts (synthesized, read + fold) ...")
    by_active = {}
    for n in sizes:
        root = tmp / f"active-{n}"
        synthesize(root, active=n, turns=3, snapshot_every=2, finished_before=0)
        phases = restore_phases(root)
        by_active[str(n)] = {k: round(v, 4) if isinstance(v, float) else v for k, v in phases.items()}
        log(
            f"  {n} active rollouts: restore {phases['restore_s'] * 1000:.1f} ms (read {phases['read_s'] * 1000:.1f}, "
            f"fold {phases['fold_s'] * 1000:.1f}; {phases['events_replayed']} events replayed)"
        )
    report["restore_time_by_active_rollouts"] = by_active
    log("restore time vs history and vs state size (snapshots on) ...")
    report.update(growth_section(tmp, active=200 if quick else 1000, rounds=3 if quick else 5))


def growth_section(tmp: Path, active: int, rounds: int) -> dict:
    """Restore of ``active`` rollouts as the journal grows, three ways against one base journal
    (``active`` rollouts 5 turns in, ``active / 2`` acknowledged past rollouts of 5 turns):

    - history: the past grows until the journal is 10x the bytes (14x ``active`` past
      rollouts); the active rollouts stay 5 turns in. Restore reads snapshots and the log
      since them, so this is what must stay flat.
    - state: the active rollouts are 41 turns in (about 8x the tokens, 8x the mutations in
      each state); the past stays. Each state to decode is 8x larger, whatever the history.
    - both: 41 turns and 5x ``active`` past rollouts, the one figure this bench gave before.

    Rounds rotate which journal goes first; each ratio is the median of its per-round ratios,
    so a shared machine's drift (and a cold page cache) lands on all alike."""
    journals = {
        "base": (5, active // 2),
        "history": (5, 14 * active),
        "state": (41, active // 2),
        "both": (41, 5 * active),
    }
    roots = {name: tmp / f"growth-{name}" for name in journals}
    for name, (turns, past) in journals.items():
        synthesize(roots[name], active=active, turns=turns, snapshot_every=2, finished_before=past)
    sizes_mb = {name: sum(p.stat().st_size for p in (root / "log").glob("*.seg")) / 1e6 for name, root in roots.items()}
    runs: dict[str, list[dict]] = {name: [] for name in journals}
    ratios: dict[str, list[float]] = {name: [] for name in journals if name != "base"}
    names = list(journals)
    for round_ in range(rounds):
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        measured = {name: restore_phases(roots[name], repeats=1) for name in order}
        for name in ratios:
            ratios[name].append(measured[name]["restore_s"] / measured["base"]["restore_s"])
        for name, phases in measured.items():
            runs[name].append(phases)
    growth: dict[str, dict[str, Any]] = {}  # a JSON report: numbers, and the ratio per round
    for name, (turns, past) in journals.items():
        medians = {key: median([r[key] for r in runs[name]]) for key in ("read_s", "fold_s", "restore_s")}
        growth[name] = {
            "active_turns": turns,
            "past_rollouts": past,
            "journal_mb": round(sizes_mb[name], 3),
            "events_replayed": int(runs[name][0]["events_replayed"]),
            **{key: round(value, 4) for key, value in medians.items()},
        }
        if name in ratios:
            growth[name]["ratio_per_round"] = [round(r, 3) for r in ratios[name]]
            growth[name]["ratio"] = round(median(ratios[name]), 3)
            log(
                f"  {name}: journal {sizes_mb[name]:.0f} MB vs {sizes_mb['base']:.0f} MB; restore "
                f"{growth[name]['restore_s'] * 1000:.1f} ms vs {growth['base']['restore_s'] * 1000:.1f} ms "
                f"(ratio {growth[name]['ratio']:.2f})"
            )
    return {
        "restore_growth": {"active_rollouts": active, "rounds": rounds, "journals": growth},
        "restore_time_ratio_10x_history": growth["history"]["ratio"],
        "restore_time_ratio_8x_state": growth["state"]["ratio"],
        "restore_time_ratio_history_and_state": growth["both"]["ratio"],
    }


def summary(report: dict) -> str:
    lines = []
    if "strategies" in report:
        s = report["strategies"]
        lines.append(
            "redone after a crash (turns / tokens): "
            + "; ".join(f"{name} {s[name]['redone_turns']} / {s[name]['redone_tokens']}" for name in STRATEGIES)
        )
    if "restore_crashed_by_environment" in report:
        lines.append(
            "restore of a crashed workload, total ms: "
            + ", ".join(
                f"{env} {r['restore_ms']['total']} (rebuild {r['restore_ms']['rebuild']})"
                for env, r in report["restore_crashed_by_environment"].items()
            )
        )
        lines.append(
            f"restore time ratio at 10x history: {report['restore_time_ratio_10x_history']}; "
            f"at 8x state: {report['restore_time_ratio_8x_state']}; at both: "
            f"{report['restore_time_ratio_history_and_state']}"
        )
    if "journal_overhead" in report:
        lines.append(
            f"journal overhead {report['journal_overhead']:.1%} (90% interval "
            f"{report['journal_overhead_90ci'][0]:.1%} to {report['journal_overhead_90ci'][1]:.1%})"
        )
    if "coordinated_pause_p50_ms" in report:
        lines.append(
            f"coordinated pause p50 {report['coordinated_pause_p50_ms']} ms, "
            f"p99 {report['coordinated_pause_p99_ms']} ms"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
