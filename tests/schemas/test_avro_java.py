"""Standard Avro: Apache Avro Java, a peer nobody here wrote, reads the journal.

Its single-object decoder (``BinaryMessageDecoder``) finds the writer schema by
the fingerprint after ``C3 01``, so it decodes a record only if that fingerprint
is the standard CRC-64-AVRO of the schema's Parsing Canonical Form. The peer
(``tests/java/AvroPeer.java``) is given nothing but each kept version's
self-contained schema JSON and the raw record bytes, read back from a real file
journal and consumed from a real Kafka topic; what it decodes must equal what
the Python codec decodes. Avro's jars come from Maven Central
(``tests/java/pom.xml``) the way the broker's do, and the compiled peer is
cached beside them, outside git.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from confluent_kafka import Consumer, KafkaError, TopicPartition

from rollout_journal import schemas
from rollout_journal.compose.maven_jars import build_once, cache_root, ensure_maven_jars, pom_property, require_tool
from rollout_journal.journal import (
    AttemptFenced,
    AttemptStarted,
    ChainHead,
    Codec,
    FileBackend,
    HeadSigner,
    Journal,
    Message,
    RecordLocation,
    ResourceMutation,
    RolloutAcknowledged,
    RolloutFailed,
    RolloutFinished,
    SnapshotDraft,
    WorkloadRegistered,
)
from rollout_journal.journal.kafka.backend import KafkaBackend
from rollout_journal.journal.kafka.config import KafkaSettings
from rollout_journal.journal.summary import COMPLETE_VALUE
from tests.support.journal_conformance import header, model_call, started, turn_done
from tests.support.paths import TESTS_DIR
from tests.support.schema_samples import SAMPLES

JAVA_DIR = TESTS_DIR / "java"
POM = JAVA_DIR / "pom.xml"
SOURCE = JAVA_DIR / "AvroPeer.java"
EVERY_RECORD_TYPE = {
    "AttemptStarted",
    "AttemptFenced",
    "ModelCall",
    "ResourceMutation",
    "TurnCompleted",
    "RolloutFinished",
    "RolloutAcknowledged",
    "Snapshot",
    "BlobChunk",
    "WorkloadRegistered",
    "HeadCheckpoint",
    "RolloutFailed",
    "FenceHistory",
    "AcknowledgedRollouts",
}
WHERE = RecordLocation("test", 0, 0)


@dataclass(frozen=True)
class AvroJava:
    """The compiled peer and its classpath."""

    java: str
    classpath: str

    def read(self, records: list[bytes], work: Path) -> dict[str, Any]:
        """Hand every kept schema version and ``records`` to the peer; its JSON answer."""
        request = work / "avro-peer-input.json"
        request.write_text(
            json.dumps(
                {
                    "schemas": [
                        {"id": f"{v.record}.v{v.version}", "json": v.schema_json}
                        for versions in schemas.released_versions().values()
                        for v in versions
                    ],
                    "messages": [record.hex() for record in records],
                }
            )
        )
        done = subprocess.run(
            [self.java, "-cp", self.classpath, "AvroPeer", str(request)],
            check=False,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=300,
        )
        assert done.returncode == 0, f"AvroPeer failed (exit {done.returncode}):\n{done.stderr[-4000:]}"
        return json.loads(done.stdout)


@pytest.fixture(scope="session")
def avro_java() -> AvroJava:
    """Avro Java's jars (Maven, once) and the peer compiled against them (javac, once per source)."""
    version = pom_property(POM, "avro.version")
    folder = cache_root() / f"avro-{version}"
    libs = ensure_maven_jars(POM, folder, f"Avro Java {version}")
    jdk = "a JDK 17+ (e.g. `apt-get install openjdk-17-jdk-headless`) to compile and run the Avro Java peer"
    javac, java = require_tool("javac", jdk), require_tool("java", jdk)
    classpath = f"{libs}{os.sep}*"

    def compile_peer(out: Path) -> None:
        done = subprocess.run(
            [javac, "-d", str(out), "-cp", classpath, str(SOURCE)],
            check=False,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
        )
        if done.returncode != 0:
            raise RuntimeError(f"javac {SOURCE} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")

    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(sorted(p.name for p in libs.glob("*.jar"))).encode())
    classes = build_once(folder / "peer-classes", key.hexdigest(), compile_peer)
    return AvroJava(java, f"{classes}{os.pathsep}{classpath}")


