"""The retry policy's table (journal.kafka.retry): what each client role does with each error class.
librdkafka's own errors, as a broker loss produced them, none flagged retriable by librdkafka; and
one retried query on a real broker (stale client metadata)."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError
from confluent_kafka.admin import AdminClient, NewPartitions, NewTopic

from rollout_journal.journal.kafka.config import KafkaSettings
from rollout_journal.journal.kafka.readers import ReaderPool
from rollout_journal.journal.kafka.retry import Action, Retry, Role, classify

BROKER_LOSS = [KafkaError._DESTROY_BROKER, KafkaError._TRANSPORT, KafkaError._TIMED_OUT, KafkaError.REQUEST_TIMED_OUT]
LEADERSHIP = [KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE, KafkaError.NOT_ENOUGH_REPLICAS]


@pytest.mark.parametrize("code", BROKER_LOSS + LEADERSHIP + [KafkaError._ALL_BROKERS_DOWN])
def test_a_broker_gone_or_a_leader_moving_is_retried_by_queries_and_skipped_by_reads(code: int) -> None:
    err = KafkaError(code)
    assert classify(err, Role.OFFSETS) is Action.RETRY
    assert classify(err, Role.ADMIN) is Action.RETRY
    assert classify(err, Role.COMMITTED) is Action.RETRY
    assert classify(err, Role.READER) is Action.SKIP
    assert classify(err, Role.PRODUCER) is Action.RETRY


def test_a_dead_transaction_is_reinitialized_never_read_as_taken_over() -> None:
    for code in (KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH):
        assert classify(KafkaError(code), Role.PRODUCER) is Action.REINIT
    assert classify(KafkaError(KafkaError.INVALID_TXN_STATE), Role.PRODUCER) is Action.REINIT
    assert classify(KafkaError(KafkaError._FENCED), Role.DELIVERY) is Action.REINIT


def test_abortable_record_level_taken_and_unknown_errors() -> None:
    assert classify(KafkaError(KafkaError._PURGE_QUEUE), Role.PRODUCER) is Action.ABORT
    assert classify(KafkaError(KafkaError.REBALANCE_IN_PROGRESS), Role.PRODUCER) is Action.ABORT
    assert classify(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE), Role.DELIVERY) is Action.RECORD
    assert classify(KafkaError(KafkaError._MSG_TIMED_OUT), Role.DELIVERY) is Action.ABORT
    assert classify(KafkaError(KafkaError.FENCED_INSTANCE_ID), Role.GROUP) is Action.TAKEN
    assert classify(KafkaError(KafkaError.UNSTABLE_OFFSET_COMMIT), Role.COMMITTED) is Action.RETRY
    assert classify(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED), Role.OFFSETS) is Action.FATAL
    assert classify(None, Role.OFFSETS) is Action.FATAL
    assert classify(KafkaError(KafkaError._TRANSPORT), Role.GROUP) is Action.SKIP  # librdkafka rejoins


def test_a_streak_backs_off_and_ends_with_its_budget() -> None:
    retry = Retry(0.3, "a test", first_s=0.01, max_s=0.05)
    waits = 0
    while retry.wait(KafkaError(KafkaError._TRANSPORT)):
        waits += 1
    assert waits >= 3 and retry.elapsed_s >= 0.3


@pytest.mark.kafka
def test_an_offset_query_the_clients_stale_metadata_refuses_refreshes_it(
    kafka_bootstrap: str, kafka_namespace: str
) -> None:
    """A client whose cached metadata lacks a partition answers ``_UNKNOWN_PARTITION`` to every
    offset query until its periodic refresh (5 min): after a broker loss, workers' queries failed
    so for minutes on a whole cluster. A partition added behind a client's back stales it the same
    way; the query must refresh the metadata and answer, well inside its retry budget."""
    topic = f"{kafka_namespace}.stale"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(timeout=60)
    settings = KafkaSettings(
        bootstrap_servers=kafka_bootstrap, namespace=kafka_namespace, cluster_unavailable_timeout_ms=20_000
    )
    pool = ReaderPool(settings)
    try:
        consumer = pool._acquire()
        assert pool._watermarks(consumer, topic, 0) == (0, 0)  # the client now caches one partition
        admin.create_partitions([NewPartitions(topic, 2)])[topic].result(timeout=60)
        assert pool._watermarks(consumer, topic, 1) == (0, 0)  # before the fix: ClusterUnreachableError
    finally:
        pool.close()
