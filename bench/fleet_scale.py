"""A fleet at scale on a local 3-broker cluster: many group members on many partitions, what one
member costs the cluster, and what the fleet keeps through broker restarts.

    python bench/fleet_scale.py [--json] [--members 50] [--per-process 5] [--partitions 256]
                                [--groups 40] [--siblings 4] [--turns 8] [--turn-delay-ms 100]
                                [--model fixed-rate|torch] [--rate 2000] [--broker-kills 2]
                                [--idle-window-s 10] [--bootstrap HOST:PORT,...]
                                [--with-sub-benches] [--smoke]

Starts a local 3-broker cluster (replication 3, ``min.insync.replicas=2``; or uses
``--bootstrap``), creates a namespace of ``--partitions`` partitions, submits one workload and runs
``--members`` members of the namespace's group, ``--per-process`` of them per process: each member
is a :class:`FleetWorker` (the code of ``rollout-journal worker``) with its own consumer-group
membership and its own transactional producer, so the brokers see ``--members`` members and
producers; a process hosts several only because this 2-core machine cannot hold 50 Python
processes. The model is not under test. ``--model fixed-rate`` (default): the OpenAI backend
against an upstream that streams deterministic token ids at ``--rate`` tokens/s per stream (16
tokens a call; ``tests/support/fixed_rate_upstream.py`` in its own process, as
``bench/commit_interval.py`` uses it), so turns come as fast as a quick model makes them;
``--model torch``: the embedded tiny Llama (CPU torch, 8 tokens a call), which on 2 cores
makes turns slowly. ``--turn-delay-ms`` of simulated environment latency per turn spreads the
turns over time as real tool calls would.

While the workload runs, a broker is SIGKILLed, left down until the fleet commits again, and
restarted, ``--broker-kills`` times (``bench/fleet.py``'s drill). Once every rollout finished, the
members idle for ``--idle-window-s``, and the kernel's counters of their sockets to the brokers
are read (``bench/idle_requests.py``'s method). Then the members stop and the journal is audited.

Figures (per member, over the busy window from the first durable turn to the last):

- ``transactions_per_worker_s``: transactions a member committed per second, the mean over
  members, with ``transactions_per_worker_s_max`` (goal <= 10: one per commit interval);
- ``turns_per_transaction``: how many turns one transaction carried, over the fleet;
- ``commit_seconds_mean``: how long a member's group commit (one transaction) took;
- ``busy_requests_per_worker_s`` (for ``--busy-window-s`` once a fifth of the turns are durable,
  before the broker kills; ``busy_turns_per_worker_s``: the turns a member made durable meanwhile) and
  ``idle_requests_per_worker_s`` (every rollout finished): requests (TCP data segments) a member
  sends the brokers per second, with the bytes it received;
- ``broker_restarts_survived`` of ``broker_kills``: kills after which every process still ran;
- ``turns_lost``, ``duplicate_turns``, ``zombie_writes_visible``: the journal against what the
  members reported durable (goal 0 each);
- ``session_timeout_seconds``: the group's session timeout the members run with;
- ``event_bytes_per_turn``, ``result_bytes_per_turn``, ``snapshot_bytes_held_per_rollout``: what
  the run left on the topics (the tiny model's 8-token turns: a real turn adds 8 bytes per sampled
  token, its id and logprob packed, and 4 per prompt token journaled as a delta).

Then ``--members`` bare transactional producers commit one small record per transaction as
fast as they can for ``--capacity-window-s``: ``cluster_transactions_per_s``, what the cluster's
transaction coordinators commit on this machine (a floor: the brokers share its cores with the
producers), against which ``transactions_per_worker_s`` x a fleet's size is set in
docs/scaling.md.

``--with-sub-benches`` runs, on the same cluster and in the same run, the benchmarks that measure
the rest of the issue's figures in their own set-ups and copies their headline figures here:
``bench/restore_history.py`` (``restore_ratio_10x_history_kafka``), ``bench/replay_scan.py``
(``list_speedup_vs_raw_scan``: ``replay list``'s events/s over a raw consumer's, the list read
from the rollouts' summaries once the summaries topic compacted; ``list_scan_ratio``: the same
for ``replay list --scan``, which folds every event) and ``bench/fleet.py``'s hand-off with 60 s
turns (``handoff_seconds_p99``). ``--smoke`` (the suite's): one broker is enough, 6 members on 24
partitions, tiny sizes, no broker kills.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import dump_stacks_on, print_report  # noqa: E402
from bench.fleet import audit_figures, cluster_for, kill_brokers, session_timeout_seconds  # noqa: E402
from bench.idle_requests import socket_counters  # noqa: E402
from bench.support.servers import started, stop  # noqa: E402
from rollout_journal.participants.workload.config import WorkloadConfig  # noqa: E402
from rollout_journal.participants.workload.specs import workload_specs  # noqa: E402
from tests.support.fleet_support import (  # noqa: E402
    WorkerProcess,
    child_environment,
    reported_turns,
    start_followed,
    submit,
    wait_for,
    wait_for_every_rollout,
    workload_yaml,
)
from tests.support.paths import REPO_ROOT  # noqa: E402

REPLICATION = "&replication_factor=3&min_insync_replicas=2"  # --smoke: the cluster's own
MEMBER_REPORT = "member-report "


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- the host process: several members of the group in one event loop --------------------------------


def host_main(args: argparse.Namespace) -> None:
    """``--members-here`` FleetWorkers in one event loop, each its own group member and producer.
    Prints every durable turn and membership event as ``rollout-journal worker --progress-lines``
    does (so ``WorkerProcess`` follows it), and at SIGTERM one ``member-report`` line per member."""
    from rollout_journal.participants.workload.worker import FleetWorker
    from rollout_journal.replay.cli.crash import PROGRESS_LINE

    def on_turn(rollout_id: str, turn: int) -> None:
        print(f"{PROGRESS_LINE} {rollout_id} {turn}", flush=True)

    def on_event_of(name: str) -> Callable[[str], None]:
        def on_event(line: str) -> None:
            print(f"{name} {line}", file=sys.stderr, flush=True)  # to look at: <prefix>.err
            if line.startswith("result-published "):  # followed, as a worker's --progress-lines print it
                print(line, flush=True)

        return on_event

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: every thread's stack
    names = [f"{args.prefix}-m{i}" for i in range(args.members_here)]
    members = [FleetWorker(args.url, name=name, on_turn=on_turn, on_event=on_event_of(name)) for name in names]

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        print("members-started", flush=True)
        reports = await asyncio.gather(*(member.run(stop) for member in members))
        for member, report in zip(members, reports, strict=True):
            registry = member.metrics.registry
            row = {
                "member": member.name,
                "transactions": registry.get_sample_value("rj_transactions_total") or 0.0,
                "turns": registry.get_sample_value("rj_turns_total") or 0.0,
                "partitions_taken": report.partitions_taken,
                "commit_seconds_sum": registry.get_sample_value("rj_commit_seconds_sum") or 0.0,
                "commits": registry.get_sample_value("rj_commit_seconds_count") or 0.0,
            }
            print(MEMBER_REPORT + json.dumps(row), flush=True)

    asyncio.run(run())


def start_host(url: str, prefix: str, members: int, work: Path) -> WorkerProcess:
    command = [sys.executable, __file__, "--host", "--url", url, "--prefix", prefix, "--members-here", str(members)]
    return start_followed(command, prefix, work)


def stop_host(host: WorkerProcess, timeout_s: float) -> None:
    """Wait for a host SIGTERMed to hand its members' partitions on and exit; one that does not
    within ``timeout_s`` writes every thread's stack to its stderr (kept) and is killed."""
    try:
        host.process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        host.signal(signal.SIGUSR1)
        time.sleep(2.0)
        host.process.kill()
        host.process.wait()
        raise AssertionError(f"{host.name} did not stop within {timeout_s} s; its threads: {host.err_path}") from None


