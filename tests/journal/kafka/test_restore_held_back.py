"""Restore while another writer's open transaction holds the event log back, on a real broker.

A writer killed inside its transaction leaves it open until the broker aborts it (the namespace's
transaction timeout, then the broker's abort scan); a read to the last stable offset stops where
it began, so a newer attempt committed after it shows in the snapshot stream (its fence) while its
events stay hidden. Restore reads such a rollout again until its events reach its fence.
"""

from __future__ import annotations

import pytest

from rollout_journal.journal.backend import OutRecord, Stream, partition_for
from rollout_journal.journal.errors import CorruptRecordError
from rollout_journal.journal.journal import Journal
from rollout_journal.journal.kafka.backend import KafkaBackend
from rollout_journal.journal.kafka.config import KafkaSettings
from rollout_journal.journal.restore import RestorePlan, load_rollouts
from tests.support.journal_conformance import started, turn_done
from tests.support.kafka_drills import open_transaction

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]


@pytest.fixture
def settings(kafka_bootstrap: str, kafka_namespace: str) -> KafkaSettings:
    return KafkaSettings(bootstrap_servers=kafka_bootstrap, namespace=kafka_namespace, operation_timeout_ms=20_000)


def _slot(settings: KafkaSettings, name: str) -> KafkaSettings:
    return settings.model_copy(update={"transactional_id": name})


def _restore_after_a_resume_behind_an_open_transaction(
    settings: KafkaSettings, *, bad_record: bool = False
) -> RestorePlan:
    """Attempt 1 of rollout r (with a record that is no event after it, if ``bad_record``), a
    transaction left open on r's partition, attempt 2 of r committed after it; then a read-only
    restore (a tool's: it reads to the last stable offset)."""
    with Journal(KafkaBackend(_slot(settings, "w1"))) as first:
        first.append_sync([started("r", 0), turn_done("r", 1)])
        if bad_record:
            first.backend.commit([OutRecord(Stream.EVENTS, "r", b"not an event", "r")])
        # a writer killed inside its transaction, as the broker sees it: the broker aborts it once
        # the namespace's transaction timeout passes; nothing in the test ends it
        open_transaction(first.backend, f"{settings.namespace}.killed", partition_for("r", settings.partitions))
    with Journal(KafkaBackend(_slot(settings, "w2"))) as second:
        second.append_sync([started("r", 2, attempt=2, epoch=2, turn=1)])
    with Journal(KafkaBackend(settings, transactional=False, create_topics=False)) as reader:
        return load_rollouts(reader)


def test_restore_reads_again_the_events_an_open_transaction_holds_behind_a_newer_fence(
    settings: KafkaSettings,
) -> None:
    plan = _restore_after_a_resume_behind_an_open_transaction(settings)

    history = plan.rollouts["r"]
    assert history.fence is not None and history.fence.epoch == 2
    # Attempt 2's AttemptStarted lies past the open transaction: read once the broker aborted it.
    assert sorted({item.event.header.attempt for item in history.events}) == [1, 2]
    assert plan.events_replayed == len(history.events) == 3


def test_a_restore_read_again_reports_each_bad_record_once_and_no_stale_hold(settings: KafkaSettings) -> None:
    plan = _restore_after_a_resume_behind_an_open_transaction(settings, bad_record=True)

    assert sorted({item.event.header.attempt for item in plan.rollouts["r"].events}) == [1, 2]
    # Every pass read the bad record; the report names it once.
    assert [type(e) for e in plan.report.errors] == [CorruptRecordError]
    # The first pass was held back; the pass that caught up was not, so the tool has nothing to warn of.
    assert plan.report.held_back == []
