"""What a crash costs, and what journaling costs.

    python bench/recovery.py [--json] [--quick]

1. Work redone after a crash, per recovery strategy: this system (resume at
   the last committed turn), a naive restart (every unfinished rollout from
   turn 1) and periodic-snapshot-only recovery (back to the last snapshot).
   Measured on a real crashed workload: the turns and generated tokens that
   each strategy executes again.
2. Restore time as active rollouts grow (100, 1k, 10k) and as history grows
   10x with snapshots on (it must stay flat), on synthesized file journals.
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

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import bootstrap_median_interval, median, percentile, turn_events  # noqa: E402
from journal.events import AttemptStarted, Header  # noqa: E402
from journal.file_backend import FileBackend  # noqa: E402
from journal.journal import Journal  # noqa: E402
from journal.open import open_journal  # noqa: E402
from journal.restore import load_rollouts  # noqa: E402
from journal.snapshots import SnapshotDraft  # noqa: E402
from participants.config import WorkloadConfig  # noqa: E402
from participants.rollout_state import RolloutState, restore_state  # noqa: E402
from participants.runner import Runner, workload_specs  # noqa: E402
from participants.workload import build_backend, open_workload_journal, run_workload  # noqa: E402


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- 1. work redone ------------------------------------------------------------
def redone_work(tmp: Path, groups: int, siblings: int, turns: int, snapshot_every: int, seed: int) -> dict:
    config = WorkloadConfig(name="redo", groups=groups, siblings=siblings, max_turns=turns, seed=seed,
                            allow_early_submit=False, journal=str(tmp / "redo"), snapshot_every_turns=snapshot_every)
    rng = random.Random(seed)
    crash = {s.rollout_id: rng.randint(0, turns) for s in workload_specs(config)}
    run_workload(config, resume=False, stop_after=crash)
    with open_journal(config.journal, read_only=True) as journal:
        plan = load_rollouts(journal)
    naive_turns = naive_tokens = snap_turns = snap_tokens = 0
    for spec in workload_specs(config):
        history = plan.rollouts[spec.rollout_id]
        state = restore_state(history, spec.group_id)
        if state.finished:
            continue
        snapshot = RolloutState.from_bytes(history.snapshot.state) if history.snapshot else RolloutState(spec.rollout_id, spec.group_id)
        naive_turns += state.next_turn
        naive_tokens += state.output_tokens
        snap_turns += state.next_turn - snapshot.next_turn
        snap_tokens += state.output_tokens - snapshot.output_tokens
    resumed = run_workload(config, resume=True)
    this_turns = this_tokens = 0
    for rid, row in resumed.rollouts.items():
        if row.restarted_from_zero:
            this_turns += row.turns_committed_before
    for rid, row in resumed.rollouts.items():
        needed = row.outcome["turns"] - row.turns_committed_before
        this_turns += max(0, row.turns_run_here - needed) if not row.restarted_from_zero else 0
    return {
        "crashed_rollouts": sum(1 for r in resumed.rollouts.values() if not r.reused_result),
        "turns_committed_at_crash": sum(r.turns_committed_before for r in resumed.rollouts.values()),
        "strategies": {
            "this_system": {"redone_turns": this_turns, "redone_tokens": this_tokens},
            "naive_restart": {"redone_turns": naive_turns, "redone_tokens": naive_tokens},
            "snapshot_only": {"redone_turns": snap_turns, "redone_tokens": snap_tokens,
                              "snapshot_every_turns": snapshot_every},
        },
    }


# -- 2. restore time -------------------------------------------------------------
def synthesize(root: Path, active: int, turns: int, snapshot_every: int, finished_before: int) -> None:
    """A file journal: ``finished_before`` acknowledged rollouts of past history, then
    ``active`` rollouts each ``turns`` turns in, snapshotted every ``snapshot_every`` turns.
    Rollouts of a cohort advance turn by turn together, as a running workload's do."""
    rng = np.random.default_rng(0)
    state_bytes = rng.bytes(4096)  # a realistic compressed rollout state

    def cohort(journal: Journal, ids: list[str], acknowledge: bool) -> None:
        futures = []
        for rid in ids:
            h = Header(rid, rid.rsplit("-", 1)[0], 1, 1, 0, 0, 0, "bench")
            futures.append(journal.append([AttemptStarted(h, 0, "topo", "new")],
                                          SnapshotDraft(h, "running", 0, state_bytes)))
        for turn in range(turns):
            for rid in ids:
                events = turn_events(rid, turn, 1 + 3 * turn, rng, prompt_delta=256, output=64)
                snap = None
                if (turn + 1) % snapshot_every == 0:
                    snap = SnapshotDraft(events[-1].header, "running", events[-1].header.seq, state_bytes)
                futures.append(journal.append(events, snap))
            if len(futures) > 20000:
                for f in futures:
                    f.result()
                futures.clear()
        if acknowledge:
            for rid in ids:
                h = Header(rid, rid.rsplit("-", 1)[0], 1, 1, turns, 1 + 3 * turns, 0, "bench")
                futures.append(journal.acknowledge(h, "trainer"))
        for f in futures:
            f.result()

    with Journal(FileBackend(root, fsync=False), linger_ms=5) as journal:
        for first in range(0, finished_before, 1000):  # past cohorts, one after another
            cohort(journal, [f"past-{i}" for i in range(first, min(finished_before, first + 1000))], True)
        cohort(journal, [f"live-{i}" for i in range(active)], False)


