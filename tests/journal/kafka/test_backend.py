"""The Kafka backend against a real broker: atomic batches, fencing, compaction, topics, settings."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import pytest
from confluent_kafka import KafkaException, Producer
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    ConfigSource,
    NewTopic,
    ResourceType,
)

from rollout_journal.journal.backend import HeldBack, OutRecord, StoredRecord, Stream, partition_for
from rollout_journal.journal.deadlines import Deadline
from rollout_journal.journal.errors import (
    AbortableCommitError,
    ConfigurationError,
    CorruptRecordError,
    FatalJournalError,
    JournalClosedError,
    ProducerFencedError,
    RecordLocation,
    UnstableReadError,
)
from rollout_journal.journal.events import BlobChunk, RolloutAcknowledged, RolloutFinished, Snapshot
from rollout_journal.journal.journal import Cursor, Journal, ReadReport
from rollout_journal.journal.kafka import readers as readers_module
from rollout_journal.journal.kafka.backend import KafkaBackend
from rollout_journal.journal.kafka.config import KafkaSettings
from rollout_journal.journal.restore import load_rollouts
from rollout_journal.journal.snapshots import BLOB_MARK, SnapshotDraft, fence_key
from tests.support.journal_conformance import header, model_call, started, turn_done
from tests.support.kafka_drills import open_transaction

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]


def make_settings(bootstrap: str, namespace: str, **overrides: object) -> KafkaSettings:
    values: dict[str, object] = {
        "bootstrap_servers": bootstrap,
        "namespace": namespace,
        "transactional_id": f"{namespace}-worker-0",
        "operation_timeout_ms": 20_000,
    }
    values.update(overrides)
    return KafkaSettings(**values)


@pytest.fixture
def settings(kafka_bootstrap: str, kafka_namespace: str) -> KafkaSettings:
    return make_settings(kafka_bootstrap, kafka_namespace)


@pytest.fixture
def backend(settings: KafkaSettings) -> Iterator[KafkaBackend]:
    with KafkaBackend(settings) as b:
        yield b


def event(rollout: str, value: bytes) -> OutRecord:
    return OutRecord(Stream.EVENTS, rollout, value, rollout)


def values(records: list[StoredRecord]) -> list[bytes | None]:
    return [r.value for r in records]


# -- round trip ---------------------------------------------------------------------------------


def test_committed_records_read_back_at_their_locations(backend: KafkaBackend) -> None:
    rollouts = [f"rollout-{i}" for i in range(12)]
    batch = [event(r, f"{r}:turn-{t}".encode()) for t in range(3) for r in rollouts]
    batch.append(OutRecord(Stream.SNAPSHOTS, "rollout-0", b"snapshot-0", "rollout-0"))

    locations = backend.commit(batch)

    assert len(locations) == len(batch)
    for record, loc in zip(batch, locations):
        topic = backend.events_topic if record.stream is Stream.EVENTS else backend.snapshots_topic
        assert loc.source == topic
        assert loc.partition == partition_for(record.partition_key, backend.partitions)
    used = {loc.partition for loc in locations[:-1]}
    assert len(used) > 1, "twelve rollouts should spread over several partitions"

    for partition in used:
        read = list(backend.read_events(partition))
        expected = [
            (r.key, r.value, loc)
            for r, loc in zip(batch, locations)
            if loc.partition == partition and r.stream is Stream.EVENTS
        ]
        assert [(s.key, s.value, s.location) for s in read] == expected
        assert all(s.error is None for s in read)
        assert backend.end_offset(partition) >= read[-1].location.offset + 1

    snapshots = list(backend.read_snapshots())
    assert [(s.key, s.value, s.location) for s in snapshots] == [("rollout-0", b"snapshot-0", locations[-1])]


def test_read_from_an_offset_returns_the_suffix(backend: KafkaBackend) -> None:
    for turn in range(5):
        backend.commit([event("r", f"turn-{turn}".encode())])
    partition = partition_for("r", backend.partitions)
    everything = list(backend.read_events(partition))
    assert values(everything) == [f"turn-{t}".encode() for t in range(5)]

    third = everything[2].location.offset
    assert values(list(backend.read_events(partition, third))) == [b"turn-2", b"turn-3", b"turn-4"]
    # an offset between records (a transaction marker) starts at the next record
    assert values(list(backend.read_events(partition, third - 1))) == [b"turn-2", b"turn-3", b"turn-4"]
    assert list(backend.read_events(partition, backend.end_offset(partition))) == []
    assert list(backend.read_events((partition + 1) % backend.partitions)) == []


def test_a_read_ends_at_the_end_seen_when_it_started(backend: KafkaBackend) -> None:
    partition = partition_for("grow", backend.partitions)
    backend.commit([event("grow", b"a"), event("grow", b"b")])
    reading = backend.read_events(partition)
    first = next(reading)
    backend.commit([event("grow", b"later")])  # the log grows while we read
    assert [first.value, *values(list(reading))] == [b"a", b"b"]
    assert values(list(backend.read_events(partition))) == [b"a", b"b", b"later"]


def test_interleaved_reads_on_one_backend_each_see_their_partition(backend: KafkaBackend) -> None:
    a, b = "alpha", "bravo-7"
    assert partition_for(a, backend.partitions) != partition_for(b, backend.partitions)
    backend.commit([event(a, f"a{i}".encode()) for i in range(50)] + [event(b, f"b{i}".encode()) for i in range(50)])
    ra = backend.read_events(partition_for(a, backend.partitions))
    rb = backend.read_events(partition_for(b, backend.partitions))
    got_a, got_b = [], []
    for x, y in zip(ra, rb):
        got_a.append(x.value)
        got_b.append(y.value)
    assert got_a == [f"a{i}".encode() for i in range(50)]
    assert got_b == [f"b{i}".encode() for i in range(50)]
    # pooled consumers are reused, not re-created per read
    for _ in range(5):
        assert len(list(backend.read_events(partition_for(a, backend.partitions)))) == 50
    assert backend.readers.open_consumers <= 2


# -- atomic batches -------------------------------------------------------------------------------


def test_an_aborted_batch_is_never_visible_and_offsets_skip_it(backend: KafkaBackend) -> None:
    partition = partition_for("r", backend.partitions)
    backend.commit([event("r", b"turn-1")])
    staged = backend.stage(
        [event("r", b"doomed-a"), event("r", b"doomed-b"), OutRecord(Stream.SNAPSHOTS, "r", b"doomed-snapshot", "r")]
    )
    doomed_offsets = [loc.offset for loc in staged.locations]
    staged.abort()
    backend.commit([event("r", b"turn-2")])

    read = list(backend.read_events(partition))
    assert values(read) == [b"turn-1", b"turn-2"]
    offsets = [r.location.offset for r in read]
    assert offsets[1] - offsets[0] > 1, "transaction markers and aborted records leave gaps"
    assert all(offsets[0] < o < offsets[1] for o in doomed_offsets[:2])
    assert list(backend.read_snapshots()) == []


def test_an_open_transaction_is_invisible_to_a_reader_until_committed(
    backend: KafkaBackend, settings: KafkaSettings
) -> None:
    partition = partition_for("r", backend.partitions)
    backend.commit([event("r", b"committed")])

    # a second writer (its own slot) with an open transaction on the same partition
    other = open_transaction(backend, f"{settings.namespace}-other", partition)

    with KafkaBackend(settings, transactional=False, create_topics=False) as reader:
        end_before = reader.end_offset(partition)
        assert values(list(reader.read_events(partition))) == [b"committed"]  # a tool reads to the LSO, at once
        other.commit_transaction(60)
        # another writer's commit becomes visible once the broker writes its markers (milliseconds later)
        deadline = time.monotonic() + 60
        while reader.end_offset(partition) == end_before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert values(list(reader.read_events(partition))) == [b"committed", b"pending"]


def test_a_read_only_read_held_back_by_an_open_transaction_says_which_partition(
    backend: KafkaBackend, settings: KafkaSettings
) -> None:
    # A writer killed inside its transaction (the broker aborts it only after its timeout), then a
    # resumed writer's commit after it on the same partition: a tool reads to the LSO, so it misses
    # that commit, and is told so.
    partition = partition_for("r", backend.partitions)
    backend.commit([event("r", b"before")])
    killed = open_transaction(backend, f"{settings.namespace}-killed", partition)
    backend.commit([event("r", b"after")])

    with KafkaBackend(settings, transactional=False, create_topics=False) as reader:
        stuck = reader.end_offset(partition)
        held: list[HeldBack] = []
        assert values(list(reader.read_events(partition, 0, held))) == [b"before"]
        assert [(h.topic, h.partition, h.stable_offset) for h in held] == [(reader.events_topic, partition, stuck)]
        assert held[0].high_watermark > stuck
        assert held[0].transaction_timeout_ms == settings.transaction_timeout_ms
        held = []  # a read from the LSO fetches nothing: the high watermark is asked of the broker
        assert list(reader.read_events(partition, stuck, held)) == [] and len(held) == 1
        quiet: list[HeldBack] = []  # nothing open on another partition: nothing said
        assert list(reader.read_events((partition + 1) % reader.partitions, 0, quiet)) == [] and quiet == []

        killed.abort_transaction(60)  # what the broker does at the timeout
        deadline = Deadline(60)
        while reader.end_offset(partition) <= stuck:
            assert not deadline.passed(), "the aborted transaction's markers never landed"
            deadline.sleep(0.01)
        held = []
        assert values(list(reader.read_events(partition, 0, held))) == [b"before", b"after"] and held == []


def test_a_live_writer_s_transaction_is_not_called_held_back_once_a_grace_was_spent(
    backend: KafkaBackend, settings: KafkaSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that ends at an open transaction waits a grace for it to end before it warns: a live
    writer's ends within it. Every partition a tool reads gets that grace, not only those read in
    the first grace of the pool: on a busy fleet, a listing that runs longer than it must not warn
    of each partition whose writer happens to be mid-commit as it is read."""
    held_p = partition_for("r", backend.partitions)
    live_p = next(p for p in range(backend.partitions) if p != held_p)
    live_rollout = next(f"l{i}" for i in range(1000) if partition_for(f"l{i}", backend.partitions) == live_p)
    backend.commit([event("r", b"before")])
    killed = open_transaction(backend, f"{settings.namespace}-killed", held_p)
    backend.commit([event("r", b"after")])
    live = Producer({**backend.producer_config(), "transactional.id": f"{settings.namespace}-live"})
    live.init_transactions(60)
    try:
        with KafkaBackend(settings, transactional=False, create_topics=False) as reader:
            held: list[HeldBack] = []
            list(reader.read_events(held_p, 0, held))
            assert [h.partition for h in held] == [held_p]  # a killed writer's: the pool's grace is spent

            # A live writer, mid-commit as the next read starts: its transaction ends during the read's
            # grace (made long here, so that it surely does).
            monkeypatch.setattr(readers_module, "_LIVE_TRANSACTION_GRACE_S", 120.0)
            backend.commit([event(live_rollout, b"committed")])
            live.begin_transaction()
            live.produce(backend.events_topic, key=live_rollout.encode(), value=b"live", partition=live_p)
            live.flush(60)
            reading = threading.Event()

            def commit_soon() -> None:
                reading.wait(60)
                time.sleep(0.3)  # the read has begun: it found the transaction open
                live.commit_transaction(60)

            committer = threading.Thread(target=commit_soon)
            committer.start()
            try:
                quiet: list[HeldBack] = []
                reading.set()
                assert values(list(reader.read_events(live_p, 0, quiet))) == [b"committed"]
            finally:
                committer.join(120)
            assert quiet == [], "a live writer's transaction was called held back"
    finally:
        killed.abort_transaction(60)


