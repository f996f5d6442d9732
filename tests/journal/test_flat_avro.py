"""The flat Avro writer writes, byte for byte, what fastavro writes: the summary record each append
adds goes through it, and its bytes must stay what any Avro peer reads (the record format and its
fingerprint are the schema's)."""

from __future__ import annotations

import dataclasses
import io
import random
from typing import Any

import pytest
from fastavro import parse_schema, schemaless_writer

from rollout_journal.journal.codec import Codec
from rollout_journal.journal.events import ModelCall, RolloutSummary
from rollout_journal.journal.flat_avro import flat_writer

EDGE_INTS = [0, 1, -1, 63, 64, -64, -65, 127, 128, 8191, 8192, -8193, 2**31, -(2**31) - 1, 2**63 - 1, -(2**63)]
STRINGS = ["", "a", "é漢🙂", "x" * 300]


def fastavro_bytes(schema: dict[str, Any], record: dict[str, Any]) -> bytes:
    out = io.BytesIO()
    schemaless_writer(out, schema, record)
    return out.getvalue()


def random_value(rng: random.Random, annotation: str) -> Any:
    if annotation == "str":
        return rng.choice(STRINGS)
    if annotation == "int":
        return rng.choice([*EDGE_INTS, rng.randrange(-(2**42), 2**42), rng.randrange(-20000, 20000)])
    if annotation == "bool":
        return rng.random() < 0.5
    if annotation == "float | None":
        return rng.choice([None, 0.0, -1.5, 1e300, float("inf"), 3])
    if annotation == "str | None":
        return rng.choice([None, *STRINGS])
    if annotation == "list[str]":
        return [rng.choice(STRINGS) for _ in range(rng.randrange(4))]
    raise AssertionError(f"no values for a field of type {annotation}")


def test_a_summary_encodes_to_the_bytes_the_codec_writes_whatever_its_values() -> None:
    codec = Codec()
    encode = codec.values_encoder(RolloutSummary)
    assert encode is not None, "the summary's schema is flat: it must keep its fast writer"
    rng = random.Random(7)
    fields = dataclasses.fields(RolloutSummary)
    for _ in range(3000):
        values = tuple(random_value(rng, str(f.type)) for f in fields)
        assert encode(values) == codec.encode(RolloutSummary(*values)), values


def test_numbers_fastavro_converts_are_converted_alike_and_a_number_too_large_is_refused() -> None:
    schema = parse_schema(
        {
            "type": "record",
            "name": "Numbers",
            "fields": [{"name": "i", "type": "int"}, {"name": "l", "type": "long"}, {"name": "d", "type": "double"}],
        }
    )
    write = flat_writer(schema)
    assert write is not None
    for value in [True, False, 1.0, 1.7, -2.5, 300.0, 5]:  # a float is truncated, a bool is its number
        assert write((value, value, value)) == fastavro_bytes(schema, {"i": value, "l": value, "d": value})
    with pytest.raises(OverflowError):
        write((2**63, 0, 0.0))


def test_a_schema_with_anything_but_flat_fields_gets_no_writer() -> None:
    codec = Codec()
    assert codec.values_encoder(ModelCall) is None  # nested records, bytes
    assert (
        flat_writer({"type": "record", "name": "E", "fields": [{"name": "e", "type": ["null", "string", "long"]}]})
        is None
    )
    assert flat_writer({"type": "record", "name": "F", "fields": [{"name": "f", "type": "float"}]}) is None
