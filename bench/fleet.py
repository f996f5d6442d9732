"""A fleet of workers on a 3-broker cluster: failover after a SIGKILL, a zombie, and throughput.

    python bench/fleet.py [--json] [--quick] [--bootstrap HOST:PORT,...]

Starts a local 3-broker cluster (replication 3, ``min.insync.replicas=2``; or uses
``--bootstrap``), submits one workload and runs real ``rollout-journal worker`` processes:

1. Failover: three workers; once each has committed turns, one is SIGKILLed. The survivors
   take its partitions after the group's session timeout. ``failover_seconds``: from the
   SIGKILL to the first turn of a moved rollout committed by a survivor (the turn's
   ``TurnCompleted`` timestamp: it commits within the group commit's linger). Then a survivor
   is SIGSTOPped past the session timeout and woken once the other took its partitions over
   (a zombie). At the end the journal is audited: ``turns_lost`` (turns a worker reported
   durable that the journal lacks), ``duplicate_turns`` (a turn's ``TurnCompleted`` written
   twice), ``zombie_writes_visible`` (events of a superseded attempt after the newer one
   started, or dropped by readers), ``identical_to_uninterrupted`` (every rollout's outcome
   against a run without journal or faults).
   ``partitions_moved_seconds``: from the SIGKILL to a survivor's first assignment of them;
   ``takeover_seconds``: from that assignment until every moved rollout was restored and its
   new attempt's fence committed (the partitions' producers fenced, their rollouts read,
   folded and their environments rebuilt); ``takeover_phases_seconds`` splits it, as the workers
   measured it: taking the writers and reading, then restoring and committing the fences.
2. Throughput: the same workload without simulated latency, on 1, 2 and 3 workers (a fresh
   namespace each, the workers joined before the submit), turns per second from the first
   committed turn to the last; ratios to one worker.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import print_report  # noqa: E402
from journal.backend import partition_for  # noqa: E402
from journal.events import TurnCompleted  # noqa: E402
from journal.kafka_config import KafkaSettings  # noqa: E402
from journal.open import open_journal  # noqa: E402
from participants.config import WorkloadConfig  # noqa: E402
from participants.specs import workload_specs  # noqa: E402
from tests.fleet_support import (  # noqa: E402
    audit_journal,
    every_turn_reported,
    reported_turns,
    start_worker,
    submit,
    wait_for,
    workload_yaml,
)
from tests.recovery_support import reference_outcomes  # noqa: E402

PARTITIONS = 12


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def workload(url: str, *, name: str, groups: int, max_turns: int, turn_delay_ms: float) -> WorkloadConfig:
    return WorkloadConfig(name=name, groups=groups, siblings=3, max_turns=max_turns, environment="workplace,counter",
                          seed=7, allow_early_submit=False, turn_delay_ms=turn_delay_ms, snapshot_every_turns=4,
                          journal=url)


def namespace_url(bootstrap: str, namespace: str) -> str:
    return f"kafka://{bootstrap}/{namespace}?partitions={PARTITIONS}&replication_factor=3&min_insync_replicas=2"


def balanced(workers: list) -> None:
    wait_for(lambda: all(w.partitions() for w in workers)
             and sorted(p for w in workers for p in w.partitions()) == list(range(PARTITIONS)), 300,
             "the workers to share the partitions", workers)


def stop_all(workers: list) -> None:
    for worker in workers:
        if worker.process.poll() is None:
            worker.stop()


def first_turn_after(url: str, rollouts: set[str], writers: set[str], after_ms: int) -> int | None:
    """ts_ms of the earliest TurnCompleted of ``rollouts`` by ``writers`` built after ``after_ms``."""
    first = None
    with open_journal(url, writer="bench", read_only=True) as journal:
        for item in journal.scan():
            h = item.event.header
            if isinstance(item.event, TurnCompleted) and h.rollout_id in rollouts and h.writer in writers \
                    and h.ts_ms >= after_ms and (first is None or h.ts_ms < first):
                first = h.ts_ms
    return first


def failover(bootstrap: str, work: Path, quick: bool) -> dict:
    url = namespace_url(bootstrap, "bench-failover")
    config = workload(url, name="failover", groups=10 if quick else 20, max_turns=30 if quick else 40,
                      turn_delay_ms=300)
    log(f"failover: {len(workload_specs(config))} rollouts x {config.max_turns} turns, reference run ...")
    reference = reference_outcomes(config)
    workers = [start_worker(url, f"w{i}", work) for i in range(3)]
    try:
        balanced(workers)
        submit(url, workload_yaml(work / "failover.yaml", **config.model_dump(mode="json", exclude={"journal"})))
        wait_for(lambda: all(len(w.committed()) >= 3 for w in workers), 300, "every worker to commit turns", workers)
        victim, survivors = workers[0], workers[1:]
        moved = victim.partitions()
        killed_ms, killed = int(time.time() * 1000), time.monotonic()
        victim.signal(signal.SIGKILL)
        victim.process.wait()
        log(f"failover: SIGKILLed w0, owner of partitions {sorted(moved)}")
        moved_at = wait_for(lambda: moved <= survivors[0].partitions() | survivors[1].partitions(), 120,
                            "the survivors to take the partitions", survivors)
        assigned = [t for w in survivors for t, _ in w.seen("partitions-assigned", since=killed)]
        moved_rollouts = {s.rollout_id for s in workload_specs(config) if partition_for(s.rollout_id, PARTITIONS) in moved}
        wait_for(lambda: any(rid in moved_rollouts for w in survivors for _, rid, _ in w.committed()), 120,
                 "a survivor to commit a turn of a moved rollout", survivors)

        zombie, other = survivors
        taken = zombie.partitions()
        zombie.signal(signal.SIGSTOP)
        log(f"zombie: SIGSTOPped w1, owner of partitions {sorted(taken)}")
        try:
            wait_for(lambda: taken <= other.partitions(), 120,
                     "the other survivor to take the stalled worker's partitions", [other])
        finally:
            zombie.signal(signal.SIGCONT)
        wait_for(lambda: every_turn_reported(workers, config), 600, "every rollout to finish", survivors)
        stop_all(survivors)
    finally:
        for worker in workers:
            if worker.process.poll() is None:
                worker.process.kill()
    first = first_turn_after(url, moved_rollouts, {"w1", "w2"}, killed_ms)
    first_admitted: dict[int, float] = {}  # each moved partition's first admission (the zombie phase moves some again)
    for worker in survivors:
        for t, line in worker.seen("rollouts-admitted", since=killed):
            partition = int(line.split()[2].removeprefix("p"))
            if partition in moved:
                first_admitted[partition] = min(t, first_admitted.get(partition, t))
    admitted = list(first_admitted.values())
    phases = []  # (take writers + read, restore + fence) of the first takeover of moved partitions after the kill
    for worker in survivors:
        for _, line in worker.seen("takeover-seconds", since=killed):
            _, numbers, read_s, admit_s = line.split()
            if {int(p) for p in numbers.split(",")} & moved:
                phases.append((float(read_s), float(admit_s)))
                break
    audit = audit_journal(url, config)
    reported = reported_turns(workers)
    return {
        "workers": 3,
        "rollouts": len(workload_specs(config)),
        "partitions": PARTITIONS,
        "failover_seconds": None if first is None else round((first - killed_ms) / 1000, 2),
        "partitions_moved_seconds": round((min(assigned) if assigned else moved_at) - killed, 2),
        "takeover_seconds": round(max(admitted) - min(assigned), 2) if admitted and assigned else None,
        "takeover_phases_seconds": {"take_writers_and_read": round(max((p[0] for p in phases), default=0), 2),
                                    "restore_and_fence": round(max((p[1] for p in phases), default=0), 2)},
        "session_timeout_seconds": KafkaSettings.model_fields["group_session_timeout_ms"].default / 1000,
        "turns_lost": sum(1 for turn in reported if audit.turns_standing[turn] != 1),
        "duplicate_turns": sum(count - 1 for count in audit.turns_written.values() if count > 1),
        "zombie_writes_visible": len(audit.fenced) + len(audit.by_writer_after_takeover),
        "identical_to_uninterrupted": audit.outcomes == reference,
    }


def throughput(bootstrap: str, work: Path, quick: bool) -> dict:
    turns_per_s: dict[int, float] = {}
    for count in (1, 2, 3):
        url = namespace_url(bootstrap, f"bench-throughput-{count}")
        config = workload(url, name=f"tp{count}", groups=10 if quick else 20, max_turns=8 if quick else 16,
                          turn_delay_ms=0.0)
        total = len(workload_specs(config)) * config.max_turns
        workers = [start_worker(url, f"t{count}-{i}", work) for i in range(count)]
        try:
            balanced(workers)
            submit(url, workload_yaml(work / f"tp{count}.yaml", **config.model_dump(mode="json", exclude={"journal"})))
            wait_for(lambda: sum(reported_turns(workers).values()) >= total, 900, "every turn", workers)  # noqa: B023 (called here)
            times = [t for w in workers for t, _, _ in w.committed()]
            started, ended = min(times), max(times)  # first to last committed turn: the workers' pick-up left out
            stop_all(workers)
        finally:
            for worker in workers:
                if worker.process.poll() is None:
                    worker.process.kill()
        turns_per_s[count] = total / (ended - started)
        log(f"throughput: {count} worker(s): {total} turns in {ended - started:.1f} s ({turns_per_s[count]:.1f}/s)")
    return {
        "throughput_turns_per_s": {str(k): round(v, 1) for k, v in turns_per_s.items()},
        "throughput_ratio": {str(k): round(v / turns_per_s[1], 2) for k, v in turns_per_s.items()},
    }


def main() -> int:
    os.environ.pop("KAFKA_BOOTSTRAP_SERVERS", None)  # it would replace the servers of every URL here
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="fewer rollouts and turns")
    parser.add_argument("--bootstrap", help="a running 3-broker cluster (default: start one for the run)")
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rj-bench-fleet-") as tmp:
        work = Path(tmp)
        cluster = None
        if args.bootstrap:
            bootstrap = args.bootstrap
        else:
            from compose.local_broker import start_local_cluster

            log("starting a local 3-broker cluster ...")
            cluster = start_local_cluster(3, work / "kafka3")
            bootstrap = cluster.bootstrap_servers
        try:
            report = failover(bootstrap, work, args.quick)
            if not args.skip_throughput:
                report |= throughput(bootstrap, work, args.quick)
        finally:
            if cluster is not None:
                cluster.stop()
    print_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