def test_restore_refuses_a_prefix_held_back_by_another_workers_open_transaction(settings: KafkaSettings) -> None:
    # The review's reproduction: worker 2 resumed rollout r as epoch 2 after worker X began a transaction
    # on r's partition. Worker 3's restore read to the last stable offset, X's open transaction hid
    # worker 2's fence, and worker 3 would have taken epoch 2 again.
    def slot(name: str) -> KafkaSettings:
        return settings.model_copy(update={"transactional_id": name, "stable_read_timeout_ms": 1500})

    with Journal(KafkaBackend(slot("w1"))) as first:
        first.append_sync(
            [started("r", 0), turn_done("r", 1)], SnapshotDraft(header("r", 1, turn=1), "running", 1, b"s")
        )
    partition = partition_for("r", settings.partitions)
    # X's transaction stays open until the test aborts it, however slow the machine: the broker's
    # own abort after the default 60 s would let the refused restore through.
    other = Producer(
        {
            "bootstrap.servers": settings.bootstrap_servers,
            "transactional.id": f"{settings.namespace}.x",
            "transaction.timeout.ms": 600_000,
        }
    )
    other.init_transactions(60)
    other.begin_transaction()
    for topic in (settings.events_topic, settings.snapshots_topic):
        other.produce(topic, key=b"q", value=b"worker x, still open", partition=partition)
    other.flush(60)
    with Journal(KafkaBackend(slot("w2"))) as second:
        second.append_sync([started("r", 2, attempt=2, epoch=2, turn=1)])

    with Journal(KafkaBackend(slot("w3"))) as third:
        with pytest.raises(UnstableReadError, match=rf"partition {partition}: an open transaction holds"):
            load_rollouts(third)
        other.abort_transaction(60)
        # abort_transaction returns once the abort is decided; the coordinator writes the partitions'
        # markers after that, and only then is the read stable (1.5 s may not cover it under load).
        deadline = time.monotonic() + 60
        while True:
            try:
                plan = load_rollouts(third)
                break
            except UnstableReadError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        assert plan.rollouts["r"].fence.epoch == 2


