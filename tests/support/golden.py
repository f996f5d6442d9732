"""Golden journals: journals this version wrote, kept in ``tests/data/golden/`` and read in CI,
so a later change that can no longer read them fails the suite (as Temporal's replay tests
load recorded histories).

Each golden journal is a small workload that crashed and resumed, and crashed again
(some rollouts unfinished, one restarted from turn 0 on the restart-only sandbox, one
acknowledged), with signed chain heads:

- ``file-journal/``: the file backend's directory, byte for byte;
- ``kafka-records.jsonl``: every committed record of a Kafka namespace, as a consumer
  read it off the wire (topic, partition, offset, key, value), so offsets are the
  broker's own (transaction markers included);
- ``expected.json``: what this version derived from each: per rollout the aggregate's
  progress and a digest of its lineage, and the audit's verdict.

``python -m tests.support.golden KAFKA_BOOTSTRAP`` writes them anew. Do that only on purpose (a
new golden set for a new format version, kept beside the old one), never to make a
failing test pass.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import shutil
import sys
import uuid
from collections.abc import Collection, Iterator

from confluent_kafka import Consumer, KafkaError, TopicPartition

from rollout_journal.journal import (
    Backend,
    HeadSigner,
    HeldBack,
    Journal,
    RecordLocation,
    StoredRecord,
    load_rollouts,
    open_journal,
)
from rollout_journal.participants.rollout.state import RolloutState, restore_state
from rollout_journal.participants.workload.config import WorkloadConfig
from rollout_journal.participants.workload.run import build_backend, open_workload_journal
from rollout_journal.participants.workload.runner import Runner, workload_specs
from tests.support.paths import DATA_DIR

GOLDEN = DATA_DIR / "golden"
VERIFY_KEY = GOLDEN / "verify-key.pem"  # the signing half is thrown away once the journals are written


def golden_workload(journal: str) -> WorkloadConfig:
    return WorkloadConfig(
        name="golden",
        groups=3,
        siblings=2,
        max_turns=4,
        environment="workplace,counter,sandbox",
        seed=7,
        allow_early_submit=False,
        journal=journal,
        snapshot_every_turns=2,
    )


def _drive(
    config: WorkloadConfig,
    *,
    resume: bool,
    stop_after: dict[str, int] | None = None,
    acknowledge: list[str] | None = None,
) -> None:
    async def go() -> None:
        backend = build_backend(config)
        with open_workload_journal(config) as journal:
            runner = Runner(config, journal, backend, backend.tokenizer, signer=HeadSigner.from_environment())
            await runner.run(resume=resume, stop_after=stop_after)
            if acknowledge:
                await runner.acknowledge(acknowledge)

    asyncio.run(go())


def write_history(config: WorkloadConfig) -> None:
    """Crash (at turn boundaries, so the history is the same every time), resume, crash again."""
    ids = [s.rollout_id for s in workload_specs(config)]
    _drive(config, resume=False, stop_after={rid: 1 + i % 3 for i, rid in enumerate(ids)})
    finished = ids[0]
    _drive(config, resume=True, stop_after={rid: (4 if rid == finished else 3) for rid in ids}, acknowledge=[finished])
    _drive(config, resume=True, stop_after={rid: 3 for rid in ids[1:]})  # attempt 3 of the unfinished


def derive(journal: Journal, config: WorkloadConfig) -> dict:
    """What this version derives from a journal: the expected.json of a golden set."""
    from rollout_journal.journal import HeadVerifier, ReadReport
    from rollout_journal.replay.audit import ChainAuditor

    plan = load_rollouts(journal)
    rollouts = {}
    for spec in workload_specs(config):
        history = plan.rollouts.get(spec.rollout_id)
        if history is None:
            rollouts[spec.rollout_id] = None  # acknowledged: gone from the snapshot stream
            continue
        rollouts[spec.rollout_id] = _summary(restore_state(history, spec.group_id))
    report = ReadReport()
    auditor = ChainAuditor(HeadVerifier.from_pem(VERIFY_KEY.read_bytes(), "golden verify key"))
    for item in journal.scan(report):
        auditor.feed(item)
    audit = auditor.finish(report)
    registration = plan.workloads[config.name]
    return {
        "rollouts": rollouts,
        "workload": {
            "name": registration.name,
            "rollout_ids": registration.rollout_ids,
            "topology": registration.topology,
        },
        "audit": {
            "chain_ok": audit.chain_ok,
            "anchored": audit.anchored,
            "anchors_verified": audit.anchors_verified,
            "mutation_count": audit.mutation_count,
            "checkpoints": audit.checkpoints,
        },
        "read_errors": [str(e) for e in plan.report.errors],
    }


def _summary(state: RolloutState) -> dict:
    return {
        "attempt": state.attempt,
        "epoch": state.epoch,
        "next_turn": state.next_turn,
        "next_seq": state.next_seq,
        "finished": state.finished,
        "reward": state.reward,
        "acknowledged": state.acknowledged,
        "restarts": state.restarts,
        "model_calls": state.model_calls,
        "mutation_count": state.mutation_count,
        "messages": len(state.messages),
        "actions": state.actions,
        "head_tokens_sha256": hashlib.sha256(state.head_tokens.astype("<i4").tobytes()).hexdigest(),
        "resources": sorted(state.resource_states),
        "mutations_since_export": len(state.mutations_since_export),
    }


# -- Kafka records, as read off the wire ------------------------------------------------------


def dump_namespace(bootstrap: str, namespace: str, partitions: int) -> list[dict]:
    """Every committed record of the namespace's topics, in log order per partition."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"golden-{uuid.uuid4().hex[:8]}",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "auto.offset.reset": "earliest",
        }
    )
    rows: list[dict] = []
    try:
        topics = [f"{namespace}.events", f"{namespace}.snapshots"]
        consumer.assign([TopicPartition(t, p, 0) for t in topics for p in range(partitions)])
        pending = {(t, p) for t in topics for p in range(partitions)}
        while pending:
            msg = consumer.poll(5.0)
            if msg is None:
                raise RuntimeError(f"no progress dumping {sorted(pending)}")
            if msg.error() is not None:
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    pending.discard((msg.topic(), msg.partition()))
                    continue
                raise RuntimeError(msg.error())
            rows.append(
                {
                    "topic": msg.topic().split(".", 1)[1],
                    "partition": msg.partition(),
                    "offset": msg.offset(),
                    "key": msg.key().decode(),
                    "value": None if msg.value() is None else base64.b64encode(msg.value()).decode(),
                }
            )
    finally:
        consumer.close()
    return rows


