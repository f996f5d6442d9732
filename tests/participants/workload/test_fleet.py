"""A fleet of real ``rollout-journal worker`` processes on one Kafka namespace.

- SIGKILL one of three workers on a 3-broker cluster: the others take its partitions after
  the group's session timeout and every rollout finishes, identical to an uninterrupted run,
  with no committed turn lost and none written twice;
- SIGSTOP a worker past the session timeout (a zombie), let the others take over and go on,
  SIGCONT it: nothing it still tries to write lands, and it drops those rollouts;
- scale out (a worker joins) and in (SIGTERM one): the partitions move at once, mid-turn (a
  turn in flight is abandoned and redone by the new owner), and no turn is committed twice.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from rollout_journal.journal.backend import partition_for
from rollout_journal.journal.open import open_journal
from rollout_journal.journal.restore import RestorePlan
from rollout_journal.participants.workload.config import FailurePolicy, WorkloadConfig
from rollout_journal.participants.workload.specs import workload_specs
from tests.support.failures import run_killing
from tests.support.fleet_support import (
    JournalAudit,
    audit_journal,
    not_reported_finished,
    reported_turns,
    start_worker,
    submit,
    wait_for,
    wait_for_every_rollout,
    workload_done,
    workload_yaml,
)
from tests.support.recovery_support import reference_outcomes

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(600)]


def fleet_workload(url: str, **overrides: object) -> WorkloadConfig:
    base: dict[str, object] = dict(
        name="fleet",
        groups=20,
        siblings=3,
        max_turns=4,
        environment="workplace,counter",
        seed=5,
        allow_early_submit=False,
        turn_delay_ms=800,
        snapshot_every_turns=2,
        journal=url,
    )
    return WorkloadConfig(**(base | overrides))


def submitted(config: WorkloadConfig, tmp_path: Path) -> None:
    path = workload_yaml(tmp_path / f"{config.name}.yaml", **config.model_dump(mode="json", exclude={"journal"}))
    submit(config.journal, path)


def balanced(workers: list, partitions: int) -> None:
    """Wait until the group settled: every worker owns partitions, and each partition one worker."""
    wait_for(
        lambda: (
            all(w.partitions() for w in workers)
            and sorted(p for w in workers for p in w.partitions()) == list(range(partitions))
        ),
        240,
        "the workers to share the partitions",
        workers,
    )


def assert_nothing_lost_or_doubled(config: WorkloadConfig, workers: list, reference: dict[str, dict]) -> JournalAudit:
    audit = audit_journal(config.journal, config)
    assert audit.outcomes == reference, "a rollout differs from the uninterrupted run"
    reported = reported_turns(workers)
    lost = sorted(turn for turn in reported if audit.turns_standing[turn] != 1)
    assert not lost, f"committed turns missing from the journal: {lost[:10]}"
    twice = sorted(turn for turn, count in audit.turns_written.items() if count > 1)
    assert not twice, f"turns written twice: {twice[:10]}"
    assert not audit.fenced, [str(f) for f in audit.fenced]
    assert not audit.by_writer_after_takeover, audit.by_writer_after_takeover[:5]
    return audit


def test_a_sigkilled_worker_s_rollouts_move_and_finish_as_if_uninterrupted(
    kafka_cluster3, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)  # the URL names the 3-broker cluster
    url = f"kafka://{kafka_cluster3.bootstrap_servers}/fleet?partitions=12&replication_factor=3&min_insync_replicas=2"
    config = fleet_workload(url, turn_delay_ms=2000)
    assert len(workload_specs(config)) >= 60
    reference = reference_outcomes(config)
    workers = [start_worker(url, f"w{i}", tmp_path) for i in range(3)]
    try:
        balanced(workers, 12)
        submitted(config, tmp_path)  # the workers pick it up
        wait_for(lambda: all(w.committed() for w in workers), 240, "every worker to commit turns", workers)
        victim, survivors = workers[0], workers[1:]
        moved = victim.partitions()
        killed = time.monotonic()
        victim.signal(signal.SIGKILL)
        victim.process.wait()
        wait_for(
            lambda: moved <= set().union(*(w.partitions() for w in survivors)),
            120,
            "the survivors to take the killed worker's partitions",
            survivors,
        )
        wait_for_every_rollout(workers, config, 300, survivors)
        assert workload_done(url)  # and `status` says so
        for worker in survivors:
            assert worker.stop() == 0, worker.stderr()
    finally:
        for worker in workers:
            if worker.process.poll() is None:
                worker.process.kill()
    audit = assert_nothing_lost_or_doubled(config, workers, reference)
    resumed = [
        rid
        for rid, attempts in audit.attempts.items()
        if partition_for(rid, 12) in moved and any(a.header.writer != "w0" for a in attempts[1:])
    ]
    assert resumed, "no rollout of the killed worker's partitions was resumed by a survivor"
    after_kill = [rid for w in survivors for _, rid, _ in w.committed(since=killed) if partition_for(rid, 12) in moved]
    assert after_kill, "the survivors committed no turn of a moved rollout"


def test_a_zombie_worker_writes_nothing_after_its_partitions_moved(
    kafka_bootstrap: str, kafka_namespace: str, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)
    url = f"kafka://{kafka_bootstrap}/{kafka_namespace}?partitions=4"
    config = fleet_workload(url, groups=4, siblings=3, max_turns=8, turn_delay_ms=2000)
    reference = reference_outcomes(config)
    zombie, other = start_worker(url, "zombie", tmp_path), start_worker(url, "other", tmp_path)
    workers = [zombie, other]
    try:
        balanced(workers, 4)
        submitted(config, tmp_path)
        wait_for(lambda: zombie.committed(), 240, "the zombie to commit turns", workers)
        taken = zombie.partitions()
        zombie.signal(signal.SIGSTOP)  # a stall past the group's session timeout
        stopped = time.monotonic()
        wait_for(
            lambda: taken <= other.partitions(), 120, "the other worker to take the stalled one's partitions", [other]
        )
        wait_for(
            lambda: any(partition_for(rid, 4) in taken for _, rid, _ in other.committed(since=stopped)),
            120,
            "the other worker to commit a turn of a moved rollout",
            [other],
        )
        resumed = time.monotonic()
        zombie.signal(signal.SIGCONT)
        wait_for(
            lambda: zombie.seen("partitions-lost", since=resumed),
            120,
            "the zombie to find its partitions lost",
            workers,
        )
        wait_for_every_rollout(workers, config, 300, workers)
        for worker in workers:
            assert worker.stop() == 0, worker.stderr()
    finally:
        for worker in workers:
            if worker.process.poll() is None:
                worker.process.kill()
    # Nothing the zombie wrote after the takeover landed (audited in the journal: no event of a superseded
    # attempt after a newer one started, none fenced by readers), and it let every moved rollout go.
    assert_nothing_lost_or_doubled(config, workers, reference)
    moved = {s.rollout_id for s in workload_specs(config) if partition_for(s.rollout_id, 4) in taken}
    assert set(zombie.report()["dropped"]) == moved


def test_scaling_out_and_in_moves_partitions_at_turn_boundaries(
    kafka_bootstrap: str, kafka_namespace: str, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)
    url = f"kafka://{kafka_bootstrap}/{kafka_namespace}?partitions=6"
    config = fleet_workload(url, groups=6, siblings=2, max_turns=24, turn_delay_ms=2000)  # outlasts a loaded start
    reference = reference_outcomes(config)
    submitted(config, tmp_path)
    first = start_worker(url, "first", tmp_path)
    workers = [first]
    try:
        wait_for(
            lambda: len(first.partitions()) == 6 and len(first.committed()) >= 12,
            240,
            "the first worker alone to commit a turn of every rollout",
            workers,
        )
        second = start_worker(url, "second", tmp_path)  # scale out: it takes some of the first's partitions
        workers.append(second)
        wait_for(
            lambda: second.partitions() and second.committed(), 120, "the new worker to take over and go on", workers
        )
        assert first.seen("partitions-revoked"), "the first worker handed nothing on"
        assert first.stop() == 0, first.stderr()  # scale in: it hands everything on and leaves
        wait_for(lambda: len(second.partitions()) == 6, 60, "the second worker to own every partition", [second])
        wait_for_every_rollout(workers, config, 300, [second])
        assert workload_done(url)
        assert second.stop() == 0, second.stderr()
    finally:
        for worker in workers:
            if worker.process.poll() is None:
                worker.process.kill()
    audit = assert_nothing_lost_or_doubled(config, workers, reference)
    twice = sorted(turn for turn, count in reported_turns(workers).items() if count > 1)
    assert not twice, f"turns reported durable twice across a planned move: {twice[:10]}"
    # Every turn stands once. (A turn whose commit was under way when its partition moved is
    # durable, but its old owner had cancelled it, so it may be reported by nobody.)
    assert sum(audit.turns_standing.values()) == sum(o["turns"] for o in reference.values())
    assert set(audit.turns_standing.values()) == {1}


def test_a_worker_that_takes_a_given_up_rollout_never_runs_it_again(
    kafka_bootstrap: str, kafka_namespace: str, tmp_path: Path
) -> None:
    """A rollout given up in a run on the namespace is terminal for a fleet's worker too: it is
    admitted like a finished one (its record is on the results stream already), never resumed."""
    url = f"kafka://{kafka_bootstrap}/{kafka_namespace}?partitions=4"
    config = fleet_workload(
        url,
        name="gaveup",
        groups=2,
        siblings=2,
        max_turns=2,
        environment="sandbox",
        turn_delay_ms=0,
        turns_in_flight=1,
        failure_policy=FailurePolicy(max_failures=1),
    )
    victim = "gaveup-g1-s0"
    assert set(run_killing(config, {victim}).given_up) == {victim}

    def victims_events() -> list:
        with open_journal(url, writer="audit", read_only=True) as journal:
            return [item.event for item in journal.read_rollout(victim)]

    before = victims_events()
    partitions = {partition_for(s.rollout_id, 4) for s in workload_specs(config)}
    worker = start_worker(url, "w0", tmp_path)
    try:
        wait_for(
            lambda: len(worker.seen("rollouts-admitted gaveup ")) == len(partitions),
            300,
            "the worker admitting the workload's rollouts on every partition",
            [worker],
        )
    finally:
        assert worker.stop() == 0, worker.stderr()[-2000:]
    report = worker.report()
    assert report["turns_run"] == 0 and report["finished_here"] == 0 and list(report["given_up"]) == [victim]
    # It ran no turn, yet says every rollout's result is published: a fleet's wait for its rollouts
    # sees those a take found finished (a final turn whose commit's outcome its writer never learned).
    assert not_reported_finished([worker], config) == []
    assert report["given_up"][victim].startswith("SandboxCrashedError")
    assert victims_events() == before  # no attempt of it started: nothing written
    assert workload_done(url)  # given up counts as done


def test_a_workload_submitted_to_an_idle_worker_is_picked_up_and_run(
    kafka_bootstrap: str, kafka_namespace: str, tmp_path: Path
) -> None:
    """A worker that joined a namespace with nothing to do learns of a workload submitted later (from
    ``<namespace>.workloads``, which it follows) and runs it to its end."""
    url = f"kafka://{kafka_bootstrap}/{kafka_namespace}?partitions=4"
    config = fleet_workload(url, name="late", groups=2, siblings=1, max_turns=2, turn_delay_ms=0)
    worker = start_worker(url, "w0", tmp_path)
    try:
        wait_for(lambda: len(worker.partitions()) == 4, 240, "the idle worker to own every partition", [worker])
        submitted(config, tmp_path)
        wait_for(lambda: worker.seen("workload-picked-up late "), 120, "the worker to pick the workload up", [worker])
        wait_for(lambda: workload_done(url), 240, "the late workload to finish", [worker])
    finally:
        assert worker.stop() == 0, worker.stderr()[-2000:]
    report = worker.report()
    assert report["finished_here"] == 2


def test_a_workload_picked_up_while_a_take_reads_is_admitted_on_that_partition(
    kafka_bootstrap: str, kafka_namespace: str, tmp_path: Path
) -> None:
    """A worker learns of a workload while its takes are still reading (a fleet that starts as the
    workload is submitted): the pick-up finds those partitions not yet owned, so each take must
    admit the workload's rollouts there itself, or they stay pending for good. The takes' reads are
    held (the real read, behind a gate) until the worker has picked the workload up."""
    from rollout_journal.participants.workload.worker import FleetWorker

    url = f"kafka://{kafka_bootstrap}/{kafka_namespace}?partitions=4"
    config = fleet_workload(url, name="midtake", groups=4, siblings=1, max_turns=1, turn_delay_ms=0)
    expected = {partition_for(s.rollout_id, 4) for s in workload_specs(config)}
    events: list[str] = []
    turns: list[str] = []
    reading, gate = threading.Event(), threading.Event()
    worker = FleetWorker(url, name="w0", on_event=events.append, on_turn=lambda rid, _: turns.append(rid), poll_s=0.2)
    read = worker._take_and_read

    def held_read(partition: int, token: int, ids: set[str]) -> RestorePlan:
        reading.set()
        gate.wait(120)  # bounded: a test that never opens it still ends
        return read(partition, token, ids)

    worker._take_and_read = held_read  # type: ignore[method-assign]

    async def until(condition: Callable[[], bool], what: str, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}; events: {events}"
            await asyncio.sleep(0.05)

    async def scenario() -> None:
        stop = asyncio.Event()
        running = asyncio.create_task(worker.run(stop))
        try:
            await until(reading.is_set, "a take to start reading")
            await asyncio.to_thread(submitted, config, tmp_path)
            await until(lambda: any(e.startswith("workload-picked-up midtake ") for e in events), "the pick-up")
            gate.set()
            await until(lambda: sum(e.startswith("takeover-seconds ") for e in events) == 4, "every take")
            admitted = {
                int(e.split()[2].removeprefix("p")) for e in events if e.startswith("rollouts-admitted midtake")
            }
            assert admitted == expected, f"partitions whose rollouts were never admitted: {expected - admitted}"
            await until(lambda: len(set(turns)) == 4, "every rollout's turn")
        finally:
            gate.set()
            stop.set()
            await running

    asyncio.run(scenario())


def test_a_pick_up_admits_nothing_on_a_partition_whose_revocation_is_still_queued(
    kafka_bootstrap: str, kafka_namespace: str, tmp_path: Path
) -> None:
    """The group's callback disowns a revoked partition at once (its appends are refused from
    then on) and queues the rest of the revocation behind whatever the worker's membership task
    is doing. A workload picked up in between must not be admitted on that partition: its
    rollouts would build environments and run turns beside their new owner, only to be refused."""
    from rollout_journal.participants.workload.worker import FleetWorker

    url = f"kafka://{kafka_bootstrap}/{kafka_namespace}?partitions=4"
    config = fleet_workload(url, name="queued", groups=4, siblings=1, max_turns=1, turn_delay_ms=0)
    expected = {partition_for(s.rollout_id, 4) for s in workload_specs(config)}
    gone = min(expected)  # a partition that holds rollouts of the workload
    events: list[str] = []
    worker = FleetWorker(url, name="w0", on_event=events.append, poll_s=0.2)

    async def until(condition: Callable[[], bool], what: str, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}; events: {events}"
            await asyncio.sleep(0.05)

    def admitted() -> set[int]:
        return {int(e.split()[2].removeprefix("p")) for e in events if e.startswith("rollouts-admitted queued")}

    async def scenario() -> None:
        stop = asyncio.Event()
        running = asyncio.create_task(worker.run(stop))
        try:
            await until(lambda: sum(e.startswith("takeover-seconds ") for e in events) == 4, "every take")
            assert worker._journal is not None
            worker._journal.backend.disown([gone])  # type: ignore[attr-defined]  # the callback's first step
            await asyncio.to_thread(submitted, config, tmp_path)
            await until(lambda: admitted() >= expected - {gone}, "the other partitions' admissions")
            await asyncio.sleep(1.0)  # the pick-up has run (the others were admitted by it); let any stray one show
            assert gone not in admitted(), f"rollouts admitted on partition {gone}, disowned"
        finally:
            stop.set()
            await running

    asyncio.run(scenario())


def test_a_worker_in_coordinated_mode_leaves_no_task_behind(
    kafka_bootstrap: str, kafka_namespace: str, tmp_path: Path
) -> None:
    """A worker embedded in a longer-lived program (a trainer's event loop) must stop everything it
    started when its ``run`` returns: a coordinated checkpoint task left running would wake every
    ``coordinated_every_s`` for the life of that loop, checkpointing through a closed journal."""
    from rollout_journal.participants.workload.worker import FleetWorker

    url = f"kafka://{kafka_bootstrap}/{kafka_namespace}?partitions=2"
    config = fleet_workload(
        url,
        name="coord",
        groups=2,
        siblings=1,
        max_turns=3,
        turn_delay_ms=300,
        checkpoint_mode="coordinated",
        coordinated_every_s=0.2,
    )
    events: list[str] = []
    turns: list[str] = []
    worker = FleetWorker(url, name="w0", on_event=events.append, on_turn=lambda rid, _: turns.append(rid), poll_s=0.2)

    async def until(condition: Callable[[], bool], what: str, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}; events: {events}"
            await asyncio.sleep(0.05)

    async def scenario() -> list[str]:
        stop = asyncio.Event()
        running = asyncio.create_task(worker.run(stop))
        try:
            await asyncio.to_thread(submitted, config, tmp_path)
            await until(lambda: len(turns) >= 2, "two committed turns")
            await asyncio.sleep(0.5)  # a few checkpoint periods
        finally:
            stop.set()
            await running
        await asyncio.sleep(0)  # what was cancelled has had its step
        me = asyncio.current_task()
        return sorted(task.get_name() for task in asyncio.all_tasks() if task is not me and not task.done())

    assert asyncio.run(scenario()) == []
