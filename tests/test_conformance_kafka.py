"""The conformance suite on a real Kafka broker."""

import pytest

from journal.kafka_backend import KafkaBackend
from journal.kafka_config import KafkaSettings
from tests.journal_conformance import JournalConformance

pytestmark = pytest.mark.kafka


class TestKafkaJournal(JournalConformance):
    @pytest.fixture
    def open_backend(self, kafka_bootstrap: str, kafka_namespace: str):
        opened: list[KafkaBackend] = []
        settings = KafkaSettings(bootstrap_servers=kafka_bootstrap, namespace=kafka_namespace,
                                 partitions=3, transactional_id=f"{kafka_namespace}-writer")

        def open_() -> KafkaBackend:
            opened.append(KafkaBackend(settings))
            return opened[-1]

        yield open_
        for backend in opened:
            backend.close()
