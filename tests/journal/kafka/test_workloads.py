"""Workload discovery on Kafka: ``<namespace>.workloads``, one partition, compacted, followed by one
long-lived fetch stream; an older namespace, whose snapshot topic alone holds registrations, still works."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from rollout_journal.journal.errors import ConfigurationError
from rollout_journal.journal.events import WorkloadRegistered
from rollout_journal.journal.file.backend import FileBackend
from rollout_journal.journal.journal import Journal, WorkloadFeed
from rollout_journal.journal.kafka.backend import KafkaBackend
from rollout_journal.journal.kafka.config import KafkaSettings
from rollout_journal.journal.kafka.readers import ReaderPool
from rollout_journal.participants.workload.config import WorkloadConfig
from rollout_journal.participants.workload.specs import workload_specs
from rollout_journal.participants.workload.worker import submit_workload

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]


@pytest.fixture
def settings(kafka_bootstrap: str, kafka_namespace: str) -> KafkaSettings:
    return KafkaSettings(
        bootstrap_servers=kafka_bootstrap,
        namespace=kafka_namespace,
        transactional_id="submit",
        operation_timeout_ms=20_000,
    )


def registration(name: str) -> WorkloadRegistered:
    return WorkloadRegistered(name, '{"groups": 1}', [f"{name}-0"], "topo", 7, "submit", True)


class Reads:
    """Every read and offset query a backend's reader pool makes, by topic (a spy on our own pool)."""

    def __init__(self, pool: ReaderPool, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, str]] = []
        read_from, watermarks = pool.read_from, pool._watermarks

        def counted_read(topic: str, *args: Any, **kwargs: Any) -> Iterator[Any]:
            self.calls.append(("read", topic))
            return read_from(topic, *args, **kwargs)

        def counted_marks(consumer: Any, topic: str, partition: int) -> tuple[int, int]:
            self.calls.append(("offsets", topic))
            return watermarks(consumer, topic, partition)

        monkeypatch.setattr(pool, "read_from", counted_read)
        monkeypatch.setattr(pool, "_watermarks", counted_marks)

    def topics(self) -> set[str]:
        return {topic for _, topic in self.calls}


def poll_until(feed: WorkloadFeed, done: Callable[[dict[str, WorkloadRegistered]], bool]) -> dict:
    found: dict[str, WorkloadRegistered] = {}
    deadline = time.monotonic() + 60
    while not done(found):
        assert time.monotonic() < deadline, f"the feed never delivered what was registered; got {sorted(found)}"
        found.update(feed.poll())
        time.sleep(0.05)
    return found


@contextmanager
def worker_feed(
    settings: KafkaSettings, monkeypatch: pytest.MonkeyPatch, registered: str
) -> Iterator[tuple[WorkloadFeed, Reads, Journal]]:
    """A fleet worker's workload feed once ``registered`` was submitted, a spy on the worker's reads,
    and the submitting journal."""
    with (
        Journal(KafkaBackend(settings, member="w0")) as worker,
        Journal(KafkaBackend(settings, transactional=False)) as submitter,
    ):
        submitter.register_workload(registration(registered)).result()
        reads = Reads(worker.backend.readers, monkeypatch)  # type: ignore[attr-defined]
        feed = worker.follow_workloads()
        try:
            yield feed, reads, submitter
        finally:
            feed.close()


