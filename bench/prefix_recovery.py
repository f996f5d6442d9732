"""Tokens regenerated after a crash inside a long generation, and what journaling its progress costs.

    python bench/prefix_recovery.py [--json] [--crashes N] [--rounds N] [--tokens N] [--every N]
                                    [--backend torch|vllm] [--only crash,overhead] [--seed N]

1. Tokens regenerated after crashes in the middle of long generations. One rollout of two
   turns, each beginning with a greedy free-form (reasoning) call of up to ``--tokens`` tokens
   (the model stops the first after some 30 tokens; the second runs the full length), runs in
   a child process; the child is SIGKILLed at a random point of a call (seeded: a token
   position drawn uniformly over the calls, after the first progress mark and before the
   call's last token), then the workload is resumed here. Every crash point is used three
   times in the same run: with prefix recovery (``progress_every_tokens=--every``:
   ModelCallProgress journaled every that many tokens exactly), with the default marks (the
   same and the workload's time floor between marks: ``tokens_regenerated_default_marks``,
   what a user's run regenerates) and without it (``progress_every_tokens=0``: the call
   starts over).

   How far the killed call had got is not read from the journal, whose figure is what is
   judged: the child's backend writes, for every token it streams, the call's position to a
   side file (one line a token, written before the agent sees it), and the last line after
   the kill is the crash position. What the resume regenerated is read from the journal's
   lineage: the finished call's ``segments`` say which attempt generated which tokens, and
   the tokens the resumed attempt generated at positions the killed one had already reached
   are the ones regenerated. Goal: only the tokens after the last progress mark
   (``tokens_after_last_mark``); a progress mark still lingering in the group commit at the
   kill, or a resume that ignored the journaled prefix, shows up as more.

   The continued output is also compared with an uninterrupted run of the same workload,
   token for token and logprob for logprob (greedy): ``continued_equals_uninterrupted``.

   The crash runs mark every ``--every`` tokens exactly (``progress_min_interval_ms=0``),
   so that the marks' positions follow from the tokens.

2. Generation throughput with progress journaling on vs off: the same workload (several
   rollouts, each turn a long free-form call and the tool call, file journal, durable
   commits) in this process with one model, three variants taking turns in each round
   (the order rotating): off (``progress_every_tokens=0``), on (``--every`` and the
   workload's default time floor, ``progress_min_interval_ms``: no mark sooner than that
   after the call's last one) and exact (``--every``, no floor).
   ``progress_overhead = 1 - on/off`` of output tokens/s, the median of the per-round
   figures with a bootstrap 90% interval (goal <= 0.03); ``progress_overhead_every_token_mark``
   the same for exact. The process's CPU seconds per output token are compared the same
   way (``progress_cpu_overhead``): on a loaded machine they vary less than wall time.

The torch backend (the embedded tiny Llama on CPU) is the default; ``--backend vllm`` runs
both sections on vLLM in process (each crash child then starts its own engine: slower).
Progress goes to stderr; the report to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncGenerator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import bootstrap_median_interval, dump_stacks_on, median  # noqa: E402
from rollout_journal.journal.events import ModelCall, ModelCallProgress  # noqa: E402
from rollout_journal.journal.journal import ReadReport  # noqa: E402
from rollout_journal.journal.open import open_journal  # noqa: E402
from rollout_journal.participants.model.generation import GenerationBackend, GenerationRequest, TokenChunk  # noqa: E402
from rollout_journal.participants.workload.config import ModelConfig, WorkloadConfig  # noqa: E402
from rollout_journal.participants.workload.run import build_backend, open_workload_journal  # noqa: E402
from rollout_journal.participants.workload.runner import Runner, RunReport  # noqa: E402

SECTIONS = ("crash", "overhead")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- the workloads ------------------------------------------------------------------
# The workload's seed: its task makes the tiny model's greedy reasoning stop after some 30 tokens
# in turn 0 and run to the full --tokens in turn 1 (the long generation crashed in).
WORKLOAD_SEED = 3


def crash_config(
    journal: Path, backend: str, tokens: int, every: int, interval_ms: float | None = 0.0
) -> WorkloadConfig:
    """One rollout, two turns; each a greedy free-form call, then the tool call. By default a mark
    every ``every`` tokens exactly (no time floor), so where the marks fall follows from the
    tokens; ``interval_ms`` None keeps the workload's default floor."""
    floor = {} if interval_ms is None else {"progress_min_interval_ms": interval_ms}
    return WorkloadConfig(
        name="prefix",
        groups=1,
        siblings=1,
        max_turns=2,
        seed=WORKLOAD_SEED,
        environment="workplace",
        allow_early_submit=False,
        journal=str(journal),
        progress_every_tokens=every,
        **floor,
        model=ModelConfig(backend=backend, temperature=0.0, reasoning_tokens=tokens),
    )


