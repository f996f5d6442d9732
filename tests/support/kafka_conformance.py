"""The journal conformance suite on a Kafka broker: the backend fixture, for every broker the
suite runs it on (the session's broker in tests/journal/kafka/test_conformance.py, a
testcontainers broker in tests/compose/broker/test_docker_path.py, which override ``kafka_bootstrap``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from rollout_journal.journal.kafka.backend import KafkaBackend
from rollout_journal.journal.kafka.config import KafkaSettings
from tests.support.journal_conformance import JournalConformance


class KafkaJournalConformance(JournalConformance):
    @pytest.fixture
    def open_backend(self, kafka_bootstrap: str, kafka_namespace: str) -> Iterator[Callable[[], KafkaBackend]]:
        opened: list[KafkaBackend] = []
        settings = KafkaSettings(
            bootstrap_servers=kafka_bootstrap,
            namespace=kafka_namespace,
            partitions=3,
            transactional_id=f"{kafka_namespace}-writer",
        )

        def open_() -> KafkaBackend:
            opened.append(KafkaBackend(settings))
            return opened[-1]

        yield open_
        for backend in opened:
            backend.close()
