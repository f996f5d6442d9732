"""Numbers read from outside text (a summaries key, a bootstrap port, an HTTP header, a fork's
turn): ``str.isdigit()`` admits what ``int()`` refuses, so one function decides what is a number,
and text that is not one is reported or refused by name, never raised as a bare ValueError."""

from __future__ import annotations

import pytest

from rollout_journal.journal.backend import StoredRecord
from rollout_journal.journal.codec import Codec
from rollout_journal.journal.errors import ConfigurationError, RecordLocation
from rollout_journal.journal.kafka.config import KafkaSettings
from rollout_journal.journal.summary import load_summaries
from rollout_journal.journal.whole_numbers import whole_number


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("0", 0),
        ("42", 42),
        ("007", 7),
        ("9" * 18, int("9" * 18)),
        ("", None),
        ("-1", None),
        (" 1", None),
        ("1.5", None),
        ("\u00b2", None),
        ("\u0663", None),
        ("\u2460", None),
        ("9" * 19, None),
        ("9" * 5000, None),
    ],
)
def test_a_whole_number_is_plain_ascii_digits(text: str, number: int | None) -> None:
    assert whole_number(text) == number


def test_a_summaries_key_whose_epoch_is_no_number_is_reported_not_raised() -> None:
    records = [
        StoredRecord(f"r-{i}/e{epoch}", b"\x00", RecordLocation("ns.summaries", 0, i))
        for i, epoch in enumerate(["\u00b2", "9" * 5000])
    ]
    index = load_summaries(Codec(), records)
    assert not index.summaries
    assert [str(e).count("is no summary's") for e in index.errors] == [1, 1]


@pytest.mark.parametrize("port", ["\u00b2", "9" * 5000, "0", "65536"])
def test_a_bootstrap_port_that_is_no_port_is_named(port: str) -> None:
    with pytest.raises(ConfigurationError, match="is not a number in 1-65535"):
        KafkaSettings(bootstrap_servers=f"localhost:{port}", namespace="ns")
