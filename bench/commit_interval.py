"""A fleet worker's Kafka transactions per second with and without its commit interval.

    python bench/commit_interval.py [--json] [--reps 2] [--rollouts 64] [--turns 8]
                                    [--interval-ms 100] [--rate 2000] [--bootstrap HOST:PORT]

One member of a fresh namespace (:class:`FleetWorker`, the code of ``rollout-journal worker`` and of
``run`` on Kafka) drives one workload to its end: ``--rollouts`` rollouts of ``--turns`` turns in
the workplace environment (every rollout runs all its turns), every rollout in flight at once. The
model is not under test: the OpenAI backend calls an upstream that streams deterministic token ids
at ``--rate`` tokens/s per stream (``tests/support/fixed_rate_upstream.py``, in its own process;
16 tokens a call, free-form actions, which the environment answers), so turns come as fast as a
worker with a quick model would make them. A first run, not counted, warms the broker. The worker
counts its own committed transactions and durable turns (``rj_transactions_total``,
``rj_turns_total``). Runs alternate between ``--commit-interval-ms 0`` (a commit as soon as a turn
is waited for: the behaviour before the interval) and ``--interval-ms``, each on a fresh namespace:

- ``transactions_per_s`` and ``transactions_per_turn``, medians per setting;
- ``turns_per_s``: what the interval costs in throughput, if anything;
- ``transactions_per_s_ratio``: with the interval over without (goal: well under 1, and at most
  1000 / interval per second whatever the turn rate), and ``turns_per_s_ratio`` (goal ~1).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import dump_stacks_on, kafka_bootstrap, print_report  # noqa: E402
from bench.support.servers import started, stop  # noqa: E402


def one_run(bootstrap: str, upstream: str, interval_ms: float, args: argparse.Namespace) -> dict[str, float]:
    from rollout_journal.participants.model.tiny_model import tiny_model_dir
    from rollout_journal.participants.workload.config import ModelConfig, WorkloadConfig
    from rollout_journal.participants.workload.worker import FixedWorkload, FleetWorker, prepare_workload

    url = f"kafka://{bootstrap}/ci-{uuid.uuid4().hex[:8]}?partitions=8"
    config = WorkloadConfig(
        name="interval",
        groups=args.rollouts,
        siblings=1,
        max_turns=args.turns,
        environment="workplace",
        journal=url,
        concurrency=args.rollouts,
        constrained_actions=False,
        model=ModelConfig(
            backend="openai",
            url=f"{upstream}/v1",
            path=str(tiny_model_dir()),
            max_tokens=16,
            server_logprobs="accept_raw",
        ),
    )
    registration, specs = prepare_workload(config, resume=False)
    worker = FleetWorker(
        url,
        name="bench-w0",
        poll_s=0.2,
        linger_ms=config.journal_linger_ms,
        workloads=[FixedWorkload(config, registration, specs)],
        commit_interval_ms=interval_ms,
    )
    started = time.perf_counter()
    asyncio.run(worker.run(asyncio.Event()))
    seconds = time.perf_counter() - started
    registry = worker.metrics.registry
    transactions = registry.get_sample_value("rj_transactions_total") or 0.0
    turns = registry.get_sample_value("rj_turns_total") or 0.0
    return {
        "seconds": seconds,
        "transactions": transactions,
        "turns": turns,
        "transactions_per_s": transactions / seconds,
        "turns_per_s": turns / seconds,
        "transactions_per_turn": transactions / turns if turns else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--reps", type=int, default=2, help="runs per setting, interleaved")
    parser.add_argument("--rollouts", type=int, default=64)
    parser.add_argument("--rate", type=float, default=2000.0, help="upstream tokens/s per stream")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--interval-ms", type=float, default=100.0)
    parser.add_argument("--bootstrap", help="an existing broker (default: $KAFKA_BOOTSTRAP_SERVERS or a local one)")
    args = parser.parse_args()
    dump_stacks_on()  # SIGUSR1: its threads' and tasks' stacks (a hang's where)
    settings = {"without": 0.0, "with": args.interval_ms}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in settings}
    from rollout_journal.participants.model.tiny_model import tiny_model_dir

    with (
        kafka_bootstrap() if args.bootstrap is None else contextlib.nullcontext(args.bootstrap) as bootstrap,
        tempfile.TemporaryDirectory(prefix="rj-bench-interval-") as tmp,
    ):
        command = [sys.executable, "-m", "tests.support.fixed_rate_upstream", "--model-dir", str(tiny_model_dir()),
                   "--rate", str(args.rate), "--chunk", "16"]  # fmt: skip
        upstream, url = started(command, "serving at", Path(tmp) / "upstream.log")
        try:
            one_run(bootstrap, url, args.interval_ms, args)  # warm-up: the broker's first topics, imports
            for rep in range(args.reps):
                for name, interval in settings.items():
                    run = one_run(bootstrap, url, interval, args)
                    runs[name].append(run)
                    print(
                        f"[rep {rep + 1}/{args.reps}] interval {interval:g} ms: {run['turns']:.0f} turns, "
                        f"{run['transactions']:.0f} transactions in {run['seconds']:.1f} s",
                        file=sys.stderr,
                        flush=True,
                    )
        finally:
            stop(upstream)

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    report: dict[str, object] = {"interval_ms": args.interval_ms, "reps": args.reps}
    for name in settings:
        for key in ("transactions_per_s", "transactions_per_turn", "turns_per_s"):
            report[f"{key}_{name}_interval"] = round(med(name, key), 3)
    report["transactions_per_s_ratio"] = round(
        med("with", "transactions_per_s") / med("without", "transactions_per_s"), 3
    )
    report["turns_per_s_ratio"] = round(med("with", "turns_per_s") / med("without", "turns_per_s"), 3)
    report["runs"] = runs
    print_report(report, args.json)


if __name__ == "__main__":
    main()
