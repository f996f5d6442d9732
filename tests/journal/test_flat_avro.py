"""The flat Avro writer writes, byte for byte, what fastavro writes: the summary record each append
adds goes through it, and its bytes must stay what any Avro peer reads (the record format and its
fingerprint are the schema's)."""

from __future__ import annotations

import dataclasses
import gc
import io
import random
import tracemalloc
from typing import Any

import pytest
from fastavro import parse_schema, schemaless_writer

from rollout_journal.journal.codec import Codec
from rollout_journal.journal.events import ModelCall, RolloutSummary
from rollout_journal.journal.flat_avro import MEMO_MAX_CHARS, flat_writer
from rollout_journal.journal.summary import SummaryFold

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


def test_a_union_fastavro_would_check_and_this_writer_would_not_stays_on_fastavro() -> None:
    for inner in ("int", "long", "boolean"):  # e.g. 2**40 in ["null", "int"]: fastavro refuses, a peer too
        schema = {"type": "record", "name": "U", "fields": [{"name": "u", "type": ["null", inner]}]}
        assert flat_writer(schema) is None, inner


def test_long_strings_written_are_not_kept_alive_by_the_memo() -> None:
    """A failure's message can be megabytes of a tool's output (written incomplete, but encoded
    first); memoized, 4,096 of them would stay in memory after their summaries were gone."""
    encode = Codec().values_encoder(RolloutSummary)
    assert encode is not None
    values = list(SummaryFold.empty("r", "g").values())
    failure_at = [f.name for f in dataclasses.fields(RolloutSummary)].index("failure")
    tracemalloc.start()
    try:
        for i in range(20):
            values[failure_at] = f"ToolError {i}: " + "x" * 1_000_000
            encode(tuple(values))
        values[failure_at] = None
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held < 5_000_000, f"{held / 1e6:.0f} MB of written strings kept after they are gone"
    short = "y" * MEMO_MAX_CHARS  # at the limit: still memoized, and the same bytes either way
    values[failure_at] = short
    assert encode(tuple(values)) == Codec().encode(RolloutSummary(*values))


def test_a_summary_s_values_are_in_its_record_s_field_order() -> None:
    """values() is positional (the writer and record() both take it so): a field moved there alone
    would swap two counts in every summary, and both sides of a byte comparison would agree."""
    fields = dataclasses.fields(RolloutSummary)
    distinct: dict[str, Any] = {}
    for i, f in enumerate(fields):
        kind = str(f.type)
        distinct[f.name] = f.name if kind in ("str", "str | None") else [f.name] if kind == "list[str]" else i + 2
    flags = ("complete", "finished", "acknowledged", "given_up")
    flags += ("newest_attempt_ran", "newest_attempt_ended", "newest_attempt_forked")
    for i, name in enumerate(flags):
        distinct[name] = i % 2 == 0
    distinct["reward"] = 0.25
    record = RolloutSummary(**distinct)
    again = SummaryFold.of(record).record()
    assert dataclasses.replace(again, ts_ms=0) == dataclasses.replace(record, ts_ms=0)
