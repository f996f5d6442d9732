"""The leader-kill drill: a transactional writer keeps committing while a partition leader of a
real 3-broker cluster is SIGKILLed and restarted (the jar launcher's cluster in
tests/journal/kafka/test_faults.py, the compose file's in tests/compose/broker/test_docker_path.py).

What must hold afterwards: every batch whose ``commit`` returned is readable in
full; no batch is partly visible; no record appears twice, even for a batch that
was redone after an ambiguous failure.

How the writer redoes a batch (the policy a rollout worker follows):

- ``AbortableCommitError``: the transaction was aborted, nothing is visible:
  redo the same batch on the same backend;
- ``FatalJournalError`` (incl. ``ProducerFencedError``): the outcome of the open
  commit may be unknown (a fatal error during ``commit_transaction``). Open a new
  backend with the same ``transactional.id``: its ``init_transactions`` completes
  or aborts the previous producer's transaction, so afterwards a read_committed
  read shows whether the batch landed. Redo it only if it did not.

Retriable errors (leader elections, a coordinator moving, request timeouts) are
retried inside the backend, ``commit_transaction`` included, and never reach the
writer.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field

import pytest
from confluent_kafka import Producer

from rollout_journal.journal.backend import OutRecord, Stream, partition_for
from rollout_journal.journal.errors import AbortableCommitError, FatalJournalError, JournalError
from rollout_journal.journal.kafka.backend import KafkaBackend
from rollout_journal.journal.kafka.config import KafkaSettings

log = logging.getLogger(__name__)

ROLLOUTS = [f"rollout-{i}" for i in range(6)]
RECORDS_PER_BATCH = 4


@dataclass
class WriterLog:
    committed: list[int] = field(default_factory=list)  # batch ids whose commit returned
    committed_at: list[float] = field(default_factory=list)
    found_after_fatal: list[int] = field(default_factory=list)  # ambiguous commits that had landed
    abortable: int = 0
    fatal: int = 0
    errors: list[str] = field(default_factory=list)
    failure: BaseException | None = None


def batch_records(batch: int) -> list[OutRecord]:
    """A few records on two rollouts; every record carries a globally unique sequence number."""
    out = []
    for i in range(RECORDS_PER_BATCH):
        rollout = ROLLOUTS[(batch + i % 2) % len(ROLLOUTS)]
        seq = batch * RECORDS_PER_BATCH + i
        out.append(OutRecord(Stream.EVENTS, rollout, json.dumps({"batch": batch, "seq": seq}).encode(), rollout))
    return out


def batch_landed(backend: KafkaBackend, batch: int) -> bool:
    partitions = {partition_for(r.partition_key, backend.partitions) for r in batch_records(batch)}
    return any(json.loads(r.value)["batch"] == batch for p in partitions for r in backend.read_events(p) if r.value)


def open_backend(settings: KafkaSettings, deadline: float) -> KafkaBackend:
    while True:
        try:
            return KafkaBackend(settings, create_topics=False)
        except JournalError as exc:
            if time.monotonic() > deadline:
                raise
            log.warning("reopening the writer failed (%s); retrying", exc)
            time.sleep(0.5)


def writer(settings: KafkaSettings, stop: threading.Event, out: WriterLog) -> None:
    try:
        backend = open_backend(settings, time.monotonic() + 60)
        batch = 0
        while not stop.is_set():
            records = batch_records(batch)
            while True:
                try:
                    backend.commit(records)
                    out.committed.append(batch)
                    out.committed_at.append(time.monotonic())
                    break
                except AbortableCommitError as exc:
                    out.abortable += 1
                    out.errors.append(f"batch {batch}: abortable: {exc}")
                except FatalJournalError as exc:
                    out.fatal += 1
                    out.errors.append(f"batch {batch}: fatal: {exc}")
                    backend.close()
                    backend = open_backend(settings, time.monotonic() + 60)  # fences the old producer
                    if batch_landed(backend, batch):
                        out.found_after_fatal.append(batch)
                        out.committed.append(batch)
                        out.committed_at.append(time.monotonic())
                        break
            batch += 1
            time.sleep(0.01)
        backend.close()
    except BaseException as exc:  # surfaced by the test thread
        out.failure = exc


def leader_kill_drill(cluster) -> None:
    """The drill on any 3-broker cluster with ``bootstrap_servers``, ``partition_leader``,
    ``kill_node`` and ``restart_node`` (the jar launcher's, or compose's in tests/compose/broker/test_docker_path.py)."""
    settings = KafkaSettings(
        bootstrap_servers=cluster.bootstrap_servers,
        namespace="faults",
        partitions=3,
        replication_factor=3,
        min_insync_replicas=2,
        transactional_id="fault-writer-0",
        transaction_timeout_ms=30_000,
        operation_timeout_ms=30_000,
    )
    with KafkaBackend(settings, transactional=False):  # create the topics
        pass

    stop = threading.Event()
    out = WriterLog()
    thread = threading.Thread(target=writer, args=(settings, stop, out), name="journal-writer", daemon=True)
    thread.start()
    try:
        wait_for(lambda: len(out.committed) >= 20 or out.failure is not None, 60, "the first 20 commits")
        victim_partition = partition_for(ROLLOUTS[0], settings.partitions)
        victim = cluster.partition_leader(settings.events_topic, victim_partition)
        assert victim is not None
        killed_at = time.monotonic()
        cluster.kill_node(victim)
        log.info("killed node %d, leader of %s[%d]", victim, settings.events_topic, victim_partition)

        # Keep appending with one broker down (2 in-sync replicas remain); the writer usually
        # commits again within seconds, once leadership and the transaction coordinator move.
        wait_for(
            lambda: (
                any(t > killed_at + 1 for t in out.committed_at)
                or out.failure is not None
                or time.monotonic() > killed_at + 20
            ),
            30,
            "the outage window",
        )
        restarted_at = time.monotonic()
        cluster.restart_node(victim)
        wait_for(
            lambda: any(t > restarted_at for t in out.committed_at) or out.failure is not None,
            90,
            "a commit after the restart",
        )
    finally:
        stop.set()
        thread.join(90)
    assert not thread.is_alive(), "the writer did not stop"
    if out.failure is not None:
        raise out.failure

    during_outage = [t for t in out.committed_at if killed_at + 1 < t < restarted_at]
    after_kill = [t for t in out.committed_at if t > killed_at + 1]
    assert after_kill, f"no commit succeeded after node {victim} was killed; errors: {out.errors[-5:]}"

    with KafkaBackend(settings, transactional=False, create_topics=False) as reader:
        seen: dict[int, int] = {}
        batches: dict[int, set[int]] = {}
        for p in range(reader.partitions):
            for record in reader.read_events(p):
                assert record.error is None, record.error
                body = json.loads(record.value)
                seen[body["seq"]] = seen.get(body["seq"], 0) + 1
                batches.setdefault(body["batch"], set()).add(body["seq"])

    duplicated = sorted(seq for seq, count in seen.items() if count > 1)
    assert not duplicated, f"records written twice: {duplicated[:20]}"
    missing = [b for b in out.committed if b not in batches]
    assert not missing, f"batches whose commit returned are not readable: {missing[:20]}"
    partial = {b: sorted(s) for b, s in batches.items() if len(s) != RECORDS_PER_BATCH}
    assert not partial, f"batches only partly visible: {partial}"
    assert len(set(out.committed)) == len(out.committed)
    assert set(batches) == set(out.committed), "a batch is visible although its commit never returned"
    log.info(
        "fault run: %d batches committed (%d during the outage), %d abortable redos, %d fatal reopenings "
        "(%d of them had landed)",
        len(out.committed),
        len(during_outage),
        out.abortable,
        out.fatal,
        len(out.found_after_fatal),
    )


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def open_transaction(backend: KafkaBackend, transactional_id: str, partition: int) -> Producer:
    """Another writer's transaction, left open on ``partition`` of the events topic with one record
    (``b"pending"``, key ``r``) delivered: as a writer killed inside it leaves it, until the broker
    aborts it (or the caller ends it)."""
    producer = Producer({**backend.producer_config(), "transactional.id": transactional_id})
    producer.init_transactions(60)
    producer.begin_transaction()
    producer.produce(backend.events_topic, key=b"r", value=b"pending", partition=partition)
    producer.flush(60)
    return producer