# -- fencing --------------------------------------------------------------------------------------


def test_a_zombie_writer_is_fenced_and_its_open_batch_never_appears(settings: KafkaSettings) -> None:
    zombie = KafkaBackend(settings.model_copy(update={"transactional_id": "slot-1-" + settings.namespace}))
    try:
        zombie.commit([event("r", b"zombie-committed-before")])
        staged = zombie.stage([event("r", b"zombie-uncommitted"), event("r2", b"zombie-uncommitted-2")])

        # the replacement worker takes over the slot: its init_transactions fences the zombie
        with KafkaBackend(settings.model_copy(update={"transactional_id": "slot-1-" + settings.namespace})) as fresh:
            with pytest.raises(ProducerFencedError, match="slot-1-"):
                staged.commit()
            with pytest.raises(FatalJournalError, match="refused"):
                zombie.commit([event("r", b"zombie-again")])

            fresh.commit([event("r", b"fresh-1")])
            read = list(fresh.read_events(partition_for("r", fresh.partitions)))
            assert values(read) == [b"zombie-committed-before", b"fresh-1"]
            assert b"zombie-uncommitted-2" not in values(list(fresh.read_events(partition_for("r2", fresh.partitions))))
    finally:
        zombie.close()


def test_a_zombie_fenced_between_transactions_learns_it_on_produce_as_producer_fenced(
    settings: KafkaSettings, recwarn: pytest.WarningsRecorder
) -> None:
    # The usual way a zombie learns it lost its slot: its next batch, produced and flushed after
    # the replacement's init_transactions, is refused by the coordinator (_FENCED, fatal).
    zombie = KafkaBackend(settings)
    zombie.commit([event("r", b"zombie-before")])
    with KafkaBackend(settings) as fresh:
        batch = [event(f"r{i}", f"zombie-{i}".encode()) for i in range(12)]  # every partition
        with pytest.raises(ProducerFencedError, match=settings.transactional_id):
            zombie.commit(batch)
        with pytest.raises(ProducerFencedError, match="refused"):
            zombie.commit([event("r", b"zombie-again")])
        zombie.close()
        assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in recwarn]
        fresh.commit([event("r", b"fresh")])
        seen = [v for p in range(fresh.partitions) for v in values(list(fresh.read_events(p)))]
        assert sorted(seen) == [b"fresh", b"zombie-before"]


def test_a_zombie_that_learns_it_was_fenced_inside_produce_is_still_told_so(settings: KafkaSettings) -> None:
    """The race behind a fenced `resume` that exited as a fatal error (exit 7, not 6): librdkafka's
    own thread learns of the fencing between two calls, so the next produce() answers only _FATAL.
    The cause comes from the next poll(), which confluent-kafka raises instead of calling error_cb.
    Forced here: the zombie's raw producer produces until it answers _FATAL, nothing polled."""
    from confluent_kafka import KafkaError, KafkaException

    zombie = KafkaBackend(settings)
    try:
        zombie.commit([event("r", b"zombie-before")])
        with KafkaBackend(settings):  # takes the slot: the zombie's next transaction is refused
            assert zombie.writer is not None
            producer = zombie.writer._producer  # the librdkafka handle, driven past the writer on purpose
            assert producer is not None
            producer.begin_transaction()
            deadline = time.monotonic() + 60
            while True:
                try:
                    producer.produce(zombie.events_topic, b"zombie", b"r", partition=0)
                except KafkaException as exc:
                    fatal = exc
                    break
                assert time.monotonic() < deadline, "the zombie never learned it was fenced"
                time.sleep(0.05)
            assert fatal.args[0].code() == KafkaError._FATAL  # the cause is not in it
            with pytest.raises(ProducerFencedError, match=settings.transactional_id):
                zombie.writer._raise_classified(producer, fatal, "producing", in_txn=True)
    finally:
        zombie.close()


def test_a_journal_closing_while_its_writer_is_fenced_closes(settings: KafkaSettings) -> None:
    # The hang of a fenced `resume`: close() queued the committer's stop while a commit was under
    # way, that commit then failed fatally, and the failure path drained the stop with the queue.
    journal = Journal(KafkaBackend(settings))
    journal.append_sync([started("r1", 0)])
    staged = journal.backend.stage([event("elsewhere", b"held open")])  # the journal's next commit waits
    pending = journal.append([turn_done("r1", 1)])
    while not pending.running():  # the committer took it and waits inside backend.commit
        time.sleep(0.01)
    closer = threading.Thread(target=journal.close, name="closer", daemon=True)
    closer.start()
    while not journal._committer._closed or journal._committer._queue.qsize() == 0:  # its stop is queued
        time.sleep(0.01)
    with KafkaBackend(settings):  # a new process takes the slot
        with pytest.raises(ProducerFencedError):
            staged.commit()
        closer.join(60)
        assert not closer.is_alive(), "Journal.close() hangs after its writer was fenced"
    assert isinstance(pending.exception(), ProducerFencedError)