def overhead_config(
    journal: Path, backend: str, tokens: int, every: int, rollouts: int, turns: int, interval_ms: float | None = None
) -> WorkloadConfig:
    """The throughput workload; ``interval_ms`` None keeps the workload's default time floor."""
    floor = {} if interval_ms is None else {"progress_min_interval_ms": interval_ms}
    return WorkloadConfig(
        name="overhead",
        groups=1,
        siblings=rollouts,
        max_turns=turns,
        seed=WORKLOAD_SEED,
        environment="workplace",
        allow_early_submit=False,
        journal=str(journal),
        progress_every_tokens=every,
        concurrency=rollouts,
        **floor,
        model=ModelConfig(backend=backend, temperature=0.0, reasoning_tokens=tokens),
    )


# The overhead section's variants: (progress_every_tokens is --every, time floor in ms; None: the default)
VARIANTS = {"off": (False, None), "on": (True, None), "exact": (True, 0.0)}


def run_here(config: WorkloadConfig, backend: GenerationBackend, *, resume: bool) -> RunReport:
    """Run (or resume) ``config`` in this process on an already built ``backend``."""

    async def drive(runner: Runner) -> RunReport:
        try:
            return await runner.run(resume=resume)
        finally:
            await backend.aclose()

    with open_workload_journal(config) as journal:
        return asyncio.run(drive(Runner(config, journal, backend, backend.tokenizer)))


def journal_events(config: WorkloadConfig) -> list:
    report = ReadReport()
    with open_journal(config.journal, writer="bench-reader", read_only=True) as journal:
        events = [item.event for item in journal.scan(report)]
    if report.errors:
        raise RuntimeError(f"journal {config.journal} does not read whole: {report.errors[:3]}")
    return events


def final_calls(events: list) -> dict[tuple[str, int, str], ModelCall]:
    """The journaled model calls by (rollout, turn, place in the turn), the last attempt's winning."""
    calls: dict[tuple[str, int, str], ModelCall] = {}
    for event in events:
        if isinstance(event, ModelCall):
            calls[(event.header.rollout_id, event.header.turn, event.call_id.rsplit("/", 1)[1])] = event
    return calls


# -- 1. the crash child --------------------------------------------------------------
class PositionLog:
    """A backend that writes, per streamed token of a free-form call, the call's position to a
    file: the ground truth of how far a killed call got, kept outside the journal. Streams one
    token a chunk (the agent journals progress at the same marks either way)."""

    def __init__(self, inner: GenerationBackend, path: Path) -> None:
        self.inner = inner
        self.out = path.open("a", buffering=1)
        self.tokenizer, self.policy_version = inner.tokenizer, inner.policy_version
        self.deterministic, self.resumes_constrained = inner.deterministic, inner.resumes_constrained
        self.logprob_mode = inner.logprob_mode

    def set_policy_version(self, version: str) -> None:
        self.inner.set_policy_version(version)
        self.policy_version = version

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[TokenChunk, None]:
        if request.constraint is not None:
            async for chunk in self.inner.stream(request):
                yield chunk
            return
        position = len(request.prefix_ids)
        async for chunk in self.inner.stream(dataclasses.replace(request, chunk_tokens=1)):
            position += len(chunk.ids)
            self.out.write(f"{request.request_id} {position}\n")
            yield chunk

    async def aclose(self) -> None:
        await self.inner.aclose()


def child_main(config_path: str, positions: str) -> int:
    """The workload child: run the config with its positions logged, until killed."""
    config = WorkloadConfig.model_validate_json(Path(config_path).read_text())
    run_here(config, PositionLog(build_backend(config), Path(positions)), resume=False)
    return 0


