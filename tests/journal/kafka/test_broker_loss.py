"""A fleet keeps running through the loss and return of any one broker of a replicated cluster.

Three real ``rollout-journal worker`` processes on a 3-broker cluster (replication 3,
``min.insync.replicas=2``); while they run a workload, each broker in turn is SIGKILLed, left down
until the workers commit again, and restarted, and once more after that. librdkafka flags few of
the errors this produces as retriable (``_DESTROY_BROKER`` on an offset query once made every
worker exit): the backend's one retry policy (``journal.kafka.retry``) must absorb them all. No
worker exits, and every rollout finishes as in an uninterrupted run, no committed turn lost, none
written twice.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from rollout_journal.participants.workload.config import WorkloadConfig
from tests.support.fleet_support import (
    audit_journal,
    every_turn_reported,
    reported_turns,
    start_worker,
    submit,
    wait_for,
    wait_for_every_rollout,
    workload_yaml,
)
from tests.support.recovery_support import reference_outcomes

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(1200)]

PARTITIONS = 6


def test_workers_survive_every_broker_killed_and_restarted_in_turn(kafka_cluster3, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)  # the URL names the 3-broker cluster
    url = (
        f"kafka://{kafka_cluster3.bootstrap_servers}/loss?partitions={PARTITIONS}"
        "&replication_factor=3&min_insync_replicas=2"
    )
    config = WorkloadConfig(
        name="loss",
        groups=4,
        siblings=3,
        max_turns=80,
        environment="workplace,counter",
        seed=9,
        allow_early_submit=False,
        turn_delay_ms=1000,
        snapshot_every_turns=4,
        journal=url,
    )
    reference = reference_outcomes(config)
    workers = [start_worker(url, f"w{i}", tmp_path) for i in range(3)]
    kills = 0
    try:
        wait_for(
            lambda: sorted(p for w in workers for p in w.partitions()) == list(range(PARTITIONS)),
            300,
            "the workers to share the partitions",
            workers,
        )
        submit(url, workload_yaml(tmp_path / "loss.yaml", **config.model_dump(mode="json", exclude={"journal"})))
        wait_for(lambda: all(w.committed() for w in workers), 300, "every worker to commit turns", workers)
        for node in (1, 2, 3, 1):
            if every_turn_reported(workers, config):
                break
            kafka_cluster3.kill_node(node)
            kills += 1
            killed = time.monotonic()
            # Down until the fleet committed again on the two brokers left (or finished).
            wait_for(
                lambda since=killed: going_on(workers, config, since),
                300,
                f"commits with broker {node} down",
                workers,
            )
            kafka_cluster3.restart_node(node, ready_timeout_s=300)  # a loaded machine restarts a JVM slowly
            restarted = time.monotonic()
            wait_for(
                lambda since=restarted: going_on(workers, config, since),
                300,
                f"commits after broker {node} restarted",
                workers,
            )
        wait_for_every_rollout(workers, config, 600, workers)
        exited = [w.name for w in workers if w.process.poll() is not None]
        assert not exited, f"workers exited during the broker kills: {exited}"
        for worker in workers:
            assert worker.stop() == 0, worker.stderr()[-3000:]
    finally:
        for worker in workers:
            if worker.process.poll() is None:
                worker.process.kill()
    assert kills >= 3, f"the workload finished after {kills} broker kills: make it longer"
    audit = audit_journal(url, config)
    assert audit.outcomes == reference, "a rollout differs from the uninterrupted run"
    reported = reported_turns(workers)
    lost = sorted(turn for turn in reported if audit.turns_standing[turn] != 1)
    assert not lost, f"committed turns missing from the journal: {lost[:10]}"
    twice = sorted(turn for turn, count in audit.turns_written.items() if count > 1)
    assert not twice, f"turns written twice: {twice[:10]}"
    assert not audit.fenced and not audit.by_writer_after_takeover


def going_on(workers: list, config: WorkloadConfig, since: float) -> bool:
    """The fleet committed turns since ``since`` (or finished)."""
    return every_turn_reported(workers, config) or sum(len(w.committed(since=since)) for w in workers) >= 6