def test_the_same_slot_in_another_namespace_never_fences_the_writer(kafka_bootstrap: str) -> None:
    # Two jobs on one cluster, each with its default slot name: neither may fence the other.
    slot = f"worker-{uuid.uuid4().hex[:6]}"
    first = make_settings(kafka_bootstrap, f"job-a-{uuid.uuid4().hex[:6]}", transactional_id=slot)
    second = make_settings(kafka_bootstrap, f"job-b-{uuid.uuid4().hex[:6]}", transactional_id=slot)
    with KafkaBackend(first) as a:
        a.commit([event("r", b"a-1")])
        with KafkaBackend(second) as b:
            b.commit([event("r", b"b-1")])
            a.commit([event("r", b"a-2")])  # still the owner of its slot in its namespace
            assert a.producer_config()["transactional.id"] == f"{first.namespace}.{slot}"
        assert values(list(a.read_events(partition_for("r", a.partitions)))) == [b"a-1", b"a-2"]


def test_a_reader_never_fences_the_writer(backend: KafkaBackend, settings: KafkaSettings) -> None:
    backend.commit([event("r", b"one")])
    with KafkaBackend(settings, transactional=False, create_topics=False) as reader:
        assert values(list(reader.read_events(partition_for("r", reader.partitions)))) == [b"one"]
    backend.commit([event("r", b"two")])  # still the slot owner
    assert values(list(backend.read_events(partition_for("r", backend.partitions)))) == [b"one", b"two"]


def test_a_delivery_refused_by_the_broker_aborts_the_batch_and_the_writer_goes_on(
    backend: KafkaBackend, kafka_bootstrap: str
) -> None:
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    topic = ConfigResource(
        ResourceType.TOPIC,
        backend.events_topic,
        incremental_configs=[ConfigEntry("max.message.bytes", "50000", incremental_operation=AlterConfigOpType.SET)],
    )
    admin.incremental_alter_configs([topic])[topic].result()
    deadline = time.monotonic() + 30
    while topic_config(admin, backend.events_topic)["max.message.bytes"].value != "50000":  # the broker applies it
        assert time.monotonic() < deadline, "max.message.bytes=50000 never took effect"
        time.sleep(0.05)
    partition = partition_for("r", backend.partitions)
    backend.commit([event("r", b"before")])

    with pytest.raises(AbortableCommitError, match=rf"{backend.events_topic} partition {partition}"):
        backend.commit([event("r", b"small-but-doomed"), event("r", os.urandom(200_000))])  # incompressible

    # The writer goes on, redoing an aborted batch as the Journal does. librdkafka carries the
    # failed sequence into the next transaction, which is aborted once more (_PURGE_QUEUE after
    # "skipped sequence numbers, requires epoch bump"; cf. karafka/waterdrop#501): bounded redo.
    for attempt in range(3):
        try:
            backend.commit([event("r", b"after")])
            break
        except AbortableCommitError:
            assert attempt < 2, "the writer did not recover from an aborted batch"
    assert values(list(backend.read_events(partition))) == [b"before", b"after"]


def test_commit_after_close_is_refused_and_close_is_idempotent(settings: KafkaSettings) -> None:
    b = KafkaBackend(settings)
    b.close()
    b.close()
    with pytest.raises(JournalClosedError):
        b.commit([event("r", b"x")])
    with pytest.raises(JournalClosedError):
        list(b.read_events(0))


# -- bad records ----------------------------------------------------------------------------------


def test_a_record_with_a_non_utf8_key_is_reported_and_reading_goes_on(backend: KafkaBackend) -> None:
    partition = partition_for("r", backend.partitions)
    backend.commit([event("r", b"good-1")])
    raw = Producer(
        {k: v for k, v in backend.producer_config().items() if k not in ("transactional.id", "transaction.timeout.ms")}
    )
    raw.produce(backend.events_topic, key=b"\xff\xfe-bad", value=b"bad-key", partition=partition)
    raw.produce(backend.events_topic, key=None, value=b"no-key", partition=partition)
    assert raw.flush(10) == 0
    backend.commit([event("r", b"good-2")])

    read = list(backend.read_events(partition))
    assert values(read) == [b"good-1", b"bad-key", b"no-key", b"good-2"]
    assert read[0].error is None and read[3].error is None
    assert read[1].error is not None and "not UTF-8" in read[1].error and backend.events_topic in read[1].error
    assert read[2].error is not None and "no key" in read[2].error


def plain_producer(backend: KafkaBackend) -> Producer:
    """A producer that is no journal writer: what a foreign tool or a misconfigured job writes."""
    return Producer(
        {k: v for k, v in backend.producer_config().items() if k not in ("transactional.id", "transaction.timeout.ms")}
    )


def test_a_null_or_foreign_value_on_the_events_topic_is_reported_by_every_read_path(backend: KafkaBackend) -> None:
    journal = Journal(backend)
    partition = journal.partition_of("r1")
    journal.append_sync(
        [started("r1", 0), turn_done("r1", 1)], SnapshotDraft(header("r1", 1, turn=1), "running", 1, b"s")
    )
    raw = plain_producer(backend)
    raw.produce(backend.events_topic, key=b"r1", value=None, partition=partition)  # a tombstone where none belongs
    foreign = journal.codec.encode(BlobChunk("0" * 64, 0, 1, b"not an event"))  # single-object Avro, wrong stream
    raw.produce(backend.events_topic, key=b"r1", value=foreign, partition=partition)
    assert raw.flush(10) == 0
    journal.append_sync([turn_done("r1", 2, turn=2)])
    bad = [r.location for r in backend.read_events(partition) if r.value is None or r.value == foreign]
    assert len(bad) == 2

    with pytest.raises(CorruptRecordError) as info:
        list(journal.read_rollout("r1"))
    assert str(bad[0]) in str(info.value)
    for read in (
        lambda report: journal.read_rollout("r1", report=report),
        lambda report: journal.read_rollout("r1", Cursor(0, after_seq=1), report),  # the seq-peeking path
        lambda report: journal.scan(report),
    ):
        report = ReadReport()
        seqs = [e.event.header.seq for e in read(report)]
        assert seqs[-1] == 2
        assert [e.location for e in report.errors] == bad
        assert "null" in str(report.errors[0]) and "BlobChunk" in str(report.errors[1])
    plan = load_rollouts(journal)
    assert [e.event.header.seq for e in plan.rollouts["r1"].events] == [2]
    assert [e.location for e in plan.report.errors] == bad
    journal.close()


