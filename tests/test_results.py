"""Results for the trainer: each finished rollout's training record is published with its final
turn, and a trainer's feed hands on every prompt group exactly once across trainer and worker
crashes, with tensors equal to what the journal's model calls hold."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from journal.backend import OutRecord, Stream, partition_for
from journal.codec import Codec
from journal.events import Header, TokenSegment, TrainingRecord
from journal.file_backend import FileBackend
from journal.open import open_backend, open_journal
from journal.restore import load_rollouts
from participants.config import WorkloadConfig
from participants.runner import workload_specs
from participants.trainer import FeedPosition, TrainerFeed
from participants.workload import run_workload
from replay.source import open_replay
from replay.training import training_records
from tests.recovery_support import run_child_and_kill
from tests.trainer_child import digest

ROOT = Path(__file__).resolve().parent.parent



def workload(location: str, **overrides) -> WorkloadConfig:
    base = dict(name="res", groups=3, siblings=2, max_turns=3, environment="workplace", seed=5,
                allow_early_submit=False, journal=location, snapshot_every_turns=2)
    return WorkloadConfig(**(base | overrides))


def exported(location: str) -> dict[str, TrainingRecord]:
    """What ``replay export-training`` builds from the journal's events alone."""
    with open_replay(location) as source:
        return {r.rollout_id: r for r in training_records(source)}


def record(rollout: str, group: str, size: int, reward: float = 1.0) -> TrainingRecord:
    ids = np.arange(4, dtype="<i4")
    return TrainingRecord(Header(rollout, group, 1, 1, 0, 3, 0, "w"), size, reward, True, ids,
                          np.array([0, 0, -0.5, -0.25], dtype="<f4"), np.array([0, 0, 1, 1], dtype=bool),
                          [TokenSegment(0, 2, False, 1, 0, "c0", "p"), TokenSegment(2, 4, True, 1, 0, "c0", "p")])


def publish(backend, *records: TrainingRecord) -> None:
    codec = Codec()
    for r in records:  # one commit each, as each final turn is
        backend.commit([OutRecord(Stream.RESULTS, r.rollout_id, codec.encode(r), r.rollout_id)])


def test_the_feed_hands_on_whole_groups_with_tensors_equal_to_the_export(journal_location: str) -> None:
    config = workload(journal_location)
    run_workload(config, resume=False)
    again = run_workload(config, resume=True)  # finished, not acknowledged: offered again, never rerun
    assert all(r.reused_result for r in again.rollouts.values())
    expected = exported(journal_location)
    assert len(expected) == 6
    with TrainerFeed(open_backend(journal_location, read_only=True)) as feed:
        groups = list(feed.groups(limit=3, idle_timeout_s=120))  # a consumer's first fetch can lag under load
        groups += feed.groups(idle_timeout_s=2, poll_s=0.5)  # and then nothing more
    assert sorted(g.group_id for g in groups) == ["res-g0", "res-g1", "res-g2"]
    assert feed.records_read == 6 and feed.duplicates_dropped == 0  # one record per rollout, resumes or not
    for group in groups:
        batch = group.tensors()
        assert batch["rollout_ids"] == sorted(s.rollout_id for s in workload_specs(config)
                                              if s.group_id == group.group_id)
        for i, (rollout_id, record) in enumerate(zip(batch["rollout_ids"], group.records)):
            got, want = record.tensors(), expected[rollout_id].tensors()
            for key in ("input_ids", "logprobs", "loss_mask", "token_attempt", "segment_bounds", "segment_attempt"):
                assert torch.equal(got[key], want[key]), (rollout_id, key)
            assert got["segment_policy_version"] == want["segment_policy_version"]
            assert got["reward"] == want["reward"]
            k = len(want["input_ids"])
            assert torch.equal(batch["input_ids"][i, :k], want["input_ids"]) and not batch["attention_mask"][i, k:].any()
            assert torch.equal(batch["loss_mask"][i, :k], want["loss_mask"]) and want["loss_mask"].any()
            assert torch.equal(batch["logprobs"][i, :k], want["logprobs"])
            assert batch["policy_versions"][i] == want["policy_versions"]