class RecordDumpBackend(Backend):
    """A read-only backend over a Kafka record dump: the journal reads the broker's exact
    records, keys, partitions and offsets, as its Kafka backend would hand them over."""

    kind = "kafka-dump"

    def __init__(self, rows: list[dict], partitions: int, namespace: str = "golden") -> None:
        self.partitions = partitions
        self._rows = rows
        self._namespace = namespace

    def _stored(self, topic: str, partition: int) -> Iterator[StoredRecord]:
        for row in self._rows:
            if row["topic"] == topic and row["partition"] == partition:
                value = None if row["value"] is None else base64.b64decode(row["value"])
                yield StoredRecord(
                    row["key"], value, RecordLocation(f"{self._namespace}.{topic}", partition, row["offset"])
                )

    def read_events(
        self, partition: int, from_offset: int = 0, held: list[HeldBack] | None = None
    ) -> Iterator[StoredRecord]:
        return (r for r in self._stored("events", partition) if r.location.offset >= from_offset)

    def read_snapshots(self, partitions: Collection[int] | None = None) -> Iterator[StoredRecord]:
        for partition in range(self.partitions) if partitions is None else sorted(partitions):
            yield from self._stored("snapshots", partition)

    def end_offset(self, partition: int) -> int:
        offsets = [r["offset"] for r in self._rows if r["topic"] == "events" and r["partition"] == partition]
        return max(offsets, default=-1) + 1

    def commit(self, records: object) -> list[RecordLocation]:
        raise NotImplementedError("a record dump is read-only")

    def close(self) -> None:
        pass


PARTITIONS = 4


def write_golden(bootstrap: str) -> None:
    """Write the golden set anew (see the module docstring)."""
    import os

    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    if GOLDEN.exists():
        shutil.rmtree(GOLDEN)
    GOLDEN.mkdir(parents=True)
    key = Ed25519PrivateKey.generate()
    VERIFY_KEY.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    os.environ["ROLLOUT_JOURNAL_SIGNING_KEY"] = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    expected = {}
    file_config = golden_workload(str(GOLDEN / "file-journal"))
    write_history(file_config)
    (GOLDEN / "file-journal" / "LOCK").unlink(missing_ok=True)
    with open_journal(file_config.journal, read_only=True) as journal:
        expected["file"] = derive(journal, file_config)
    namespace = f"golden{uuid.uuid4().hex[:6]}"
    kafka_config = golden_workload(f"kafka://{bootstrap}/{namespace}?partitions={PARTITIONS}")
    write_history(kafka_config)
    rows = dump_namespace(bootstrap, namespace, PARTITIONS)
    with (GOLDEN / "kafka-records.jsonl").open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    with Journal(RecordDumpBackend(rows, PARTITIONS)) as journal:
        expected["kafka"] = derive(journal, kafka_config)
    (GOLDEN / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    write_golden(sys.argv[1])