# -- compaction -----------------------------------------------------------------------------------


def compacting_settings(bootstrap: str, namespace: str, **overrides: object) -> KafkaSettings:
    """Settings whose snapshot topic the broker's log cleaner compacts within seconds."""
    return make_settings(
        bootstrap,
        namespace,
        snapshot_segment_ms=200,
        snapshot_segment_bytes=1024 * 1024,  # Kafka 4 minimum
        snapshot_min_cleanable_dirty_ratio=0.01,
        snapshot_delete_retention_ms=100,
        snapshot_min_compaction_lag_ms=0,
        **overrides,
    )


def wait_for_compaction(
    backend: KafkaBackend, compacted: Callable[[dict[str, list[bytes | None]]], bool], timeout_s: float = 150
) -> dict[str, list[bytes | None]]:
    """Keep rolling segments until the log cleaner has run as ``compacted`` (values per key) says."""
    # one filler key per partition: a partition's active segment rolls only when it gets an append
    candidates = [f"filler-{i}" for i in range(100)]
    fillers = [
        next(k for k in candidates if partition_for(k, backend.partitions) == p) for p in range(backend.partitions)
    ]
    deadline = time.monotonic() + timeout_s
    filler = 0
    while True:
        # segments roll only on append after segment.ms: keep appending so the old ones become cleanable
        time.sleep(0.5)
        filler += 1
        backend.commit([OutRecord(Stream.SNAPSHOTS, k, str(filler).encode(), k) for k in fillers])
        seen: dict[str, list[bytes | None]] = {}
        for r in backend.read_snapshots():
            seen.setdefault(r.key, []).append(r.value)
        if compacted(seen):
            return seen
        if time.monotonic() > deadline:
            pytest.fail(f"compaction not observed within {timeout_s} s: { ({k: len(v) for k, v in seen.items()}) }")


@pytest.mark.timeout(300)  # the cleaner is one thread for every topic of the shared broker: give it time
def test_the_broker_compacts_snapshots_to_the_latest_value_and_drops_tombstones(
    kafka_bootstrap: str, kafka_namespace: str
) -> None:
    settings = compacting_settings(kafka_bootstrap, kafka_namespace, partitions=2)
    kept, dropped = ["keep-a", "keep-b", "keep-c"], ["gone-d", "gone-e"]

    def snap(key: str, value: bytes | None) -> OutRecord:
        return OutRecord(Stream.SNAPSHOTS, key, value, key)

    with KafkaBackend(settings) as backend:
        for version in range(10):
            backend.commit([snap(k, f"{k}@v{version}".encode()) for k in kept + dropped])
        backend.commit([snap(k, None) for k in dropped])
        before = list(backend.read_snapshots())
        # superseded values are there until the cleaner runs (it may already have started)
        assert len(before) > len(kept) + 1

        latest = {k: f"{k}@v9".encode() for k in kept}
        seen = wait_for_compaction(
            backend,
            lambda seen: all(seen.get(k) == [v] for k, v in latest.items()) and not any(k in seen for k in dropped),
        )
        assert all(seen[k] == [latest[k]] for k in kept)
        assert not any(k in seen for k in dropped)


@pytest.mark.timeout(300)
def test_after_the_cleaner_ran_a_corrupt_newest_snapshot_still_falls_back_to_the_previous_one(
    kafka_bootstrap: str, kafka_namespace: str
) -> None:
    settings = compacting_settings(kafka_bootstrap, kafka_namespace, partitions=1)
    with Journal(KafkaBackend(settings)) as journal:
        journal.append_sync([started("r1", 0)])
        for version in range(4):
            journal.append_sync(
                [turn_done("r1", version + 1, turn=version + 1)],
                SnapshotDraft(
                    header("r1", version + 1, turn=version + 1), "running", version + 1, f"state-v{version}".encode()
                ),
            )
        # The newest snapshot record turns out corrupt (here: its state no longer matches its SHA-256).
        newest = [
            r
            for r in journal.backend.read_snapshots()
            if r.value and isinstance(journal.codec.decode(r.value, r.location), Snapshot)
        ][-1]
        assert b"state-v3" in newest.value
        corrupt = journal.backend.commit(
            [OutRecord(Stream.SNAPSHOTS, newest.key, newest.value.replace(b"state-v3", b"state-v9"), "r1")]
        )[0]
        snapshot_keys = [
            k
            for k in {r.key for r in journal.backend.read_snapshots()}
            if k == "r1" or (k.startswith("r1/") and k != "r1/fence")
        ]
        # Only once the cleaner has left one value per key is "the previous one" a real claim.
        wait_for_compaction(
            journal.backend,
            lambda seen: (
                all(len(seen.get(k, [])) <= 1 for k in snapshot_keys) and newest.value not in seen.get(newest.key, [])
            ),
        )
        index = journal.snapshots()
        assert index.snapshots["r1"] is not None, [str(e) for e in index.errors]
        assert index.snapshots["r1"].state == b"state-v2"
        assert any(str(corrupt) in str(e) and "SHA-256" in str(e) for e in index.errors)
        plan = load_rollouts(journal)  # and restore replays the turn the lost snapshot covered
        assert [e.event.header.seq for e in plan.rollouts["r1"].events] == [4]