def restore_seconds(root: Path, repeats: int = 3) -> tuple[float, int]:
    times, replayed = [], 0
    for _ in range(repeats):
        with Journal(FileBackend(root, read_only=True)) as journal:
            started = time.perf_counter()
            plan = load_rollouts(journal)
            times.append(time.perf_counter() - started)
            replayed = plan.events_replayed
    return median(times), replayed


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
        config = WorkloadConfig(name=name, groups=groups, siblings=siblings, max_turns=turns,
                                allow_early_submit=False, journal=str(journal_dir), journaling=journaling)
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
        log(f"  throughput round {round_ + 1}/{rounds}: on {result[True][0]:.1f} turns/s, "
            f"off {result[False][0]:.1f} turns/s")
    overheads = [1 - on[0] / off[0] for on, off in pairs]
    low, high = bootstrap_median_interval(overheads)
    return {
        "turns_per_s_journal_on": round(median([on[0] for on, _ in pairs]), 1),
        "turns_per_s_journal_off": round(median([off[0] for _, off in pairs]), 1),
        "journal_overhead": round(median(overheads), 4),
        "journal_overhead_90ci": [round(low, 4), round(high, 4)],
        "journal_cpu_overhead": round(median([on[1] / off[1] for on, off in pairs]) - 1, 4),
        "throughput_rounds": rounds, "throughput_turns_per_run": total,
    }


# -- 4. coordinated pause ----------------------------------------------------------
def coordinated_pauses(tmp: Path, groups: int, siblings: int, turns: int) -> dict:
    config = WorkloadConfig(name="coord", groups=groups, siblings=siblings, max_turns=turns, environment="counter",
                            allow_early_submit=False, journal=str(tmp / "coord"), checkpoint_mode="coordinated",
                            coordinated_every_s=0.05, turn_delay_ms=5.0)
    backend = build_backend(config)
    with open_workload_journal(config) as journal:
        runner = Runner(config, journal, backend, backend.tokenizer)
        asyncio.run(runner.run(resume=False))
        pauses = [c.pause_ms for c in runner.checkpointer.history]
        skipped = sum(len(c.skipped) for c in runner.checkpointer.history)
    return {"coordinated_checkpoints": len(pauses), "coordinated_pause_p50_ms": round(percentile(pauses, 50), 2),
            "coordinated_pause_p99_ms": round(percentile(pauses, 99), 2), "coordinated_rollouts_skipped": skipped}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="smaller sizes (1k rollouts at most), for a smoke run")
    parser.add_argument("--rounds", type=int, default=0,
                        help="journal-on/off throughput rounds (default 24; each is two runs of 256 turns)")
    args = parser.parse_args(argv)
    sizes = [100, 1000] if args.quick else [100, 1000, 10000]
    report: dict = {}
    with tempfile.TemporaryDirectory(prefix="rj-bench-recovery-") as d:
        tmp = Path(d)
        log("work redone after a crash ...")
        report.update(redone_work(tmp, groups=8, siblings=4, turns=8, snapshot_every=4, seed=11))
        log("restore time vs active rollouts ...")
        by_active = {}
        for n in sizes:
            root = tmp / f"active-{n}"
            synthesize(root, active=n, turns=3, snapshot_every=2, finished_before=0)
            seconds, replayed = restore_seconds(root)
            by_active[str(n)] = {"restore_s": round(seconds, 4), "events_replayed": replayed}
            log(f"  {n} active rollouts: restore {seconds * 1000:.1f} ms ({replayed} events replayed)")
        report["restore_time_by_active_rollouts"] = by_active
        log("restore time vs history (snapshots on) ...")
        active = 200 if args.quick else 1000
        base, big = tmp / "hist-1x", tmp / "hist-10x"
        synthesize(base, active=active, turns=5, snapshot_every=2, finished_before=active // 2)
        synthesize(big, active=active, turns=41, snapshot_every=2, finished_before=5 * active)
        (t1, r1), (t10, r10) = restore_seconds(base), restore_seconds(big)
        sizes_mb = [sum(p.stat().st_size for p in (root / "log").glob("*.seg")) / 1e6 for root in (base, big)]
        report["restore_time_history"] = {"active_rollouts": active, "journal_mb_1x": round(sizes_mb[0], 1),
                                          "journal_mb_10x": round(sizes_mb[1], 1), "restore_s_1x": round(t1, 4),
                                          "restore_s_10x": round(t10, 4), "events_replayed_1x": r1,
                                          "events_replayed_10x": r10}
        report["restore_time_ratio_10x_history"] = round(t10 / t1, 3)
        log(f"  history x{sizes_mb[1] / sizes_mb[0]:.1f} bytes: restore {t1 * 1000:.1f} ms -> {t10 * 1000:.1f} ms")
        log("rollout throughput, journaling on vs off ...")
        report.update(throughput(tmp, rounds=args.rounds or (2 if args.quick else 24), groups=8, siblings=4, turns=8))
        log("coordinated-mode checkpoint pauses ...")
        report.update(coordinated_pauses(tmp, groups=4, siblings=4, turns=12))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        s = report["strategies"]
        print(f"redone after a crash: this system {s['this_system']['redone_turns']} turns / "
              f"{s['this_system']['redone_tokens']} tokens; naive restart {s['naive_restart']['redone_turns']} / "
              f"{s['naive_restart']['redone_tokens']}; snapshot-only {s['snapshot_only']['redone_turns']} / "
              f"{s['snapshot_only']['redone_tokens']}")
        print(f"restore time ratio at 10x history: {report['restore_time_ratio_10x_history']}; "
              f"journal overhead {report['journal_overhead']:.1%} (90% interval "
              f"{report['journal_overhead_90ci'][0]:.1%} to {report['journal_overhead_90ci'][1]:.1%}); coordinated pause p50 "
              f"{report['coordinated_pause_p50_ms']} ms, p99 {report['coordinated_pause_p99_ms']} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