def test_a_workload_registered_after_the_worker_started_is_picked_up_without_reading_snapshots(
    settings: KafkaSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    with worker_feed(settings, monkeypatch, "first") as (feed, reads, submitter):
        assert set(feed.poll()) == {"first"}  # everything registered before it started
        assert reads.topics() == {settings.workloads_topic}, "the first poll read more than the workloads topic"
        reads.calls.clear()
        for _ in range(20):  # an idle worker's polls
            assert feed.poll() == {}
        submitter.register_workload(registration("second")).result()
        assert set(poll_until(feed, lambda found: "second" in found)) == {"second"}
        assert reads.calls == [], "polls after the first read or queried offsets again"


def test_the_workloads_topic_has_one_partition_and_is_compacted(settings: KafkaSettings, kafka_bootstrap: str) -> None:
    with KafkaBackend(settings.model_copy(update={"partitions": 8}), transactional=False) as backend:
        state = backend.topics[settings.workloads_topic]
        assert state.partitions == 1
        assert state.configs["cleanup.policy"] == "compact"
        assert backend.keeps_workloads


def old_namespace(admin: AdminClient, settings: KafkaSettings) -> None:
    """The topics of a version before ``<namespace>.workloads``."""
    topics = [
        NewTopic(settings.events_topic, settings.partitions, 1, config={"cleanup.policy": "delete"}),
        NewTopic(settings.snapshots_topic, settings.partitions, 1, config={"cleanup.policy": "compact"}),
        NewTopic(settings.results_topic, settings.partitions, 1, config={"cleanup.policy": "delete"}),
        NewTopic(settings.acks_topic, settings.partitions, 1, config={"cleanup.policy": "delete"}),
    ]
    for future in admin.create_topics(topics).values():
        future.result()
    deadline = time.monotonic() + 30
    while not all(t.topic in admin.list_topics(timeout=10).topics for t in topics):
        assert time.monotonic() < deadline, "created topics never appeared in the metadata"
        time.sleep(0.05)


def test_an_old_namespace_s_registrations_are_found_once_then_copied_by_the_next_submit(
    settings: KafkaSettings, kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    old_namespace(AdminClient({"bootstrap.servers": kafka_bootstrap}), settings)
    with Journal(KafkaBackend(settings, create_topics=False, transactional=False)) as old_submit:
        assert not old_submit.backend.keeps_workloads  # as an older version wrote it: the snapshot topic only
        old_submit.register_workload(registration("old")).result()
        assert set(old_submit.workloads()) == {"old"}  # the read tools fall back to the snapshots

    caplog.set_level(logging.INFO, logger="rollout_journal.journal.journal")
    with Journal(KafkaBackend(settings, member="w0")) as worker:  # this version: creates the workloads topic
        feed = worker.follow_workloads()
        try:
            assert set(feed.poll()) == {"old"}
            said = [r.getMessage() for r in caplog.records if "read once from the snapshot stream" in r.getMessage()]
            assert len(said) == 1 and settings.workloads_topic in said[0], said
            reads = Reads(worker.backend.readers, monkeypatch)  # type: ignore[attr-defined]
            assert feed.poll() == {}
            assert reads.calls == [], "the fallback reread the snapshot topic"

            with Journal(KafkaBackend(settings, transactional=False)) as new_submit:
                new_submit.register_workload(registration("new")).result()  # copies "old" in the same commit
            assert set(poll_until(feed, lambda found: "new" in found)) >= {"new"}
        finally:
            feed.close()

    with Journal(KafkaBackend(settings, member="w1")) as later_worker:
        reads = Reads(later_worker.backend.readers, monkeypatch)  # type: ignore[attr-defined]
        feed = later_worker.follow_workloads()
        try:
            assert set(feed.poll()) == {"old", "new"}
            assert reads.topics() == {settings.workloads_topic}, "a worker of a migrated namespace read the snapshots"
        finally:
            feed.close()
        assert set(later_worker.workloads()) == {"old", "new"}
        assert set(later_worker.snapshots().workloads) == {"old", "new"}  # restore and read tools: as before


def test_a_file_journal_keeps_registrations_on_its_snapshot_stream(tmp_path: Path) -> None:
    with Journal(FileBackend(tmp_path / "j")) as journal:
        journal.register_workload(registration("local")).result()
        assert set(journal.workloads()) == {"local"}
        assert set(journal.snapshots().workloads) == {"local"}
        with pytest.raises(ConfigurationError, match="cannot be followed"):
            journal.follow_workloads()


def test_submitting_an_old_namespace_s_workload_again_puts_it_on_the_workloads_topic(
    settings: KafkaSettings, kafka_bootstrap: str
) -> None:
    url = f"kafka://{kafka_bootstrap}/{settings.namespace}?partitions={settings.partitions}"
    config = WorkloadConfig(name="again", groups=2, siblings=1, max_turns=2, environment="counter", journal=url)
    old_namespace(AdminClient({"bootstrap.servers": kafka_bootstrap}), settings)
    with Journal(KafkaBackend(settings, create_topics=False, transactional=False)) as old_submit:
        ids = [s.rollout_id for s in workload_specs(config)]
        old = WorkloadRegistered(config.name, config.model_dump_json(), ids, config.topology(), 7, "submit", True)
        old_submit.register_workload(old).result()

    registered, new = submit_workload(config, url)
    assert not new and registered == old
    with KafkaBackend(settings, transactional=False) as backend:
        assert [r.key for r in backend.read_workloads()] == ["again"]


def test_two_submits_of_one_name_at_once_register_one_of_them(
    settings: KafkaSettings, kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both read "not registered yet" before either writes (a barrier holds them there): the later
    one's opening fenced the earlier, so exactly one registration lands, and the loser is told so."""
    import threading

    url = f"kafka://{kafka_bootstrap}/{settings.namespace}?partitions={settings.partitions}"
    configs = [
        WorkloadConfig(name="race", groups=groups, siblings=1, max_turns=2, environment="counter", journal=url)
        for groups in (1, 2)
    ]
    both_read = threading.Barrier(2, timeout=120)
    workloads = Journal.workloads

    def read_then_wait(self: Journal) -> dict[str, WorkloadRegistered]:
        found = workloads(self)
        both_read.wait()
        return found

    monkeypatch.setattr(Journal, "workloads", read_then_wait)
    outcomes: list[object] = [None, None]

    def submit(i: int) -> None:
        try:
            outcomes[i] = submit_workload(configs[i], url)
        except Exception as exc:  # noqa: BLE001 - what the loser raises is the assertion
            outcomes[i] = exc

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    monkeypatch.undo()
    won = [o for o in outcomes if isinstance(o, tuple)]
    lost = [o for o in outcomes if isinstance(o, BaseException)]
    assert len(won) == 1 and len(lost) == 1, outcomes
    assert isinstance(lost[0], ConfigurationError) and "another submit of the same name" in str(lost[0])
    registered, new = won[0]
    assert new
    with Journal(KafkaBackend(settings, transactional=False)) as reader:
        assert reader.workloads()["race"] == registered  # the winner's, on both topics
        assert [r.key for r in reader.backend.read_workloads()] == ["race"]


def test_a_workload_feed_closed_before_it_was_polled_reads_nothing_and_opens_no_consumer(
    settings: KafkaSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker polls its workload feed on one thread and closes it on another at shutdown, so a
    poll can come after the close. It used to read the whole workloads topic then and open a
    consumer that nobody closed; a poll after close now reads nothing (and a close during a poll
    waits for it)."""
    with worker_feed(settings, monkeypatch, "closed") as (feed, reads, _):
        feed.close()
        assert feed.poll() == {}
        assert reads.calls == [], "a poll after close read the workloads topic"
        feed.close()  # a second close is a no-op (and the helper's close a third)