@pytest.mark.timeout(300)
def test_after_the_cleaner_ran_an_acknowledged_rollout_leaves_only_its_fence(
    kafka_bootstrap: str, kafka_namespace: str
) -> None:
    """What restore reads from a compacted snapshot topic is the live rollouts' state, not history:
    an acknowledged rollout's snapshots and every chunk of its large states are gone, its fence
    stays (one record); a live rollout keeps its two slots and their blobs, nothing older."""
    settings = compacting_settings(kafka_bootstrap, kafka_namespace, partitions=1)
    rng = np.random.default_rng(7)
    with Journal(KafkaBackend(settings)) as journal:
        states: dict[str, list[bytes]] = {"acked": [], "live": []}
        for turn in range(4):
            for rollout, kept in states.items():
                kept.append(rng.bytes(2 * journal.inline_snapshot_limit + turn))  # chunked: a blob per state
                events = [started(rollout, 0)] if turn == 0 else [turn_done(rollout, turn, turn=turn)]
                journal.append_sync(events, SnapshotDraft(header(rollout, turn, turn=turn), "running", turn, kept[-1]))
        journal.append_sync(
            [RolloutFinished(header("acked", 4), 1.0, 4, "{}")],
            SnapshotDraft(header("acked", 4), "finished", 4, rng.bytes(2 * journal.inline_snapshot_limit)),
        )
        journal.acknowledge(RolloutAcknowledged(header("acked", 5), "trainer")).result()

        def keys_of(seen: dict[str, list[bytes | None]], rollout: str) -> dict[str, list[bytes | None]]:
            return {k: v for k, v in seen.items() if k == rollout or k.startswith(rollout + "/")}

        def blob_hashes(keys: Iterable[str]) -> set[str]:
            return {k.split(BLOB_MARK)[1].split("/")[0] for k in keys if BLOB_MARK in k}

        newest_two = {hashlib.sha256(state).hexdigest() for state in states["live"][-2:]}
        seen = wait_for_compaction(
            journal.backend,
            lambda seen: (
                list(keys_of(seen, "acked")) == [fence_key("acked")]
                and all(len(values) == 1 for values in keys_of(seen, "live").values())
                and blob_hashes(keys_of(seen, "live")) == newest_two
            ),
        )
        assert len(seen[fence_key("acked")]) == 1 and seen[fence_key("acked")][0] is not None
        assert all(values[0] is not None for values in keys_of(seen, "live").values())
        plan = load_rollouts(journal)  # restore from what the cleaner left: the newest state, the ack
        assert plan.rollouts["live"].snapshot is not None and plan.rollouts["live"].snapshot.state == states["live"][-1]
        assert "acked" in plan.acknowledged and "acked" not in plan.rollouts


# -- topics ---------------------------------------------------------------------------------------


def test_topics_are_created_once_with_their_configs(settings: KafkaSettings, kafka_bootstrap: str) -> None:
    with KafkaBackend(settings):
        pass
    with KafkaBackend(settings, transactional=False):  # again: TOPIC_ALREADY_EXISTS is fine
        pass
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    meta = admin.list_topics(timeout=10).topics
    assert len(meta[settings.events_topic].partitions) == settings.partitions
    assert len(meta[settings.snapshots_topic].partitions) == settings.partitions
    configs = {
        r.name: {k: v.value for k, v in f.result().items()}
        for r, f in admin.describe_configs(
            [
                ConfigResource(ResourceType.TOPIC, settings.events_topic),
                ConfigResource(ResourceType.TOPIC, settings.snapshots_topic),
            ]
        ).items()
    }
    assert configs[settings.events_topic]["cleanup.policy"] == "delete"
    assert configs[settings.events_topic]["retention.ms"] == "-1"
    assert configs[settings.snapshots_topic]["cleanup.policy"] == "compact"
    assert configs[settings.snapshots_topic]["segment.ms"] == str(settings.snapshot_segment_ms)
    assert configs[settings.snapshots_topic]["min.cleanable.dirty.ratio"] == str(
        settings.snapshot_min_cleanable_dirty_ratio
    )
    assert configs[settings.snapshots_topic]["delete.retention.ms"] == str(settings.snapshot_delete_retention_ms)


def topic_config(admin: AdminClient, topic: str) -> dict[str, ConfigEntry]:
    """A topic's configs, from a broker that knows the topic (just created: not every one does yet)."""
    resource = ConfigResource(ResourceType.TOPIC, topic)
    deadline = time.monotonic() + 30
    while True:
        try:
            return admin.describe_configs([resource])[resource].result()
        except KafkaException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def create_topics(admin: AdminClient, settings: KafkaSettings, replication: int, **config: str) -> None:
    """The journal's two topics as somebody else created them (a platform team, an older version)."""
    topics = [
        NewTopic(
            settings.events_topic, settings.partitions, replication, config={"cleanup.policy": "delete", **config}
        ),
        NewTopic(
            settings.snapshots_topic, settings.partitions, replication, config={"cleanup.policy": "compact", **config}
        ),
    ]
    for future in admin.create_topics(topics).values():
        future.result()
    deadline = time.monotonic() + 30
    while not all(t.topic in admin.list_topics(timeout=10).topics for t in topics):  # metadata catches up
        assert time.monotonic() < deadline, "created topics never appeared in the metadata"
        time.sleep(0.05)


def test_topics_take_the_clusters_replication_defaults_unless_asked(
    settings: KafkaSettings, kafka_bootstrap: str
) -> None:
    with KafkaBackend(settings, transactional=False):
        pass
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    for topic in (settings.events_topic, settings.snapshots_topic):
        entry = topic_config(admin, topic)["min.insync.replicas"]
        assert entry.source != ConfigSource.DYNAMIC_TOPIC_CONFIG.value, f"{topic} overrides min.insync.replicas"


def test_an_existing_topic_whose_min_isr_exceeds_its_replicas_is_refused(
    settings: KafkaSettings, kafka_bootstrap: str
) -> None:
    create_topics(AdminClient({"bootstrap.servers": kafka_bootstrap}), settings, 1, **{"min.insync.replicas": "2"})
    with pytest.raises(
        ConfigurationError, match=rf"{settings.events_topic} has min.insync.replicas=2 .*replication factor 1"
    ):
        KafkaBackend(settings, transactional=False)


def test_an_existing_topic_with_fewer_replicas_than_asked_is_refused(
    settings: KafkaSettings, kafka_bootstrap: str
) -> None:
    create_topics(AdminClient({"bootstrap.servers": kafka_bootstrap}), settings, 1)
    with pytest.raises(
        ConfigurationError, match=rf"{settings.events_topic} has replication factor 1 .*replication_factor=3"
    ):
        KafkaBackend(settings.model_copy(update={"replication_factor": 3}), transactional=False, create_topics=False)


