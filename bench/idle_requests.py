"""An idle fleet worker's requests per second against the namespace's partition count.

    python bench/idle_requests.py [--json] [--partitions 8,64] [--window-s 10]
                                  [--baseline-pythonpath PATH] [--bootstrap HOST:PORT]

For each partition count, one worker process (:class:`FleetWorker`, the code of ``rollout-journal
worker``) joins a fresh namespace that holds no workload: it takes every partition, then idles.
Once it settled (every partition taken, then ``--settle-s``), the bench counts for ``--window-s``
what the worker's sockets to the broker did, from the kernel's per-connection counters (``ss -ti``
of the worker's pid: every client of the process, whatever library code opened it, counted alike):

- ``requests_per_s``: TCP data segments sent to the broker per second. An idle client writes each
  request in one segment (librdkafka disables Nagle), so this counts requests: fetches, heartbeats,
  offset queries, metadata;
- ``received_bytes_per_s``: bytes the broker sent the worker per second.

``idle_requests_ratio_64_vs_8`` (with the default partition counts): requests per second at the
largest count over the smallest, measured in the same run (goal ~1: independent of partitions).
``--baseline-pythonpath PATH`` measures the same worker again with ``PYTHONPATH=PATH`` (another
checkout's code, e.g. the build/namespace of a worktree of an earlier commit; an empty string:
the installed package) and prints its figures and ratios beside this checkout's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import dump_stacks_on, kafka_bootstrap, print_report  # noqa: E402

_SOCKET_COUNTERS = re.compile(r"\b(data_segs_out|bytes_received):(\d+)")


def child_main(args: argparse.Namespace) -> None:
    """The worker: join, take every partition, say ``ready``, idle until SIGTERM."""
    from rollout_journal.participants.workload.worker import FleetWorker

    url = f"kafka://{args.bootstrap}/{args.namespace}?partitions={args.partitions}"
    taken = 0

    def on_event(line: str) -> None:
        nonlocal taken
        if line.startswith("takeover-seconds "):
            taken += 1
            if taken == args.partitions:
                print("ready", flush=True)

    async def run() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await FleetWorker(url, name="idle", on_event=on_event).run(stop)

    asyncio.run(run())


def socket_counters(pid: int, port: int) -> tuple[int, int]:
    """(data segments sent, bytes received) summed over the TCP connections of ``pid`` to ``port``."""
    out = subprocess.run(
        ["ss", "-tinpH", "state", "established", "dport", f"= :{port}"], capture_output=True, text=True, check=True
    ).stdout
    sent = received = 0
    mine = False
    for line in out.splitlines():
        if not line.startswith((" ", "\t")):  # a socket's line; its counters follow on the next one
            mine = f"pid={pid}," in line
            continue
        if mine:
            counters = dict(_SOCKET_COUNTERS.findall(line))
            sent += int(counters.get("data_segs_out", 0))
            received += int(counters.get("bytes_received", 0))
    return sent, received


def measure(bootstrap: str, partitions: int, args: argparse.Namespace, pythonpath: str | None) -> dict[str, float]:
    """One idle worker on a fresh namespace of ``partitions``: its requests and received bytes per second."""
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    if pythonpath == "":
        env.pop("PYTHONPATH")
    namespace = f"idle{uuid.uuid4().hex[:8]}"
    command = [sys.executable, __file__, "--child", "--bootstrap", bootstrap, "--namespace", namespace]
    child = subprocess.Popen([*command, "--partitions", str(partitions)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        if child.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the worker on {partitions} partitions ended before it took them (exit {child.wait()})")
        port = int(bootstrap.split(",")[0].rsplit(":", 1)[1])
        time.sleep(args.settle_s)
        sent0, received0 = socket_counters(child.pid, port)
        started = time.monotonic()
        time.sleep(args.window_s)
        sent1, received1 = socket_counters(child.pid, port)
        seconds = time.monotonic() - started
    finally:
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    return {
        "requests_per_s": round((sent1 - sent0) / seconds, 2),
        "received_bytes_per_s": round((received1 - received0) / seconds, 1),
    }


def measure_all(bootstrap: str, args: argparse.Namespace, pythonpath: str | None) -> dict[int, dict[str, float]]:
    return {p: measure(bootstrap, p, args, pythonpath) for p in args.partitions}


def report_of(figures: dict[int, dict[str, float]], prefix: str) -> dict[str, object]:
    low, high = min(figures), max(figures)
    report: dict[str, object] = {}
    for p, row in figures.items():
        report[f"{prefix}idle_requests_per_s_{p}_partitions"] = row["requests_per_s"]
        report[f"{prefix}idle_received_bytes_per_s_{p}_partitions"] = row["received_bytes_per_s"]
    if low != high:
        report[f"{prefix}idle_requests_ratio_{high}_vs_{low}"] = round(
            figures[high]["requests_per_s"] / max(figures[low]["requests_per_s"], 1e-9), 2
        )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--partitions", type=lambda v: [int(p) for p in v.split(",")], default=[8, 64])
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--settle-s", type=float, default=3.0)
    parser.add_argument("--baseline-pythonpath", default=None)
    parser.add_argument("--bootstrap", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--namespace", help=argparse.SUPPRESS)
    args = parser.parse_args()
    dump_stacks_on()  # SIGUSR1: its threads' and tasks' stacks (a hang's where)
    if args.child:
        args.partitions = args.partitions[0]
        child_main(args)
        return

    def run(bootstrap: str) -> dict[str, object]:
        report: dict[str, object] = {"window_seconds": args.window_s}
        report.update(report_of(measure_all(bootstrap, args, None), ""))
        if args.baseline_pythonpath is not None:
            baseline = measure_all(bootstrap, args, args.baseline_pythonpath)
            report.update(report_of(baseline, "baseline_"))
            high = max(args.partitions)
            report[f"idle_requests_vs_baseline_{high}_partitions"] = round(
                float(str(report[f"idle_requests_per_s_{high}_partitions"]))
                / max(float(str(report[f"baseline_idle_requests_per_s_{high}_partitions"])), 1e-9),
                3,
            )
        return report

    if args.bootstrap:
        report = run(args.bootstrap)
    else:
        with kafka_bootstrap() as bootstrap:
            report = run(bootstrap)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report, as_json=False)


if __name__ == "__main__":
    main()
