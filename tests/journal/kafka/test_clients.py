"""Closing a Kafka client is bounded (journal.kafka.clients.close_client).

confluent-kafka's ``Producer.close()`` aborts the open transaction and flushes, neither with a
timeout of its own: a worker re-creating its producer after a broker restart once went silent so,
its committer blocked under its transaction lock. A producer whose records cannot be delivered
(its bootstrap answers nothing) holds ``close()`` the same way, without any broker to stop."""

from __future__ import annotations

import threading
import time

from confluent_kafka import Producer

from rollout_journal.journal.kafka.clients import close_client
from rollout_journal.journal.kafka.config import KafkaSettings
from rollout_journal.journal.kafka.readers import ReaderPool, StreamingFollower

UNREACHABLE = {"bootstrap.servers": "127.0.0.1:9", "message.timeout.ms": 120_000, "log_level": 0}


def stuck_producer() -> Producer:
    """A producer with a record it can never deliver: its ``close()`` flushes for two minutes."""
    producer = Producer(UNREACHABLE)
    producer.produce("t", value=b"undeliverable")
    return producer


def closed_within(client: Producer, join_s: float, **options: object) -> bool:
    done = threading.Event()
    threading.Thread(target=lambda: (close_client(client, **options), done.set()), daemon=True).start()  # type: ignore[arg-type]
    return done.wait(join_s)


def test_a_close_that_cannot_flush_returns_after_its_bound_and_goes_on_behind() -> None:
    assert closed_within(stuck_producer(), 30, bound_s=0.5)  # before: blocked for message.timeout.ms


def test_a_discarded_producer_is_purged_so_its_close_finishes() -> None:
    before = set(threading.enumerate())
    assert closed_within(stuck_producer(), 30, discard=True, bound_s=30)
    closing = [t for t in threading.enumerate() if t.name == "close-Producer" and t not in before]
    for thread in closing:
        thread.join(30)
    assert not [t for t in closing if t.is_alive()]


def test_a_follower_closed_while_another_thread_polls_it_waits_for_that_poll() -> None:
    """A worker polls its acknowledgement follower on a thread and closes it on another once
    cancelled: librdkafka must not close a consumer another thread polls (confluent-kafka-python
    #1797 crashes in ``Consumer_poll`` so). ``close()`` returns only after the poll in flight did,
    and a poll after it hands on nothing. (No broker: a poll of an unreachable one waits out its
    timeout, as an idle topic's does.)"""
    settings = KafkaSettings(bootstrap_servers="127.0.0.1:9", namespace="closing")
    follower = StreamingFollower(ReaderPool(settings), "closing.acks", 1, {})
    polling, polled = threading.Event(), threading.Event()
    answers: list[object] = []

    def poll() -> None:
        polling.set()
        answers.append(follower.poll(3.0))
        polled.set()

    threading.Thread(target=poll, daemon=True).start()
    assert polling.wait(30)
    time.sleep(0.5)  # inside librdkafka's poll now: it waits its 3 s out
    follower.close()
    assert polled.is_set(), "close() returned while another thread was still polling the consumer"
    assert answers == [[]]
    assert follower.poll(0.1) == []  # closed: nothing, and no call into the closed consumer
    follower.close()  # a second close is a no-op
