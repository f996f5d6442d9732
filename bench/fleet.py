"""A fleet of workers on a 3-broker cluster: failover after a SIGKILL, a zombie, broker kills,
hand-offs with long turns, racing writer slots, and throughput.

    python bench/fleet.py [--json] [--quick] [--bootstrap HOST:PORT,...] [--skip-throughput]
                          [--no-broker-kills] [--races N] [--handoff-turn-s S] [--smoke]

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
   ``broker_kills_survived``: during the same run (after the zombie), a broker is SIGKILLed, left
   down until the workers commit again, and restarted, twice; the kills after which every worker
   was still running (goal: all), with ``workers_exited``.
2. Hand-offs with long turns: one worker drives a workload of ``--handoff-turn-s`` (60) second
   turns; a second joins (the group moves half the partitions), then the first leaves (SIGTERM).
   ``handoff_seconds_p99``: per moved partition, from its revocation at the old owner to the new
   owner's first durable write to it (the moved rollouts restored and fenced), p99 over both
   moves (goal: within the session timeout + 5 s, whatever the turn length: the old owner
   abandons the turns in flight and the new one redoes them from the last committed turn).
3. Racing writer slots: ``--races`` times, two ``resume`` processes with different ``--writer``
   started on one fresh namespace at random offsets (0-500 ms). ``duplicate_training_records``:
   training records on the results topic beyond one per rollout, summed over the races (goal 0);
   ``race_outcomes`` counts how the second process ended (0: the two shared the partitions,
   6: refused, naming the first).
4. Throughput: the same workload without simulated latency, on 1, 2 and 3 workers (a fresh
   namespace each, the workers joined before the submit), turns per second from the first
   committed turn to the last; ratios to one worker.

``--smoke`` (the suite's): one broker is enough (the cluster's replication), tiny sizes, no
broker kills, 5 s turns for the hand-off, one race, no throughput.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import dump_stacks_on, print_report  # noqa: E402
from rollout_journal.journal.backend import partition_for  # noqa: E402
from rollout_journal.journal.events import TurnCompleted  # noqa: E402
from rollout_journal.journal.kafka.config import KafkaSettings  # noqa: E402
from rollout_journal.journal.open import open_journal  # noqa: E402
from rollout_journal.participants.workload.config import WorkloadConfig  # noqa: E402
from rollout_journal.participants.workload.specs import workload_specs  # noqa: E402
from tests.support.fleet_support import (  # noqa: E402
    audit_journal,
    child_environment,
    every_turn_reported,
    reported_turns,
    start_worker,
    submit,
    wait_for,
    wait_for_every_rollout,
    workload_done,
    workload_yaml,
)
from tests.support.paths import REPO_ROOT  # noqa: E402
from tests.support.recovery_support import reference_outcomes  # noqa: E402

PARTITIONS = 12
REPLICATION = "&replication_factor=3&min_insync_replicas=2"  # --smoke: the cluster's own


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def workload(url: str, *, name: str, groups: int, max_turns: int, turn_delay_ms: float) -> WorkloadConfig:
    return WorkloadConfig(
        name=name,
        groups=groups,
        siblings=3,
        max_turns=max_turns,
        environment="workplace,counter",
        seed=7,
        allow_early_submit=False,
        turn_delay_ms=turn_delay_ms,
        snapshot_every_turns=4,
        journal=url,
    )


def namespace_url(bootstrap: str, namespace: str) -> str:
    return f"kafka://{bootstrap}/{namespace}?partitions={PARTITIONS}{REPLICATION}"


def balanced(workers: list) -> None:
    wait_for(
        lambda: (
            all(w.partitions() for w in workers)
            and sorted(p for w in workers for p in w.partitions()) == list(range(PARTITIONS))
        ),
        300,
        "the workers to share the partitions",
        workers,
    )


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
            if (
                isinstance(item.event, TurnCompleted)
                and h.rollout_id in rollouts
                and h.writer in writers
                and h.ts_ms >= after_ms
                and (first is None or h.ts_ms < first)
            ):
                first = h.ts_ms
    return first


def kill_brokers(cluster, workers: list, config: WorkloadConfig, times: int) -> dict:
    """SIGKILL a broker, wait until the fleet commits again, restart it, wait again; ``times`` times."""
    survived, kills = 0, 0
    for node in [2, 3, 1][:times]:
        if every_turn_reported(workers, config):
            log(f"broker kills: the workload finished after {kills} kills")
            break
        cluster.kill_node(node)
        kills += 1
        killed = time.monotonic()
        log(f"broker kills: SIGKILLed broker {node}")
        wait_for(functools.partial(going_on, workers, config, killed), 300, f"commits with broker {node} down", [])
        cluster.restart_node(node, ready_timeout_s=300)
        restarted = time.monotonic()
        log(f"broker kills: restarted broker {node}")
        wait_for(functools.partial(going_on, workers, config, restarted), 300, f"commits after {node} is back", [])
        survived += all(w.process.poll() is None for w in workers)
    return {"broker_kills": kills, "broker_kills_survived": survived}


def going_on(workers: list, config: WorkloadConfig, since: float) -> bool:
    alive = [w for w in workers if w.process.poll() is None]
    return every_turn_reported(workers, config) or sum(len(w.committed(since=since)) for w in alive) >= 6


def failover(bootstrap: str, work: Path, quick: bool, cluster: Any = None, broker_kills: int = 2) -> dict:
    url = namespace_url(bootstrap, "bench-failover")
    config = workload(
        url, name="failover", groups=10 if quick else 20, max_turns=30 if quick else 40, turn_delay_ms=300
    )
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
        moved_at = wait_for(
            lambda: moved <= survivors[0].partitions() | survivors[1].partitions(),
            120,
            "the survivors to take the partitions",
            survivors,
        )
        assigned = [t for w in survivors for t, _ in w.seen("partitions-assigned", since=killed)]
        moved_rollouts = {
            s.rollout_id for s in workload_specs(config) if partition_for(s.rollout_id, PARTITIONS) in moved
        }
        wait_for(
            lambda: any(rid in moved_rollouts for w in survivors for _, rid, _ in w.committed()),
            120,
            "a survivor to commit a turn of a moved rollout",
            survivors,
        )

        zombie, other = survivors
        taken = zombie.partitions()
        zombie.signal(signal.SIGSTOP)
        log(f"zombie: SIGSTOPped w1, owner of partitions {sorted(taken)}")
        try:
            wait_for(
                lambda: taken <= other.partitions(),
                120,
                "the other survivor to take the stalled worker's partitions",
                [other],
            )
        finally:
            zombie.signal(signal.SIGCONT)
        kills = {"broker_kills": 0, "broker_kills_survived": 0}
        if cluster is not None and broker_kills:
            kills = kill_brokers(cluster, survivors, config, broker_kills)
        exited = [w.name for w in survivors if w.process.poll() is not None]
        wait_for_every_rollout(workers, config, 600, survivors)
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
    return kills | {
        "workers_exited": len(exited),
        "workers": 3,
        "rollouts": len(workload_specs(config)),
        "partitions": PARTITIONS,
        "failover_seconds": None if first is None else round((first - killed_ms) / 1000, 2),
        "partitions_moved_seconds": round((min(assigned) if assigned else moved_at) - killed, 2),
        "takeover_seconds": round(max(admitted) - min(assigned), 2) if admitted and assigned else None,
        "takeover_phases_seconds": {
            "take_writers_and_read": round(max((p[0] for p in phases), default=0), 2),
            "restore_and_fence": round(max((p[1] for p in phases), default=0), 2),
        },
        "session_timeout_seconds": session_timeout_seconds(),
        **audit_figures(url, config, workers, reference),
    }


def session_timeout_seconds() -> float:
    """The group's session timeout a worker runs with (its default): how long a SIGKILLed
    member's partitions wait before they move."""
    return KafkaSettings.model_fields["group_session_timeout_ms"].default / 1000