def member_reports(host: WorkerProcess) -> list[dict[str, Any]]:
    return [json.loads(line.removeprefix(MEMBER_REPORT)) for _, line in host.seen(MEMBER_REPORT)]


# -- the run -----------------------------------------------------------------------------------------


def workload(url: str, args: argparse.Namespace, upstream: str | None) -> WorkloadConfig:
    """The workload every member drives. With ``upstream`` (``--model fixed-rate``), the OpenAI
    backend against ``tests/support/fixed_rate_upstream.py``, as ``bench/commit_interval.py``
    does: turns come as fast as a quick model makes them and no member loads torch; else the
    embedded tiny Llama."""
    from rollout_journal.participants.model.tiny_model import tiny_model_dir

    model: dict[str, Any] = {"max_tokens": 8}
    if upstream is not None:
        model = {
            "backend": "openai",
            "url": f"{upstream}/v1",
            "path": str(tiny_model_dir()),
            "max_tokens": 16,
            "server_logprobs": "accept_raw",
        }
    return WorkloadConfig.model_validate(
        {
            "name": "scale",
            "groups": args.groups,
            "siblings": args.siblings,
            "max_turns": args.turns,
            "environment": "workplace,counter",
            "seed": 11,
            "allow_early_submit": False,
            "turn_delay_ms": args.turn_delay_ms,
            "snapshot_every_turns": 2,
            "concurrency": args.groups * args.siblings,
            "constrained_actions": upstream is None,
            "journal": url,
            "model": model,
        }
    )