def plain(value: Any) -> Any:
    """A decoded record as the peer prints it: packed arrays and bytes as hex."""
    if dataclasses.is_dataclass(value):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, np.ndarray):
        return value.tobytes().hex()  # int32-le / float32-le fields are plain bytes to any other Avro reader
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def assert_java_reads_what_we_read(avro_java: AvroJava, records: list[bytes], work: Path) -> set[str]:
    """Each record decodes in Java to the values the Python codec decodes; the record types seen."""
    codec = Codec()
    answer = avro_java.read(records, work)
    seen = set()
    for i, (record, theirs) in enumerate(zip(records, answer["messages"], strict=True)):
        ours = codec.decode(record, WHERE)
        assert "error" not in theirs, f"record {i} ({ours.RECORD}, fingerprint {record[2:10].hex()}): {theirs['error']}"
        assert theirs["schema"] == f"rollout_journal.{ours.RECORD}"
        assert theirs["value"] == plain(ours), f"record {i} ({ours.RECORD})"
        seen.add(ours.RECORD)
    return seen


def test_java_computes_our_fingerprint_for_every_kept_schema_version(avro_java: AvroJava, tmp_path: Path) -> None:
    fingerprints = avro_java.read([], tmp_path)["fingerprints"]
    for versions in schemas.released_versions().values():
        for version in versions:
            theirs = (fingerprints[f"{version.record}.v{version.version}"] & (2**64 - 1)).to_bytes(8, "little")
            assert theirs.hex() == version.fingerprint.hex(), version.path.name  # both in wire order


def test_java_decodes_a_record_of_every_kept_schema_version(avro_java: AvroJava, tmp_path: Path) -> None:
    codec = Codec()
    samples: dict[str, Any] = SAMPLES
    records = [
        codec.encode_with(samples[name], v) for name, versions in schemas.released_versions().items() for v in versions
    ]  # old versions too: Java resolves them to the newest, as we do
    assert assert_java_reads_what_we_read(avro_java, records, tmp_path) == set(schemas.released_versions())


def write_every_record_type(journal: Journal) -> None:
    """A rollout whose first attempt fails on its infrastructure, resumes as attempt 2 with a
    chunked snapshot, finishes, is acknowledged, and has its resources' chain heads signed. A second
    rollout on its partition (of 1 or 2) runs and is acknowledged: with a bucket size of 1 that folds
    the first one's fence into an ``AcknowledgedRollouts`` bucket."""
    r = "rollout-a"
    mutation = ResourceMutation(
        header(r, 2), "r/mail", "mailbox", "send", '{"to":"a"}', "r:1:0", 4, 5, '{"ok":true}', "d" * 64, "c" * 64
    )
    first = AttemptStarted(header(r, 0), 0, "topo", "new rollout", [Message("system", "be brief")])
    journal.append_sync(
        [first, model_call(r, 1), mutation, turn_done(r, 3)], SnapshotDraft(header(r, 3), "running", 3, b"small state")
    )
    journal.append_sync([RolloutFailed(header(r, 4, turn=1), "SandboxCrashedError", "sandbox exited with -9")])
    journal.append_sync(
        [
            started(r, 5, attempt=2, epoch=2),
            AttemptFenced(header(r, 6, attempt=2, epoch=2), 1, 1, "resumed after a failure"),
        ]
    )
    big_state = bytes(range(256)) * 40  # over the inline limit below: BlobChunk records
    journal.append_sync(
        [model_call(r, 7, turn=2, epoch=2), turn_done(r, 8, turn=2, epoch=2, attempt=2)],
        SnapshotDraft(header(r, 8, turn=2, attempt=2, epoch=2), "running", 8, big_state),
    )
    journal.append_sync([RolloutFinished(header(r, 9, turn=2, attempt=2, epoch=2), 0.75, 2, '{"reward":0.75}')])
    journal.acknowledge(RolloutAcknowledged(header(r, 10, turn=2, attempt=2, epoch=2), "trainer-0")).result()
    journal.append_sync([started("rollout-b", 0), RolloutFinished(header("rollout-b", 1), 1.0, 0, "{}")])
    journal.acknowledge(RolloutAcknowledged(header("rollout-b", 2), "trainer-0")).result()
    signer = HeadSigner.generate()
    journal.append_sync(
        [
            signer.checkpoint(
                header(r, 11, turn=2, attempt=2, epoch=2),
                0,
                [ChainHead("r/mail", 5, "c" * 64), ChainHead("r/crm", 0, "e" * 64)],
            )
        ]
    )
    journal.register_workload(WorkloadRegistered("wl", '{"groups": 1}', [r], "topo", 7, "worker-0", True)).result()


