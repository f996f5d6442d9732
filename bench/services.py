"""What running environments and the trainer as services costs.

    python bench/services.py [--json] [--rounds N] [--only throughput,pause]

1. ``http_vs_inprocess_ratio``: rollout throughput (turns/s) of the same workload with its
   resources in resource servers (``rollout-journal serve-resources``, one process per
   environment kind, reached over loopback HTTP) divided by the same with the resources in
   the worker's process. Workplace (event-sourced) and counter (exportable) rollouts,
   journaled to a file journal, snapshot every 4 turns. Rounds alternate which runs first;
   the median of the per-round ratios is reported with a bootstrap 90% interval.
2. ``pause_p50_ms`` / ``pause_p99_ms``: the pause of coordinated checkpoints (admission
   closed, agents parked, every rollout prepared and exported by its resource server over
   HTTP, snapshots committed, sessions resumed) while the same kinds of rollouts run.

A section is a function ``(args, tmp) -> figures`` in ``SECTIONS``; the results stream adds
``results_read_ratio`` (trainer-side reads of the results topic vs a raw consumer) there.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import bootstrap_median_interval, median, percentile  # noqa: E402
from participants.config import WorkloadConfig  # noqa: E402
from participants.resource_protocol import TOKEN_ENV_VAR  # noqa: E402
from participants.runner import Runner  # noqa: E402
from participants.workload import build_backend, open_workload_journal  # noqa: E402

ENVIRONMENTS = ("workplace", "counter")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def resource_servers(environments: tuple[str, ...]) -> Iterator[dict[str, str]]:
    """One ``serve-resources`` process per environment kind (a port each, picked by the server)."""
    os.environ.setdefault(TOKEN_ENV_VAR, os.urandom(16).hex())
    procs: list[subprocess.Popen[bytes]] = []
    urls = {}
    try:
        for name in environments:
            proc = subprocess.Popen([sys.executable, "-m", "replay.cli", "serve-resources", "--environment", name,
                                     "--port", "0"], cwd=ROOT, stdout=subprocess.PIPE,
                                    env=os.environ | {"PYTHONPATH": str(ROOT)})
            procs.append(proc)
            line = proc.stdout.readline().decode().split() if proc.stdout else []
            if len(line) < 4 or line[0] != "serving":
                raise SystemExit(f"resource server for {name} did not start")
            urls[name] = line[-1]
        yield urls
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


def workload(tmp: Path, name: str, args: argparse.Namespace, **overrides) -> WorkloadConfig:
    base = {"name": name, "groups": args.groups, "siblings": args.siblings, "max_turns": args.turns,
            "environment": ",".join(ENVIRONMENTS), "seed": 1, "allow_early_submit": False,
            "journal": str(tmp / name), "concurrency": args.groups * args.siblings}
    return WorkloadConfig(**(base | overrides))


def run_once(config: WorkloadConfig, backend) -> tuple[Runner, float]:
    with open_workload_journal(config) as journal:
        runner = Runner(config, journal, backend, backend.tokenizer)
        gc.collect()
        started = time.perf_counter()
        report = asyncio.run(runner.run(resume=False))
        elapsed = time.perf_counter() - started
    if report.failed or report.set_aside:
        raise SystemExit(f"workload {config.name} had failures: {report.failed or report.set_aside}")
    return runner, report.turns_run / elapsed


# -- 1. throughput: resources behind HTTP vs in process ---------------------------------------
def http_vs_inprocess(args: argparse.Namespace, tmp: Path) -> dict:
    backend = build_backend(WorkloadConfig())
    with resource_servers(ENVIRONMENTS) as urls:
        def one(name: str, http: bool) -> float:
            config = workload(tmp, name, args, resource_servers=urls if http else {})
            return run_once(config, backend)[1]

        one("warmup-local", False)
        one("warmup-http", True)
        pairs = []
        for round_ in range(args.rounds):
            order = (False, True) if round_ % 2 == 0 else (True, False)
            result = {http: one(f"tp{round_}-{'http' if http else 'local'}", http) for http in order}
            pairs.append((result[True], result[False]))
            log(f"  round {round_ + 1}/{args.rounds}: HTTP {result[True]:.1f} turns/s, "
                f"in process {result[False]:.1f} turns/s")
    ratios = [http / local for http, local in pairs]
    low, high = bootstrap_median_interval(ratios)
    return {
        "turns_per_s_http": round(median([h for h, _ in pairs]), 1),
        "turns_per_s_inprocess": round(median([loc for _, loc in pairs]), 1),
        "http_vs_inprocess_ratio": round(median(ratios), 4),
        "http_vs_inprocess_ratio_90ci": [round(low, 4), round(high, 4)],
        "throughput_rounds": args.rounds,
        "throughput_turns_per_run": args.groups * args.siblings * args.turns,
    }


# -- 2. coordinated checkpoint pauses with HTTP exports ----------------------------------------
def checkpoint_pauses(args: argparse.Namespace, tmp: Path) -> dict:
    backend = build_backend(WorkloadConfig())
    pauses: list[float] = []
    skipped = 0
    with resource_servers(ENVIRONMENTS) as urls:
        for round_ in range(max(1, args.rounds // 2)):
            config = workload(tmp, f"pause{round_}", args, resource_servers=urls, checkpoint_mode="coordinated",
                              coordinated_every_s=0.05, turn_delay_ms=5.0, max_turns=max(args.turns, 12))
            runner, _ = run_once(config, backend)
            pauses += [c.pause_ms for c in runner.checkpointer.history]
            skipped += sum(len(c.skipped) for c in runner.checkpointer.history)
    return {"pause_p50_ms": round(percentile(pauses, 50), 2), "pause_p99_ms": round(percentile(pauses, 99), 2),
            "pause_checkpoints": len(pauses), "pause_rollouts_skipped": skipped,
            "pause_rollouts": args.groups * args.siblings}


# The results stream's reader adds its section here: "results": <fn giving results_read_ratio>.
SECTIONS: dict[str, Callable[[argparse.Namespace, Path], dict]] = {
    "throughput": http_vs_inprocess,
    "pause": checkpoint_pauses,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rounds", type=int, default=6, help="alternating HTTP / in-process rounds")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--siblings", type=int, default=4)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"sections: {', '.join(SECTIONS)}")
    args = parser.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(only) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; known: {', '.join(SECTIONS)}")
    report: dict = {}
    with tempfile.TemporaryDirectory(prefix="rj-bench-services-") as tmp:
        for name in only:
            log(f"{name} ...")
            report.update(SECTIONS[name](args, Path(tmp)))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for key, value in report.items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