def socket_totals(hosts: list[WorkerProcess], bootstrap: str) -> tuple[float, int, int]:
    """(now, data segments sent, bytes received) over every host's sockets to every broker: the
    requests the members made, whatever client of theirs made them (``bench/idle_requests.py``)."""
    ports = [int(server.rsplit(":", 1)[1]) for server in bootstrap.split(",")]
    sent = received = 0
    for host in hosts:
        for port in ports:
            s, r = socket_counters(host.process.pid, port)
            sent, received = sent + s, received + r
    return time.monotonic(), sent, received


def requests_per_member(
    before: tuple[float, int, int], after: tuple[float, int, int], members: int, what: str
) -> dict[str, float]:
    seconds = after[0] - before[0]
    return {
        f"{what}_requests_per_worker_s": round((after[1] - before[1]) / seconds / members, 2),
        f"{what}_received_bytes_per_worker_s": round((after[2] - before[2]) / seconds / members, 1),
    }


def journal_bytes(url: str, turns: int, rollouts: int) -> dict[str, float]:
    """What the run left on the namespace's topics, per turn (events, results) and per rollout
    (the snapshot topic as the cleaner left it so far): the bytes a fleet's brokers take in."""
    from rollout_journal.journal.open import open_journal

    with open_journal(url, writer="bench-bytes", read_only=True) as journal:
        backend = journal.backend
        partitions = range(backend.partitions)
        events = sum(len(r.value or b"") for p in partitions for r in backend.read_events(p))
        results = sum(len(r.value or b"") for p in partitions for r in backend.read_results(p))
        snapshots = sum(len(r.value or b"") for r in backend.read_snapshots())
    return {
        "event_bytes_per_turn": round(events / turns),
        "result_bytes_per_turn": round(results / turns),
        "snapshot_bytes_held_per_rollout": round(snapshots / rollouts),
    }


def run_fleet(bootstrap: str, work: Path, args: argparse.Namespace, cluster: Any) -> dict[str, Any]:
    url = f"kafka://{bootstrap}/bench-scale-{uuid.uuid4().hex[:8]}?partitions={args.partitions}{REPLICATION}"
    with contextlib.ExitStack() as servers:
        upstream = None
        if args.model == "fixed-rate":
            from rollout_journal.participants.model.tiny_model import tiny_model_dir

            command = [sys.executable, "-m", "tests.support.fixed_rate_upstream", "--model-dir", str(tiny_model_dir()),
                       "--rate", str(args.rate), "--chunk", "16"]  # fmt: skip
            process, upstream = started(command, "serving at", work / "upstream.log")
            servers.callback(stop, process)
        return drive(url, workload(url, args, upstream), bootstrap, work, args, cluster)