def test_java_decodes_a_file_journal(avro_java: AvroJava, tmp_path: Path) -> None:
    journal = Journal(FileBackend(tmp_path / "journal"), inline_snapshot_limit=4096, acknowledgement_bucket_size=1)
    write_every_record_type(journal)
    journal.close()
    backend = FileBackend(tmp_path / "journal")
    try:
        stored = [*backend.read_events(), *backend.read_snapshots()]  # raw frames: nothing decoded yet
    finally:
        backend.close()
    assert not [s for s in stored if s.error is not None]
    records = [s.value for s in stored if s.value is not None]
    assert assert_java_reads_what_we_read(avro_java, records, tmp_path) == EVERY_RECORD_TYPE


def consume_raw_values(bootstrap: str, topics: list[str]) -> list[bytes]:
    """Every committed value of ``topics``, as bytes off the wire (tombstones left out)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "avro-java-peer",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
        }
    )
    try:
        partitions = [
            TopicPartition(topic, p, 0)
            for topic in topics
            for p in consumer.list_topics(topic, timeout=30).topics[topic].partitions
        ]
        consumer.assign(partitions)
        at_end: set[tuple[str, int]] = set()
        values: list[bytes] = []
        while len(at_end) < len(partitions):
            message = consumer.poll(30)
            assert message is not None, f"no record and no end of partition within 30 s; at end: {sorted(at_end)}"
            error, value = message.error(), message.value()
            if error is not None:
                assert error.code() == KafkaError._PARTITION_EOF, error
                at_end.add((str(message.topic()), int(message.partition() or 0)))
            elif value is not None:  # a tombstone (acknowledged rollout) carries no record
                values.append(value)
        return values
    finally:
        consumer.close()


@pytest.mark.kafka
def test_java_decodes_a_kafka_journal(
    avro_java: AvroJava, kafka_bootstrap: str, kafka_namespace: str, tmp_path: Path
) -> None:
    settings = KafkaSettings(
        bootstrap_servers=kafka_bootstrap,
        namespace=kafka_namespace,
        partitions=2,
        transactional_id=f"{kafka_namespace}-writer",
    )
    journal = Journal(KafkaBackend(settings), inline_snapshot_limit=4096, acknowledgement_bucket_size=1)
    try:
        write_every_record_type(journal)
    finally:
        journal.close()
    topics = [settings.events_topic, settings.snapshots_topic, settings.summaries_topic]
    records = [v for v in consume_raw_values(kafka_bootstrap, topics) if v != COMPLETE_VALUE]  # the mark is no Avro
    assert assert_java_reads_what_we_read(avro_java, records, tmp_path) == EVERY_RECORD_TYPE | {"RolloutSummary"}
