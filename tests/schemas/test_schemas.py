"""Schema evolution: a record written with every kept writer schema reads with the current one."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from fastavro import parse_schema
from fastavro.schema import to_parsing_canonical_form

from rollout_journal import schemas
from rollout_journal.journal.codec import MAGIC, Codec
from rollout_journal.journal.errors import RecordLocation
from rollout_journal.journal.events import (
    AttemptStarted,
    Header,
    Message,
    ModelCall,
    Record,
    TurnCompleted,
)
from rollout_journal.schemas.legacy import FINGERPRINTS_0_1_0, fingerprint_by_the_0_1_0_rule
from tests.support.schema_samples import SAMPLES

WHERE = RecordLocation("test", 0, 0)

NOT_ROLLOUT_EVENTS = (
    "Snapshot",
    "BlobChunk",
    "WorkloadRegistered",
    "FenceHistory",
    "AcknowledgedRollouts",
    "TrainingRecord",
    "RolloutSummary",
)
NO_HEADER = ("BlobChunk", "WorkloadRegistered", "FenceHistory", "AcknowledgedRollouts", "RolloutSummary")

CASES = [(name, v) for name, versions in schemas.released_versions().items() for v in versions]


def test_every_schema_has_a_sample() -> None:
    assert set(SAMPLES) == set(schemas.released_versions())


@pytest.mark.parametrize(("name", "version"), CASES, ids=[f"{n}.v{v.version}" for n, v in CASES])
def test_a_record_written_with_a_kept_version_reads_with_the_current_one(
    name: str, version: schemas.SchemaVersion
) -> None:
    codec = Codec()
    sample = SAMPLES[name]
    data = codec.encode_with(sample, version)
    assert data[:2] == MAGIC and data[2:10] == version.fingerprint
    decoded = codec.decode(data, WHERE)
    written = {f["name"] for f in version.parsed["fields"]}
    fields = {f["name"]: f for f in version.parsed["fields"]}
    for field in dataclasses.fields(sample):
        expected = (
            as_written(getattr(sample, field.name), fields[field.name]["type"])
            if field.name in written
            else _default(field)
        )
        got = getattr(decoded, field.name)
        if isinstance(got, np.ndarray):
            assert np.array_equal(got, expected)
        else:
            assert got == expected, field.name


def _default(field: dataclasses.Field) -> object:
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default


def as_written(value: object, avro_type: object) -> object:
    """``value`` as a writer of ``avro_type`` keeps it: fields of nested records that this
    (older) schema lacks take their defaults."""
    if isinstance(avro_type, list):  # a union: the branch that is a record, if any
        records = [t for t in avro_type if isinstance(t, dict)]
        return value if value is None or not records else as_written(value, records[0])
    if isinstance(avro_type, dict) and avro_type.get("type") == "array" and isinstance(value, list):
        return [as_written(v, avro_type["items"]) for v in value]
    if isinstance(avro_type, dict) and avro_type.get("type") == "record" and dataclasses.is_dataclass(value):
        kept = {f["name"]: f["type"] for f in avro_type["fields"]}
        return dataclasses.replace(
            value,  # type: ignore[type-var]
            **{
                f.name: as_written(getattr(value, f.name), kept[f.name]) if f.name in kept else _default(f)
                for f in dataclasses.fields(value)
                if f.init
            },
        )
    return value


def test_packed_arrays_decode_as_views_without_copies() -> None:
    codec = Codec()
    call: ModelCall = codec.decode(codec.encode(SAMPLES["ModelCall"]), WHERE)
    assert call.prompt_delta.dtype == np.dtype("<i4") and not call.prompt_delta.flags.writeable
    assert call.prompt_delta.base is not None


@pytest.mark.parametrize(
    ("name", "version"),
    [c for c in CASES if c[0] not in NOT_ROLLOUT_EVENTS],
    ids=[f"{n}.v{v.version}" for n, v in CASES if n not in NOT_ROLLOUT_EVENTS],
)
def test_the_header_seq_is_read_without_decoding_every_kept_event_version(name: str, version) -> None:
    from rollout_journal.journal.codec import peek_seq

    data = Codec().encode_with(SAMPLES[name], version)
    assert peek_seq(data) == SAMPLES[name].header.seq


# Avro Java's SchemaNormalization.parsingFingerprint64 of each released version's
# self-contained schema, in wire order (tests/schemas/test_avro_java.py asks Java itself).
# A released schema's fingerprint never changes: journals on disk name it.
STANDARD_FINGERPRINTS = {
    ("AttemptFenced", 1): "aab84780fdbd70e3",
    ("AttemptStarted", 1): "00d1dbb059e6d92b",
    ("BlobChunk", 1): "b7045a2445318d95",
    ("ModelCall", 1): "0dec6cc675ea20f4",
    ("ModelCall", 2): "e6a8ea4245aac457",
    ("ModelCallProgress", 1): "30dd878921db461a",
    ("ResourceMutation", 1): "3a650556da1445d9",
    ("RolloutAcknowledged", 1): "4b4e2c5760e825c3",
    ("RolloutFinished", 1): "caf0371a1cc2cc5b",
    ("Snapshot", 1): "c66d6e0015f3cda9",
    ("TurnCompleted", 1): "ec45046c9a4afcfd",
    ("TurnCompleted", 2): "c4cd42f10bd0cb34",
    ("AttemptStarted", 2): "ad1d369e704c5ce1",
    ("WorkloadRegistered", 1): "7149c706c2430d14",
    ("HeadCheckpoint", 1): "0d25b1abca126d5f",
    ("EventChunk", 1): "20e3593bcea8e933",
    ("RolloutFailed", 1): "5f3310f64cd3a4c3",
    ("WorkloadRegistered", 2): "fc16837d18ccf77e",
    ("FenceHistory", 1): "c9a8031f22bc6636",
    ("TrainingRecord", 1): "fe72a4881ad012fb",
    ("RolloutGivenUp", 1): "e305fd95f8ae373e",
    ("WorkloadRegistered", 3): "4fb4384558102b9a",
    ("AttemptStarted", 3): "9a62be241fd64644",
    ("ModelCall", 3): "fb5b8dc5621a2316",
    ("ModelCallProgress", 2): "e36e29f493a5608b",
    ("TrainingRecord", 2): "156a491f337fd8bb",
    ("TurnCompleted", 3): "df12c42d402c7a64",
    ("Snapshot", 2): "2d9ab8a8a1c4dd11",
    ("RolloutSummary", 1): "9c801bd7a6f16fc3",
    ("AttemptStarted", 4): "429a26684f3299f5",
    ("AcknowledgedRollouts", 1): "9352617179e4509a",
    ("Snapshot", 3): "a17def081314b518",
}
VERSIONS = {(v.record, v.version): v for _, v in CASES}


def test_every_released_version_has_its_fingerprint_pinned() -> None:
    assert set(VERSIONS) == set(STANDARD_FINGERPRINTS)


@pytest.mark.parametrize("key", list(STANDARD_FINGERPRINTS), ids=[f"{n}.v{v}" for n, v in STANDARD_FINGERPRINTS])
def test_the_fingerprint_is_the_standard_one_avro_implementations_compute(key: tuple[str, int]) -> None:
    assert VERSIONS[key].fingerprint.hex() == STANDARD_FINGERPRINTS[key]


def test_the_self_contained_schema_parses_alone_and_writes_each_named_type_once() -> None:
    for _, version in CASES:
        parsed = parse_schema(json.loads(version.schema_json), named_schemas={})  # no shared types to lean on
        assert to_parsing_canonical_form(parsed) == to_parsing_canonical_form(version.parsed)
        assert version.schema_json.count('"name": "Header"') == (0 if version.record in NO_HEADER else 1)


def test_the_0_1_0_table_is_what_the_0_1_0_rule_computed() -> None:
    for (record, number), fp in FINGERPRINTS_0_1_0.items():
        assert fingerprint_by_the_0_1_0_rule(VERSIONS[record, number].path) == fp, f"{record}.v{number}"


RELEASED_IN_0_1_0 = [(n, v) for n, v in CASES if (n, v.version) in FINGERPRINTS_0_1_0]


@pytest.mark.parametrize(
    ("name", "version"), RELEASED_IN_0_1_0, ids=[f"{n}.v{v.version}" for n, v in RELEASED_IN_0_1_0]
)
def test_a_record_with_its_0_1_0_fingerprint_still_decodes(name: str, version: schemas.SchemaVersion) -> None:
    codec = Codec()
    assert version.legacy_fingerprint == FINGERPRINTS_0_1_0[name, version.version]
    written = codec.encode_with(SAMPLES[name], version)
    as_0_1_0_wrote_it = MAGIC + version.legacy_fingerprint + written[10:]  # schema files are frozen: same body
    assert codec.decode(as_0_1_0_wrote_it, WHERE) == codec.decode(written, WHERE)


HEADER = Header("rollout-7", "group-1", 2, 3, 4, 17, 1764000000000, "worker-0")
# Bytes rollout-journal 0.1.0 wrote (its own codec, commit ef5c7df) for these two records.
WRITTEN_BY_0_1_0 = [
    (
        (
            "c3014ac57d493a8b2b8d12726f6c6c6f75742d370e67726f75702d310406082280a0bfe9d66610776f726b65722d3008"
            "10746f706f2d61626324726573756d65206166746572206372617368"
        ),
        AttemptStarted(HEADER, 4, "topo-abc", "resume after crash"),
    ),
    (
        (
            "c301b500b96dae80643e12726f6c6c6f75742d370e67726f75702d310406082280a0bfe9d66610776f726b65722d3002"
            "12617373697374616e740e6c73202f746d70000222726f6c6c6f75742d372d63616c6c2d313600020466730a00020000"
            "00000000e03f02106c73282f746d702900"
        ),
        TurnCompleted(HEADER, [Message("assistant", "ls /tmp")], ["rollout-7-call-16"], {"fs": 5}, 0.5, ["ls(/tmp)"]),
    ),
]


@pytest.mark.parametrize(("hex_bytes", "record"), WRITTEN_BY_0_1_0, ids=["AttemptStarted.v1", "TurnCompleted.v2"])
def test_a_journal_record_written_by_0_1_0_decodes_and_is_rewritten_with_the_standard_fingerprint(
    hex_bytes: str, record: Record
) -> None:
    codec = Codec()
    old = bytes.fromhex(hex_bytes)
    assert codec.decode(old, WHERE) == record
    (written_with,) = [v for _, v in CASES if v.legacy_fingerprint == old[2:10]]
    new = codec.encode_with(record, written_with)
    assert new[10:] == old[10:] and new[2:10] == written_with.fingerprint != old[2:10]


def test_a_shared_type_is_written_out_at_its_first_use_only() -> None:
    record = {
        "type": "record",
        "name": "Pair",
        "namespace": "rollout_journal",
        "fields": [
            {"name": "first", "type": "rollout_journal.Header"},
            {"name": "second", "type": ["null", "Header"]},  # relative to the enclosing namespace: the same type
        ],
    }
    written = schemas.self_contained(record, schemas.shared_types())
    assert written["fields"][0]["type"]["name"] == "Header" and written["fields"][0]["type"]["fields"]
    assert written["fields"][1]["type"] == ["null", "Header"]
    assert to_parsing_canonical_form(parse_schema(written, named_schemas={})).count('"fields"') == 2