def drive(
    url: str, config: WorkloadConfig, bootstrap: str, work: Path, args: argparse.Namespace, cluster: Any
) -> dict[str, Any]:
    """Start the members, submit ``config``, kill brokers under them, idle them, stop and audit."""
    rollouts = len(workload_specs(config))
    counts = [args.per_process] * (args.members // args.per_process)
    if args.members % args.per_process:
        counts.append(args.members % args.per_process)
    log(
        f"fleet scale: {args.members} members in {len(counts)} processes, {args.partitions} partitions, "
        f"{rollouts} rollouts x {config.max_turns} turns"
    )
    hosts = [start_host(url, f"h{i}", n, work) for i, n in enumerate(counts)]
    try:
        wait_for(lambda: all(h.seen("members-started") for h in hosts), 300, "every host to start", hosts)
        joined = time.monotonic()
        submit(url, workload_yaml(work / "scale.yaml", **config.model_dump(mode="json", exclude={"journal"})))
        log("fleet scale: workload submitted")
        wait_for(lambda: any(h.committed() for h in hosts), 600, "a first durable turn", hosts)
        # Steady state (a fifth of the turns durable: the takes are over), and before the broker kills:
        # a killed broker's connections take their counters with them.
        total = rollouts * config.max_turns
        wait_for(lambda: len(reported_turns(hosts)) >= total / 5, 600, "a fifth of the turns", hosts)
        busy_turns = len(reported_turns(hosts))
        busy_from = socket_totals(hosts, bootstrap)
        time.sleep(args.busy_window_s)
        busy = requests_per_member(busy_from, socket_totals(hosts, bootstrap), args.members, "busy")
        busy["busy_turns_per_worker_s"] = round(
            (len(reported_turns(hosts)) - busy_turns) / args.busy_window_s / args.members, 3
        )
        kills = {"broker_kills": 0, "broker_kills_survived": 0}
        if cluster is not None and args.broker_kills:
            kills = kill_brokers(cluster, hosts, config, args.broker_kills)
        wait_for_every_rollout(hosts, config, 1800, hosts)
        times = [t for h in hosts for t, _, _ in h.committed()]
        busy_s = max(times) - min(times)
        log(f"fleet scale: every rollout finished, {busy_s:.1f} s from the first durable turn to the last; idling")
        time.sleep(args.idle_settle_s)
        idle_from = socket_totals(hosts, bootstrap)
        time.sleep(args.idle_window_s)
        idle = requests_per_member(idle_from, socket_totals(hosts, bootstrap), args.members, "idle")
        exited = [h.name for h in hosts if h.process.poll() is not None]
        for host in hosts:
            host.signal(signal.SIGTERM)
        for host in hosts:
            stop_host(host, timeout_s=180)
    finally:
        for host in hosts:
            if host.process.poll() is None:
                host.process.kill()
    rows = [row for h in hosts for row in member_reports(h)]
    per_member = sorted(row["transactions"] / busy_s for row in rows)
    transactions = sum(row["transactions"] for row in rows)
    return (
        {
            "members": args.members,
            "processes": len(hosts),
            "model": args.model,
            "partitions": args.partitions,
            "rollouts": rollouts,
            "turns": rollouts * config.max_turns,
            "busy_seconds": round(busy_s, 1),
            "join_to_first_turn_seconds": round(min(times) - joined, 1),
            "members_reporting": len(rows),
            "members_that_took_partitions": sum(1 for row in rows if row["partitions_taken"]),
            "transactions_per_worker_s": round(sum(per_member) / max(len(per_member), 1), 2),
            "transactions_per_worker_s_max": round(max(per_member, default=0.0), 2),
            "turns_per_transaction": round(sum(row["turns"] for row in rows) / max(transactions, 1), 2),
            "commit_seconds_mean": round(
                sum(row["commit_seconds_sum"] for row in rows) / max(sum(row["commits"] for row in rows), 1), 3
            ),
            "processes_exited": len(exited),
            "broker_kills": kills["broker_kills"],
            "broker_restarts_survived": kills["broker_kills_survived"],
            "session_timeout_seconds": session_timeout_seconds(),
        }
        | busy
        | idle
        | audit_figures(url, config, hosts)
        | journal_bytes(url, rollouts * config.max_turns, rollouts)
    )


def transaction_capacity(bootstrap: str, producers: int, window_s: float, replication: int) -> dict[str, float]:
    """How many transactions a second the cluster commits for ``producers`` transactional
    producers that do nothing else (one small record per transaction, each on a partition of its
    own), for ``window_s``: the transaction coordinators' capacity on this machine, a floor (the
    brokers share its 2 cores with the producers), for the model in docs/scaling.md."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = f"bench-txcap-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, producers, replication)])[topic].result(60)
    counts = [0] * producers
    ends = time.monotonic() + 3600.0  # set below, once every producer is ready
    ready = threading.Barrier(producers + 1)

    def drive(i: int) -> None:
        producer = Producer(
            {"bootstrap.servers": bootstrap, "transactional.id": f"{topic}-{i}", "enable.idempotence": True}
        )
        producer.init_transactions(60)
        ready.wait(120)
        while time.monotonic() < ends:
            producer.begin_transaction()
            producer.produce(topic, b"x" * 64, partition=i)
            producer.commit_transaction(60)
            counts[i] += 1

    threads = [threading.Thread(target=drive, args=(i,), daemon=True) for i in range(producers)]
    for thread in threads:
        thread.start()
    ready.wait(120)
    started = time.monotonic()
    ends = started + window_s
    for thread in threads:
        thread.join(window_s + 120)
    seconds = time.monotonic() - started
    admin.delete_topics([topic])
    return {
        "cluster_transactions_per_s": round(sum(counts) / seconds, 1),
        "cluster_transactions_producers": producers,
    }


def sub_benches(bootstrap: str) -> dict[str, Any]:
    """The issue's other figures, each from its own benchmark on the same cluster, in this run."""

    def run(script: str, *extra: str) -> dict[str, Any]:
        log(f"fleet scale: running bench/{script} {' '.join(extra)}")
        done = subprocess.run(
            [sys.executable, str(REPO_ROOT / "bench" / script), "--json", *extra],
            cwd=REPO_ROOT,
            env=child_environment() | {"KAFKA_BOOTSTRAP_SERVERS": bootstrap},
            stdout=subprocess.PIPE,
            text=True,
            check=True,
        )
        return json.loads(done.stdout)

    restore = run("restore_history.py")
    scan = run("replay_scan.py", "--events", "200000", "--rounds", "1")
    handoff = run("fleet.py", "--bootstrap", bootstrap, "--skip-throughput", "--no-broker-kills", "--races", "0")
    return {
        "restore_ratio_10x_history_kafka": restore.get("restore_ratio_10x_history_kafka", restore.get("ratio")),
        "list_speedup_vs_raw_scan": scan.get("summaries_ratio"),
        "list_speedup_fresh": scan.get("summaries_fresh_ratio"),
        "list_scan_ratio": scan.get("ratio"),
        "handoff_seconds_p99": handoff.get("handoff_seconds_p99"),
        "handoff_turn_seconds": handoff.get("handoff_turn_seconds"),
    }


def main() -> int:
    os.environ.pop("KAFKA_BOOTSTRAP_SERVERS", None)  # it would replace the servers of every URL here
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--members", type=int, default=50)
    parser.add_argument("--per-process", type=int, default=5)
    parser.add_argument("--partitions", type=int, default=256)
    parser.add_argument("--groups", type=int, default=40)
    parser.add_argument("--siblings", type=int, default=4)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--turn-delay-ms", type=float, default=100.0)
    parser.add_argument(
        "--model", choices=("fixed-rate", "torch"), default="fixed-rate", help="what stands in for the model"
    )
    parser.add_argument("--rate", type=float, default=2000.0, help="fixed-rate upstream: tokens/s per stream")
    parser.add_argument("--broker-kills", type=int, default=2)
    parser.add_argument("--busy-window-s", type=float, default=10.0)
    parser.add_argument("--idle-settle-s", type=float, default=5.0)
    parser.add_argument("--idle-window-s", type=float, default=10.0)
    parser.add_argument("--capacity-window-s", type=float, default=20.0, help="bare transactions' window (0: skip)")
    parser.add_argument("--bootstrap", help="a running 3-broker cluster (default: start one for the run)")
    parser.add_argument("--with-sub-benches", action="store_true", help="restore_history, replay_scan, fleet hand-off")
    parser.add_argument("--smoke", action="store_true", help="the suite's cheap run (see the module docstring)")
    parser.add_argument("--host", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    parser.add_argument("--members-here", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    dump_stacks_on()  # SIGUSR1: its threads' and tasks' stacks (a hang's where)
    if args.host:
        host_main(args)
        return 0
    global REPLICATION
    if args.smoke:
        REPLICATION = ""
        args.members, args.per_process, args.partitions = 6, 3, 24
        args.groups, args.siblings, args.turns, args.turn_delay_ms = 4, 2, 2, 50.0
        args.broker_kills, args.idle_settle_s, args.idle_window_s, args.with_sub_benches = 0, 1.0, 2.0, False
        args.capacity_window_s, args.busy_window_s = 2.0, 1.0
    work = Path(tempfile.mkdtemp(prefix="rj-bench-fleet-scale-"))  # kept if the run fails: the members' logs
    succeeded = False
    try:
        with cluster_for(args.bootstrap, work) as (bootstrap, cluster):
            report = run_fleet(bootstrap, work, args, cluster)
            if args.capacity_window_s > 0:
                log(f"fleet scale: transaction capacity, {args.members} bare producers for {args.capacity_window_s} s")
                report |= transaction_capacity(bootstrap, args.members, args.capacity_window_s, 1 if args.smoke else 3)
            if args.with_sub_benches:
                report |= sub_benches(bootstrap)
            # A run that lost, doubled or let a zombie's write through keeps the members' logs too.
            succeeded = not any(report.get(k) for k in ("turns_lost", "duplicate_turns", "zombie_writes_visible"))
    finally:
        if succeeded:
            shutil.rmtree(work, ignore_errors=True)
        else:
            log(f"fleet scale: failed; the members' logs are kept in {work}")
    print_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