def test_a_position_resumes_after_the_groups_handed_on_and_before_the_rest(tmp_path: Path) -> None:
    backend = FileBackend(tmp_path / "j")
    publish(backend, record("a0", "A", 2), record("b0", "B", 2), record("a1", "A", 2))
    with TrainerFeed(backend) as feed:
        first = feed.poll(5)
        assert first is not None and first.group_id == "A" and feed.poll(0.1) is None  # B waits for its sibling
        [waiting] = feed.waiting()  # what holds the position back, for an operator to find
        assert (waiting.group_id, waiting.arrived, waiting.missing) == ("B", ("b0",), 1)
        assert waiting.first.offset == first.position.offsets[0]  # a resumed feed starts at it
    assert first.position.delivered == {"A"}  # a1 lies past b0, where a resumed feed starts
    publish(backend, record("b1", "B", 2), record("a1", "A", 2))  # a1 again: a repeat the feed must drop
    with TrainerFeed(backend, FeedPosition.from_json(first.position.to_json())) as feed:
        second = feed.poll(5)
        assert second is not None and second.group_id == "B" and second.rollout_ids == ["b0", "b1"]
        assert feed.waiting() == []
        assert feed.poll(0.1) is None
    with TrainerFeed(backend, second.position) as feed:
        assert feed.poll(0.2) is None  # nothing is handed on twice
    with TrainerFeed(backend) as feed:  # from the start: every group once, the repeat dropped
        assert [g.group_id for g in feed.groups(idle_timeout_s=0.5, poll_s=0.1)] == ["A", "B"]
        assert feed.duplicates_dropped == 1
    backend.close()


@pytest.mark.kafka
def test_an_aborted_transaction_never_reaches_the_trainer(kafka_bootstrap: str, kafka_namespace: str) -> None:
    location = f"kafka://{kafka_bootstrap}/{kafka_namespace}?partitions=2"
    codec = Codec()
    writer = open_backend(location, writer="w0")
    lost = record("lost0", "lost", 1)
    staged = writer.stage([OutRecord(Stream.RESULTS, "lost0", codec.encode(lost), "lost0")])
    staged.abort()
    publish(writer, record("kept0", "kept", 1))
    writer.close()
    with TrainerFeed(open_backend(location, read_only=True)) as feed:
        groups = list(feed.groups(limit=1, idle_timeout_s=120))  # a consumer's first fetch can lag under load
        groups += feed.groups(idle_timeout_s=2, poll_s=0.5)  # and then nothing more
    assert [g.group_id for g in groups] == ["kept"]
    assert feed.records_read == 1


@pytest.mark.kafka
def test_a_waiting_group_names_every_partition_it_holds_back(kafka_bootstrap: str, kafka_namespace: str) -> None:
    """Results are keyed by rollout, so a group's siblings land on several partitions, and each
    one that arrived holds its partition's resume offset back, not only the first read."""
    location = f"kafka://{kafka_bootstrap}/{kafka_namespace}?partitions=4"
    by_partition: dict[int, str] = {}
    for i in range(64):  # two siblings on different partitions
        by_partition.setdefault(partition_for(f"w{i}", 4), f"w{i}")
    w0, w1 = list(by_partition.values())[:2]
    writer = open_backend(location, writer="w0")
    publish(writer, record(w0, "W", 3), record(w1, "W", 3))
    writer.close()
    with TrainerFeed(open_backend(location, read_only=True)) as feed:
        for _ in range(240):  # until both are read (a consumer's first fetch can lag under load)
            assert feed.poll(0.5) is None
            if feed.records_read == 2:
                break
        [waiting] = feed.waiting()
        position = feed.position()
    assert (waiting.group_id, waiting.arrived, waiting.missing) == ("W", tuple(sorted((w0, w1))), 1)
    held = {loc.partition: loc.offset for loc in waiting.locations}
    assert sorted(held) == sorted(partition_for(r, 4) for r in (w0, w1))  # both partitions, in arrived's order
    assert [loc.partition for loc in waiting.locations] == [partition_for(r, 4) for r in waiting.arrived]
    assert all(position.offsets[p] == offset for p, offset in held.items())  # a resumed feed starts at each
    assert waiting.first in waiting.locations