@pytest.mark.slow
def test_on_a_three_broker_cluster_the_defaults_hold_and_min_isr_is_never_lowered(
    kafka_cluster3, caplog: pytest.LogCaptureFixture
) -> None:
    """The 3-node local cluster, like the compose one, sets replication 3 and min.insync.replicas=2."""
    bootstrap = kafka_cluster3.bootstrap_servers
    admin = AdminClient({"bootstrap.servers": bootstrap})

    defaults = make_settings(bootstrap, "defaults", partitions=2)
    with KafkaBackend(defaults) as backend:
        backend.commit([event("r", b"acks=all reached 2 in-sync replicas")])
    for topic in (defaults.events_topic, defaults.snapshots_topic):
        assert {len(kafka_cluster3.describe_partition(topic, p).replicas) for p in range(defaults.partitions)} == {3}
        assert topic_config(admin, topic)["min.insync.replicas"].value == "2"

    lower = make_settings(bootstrap, "asks-lower", partitions=2, min_insync_replicas=1)
    with caplog.at_level(logging.WARNING, logger="rollout_journal.journal.kafka.topics"):
        with KafkaBackend(lower, transactional=False):
            pass
    assert topic_config(admin, lower.events_topic)["min.insync.replicas"].value == "2"
    assert any("min.insync.replicas=2" in r.getMessage() and "never lowers" in r.getMessage() for r in caplog.records)

    higher = make_settings(bootstrap, "asks-higher", partitions=2, replication_factor=3, min_insync_replicas=3)
    with KafkaBackend(higher, transactional=False):
        pass
    deadline = time.monotonic() + 30  # applied by the controller; each broker learns it a moment later
    while topic_config(admin, higher.events_topic)["min.insync.replicas"].value != "3":
        assert time.monotonic() < deadline, "the asked min_insync_replicas=3 never took effect"
        time.sleep(0.05)

    weak = make_settings(bootstrap, "weak", partitions=2)
    create_topics(admin, weak, 3, **{"min.insync.replicas": "1"})
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rollout_journal.journal.kafka.topics"):
        with KafkaBackend(weak, transactional=False):
            pass
    assert any(
        weak.events_topic in r.getMessage() and "min.insync.replicas=1" in r.getMessage() for r in caplog.records
    )


def test_events_are_chunked_below_the_topics_own_max_message_bytes(
    settings: KafkaSettings, kafka_bootstrap: str
) -> None:
    create_topics(AdminClient({"bootstrap.servers": kafka_bootstrap}), settings, 1, **{"max.message.bytes": "100000"})
    with Journal(KafkaBackend(settings)) as journal:
        assert journal.max_record_bytes < 100_000 and journal.inline_snapshot_limit < 100_000
        call = model_call("r1", 1, tokens=100_000)  # 400 KB: accepted by the file journal, so by this one too
        journal.append_sync(
            [started("r1", 0), call], SnapshotDraft(header("r1", 1), "running", 1, os.urandom(300_000))
        )  # a blob, in chunks
        assert [e.event for e in journal.read_rollout("r1")][1] == call
        assert len(journal.snapshots().snapshots["r1"].state) == 300_000


def test_a_partition_count_mismatch_is_a_configuration_error(settings: KafkaSettings) -> None:
    with KafkaBackend(settings, transactional=False):
        pass
    with pytest.raises(ConfigurationError, match=rf"{settings.events_topic} has 8 partitions .* 4"):
        KafkaBackend(settings.model_copy(update={"partitions": 4}))


def test_missing_topics_without_create_topics_is_a_configuration_error(settings: KafkaSettings) -> None:
    with pytest.raises(ConfigurationError, match=rf"{settings.events_topic} does not exist"):
        KafkaBackend(settings, create_topics=False, transactional=False)


def test_an_impossible_replication_factor_is_a_configuration_error(settings: KafkaSettings) -> None:
    with pytest.raises(ConfigurationError, match="replication factor 5"):
        KafkaBackend(settings.model_copy(update={"replication_factor": 5}), transactional=False)


def test_committing_needs_a_transactional_id(settings: KafkaSettings) -> None:
    with pytest.raises(ConfigurationError, match="transactional_id"):
        KafkaBackend(settings.model_copy(update={"transactional_id": None}))


# -- settings -------------------------------------------------------------------------------------


def test_settings_from_url() -> None:
    s = KafkaSettings.from_url(
        "kafka://h1:9092,h2:9093/prod.rollouts?partitions=16&replication_factor=3&min_insync_replicas=2"
        "&transactional_id=w0&security.protocol=SASL_SSL&librdkafka.sasl.mechanism=PLAIN",
        env={},
    )
    assert s.bootstrap_servers == "h1:9092,h2:9093"
    assert s.namespace == "prod.rollouts"
    assert (s.partitions, s.replication_factor, s.min_insync_replicas) == (16, 3, 2)
    assert s.transactional_id == "w0"
    assert s.librdkafka == {"security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN"}
    assert (s.events_topic, s.snapshots_topic) == ("prod.rollouts.events", "prod.rollouts.snapshots")


@pytest.mark.parametrize(
    "url, problem",
    [
        ("http://h:9092/ns", "kafka://"),
        ("kafka://h:9092/", "namespace"),
        ("kafka://user:pw@h:9092/ns", "credentials"),
        ("kafka://h:9092/ns?partitionz=3", "partitionz"),
        ("kafka://h:9092/ns?partitions=zero", "partitions"),
        ("kafka://h:9092/bad%20name", "namespace"),
        ("kafka://h:9092/ns?replication_factor=1&min_insync_replicas=2", "min_insync_replicas"),
        ("kafka://h:9092/ns?librdkafka.acks=1&enable.idempotence=false", "cannot be overridden"),
    ],
)
def test_bad_urls_are_configuration_errors(url: str, problem: str) -> None:
    with pytest.raises(ConfigurationError, match=problem):
        KafkaSettings.from_url(url, env={})


def test_environment_overrides_the_url() -> None:
    env = {
        "KAFKA_BOOTSTRAP_SERVERS": "env-host:9092",
        "ROLLOUT_JOURNAL_KAFKA_PARTITIONS": "3",
        "ROLLOUT_JOURNAL_KAFKA_TRANSACTIONAL_ID": "worker-7",
        "ROLLOUT_JOURNAL_LIBRDKAFKA_SASL_USERNAME": "alice",
        "ROLLOUT_JOURNAL_LIBRDKAFKA_SASL_PASSWORD": "s3cret-pw",
        "ROLLOUT_JOURNAL_LIBRDKAFKA_SSL_ENDPOINT_IDENTIFICATION_ALGORITHM": "none",
    }
    s = KafkaSettings.from_url("kafka://url-host:9092/ns?partitions=8&transactional_id=w0", env=env)
    assert s.bootstrap_servers == "env-host:9092"
    assert s.partitions == 3
    assert s.transactional_id == "worker-7"
    assert s.librdkafka == {
        "sasl.username": "alice",
        "sasl.password": "s3cret-pw",
        "ssl.endpoint.identification.algorithm": "none",
    }
    # the specific variable beats the generic one
    s2 = KafkaSettings.from_url("kafka://h:1/ns", env={**env, "ROLLOUT_JOURNAL_KAFKA_BOOTSTRAP_SERVERS": "specific:1"})
    assert s2.bootstrap_servers == "specific:1"
    with pytest.raises(ConfigurationError, match="ROLLOUT_JOURNAL_KAFKA_PARTITONS"):
        KafkaSettings.from_url("kafka://h:1/ns", env={"ROLLOUT_JOURNAL_KAFKA_PARTITONS": "3"})