def audit_figures(
    url: str, config: WorkloadConfig, workers: list, reference: dict[str, dict | None] | None = None
) -> dict[str, Any]:
    """What the journal holds against what the ``workers`` reported durable: ``turns_lost`` (a
    turn reported durable that a fenced read does not find exactly once), ``duplicate_turns`` (a
    turn's ``TurnCompleted`` written twice), ``zombie_writes_visible`` (events of a superseded
    attempt after the newer one started, or dropped by readers); with ``reference`` (a run without
    journal or faults), ``identical_to_uninterrupted``."""
    audit = audit_journal(url, config)
    reported = reported_turns(workers)
    lost = sorted(turn for turn in reported if audit.turns_standing[turn] != 1)
    figures: dict[str, Any] = {
        "turns_lost": len(lost),
        "duplicate_turns": sum(count - 1 for count in audit.turns_written.values() if count > 1),
        "zombie_writes_visible": len(audit.fenced) + len(audit.by_writer_after_takeover),
    }
    if lost:  # what to look at: the journal's view of each, and whether a read was still held back
        figures["turns_lost_detail"] = [audit.turn_detail(*turn) for turn in lost[:5]]
    if audit.held_back:
        figures["audit_reads_held_back"] = audit.held_back[:5]
    if audit.held_back_waited_s:  # an open transaction held the audit's first read back this long
        figures["audit_held_back_waited_s"] = audit.held_back_waited_s
    if reference is not None:
        figures["identical_to_uninterrupted"] = audit.outcomes == reference
    return figures