def _trainer(location: str, checkpoint: Path, groups: int, *, kill: str | None = None, at: int = 0,
             log: Path | None = None) -> subprocess.Popen:
    args = [sys.executable, "-m", "tests.trainer_child", location, str(checkpoint), "--groups", str(groups)]
    if kill:
        args += ["--kill", kill, "--at", str(at)]
    if log:
        args += ["--log", str(log)]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(args, cwd=ROOT, env=env)


@pytest.mark.slow
def test_every_finished_rollout_reaches_the_trainer_once_across_trainer_and_worker_crashes(
        journal_location: str, tmp_path: Path) -> None:
    config = workload(journal_location, turn_delay_ms=20.0)
    kafka = journal_location.startswith("kafka://")
    progress, checkpoint, log = tmp_path / "progress", tmp_path / "trainer.json", tmp_path / "trained.log"
    assert run_child_and_kill(config, resume=False, kill_after_turns=8, extra_delay_s=0.01, progress_path=progress)
    # Kafka: the trainer reads while the worker resumes (the file journal has one writer at a time,
    # so its trainer, which acknowledges, runs once the worker is done).
    first = _trainer(journal_location, checkpoint, 3, kill="before_save", at=1, log=log) if kafka else None
    run_child_and_kill(config, resume=True, kill_after_turns=10**6, extra_delay_s=0, progress_path=progress)
    if first is None:
        first = _trainer(journal_location, checkpoint, 3, kill="before_save", at=1, log=log)
    assert first.wait(180) == -signal.SIGKILL
    assert not checkpoint.exists()  # killed after its step, before saving it
    second = _trainer(journal_location, checkpoint, 3, kill="after_save", at=2, log=log)
    assert second.wait(180) == -signal.SIGKILL
    third = _trainer(journal_location, checkpoint, 3, log=log)
    assert third.wait(180) == 0

    steps = json.loads(checkpoint.read_text())["steps"]
    assert sorted(s["group"] for s in steps) == ["res-g0", "res-g1", "res-g2"]  # every group once
    handed = log.read_text().split()
    assert len(handed) == 4 and handed[0] in handed[1:]  # the step lost with the first trainer, taken again
    expected = exported(journal_location)
    trained = {rid: d for s in steps for rid, d in s["rollouts"].items()}
    assert trained == {rid: digest(r) for rid, r in expected.items()}  # the tensors the journaled calls hold
    with open_journal(journal_location, read_only=True) as journal:
        plan = load_rollouts(journal)
    assert set(plan.acknowledged) == set(expected) and not plan.rollouts  # every result acknowledged
    rerun = run_workload(config, resume=True)
    assert all(r.acknowledged for r in rerun.rollouts.values())  # a resume offers none of them again


def test_a_rollout_resumed_from_an_older_snapshot_publishes_the_record_its_events_hold(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A snapshot written before the token lineage was kept (format 2) cannot say who made the
    head's tokens: the resumed rollout is replayed from its first event instead, once."""
    from participants.rollout_state import RolloutState

    config = workload(str(tmp_path / "journal"), groups=1)
    a, b = (s.rollout_id for s in workload_specs(config))
    newer = RolloutState.to_bytes

    def as_the_older_version_wrote_it(self: RolloutState) -> bytes:
        lineage, self.lineage = self.lineage, None
        try:
            return newer(self)
        finally:
            self.lineage = lineage

    with monkeypatch.context() as patch:
        patch.setattr(RolloutState, "to_bytes", as_the_older_version_wrote_it)
        run_workload(config, resume=False, stop_after={a: 2, b: 2})
    report = run_workload(config, resume=True)
    assert not report.failed and not report.set_aside
    with TrainerFeed(open_backend(config.journal, read_only=True)) as feed:
        (group,) = list(feed.groups(limit=1, idle_timeout_s=120))
    expected = exported(config.journal)
    assert {r.rollout_id: digest(r) for r in group.records} == {rid: digest(r) for rid, r in expected.items()}
