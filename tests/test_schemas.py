"""Schema evolution: a record written with every kept writer schema reads with the current one."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import schemas
from journal.codec import MAGIC, Codec
from journal.errors import RecordLocation
from journal.events import (
    AttemptFenced, BlobChunk, BlobRef, EventChunk, ModelCall, ResourceMutation, RolloutAcknowledged,
    RolloutFinished, Snapshot,
)
from tests.journal_conformance import header, model_call, started, turn_done

WHERE = RecordLocation("test", 0, 0)

SAMPLES = {
    "AttemptStarted": started("r", 0, attempt=3, epoch=4),
    "AttemptFenced": AttemptFenced(header("r", 1), 2, 3, "superseded by attempt 3"),
    "ModelCall": model_call("r", 2, tokens=1024),
    "ResourceMutation": ResourceMutation(header("r", 3), "r/mail", "mailbox", "send", '{"to":"a"}', "r:1:0",
                                         4, 5, '{"ok":true}', "d" * 64, "c" * 64),
    "TurnCompleted": turn_done("r", 4),
    "RolloutFinished": RolloutFinished(header("r", 5), 0.75, 5, '{"reward":0.75}'),
    "RolloutAcknowledged": RolloutAcknowledged(header("r", 6), "trainer-0"),
    "Snapshot": Snapshot(header("r", 7), "running", 6, 0, 123, b"state", "e" * 64, BlobRef("f" * 64, 10, 1)),
    "BlobChunk": BlobChunk("f" * 64, 0, 1, b"0123456789"),
    "EventChunk": EventChunk(header("r", 8), "ModelCall", "a" * 64, 1, 3, 1_500_000, b"piece"),
}

CASES = [(name, v) for name, versions in schemas.released_versions().items() for v in versions]


def test_every_schema_has_a_sample() -> None:
    assert set(SAMPLES) == set(schemas.released_versions())


@pytest.mark.parametrize(("name", "version"), CASES, ids=[f"{n}.v{v.version}" for n, v in CASES])
def test_a_record_written_with_a_kept_version_reads_with_the_current_one(name: str, version: schemas.SchemaVersion) -> None:
    codec = Codec()
    sample = SAMPLES[name]
    data = codec.encode_with(sample, version)
    assert data[:2] == MAGIC and data[2:10] == version.fingerprint
    decoded = codec.decode(data, WHERE)
    written = {f["name"] for f in version.parsed["fields"]}
    for field in dataclasses.fields(sample):
        expected = getattr(sample, field.name) if field.name in written else field.default_factory() \
            if field.default_factory is not dataclasses.MISSING else field.default
        got = getattr(decoded, field.name)
        if isinstance(got, np.ndarray):
            assert np.array_equal(got, expected)
        else:
            assert got == expected, field.name


def test_packed_arrays_decode_as_views_without_copies() -> None:
    codec = Codec()
    call: ModelCall = codec.decode(codec.encode(SAMPLES["ModelCall"]), WHERE)
    assert call.prompt_delta.dtype == np.dtype("<i4") and not call.prompt_delta.flags.writeable
    assert call.prompt_delta.base is not None


@pytest.mark.parametrize(("name", "version"), [c for c in CASES if c[0] not in ("Snapshot", "BlobChunk")],
                         ids=[f"{n}.v{v.version}" for n, v in CASES if n not in ("Snapshot", "BlobChunk")])
def test_the_header_seq_is_read_without_decoding_every_kept_event_version(name: str, version) -> None:
    from journal.codec import peek_seq
    data = Codec().encode_with(SAMPLES[name], version)
    assert peek_seq(data) == SAMPLES[name].header.seq