def last_position(path: Path) -> tuple[str, int]:
    """(call id, tokens generated) of the last complete line of a position log."""
    if not path.exists():
        return "", 0
    lines = [line for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")]
    if not lines:
        return "", 0
    call_id, position = lines[-1].split()
    return call_id, int(position)


def crash_at(config: WorkloadConfig, tmp: Path, turn: int, target: int, timeout_s: float) -> tuple[str, int]:
    """Run ``config`` in a child and SIGKILL it once turn ``turn``'s free-form call has streamed
    ``target`` tokens. Returns (call id, tokens the killed call had generated)."""
    config_path, positions = tmp / f"{Path(config.journal).name}.json", tmp / f"{Path(config.journal).name}.pos"
    config_path.write_text(config.model_dump_json())
    child = subprocess.Popen(
        [sys.executable, __file__, "--child", str(config_path), str(positions)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + timeout_s
    try:
        while child.poll() is None and time.monotonic() < deadline:
            call_id, position = last_position(positions)
            if call_id.endswith(f"/t{turn}/c0") and position >= target:
                child.send_signal(signal.SIGKILL)
                break
            time.sleep(0.002)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    if child.returncode != -signal.SIGKILL:
        raise RuntimeError(
            f"the workload child exited with {child.returncode} before its call reached token "
            f"{target} (--tokens too small, or the model stopped early?): "
            f"{(child.stderr.read() if child.stderr else '')[-2000:]}"
        )
    return last_position(positions)


def crash_trial(
    tmp: Path,
    config: WorkloadConfig,
    backend: GenerationBackend,
    turn: int,
    target: int,
    reference: dict,
    timeout_s: float,
) -> dict:
    """One crash at ``target`` tokens into turn ``turn``'s free-form call and its resume; every
    figure from the position log (how far the call got) and the journal (what the resume generated)."""
    call_id, at_crash = crash_at(config, tmp, turn, target, timeout_s)
    journaled = sum(
        len(e.output_ids) for e in journal_events(config) if isinstance(e, ModelCallProgress) and e.call_id == call_id
    )
    run_here(config, backend, resume=True)
    events = journal_events(config)
    calls = final_calls(events)
    rollout, turn = call_id.split("/a", 1)[0], int(call_id.rsplit("/t", 1)[1].split("/")[0])
    finished = calls[(rollout, turn, "c0")]
    killed_attempt = int(call_id.rsplit("/a", 1)[1].split("/")[0])
    # The lineage: the resumed call's tokens, attempt by attempt, in order.
    kept = 0
    for segment in finished.output_segments():
        if segment.attempt != killed_attempt:
            break
        kept += segment.tokens
    resumed_tokens = len(finished.output_ids) - kept
    regenerated = max(0, min(at_crash, len(finished.output_ids)) - kept)
    every = config.progress_every_tokens
    equal = all(
        calls.get(key) is not None
        and np.array_equal(calls[key].output_ids, ref.output_ids)
        and np.array_equal(calls[key].logprobs, ref.logprobs)
        for key, ref in reference.items()
    )
    return {
        "turn": turn,
        "target": target,
        "tokens_at_crash": at_crash,
        "journaled_at_crash": journaled,
        "prefix_kept": kept,
        "generated_by_resume": resumed_tokens,
        "regenerated": regenerated,
        "after_last_mark": at_crash - (at_crash // every) * every if every else at_crash,
        "call_tokens": len(finished.output_ids),
        "equals_uninterrupted": equal,
    }


def crash_section(tmp: Path, backend_name: str, crashes: int, tokens: int, every: int, seed: int) -> dict:
    backend = build_backend(crash_config(tmp / "x", backend_name, tokens, every))
    log(f"uninterrupted reference run (free-form calls of up to {tokens} tokens) ...")
    reference_config = crash_config(tmp / "reference", backend_name, tokens, every)
    started = time.perf_counter()
    run_here(reference_config, backend, resume=False)
    log(f"  {time.perf_counter() - started:.1f} s")
    reference = final_calls(journal_events(reference_config))
    # Crash points: a token position drawn uniformly over the free-form calls long enough to hold
    # a progress mark, anywhere after the first mark and before the call's last token.
    lengths = {key[1]: len(call.output_ids) for key, call in reference.items() if key[2] == "c0"}
    points = [(turn, position) for turn, n in sorted(lengths.items()) for position in range(every + 1, n)]
    if not points:
        raise SystemExit(f"no free-form call ran past {every + 1} tokens ({lengths}): raise --tokens or lower --every")
    rng = random.Random(seed)
    targets = [rng.choice(points) for _ in range(crashes)]
    timeout_s = 600.0
    # with_prefix: a mark every `every` tokens exactly, the mechanism judged; default_marks: the
    # workload's default time floor too, what a user's run regenerates; without_prefix: no marks
    modes = {"with_prefix": (every, 0.0), "default_marks": (every, None), "without_prefix": (0, 0.0)}
    trials: dict[str, list[dict]] = {mode: [] for mode in modes}
    for i, (turn, target) in enumerate(targets):
        for mode, (mode_every, interval_ms) in modes.items():
            config = crash_config(tmp / f"{mode}-{i}", backend_name, tokens, mode_every, interval_ms)
            trial = crash_trial(tmp, config, backend, turn, target, reference, timeout_s)
            trials[mode].append(trial)
            log(
                f"  crash {i + 1}/{crashes} {mode}: killed at token {trial['tokens_at_crash']} of turn {turn}'s "
                f"call (journaled {trial['journaled_at_crash']}), resume kept {trial['prefix_kept']}, "
                f"regenerated {trial['regenerated']}, equal to uninterrupted: {trial['equals_uninterrupted']}"
            )
    with_prefix, without = trials["with_prefix"], trials["without_prefix"]
    return {
        "crashes": crashes,
        "progress_every_tokens": every,
        "call_tokens": lengths,
        "tokens_at_crash": sum(t["tokens_at_crash"] for t in with_prefix),
        "tokens_at_crash_without_prefix": sum(t["tokens_at_crash"] for t in without),  # the kill lands a bit apart
        "tokens_journaled_at_crash": sum(t["journaled_at_crash"] for t in with_prefix),
        "tokens_regenerated_with_prefix": sum(t["regenerated"] for t in with_prefix),
        "tokens_regenerated_without_prefix": sum(t["regenerated"] for t in without),
        "tokens_regenerated_default_marks": sum(t["regenerated"] for t in trials["default_marks"]),
        "tokens_at_crash_default_marks": sum(t["tokens_at_crash"] for t in trials["default_marks"]),
        "tokens_after_last_mark": sum(t["after_last_mark"] for t in with_prefix),
        "only_tokens_after_last_mark": all(t["regenerated"] <= t["after_last_mark"] for t in with_prefix),
        "continued_equals_uninterrupted": all(t["equals_uninterrupted"] for ts in trials.values() for t in ts),
        "trials": trials,
    }


# -- 2. progress journaling overhead ---------------------------------------------------
def overhead_section(
    tmp: Path, backend_name: str, rounds: int, tokens: int, every: int, rollouts: int, turns: int
) -> dict:
    """Output tokens/s of the same rollouts with progress journaled (``on``: every ``every`` tokens
    and the workload's default time floor; ``exact``: every ``every`` tokens, no floor) and with it
    off; all with the turns journaled (file journal, durable commits). The three take turns in
    each round, the order rotating."""
    backend = build_backend(overhead_config(tmp / "x", backend_name, tokens, every, rollouts, turns))

    def one(name: str, variant: str) -> tuple[float, float, int]:
        """(output tokens/s, process CPU seconds per 1k output tokens, progress marks journaled)."""
        progress, interval_ms = VARIANTS[variant]
        config = overhead_config(
            tmp / f"{name}-{variant}", backend_name, tokens, every if progress else 0, rollouts, turns, interval_ms
        )
        gc.collect()
        wall, cpu = time.perf_counter(), time.process_time()
        report = run_here(config, backend, resume=False)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        generated = sum(r.tokens_run_here for r in report.rollouts.values())
        marks = sum(isinstance(e, ModelCallProgress) for e in journal_events(config)) if progress else 0
        return generated / wall, cpu / generated * 1000, marks

    names = list(VARIANTS)
    for variant in names:
        one("warmup", variant)
    runs: list[dict[str, tuple[float, float, int]]] = []
    for round_ in range(rounds):
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        runs.append({variant: one(f"r{round_}", variant) for variant in order})
        log(
            f"  overhead round {round_ + 1}/{rounds}: "
            + ", ".join(f"{v} {runs[-1][v][0]:.0f} tok/s ({runs[-1][v][1]:.2f} CPU s per 1k tokens)" for v in names)
        )
    report: dict = {
        "overhead_rounds": rounds,
        "overhead_workload": {
            "rollouts": rollouts,
            "turns": turns,
            "reasoning_tokens": tokens,
            "progress_every_tokens": every,
            "progress_min_interval_ms": WorkloadConfig.model_fields["progress_min_interval_ms"].default,
        },
        "tokens_per_s_progress_off": round(median([r["off"][0] for r in runs]), 1),
    }
    for variant, key in (("on", "progress_overhead"), ("exact", "progress_overhead_every_token_mark")):
        overheads = [1 - r[variant][0] / r["off"][0] for r in runs]
        cpu_overheads = [r[variant][1] / r["off"][1] - 1 for r in runs]
        low, high = bootstrap_median_interval(overheads)
        cpu_low, cpu_high = bootstrap_median_interval(cpu_overheads)
        report |= {
            key: round(median(overheads), 4),
            f"{key}_90ci": [round(low, 4), round(high, 4)],
            f"{key}_rounds": [round(o, 4) for o in overheads],
            f"{key.replace('overhead', 'cpu_overhead')}": round(median(cpu_overheads), 4),
            f"{key.replace('overhead', 'cpu_overhead')}_90ci": [round(cpu_low, 4), round(cpu_high, 4)],
            f"tokens_per_s_{variant}": round(median([r[variant][0] for r in runs]), 1),
            f"progress_marks_per_run_{variant}": runs[-1][variant][2],
        }
    return report


def summary(report: dict) -> str:
    lines = []
    if "crashes" in report:
        lines.append(
            f"{report['crashes']} crashes inside long generations "
            f"({report['tokens_at_crash']} tokens generated before the kills): regenerated "
            f"{report['tokens_regenerated_with_prefix']} with prefix recovery (every "
            f"{report['progress_every_tokens']}; {report['tokens_after_last_mark']} after the last marks), "
            f"{report['tokens_regenerated_without_prefix']} without, {report['tokens_regenerated_default_marks']} "
            f"with the default marks (a time floor too); continued output equal to the "
            f"uninterrupted one: {report['continued_equals_uninterrupted']}"
        )
    if "progress_overhead" in report:
        for key, what in (
            ("progress_overhead", "default time floor"),
            ("progress_overhead_every_token_mark", "a mark every --every tokens exactly"),
        ):
            low, high = report[f"{key}_90ci"]
            cpu = key.replace("overhead", "cpu_overhead")
            lines.append(
                f"progress journaling overhead on generation throughput ({what}): {report[key]:.1%} "
                f"(90% interval {low:.1%} to {high:.1%}); CPU per token {report[cpu]:+.1%} "
                f"(90% interval {report[cpu + '_90ci'][0]:.1%} to {report[cpu + '_90ci'][1]:.1%})"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--crashes", type=int, default=6, help="crash points, each used with and without prefix recovery (default 6)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=24,
        help="interleaved on/off throughput rounds (default 24: a "
        "round swings by 10-20 %% on a shared machine, and the goal is 3 %%)",
    )
    parser.add_argument("--tokens", type=int, default=384, help="tokens of the long free-form call (default 384)")
    parser.add_argument(
        "--every",
        type=int,
        default=32,
        help="progress_every_tokens with prefix recovery (default 32, the workload default)",
    )
    parser.add_argument("--rollouts", type=int, default=4, help="overhead section: rollouts in flight (default 4)")
    parser.add_argument("--turns", type=int, default=3, help="overhead section: turns per rollout (default 3)")
    parser.add_argument(
        "--backend",
        choices=("torch", "vllm"),
        default="torch",
        help="torch: the embedded tiny Llama on CPU (default); vllm: vLLM's engine in process",
    )
    parser.add_argument("--seed", type=int, default=7, help="seed of the crash points (default 7)")
    parser.add_argument("--only", default=",".join(SECTIONS), help="sections to run: crash,overhead")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # internal: the workload child
    args = parser.parse_args(argv)
    dump_stacks_on()  # SIGUSR1: its threads' and tasks' stacks (a hang's where)
    if args.child:
        return child_main(*args.child)
    sections = set(args.only.split(","))
    if not sections <= set(SECTIONS):
        parser.error(f"--only takes {','.join(SECTIONS)}, got {args.only!r}")
    if args.every < 1:
        parser.error("--every must be at least 1 (the comparison without prefix recovery is measured anyway)")
    report: dict = {"backend": args.backend, "seed": args.seed}
    with tempfile.TemporaryDirectory(prefix="rj-bench-prefix-") as tmp:
        if "crash" in sections:
            log(f"SIGKILLs inside long generations: {args.crashes} crash points, with and without prefix recovery")
            report |= crash_section(Path(tmp), args.backend, args.crashes, args.tokens, args.every, args.seed)
        if "overhead" in sections:
            log(f"progress journaling on vs off: {args.rounds} interleaved rounds")
            report |= overhead_section(
                Path(tmp), args.backend, args.rounds, args.tokens, args.every, args.rollouts, args.turns
            )
    print(json.dumps(report, indent=2) if args.json else summary(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