def throughput(bootstrap: str, work: Path, quick: bool) -> dict:
    turns_per_s: dict[int, float] = {}
    for count in (1, 2, 3):
        url = namespace_url(bootstrap, f"bench-throughput-{count}")
        config = workload(
            url, name=f"tp{count}", groups=10 if quick else 20, max_turns=8 if quick else 16, turn_delay_ms=0.0
        )
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


def handoff(bootstrap: str, work: Path, turn_s: float) -> dict:
    """Two planned moves with ``turn_s`` turns in flight: a worker joins, then the first leaves."""
    url = namespace_url(bootstrap, "bench-handoff")
    config = workload(url, name="handoff", groups=4, max_turns=3, turn_delay_ms=turn_s * 1000)
    submit(url, workload_yaml(work / "handoff.yaml", **config.model_dump(mode="json", exclude={"journal"})))
    first = start_worker(url, "h0", work)
    workers = [first]
    moves: list[float] = []
    try:
        wait_for(
            lambda: len(first.partitions()) == PARTITIONS and bool(first.seen("rollouts-admitted")), 300, "h0", workers
        )
        time.sleep(min(turn_s / 3, 10.0))  # every rollout mid-turn
        second = start_worker(url, "h1", work)
        workers.append(second)
        wait_for(lambda: bool(first.seen("partitions-revoked")), 300, "the join's revocation", workers)
        moves += handoff_times(first, second, work)
        left = time.monotonic()
        first.stop()
        wait_for(lambda: len(second.partitions()) == PARTITIONS, 300, "h1 to own every partition", [second])
        moves += handoff_times(first, second, work, since=left)
    finally:
        for worker in workers:
            if worker.process.poll() is None:
                worker.process.kill()
    moves.sort()
    p99 = moves[min(len(moves) - 1, int(round(0.99 * (len(moves) - 1))))] if moves else None
    return {
        "handoff_turn_seconds": turn_s,
        "handoff_moves": len(moves),
        "handoff_seconds_p99": None if p99 is None else round(p99, 2),
        "handoff_seconds_max": round(max(moves), 2) if moves else None,
    }


def handoff_times(old: Any, new: Any, work: Path, since: float = 0.0) -> list[float]:
    """Per partition the old owner revoked (its first revocation after ``since``): from then to the new
    owner's take of it, its rollouts restored and their fences durable (``takeover-seconds``)."""
    out = []
    for revoked_at, line in old.seen("partitions-revoked", since=since)[:1]:
        for partition in (int(p) for p in line.split()[1].split(",") if p != "-"):

            def taken(p: int = partition, t: float = revoked_at) -> list[float]:
                return [a for a, text in new.seen("takeover-seconds", t) if text.split()[1] == str(p)]

            wait_for(lambda: bool(taken()), 300, f"the new owner to take partition {partition}", [new])  # noqa: B023
            out.append(min(taken()) - revoked_at)
    return out


