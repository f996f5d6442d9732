"""Schema evolution: a record written with every kept writer schema reads with the current one."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from fastavro import parse_schema
from fastavro.schema import to_parsing_canonical_form

import schemas
from journal.codec import MAGIC, Codec
from journal.errors import RecordLocation
from journal.events import (
    AttemptFenced,
    AttemptStarted,
    BlobChunk,
    BlobRef,
    ChainHead,
    EventChunk,
    FenceEntry,
    FenceHistory,
    HeadCheckpoint,
    Header,
    Message,
    ModelCall,
    ModelCallProgress,
    OutputSegment,
    Record,
    ResourceMutation,
    RolloutAcknowledged,
    RolloutFailed,
    RolloutFinished,
    Snapshot,
    TokenSegment,
    TrainingRecord,
    TurnCompleted,
    WorkloadRegistered,
)
from schemas.legacy import FINGERPRINTS_0_1_0, fingerprint_by_the_0_1_0_rule
from tests.journal_conformance import header, model_call, started, turn_done

WHERE = RecordLocation("test", 0, 0)

SAMPLES = {
    "AttemptStarted": AttemptStarted(started("r", 0, attempt=3, epoch=4).header, 0, "topo", "new rollout",
                                     [Message("system", "be brief"), Message("user", "task")], "max_turns 5 -> 6",
                                     "r0@3"),
    "AttemptFenced": AttemptFenced(header("r", 1), 2, 3, "superseded by attempt 3"),
    "ModelCall": dataclasses.replace(model_call("r", 2, tokens=1024),
                                     segments=[OutputSegment(1, "policy-a", 600), OutputSegment(2, "policy-a", 424)]),
    "ModelCallProgress": ModelCallProgress(header("r", 2), "r/a1/t0/c0", 0, "policy-a", "s" * 64, 32,
                                           np.arange(32, dtype="<i4"), np.linspace(-3, 0, 32, dtype="<f4")),
    "ResourceMutation": ResourceMutation(header("r", 3), "r/mail", "mailbox", "send", '{"to":"a"}', "r:1:0",
                                         4, 5, '{"ok":true}', "d" * 64, "c" * 64),
    "TurnCompleted": turn_done("r", 4),
    "RolloutFinished": RolloutFinished(header("r", 5), 0.75, 5, '{"reward":0.75}'),
    "RolloutFailed": RolloutFailed(header("r", 5), "SandboxCrashedError", "sandbox r/python exited with code -9"),
    "RolloutAcknowledged": RolloutAcknowledged(header("r", 6), "trainer-0"),
    "Snapshot": Snapshot(header("r", 7), "running", 6, 0, 123, b"state", "e" * 64, BlobRef("f" * 64, 10, 1)),
    "BlobChunk": BlobChunk("f" * 64, 0, 1, b"0123456789"),
    "WorkloadRegistered": WorkloadRegistered("demo", '{"groups":2}', ["demo-g0-s0", "demo-g1-s0"], "t" * 16, 7, "w0",
                                             True),
    "FenceHistory": FenceHistory("r", [FenceEntry(1, 1, 0, "w0", 5), FenceEntry(2, 2, 6, "w1", 9)], 2),
    "HeadCheckpoint": HeadCheckpoint(header("r", 8), 1, [ChainHead("r/mail", 5, "c" * 64), ChainHead("r/crm", 0, "a" * 64)],
                                     "ed25519", "k" * 64, bytes(range(64))),
    "EventChunk": EventChunk(header("r", 8), "ModelCall", "a" * 64, 1, 3, 1_500_000, b"piece"),
    "TrainingRecord": TrainingRecord(header("r", 5), 3, 0.75, True, np.arange(6, dtype="<i4"),
                                     np.array([0, 0, 0, -0.5, -1.25, 0], dtype="<f4"),
                                     np.array([0, 0, 0, 1, 1, 0], dtype=bool),
                                     [TokenSegment(0, 3, False, 1, 0, "r/a1/t0/c0", "policy-a"),
                                      TokenSegment(3, 5, True, 2, 0, "r/a1/t0/c0", "policy-b"),
                                      TokenSegment(5, 6, False, 2, 1, "r/a2/t1/c0", "policy-b")],
                                     [FenceEntry(1, 1, 0, "w0", 5), FenceEntry(2, 2, 6, "w1", 9)]),
}
NOT_ROLLOUT_EVENTS = ("Snapshot", "BlobChunk", "WorkloadRegistered", "FenceHistory", "TrainingRecord")
NO_HEADER = ("BlobChunk", "WorkloadRegistered", "FenceHistory")

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


@pytest.mark.parametrize(("name", "version"), [c for c in CASES if c[0] not in NOT_ROLLOUT_EVENTS],
                         ids=[f"{n}.v{v.version}" for n, v in CASES if n not in NOT_ROLLOUT_EVENTS])
def test_the_header_seq_is_read_without_decoding_every_kept_event_version(name: str, version) -> None:
    from journal.codec import peek_seq
    data = Codec().encode_with(SAMPLES[name], version)
    assert peek_seq(data) == SAMPLES[name].header.seq


# Avro Java's SchemaNormalization.parsingFingerprint64 of each released version's
# self-contained schema, in wire order (tests/test_avro_java.py asks Java itself).
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


@pytest.mark.parametrize(("name", "version"), RELEASED_IN_0_1_0, ids=[f"{n}.v{v.version}" for n, v in RELEASED_IN_0_1_0])
def test_a_record_with_its_0_1_0_fingerprint_still_decodes(name: str, version: schemas.SchemaVersion) -> None:
    codec = Codec()
    assert version.legacy_fingerprint == FINGERPRINTS_0_1_0[name, version.version]
    written = codec.encode_with(SAMPLES[name], version)
    as_0_1_0_wrote_it = MAGIC + version.legacy_fingerprint + written[10:]  # schema files are frozen: same body
    assert codec.decode(as_0_1_0_wrote_it, WHERE) == codec.decode(written, WHERE)


HEADER = Header("rollout-7", "group-1", 2, 3, 4, 17, 1764000000000, "worker-0")
# Bytes rollout-journal 0.1.0 wrote (its own codec, commit ef5c7df) for these two records.
WRITTEN_BY_0_1_0 = [
    (("c3014ac57d493a8b2b8d12726f6c6c6f75742d370e67726f75702d310406082280a0bfe9d66610776f726b65722d3008"
      "10746f706f2d61626324726573756d65206166746572206372617368"),
     AttemptStarted(HEADER, 4, "topo-abc", "resume after crash")),
    (("c301b500b96dae80643e12726f6c6c6f75742d370e67726f75702d310406082280a0bfe9d66610776f726b65722d3002"
      "12617373697374616e740e6c73202f746d70000222726f6c6c6f75742d372d63616c6c2d313600020466730a00020000"
      "00000000e03f02106c73282f746d702900"),
     TurnCompleted(HEADER, [Message("assistant", "ls /tmp")], ["rollout-7-call-16"], {"fs": 5}, 0.5, ["ls(/tmp)"])),
]


@pytest.mark.parametrize(("hex_bytes", "record"), WRITTEN_BY_0_1_0, ids=["AttemptStarted.v1", "TurnCompleted.v2"])
def test_a_journal_record_written_by_0_1_0_decodes_and_is_rewritten_with_the_standard_fingerprint(
        hex_bytes: str, record: Record) -> None:
    codec = Codec()
    old = bytes.fromhex(hex_bytes)
    assert codec.decode(old, WHERE) == record
    (written_with,) = [v for _, v in CASES if v.legacy_fingerprint == old[2:10]]
    new = codec.encode_with(record, written_with)
    assert new[10:] == old[10:] and new[2:10] == written_with.fingerprint != old[2:10]


def test_a_shared_type_is_written_out_at_its_first_use_only() -> None:
    record = {"type": "record", "name": "Pair", "namespace": "rollout_journal", "fields": [
        {"name": "first", "type": "rollout_journal.Header"},
        {"name": "second", "type": ["null", "Header"]},  # relative to the enclosing namespace: the same type
    ]}
    written = schemas.self_contained(record, schemas.shared_types())
    assert written["fields"][0]["type"]["name"] == "Header" and written["fields"][0]["type"]["fields"]
    assert written["fields"][1]["type"] == ["null", "Header"]
    assert to_parsing_canonical_form(parse_schema(written, named_schemas={})).count('"fields"') == 2
