"""The conformance suite on a real Kafka broker."""

import pytest

from tests.support.kafka_conformance import KafkaJournalConformance

pytestmark = pytest.mark.kafka


class TestKafkaJournal(KafkaJournalConformance):
    """Every conformance test, on the session's broker."""