def races(bootstrap: str, work: Path, rounds: int) -> dict:
    """Two ``resume`` slots of different writers raced on fresh namespaces."""
    duplicates = 0
    outcomes: Counter = Counter()
    for round_ in range(rounds):
        url = namespace_url(bootstrap, f"bench-race-{round_}-{os.getpid()}")
        config = workload(url, name="race", groups=2, max_turns=4, turn_delay_ms=300)
        path = workload_yaml(work / f"race{round_}.yaml", **config.model_dump(mode="json"))
        procs = []
        for writer in ("a", "b"):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "rollout_journal.replay.cli.main", "resume", str(path), "--writer", writer],
                    cwd=REPO_ROOT,
                    env=child_environment(),
                    stdout=subprocess.DEVNULL,
                    stderr=(work / f"race{round_}-{writer}.err").open("w"),
                )
            )
            time.sleep(random.uniform(0.0, 0.5))
        codes = [p.wait(900) for p in procs]
        outcomes[str(codes[1])] += 1
        if not workload_done(url):
            log(f"race {round_}: the workload is not done (exit codes {codes})")
        per_rollout = training_records(url)
        duplicates += sum(count - 1 for count in per_rollout.values() if count > 1)
        log(f"race {round_}: exit codes {codes}, training records {sum(per_rollout.values())}")
    return {"races": rounds, "race_outcomes": dict(outcomes), "duplicate_training_records": duplicates}


def training_records(url: str) -> Counter:
    from rollout_journal.journal.open import open_backend
    from rollout_journal.journal.results import ResultsDecoder

    backend = open_backend(url, read_only=True)
    decoder, found = ResultsDecoder(), Counter[str]()
    try:
        for partition in range(backend.partitions):
            for stored in backend.read_results(partition):
                published = decoder.add(stored)
                if published is not None:
                    found[published.record.rollout_id] += 1
    finally:
        backend.close()
    return found


@contextlib.contextmanager
def cluster_for(bootstrap: str | None, work: Path) -> Iterator[tuple[str, Any]]:
    """(bootstrap servers, the cluster started for the run or None): ``bootstrap`` if given (a
    running cluster), else a local 3-broker cluster under ``work``, stopped at the end."""
    if bootstrap:
        yield bootstrap, None
        return
    from rollout_journal.compose.local_broker import start_local_cluster

    log("starting a local 3-broker cluster ...")
    cluster = start_local_cluster(3, work / "kafka3")
    try:
        yield cluster.bootstrap_servers, cluster
    finally:
        cluster.stop()


def main() -> int:
    os.environ.pop("KAFKA_BOOTSTRAP_SERVERS", None)  # it would replace the servers of every URL here
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="fewer rollouts and turns")
    parser.add_argument("--bootstrap", help="a running 3-broker cluster (default: start one for the run)")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--no-broker-kills", action="store_true")
    parser.add_argument("--races", type=int, default=10, help="racing writer slots, rounds")
    parser.add_argument("--handoff-turn-s", type=float, default=60.0)
    parser.add_argument("--smoke", action="store_true", help="the suite's cheap run (see the module docstring)")
    args = parser.parse_args()
    dump_stacks_on()  # SIGUSR1: its threads' and tasks' stacks (a hang's where)
    global REPLICATION
    if args.smoke:
        REPLICATION = ""
        args.quick, args.skip_throughput, args.no_broker_kills, args.races = True, True, True, 1
        args.handoff_turn_s = 5.0
    with tempfile.TemporaryDirectory(prefix="rj-bench-fleet-") as tmp:
        work = Path(tmp)
        with cluster_for(args.bootstrap, work) as (bootstrap, cluster):
            report = failover(bootstrap, work, args.quick, cluster, 0 if args.no_broker_kills else 2)
            report |= handoff(bootstrap, work, args.handoff_turn_s)
            if args.races:
                report |= races(bootstrap, work, args.races)
            if not args.skip_throughput:
                report |= throughput(bootstrap, work, args.quick)
    print_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
