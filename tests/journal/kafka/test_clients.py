"""Closing a Kafka client is bounded (journal.kafka.clients.close_client).

confluent-kafka's ``Producer.close()`` aborts the open transaction and flushes, neither with a
timeout of its own: a worker re-creating its producer after a broker restart once went silent so,
its committer blocked under its transaction lock. A producer whose records cannot be delivered
(its bootstrap answers nothing) holds ``close()`` the same way, without any broker to stop."""

from __future__ import annotations

import threading

from confluent_kafka import Producer

from rollout_journal.journal.kafka.clients import close_client

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