def test_environment_redirecting_a_url_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="rollout_journal.journal.kafka.config"):
        KafkaSettings.from_url("kafka://url-host:9092/ns", env={"KAFKA_BOOTSTRAP_SERVERS": "url-host:9092"})
        assert not caplog.records  # the same servers: nothing to say
        s = KafkaSettings.from_url("kafka://url-host:9092/ns", env={"KAFKA_BOOTSTRAP_SERVERS": "env-host:9092"})
    assert s.bootstrap_servers == "env-host:9092"
    [record] = caplog.records
    assert "KAFKA_BOOTSTRAP_SERVERS=env-host:9092 overrides" in record.getMessage()
    assert "url-host:9092" in record.getMessage()


def test_settings_from_env_alone() -> None:
    env = {"ROLLOUT_JOURNAL_KAFKA_URL": "kafka://u:1/from-url?partitions=2", "ROLLOUT_JOURNAL_KAFKA_LINGER_MS": "0"}
    s = KafkaSettings.from_env(env, namespace="default-ns", transactional_id="w1", bootstrap_servers="d:1")
    assert (s.bootstrap_servers, s.namespace, s.partitions, s.linger_ms, s.transactional_id) == (
        "u:1",
        "from-url",
        2,
        0,
        "w1",
    )


def test_secrets_stay_out_of_repr_and_errors(kafka_bootstrap: str, kafka_namespace: str) -> None:
    s = make_settings(
        kafka_bootstrap,
        kafka_namespace,
        librdkafka={
            "sasl.username": "alice",
            "sasl.password": "s3cret-pw",
            "sasl.oauthbearer.client.secret": "tok-123",
            "socket.timeout.ms": "not-a-number",
        },
    )
    for text in (repr(s), str(s), f"{s}"):
        assert "s3cret-pw" not in text and "tok-123" not in text
        assert "alice" in text
    with pytest.raises(ConfigurationError, match="socket.timeout.ms") as failure:
        KafkaBackend(s)
    assert "s3cret-pw" not in str(failure.value)


def test_librdkafka_passthrough_reaches_every_client(settings: KafkaSettings) -> None:
    s = settings.model_copy(update={"librdkafka": {"client.rack": "rack-9", "socket.keepalive.enable": "true"}})
    with KafkaBackend(s) as b:
        for cfg in (b.producer_config(), b.consumer_config(), b.admin_config()):
            assert cfg["client.rack"] == "rack-9"
            assert cfg["socket.keepalive.enable"] == "true"
        producer = b.producer_config()
        assert producer["enable.idempotence"] is True and producer["acks"] == "all"
        assert producer["transactional.id"] == f"{s.namespace}.{s.transactional_id}"
        assert b.consumer_config()["isolation.level"] == "read_committed"
        b.commit([event("r", b"works")])
        assert values(list(b.read_events(partition_for("r", b.partitions)))) == [b"works"]
    with pytest.raises(ConfigurationError, match="isolation.level"):
        KafkaSettings(bootstrap_servers="h:1", namespace="ns", librdkafka={"isolation.level": "read_uncommitted"})


def test_locations_print_as_topic_partition_offset() -> None:
    assert str(RecordLocation("ns.events", 3, 17)) == "topic ns.events partition 3 offset 17"


def test_topic_listed_leaves_an_unanswered_question_to_the_caller(backend: KafkaBackend, kafka_bootstrap: str) -> None:
    """A listed topic is there and an unknown one is not, whatever the caller asked; a cluster
    that does not answer gives the caller's ``unsure``. Two helpers once shared this name with
    opposite answers to that case, and the one defined last decided both callers."""
    from rollout_journal.journal.kafka.topics import topic_listed

    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    for unsure in (True, False):
        assert topic_listed(admin, backend.events_topic, 10, unsure=unsure)
        assert not topic_listed(admin, f"no-such-topic-{uuid.uuid4().hex[:8]}", 10, unsure=unsure)
    nobody = AdminClient({"bootstrap.servers": "127.0.0.1:9", "socket.connection.setup.timeout.ms": 1000})
    assert topic_listed(nobody, backend.events_topic, 1, unsure=True) is True
    assert topic_listed(nobody, backend.events_topic, 1, unsure=False) is False


@pytest.mark.parametrize(
    "line, level",
    [
        (
            "GETPID [p#producer-2] [thrd:main]: Failed to acquire transactional PID from broker TxnCoordinator/1: "
            "Broker: Coordinator load in progress: retrying",
            logging.INFO,
        ),
        ("FENCED [p#producer-1]: Producer fenced by a newer instance", logging.INFO),
        (  # a member's transaction a rebalance ended: the writer redoes it, and says so itself
            "TXNERR [m#producer-5] [thrd:main]: Current transaction failed in state InTransaction: Failed to "
            "commit offsets to transaction on broker 127.0.0.1:1/1: ns.events[3] (Broker: Specified group "
            "generation id is not valid)",
            logging.INFO,
        ),
        ("MAXPOLL [c#consumer-1]: Application maximum poll interval exceeded", logging.WARNING),
    ],
    ids=["retried", "fenced", "rebalance", "news"],
)
def test_librdkafka_lines_that_carry_no_news_are_demoted(line: str, level: int, caplog) -> None:
    """A line librdkafka retries (a transaction coordinator still loading), or one the backend
    raises once itself (a fencing), is INFO: a process that loses its slot prints one line, not
    a warning before it (seen in the racing-resumes test under load). Other warnings stay."""
    from rollout_journal.journal.kafka.clients import client_log

    caplog.set_level(logging.INFO, logger=client_log.name)
    client_log.warning("%s", line)
    assert [r.levelno for r in caplog.records if r.name == client_log.name] == [level]
