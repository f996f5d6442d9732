"""Results for the trainer: each finished rollout's training record is published with its final
turn, and a trainer's feed hands on every prompt group exactly once across trainer and worker
crashes, with tensors equal to what the journal's model calls hold."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from rollout_journal.journal.backend import OutRecord, Stream, compacted, partition_for
from rollout_journal.journal.codec import Codec
from rollout_journal.journal.events import Header, TokenSegment, TrainingRecord
from rollout_journal.journal.file.backend import FileBackend
from rollout_journal.journal.journal import ReadReport
from rollout_journal.journal.open import open_backend, open_journal
from rollout_journal.journal.restore import load_rollouts
from rollout_journal.journal.results import ResultsDecoder
from rollout_journal.journal.snapshots import BUCKET_MARK
from rollout_journal.participants.rollout import RolloutState
from rollout_journal.participants.trainer import FeedPosition, TrainerFeed
from rollout_journal.participants.workload.config import FailurePolicy, WorkloadConfig
from rollout_journal.participants.workload.run import run_workload
from rollout_journal.participants.workload.runner import workload_specs
from rollout_journal.replay.listing import list_rollouts
from rollout_journal.replay.source import open_replay
from rollout_journal.replay.training import training_rows
from tests.support.failures import run_killing
from tests.support.paths import REPO_ROOT
from tests.support.recovery_support import run_child_and_kill
from tests.support.trainer_child import digest


def workload(location: str, **overrides) -> WorkloadConfig:
    base = dict(
        name="res",
        groups=3,
        siblings=2,
        max_turns=3,
        environment="workplace",
        seed=5,
        allow_early_submit=False,
        journal=location,
        snapshot_every_turns=2,
    )
    return WorkloadConfig(**(base | overrides))


def exported(location: str, *, settle_s: float = 120.0) -> dict[str, TrainingRecord]:
    """What ``replay export-training`` builds from the journal's events alone, once no open
    transaction holds any of them back. A read-only read ends at Kafka's last stable offset: a
    killed worker's transaction hides whatever the resumed worker committed after it on that
    partition until the broker aborts it (its transaction timeout plus the abort interval, seconds),
    and the export warns and asks to rerun then, as this does."""
    deadline = time.monotonic() + settle_s
    while True:
        report = ReadReport()
        with open_replay(location) as source:
            records = {row.record.rollout_id: row.record for row in training_rows(source, report=report)}
        if not report.held_back:
            return records
        assert time.monotonic() < deadline, f"still held back after {settle_s:g} s: {report.held_back}"
        time.sleep(0.5)


def record(rollout: str, group: str, size: int, reward: float = 1.0) -> TrainingRecord:
    ids = np.arange(4, dtype="<i4")
    return TrainingRecord(
        Header(rollout, group, 1, 1, 0, 3, 0, "w"),
        size,
        reward,
        True,
        ids,
        np.array([0, 0, -0.5, -0.25], dtype="<f4"),
        np.array([0, 0, 1, 1], dtype=bool),
        [TokenSegment(0, 2, False, 1, 0, "c0", "p"), TokenSegment(2, 4, True, 1, 0, "c0", "p")],
    )


def given_up_record_of(rollout: str, group: str, size: int) -> TrainingRecord:
    """What a given-up rollout publishes (see ``participants.rollout.state.given_up_record``)."""
    return RolloutState(rollout, group).given_up_record(Header(rollout, group, 3, 3, 1, 9, 0, "w"), size, "drop")


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
        assert batch["rollout_ids"] == sorted(
            s.rollout_id for s in workload_specs(config) if s.group_id == group.group_id
        )
        for i, (rollout_id, record) in enumerate(zip(batch["rollout_ids"], group.records)):
            got, want = record.tensors(), expected[rollout_id].tensors()
            for key in ("input_ids", "logprobs", "loss_mask", "token_attempt", "segment_bounds", "segment_attempt"):
                assert torch.equal(got[key], want[key]), (rollout_id, key)
            assert got["segment_policy_version"] == want["segment_policy_version"]
            assert got["reward"] == want["reward"]
            k = len(want["input_ids"])
            assert (
                torch.equal(batch["input_ids"][i, :k], want["input_ids"]) and not batch["attention_mask"][i, k:].any()
            )
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


def test_a_sibling_given_up_while_the_trainer_holds_its_group_resolves_the_group_as_dropped(tmp_path: Path) -> None:
    """A's first sibling is in when the second is given up: A is dropped at once (never handed on,
    never left waiting), B behind it is not held back, and a feed resumed from any position
    neither hands A on nor drops it twice."""
    backend = FileBackend(tmp_path / "j")
    publish(backend, record("a0", "A", 2), record("b0", "B", 2))
    with TrainerFeed(backend) as feed:
        assert feed.poll(0.5) is None and {w.group_id for w in feed.waiting()} == {"A", "B"}
        publish(backend, given_up_record_of("a1", "A", 2))
        assert feed.poll(5) is None  # nothing to train on
        [dropped] = feed.dropped()
        assert (dropped.group_id, dropped.rollout_ids, dropped.given_up) == ("A", ("a0", "a1"), ("a1",))
        [waiting] = feed.waiting()  # only B: the dropped group pins nothing
        assert waiting.group_id == "B" and feed.position().offsets[0] == waiting.first.offset
        held = feed.position()
        publish(backend, record("b1", "B", 2))
        group = feed.poll(5)
        assert group is not None and group.group_id == "B" and feed.waiting() == []
    assert held.delivered == {"A"}  # a1 lies past b0, where a feed resumed from it starts
    with TrainerFeed(backend, held) as feed:
        assert [g.group_id for g in feed.groups(idle_timeout_s=0.5, poll_s=0.1)] == ["B"]
        assert feed.dropped() == [] and feed.waiting() == []  # A's records stepped over, not dropped again
    with TrainerFeed(backend, group.position) as feed:
        assert feed.poll(0.2) is None and feed.dropped() == [] and feed.waiting() == []
    backend.close()


def test_a_group_with_a_given_up_sibling_is_dropped_acknowledged_and_never_pins_the_trainer(
    journal_location: str,
) -> None:
    config = workload(
        journal_location,
        groups=2,
        max_turns=2,
        environment="sandbox",
        turns_in_flight=1,
        failure_policy=FailurePolicy(max_failures=1),
    )
    victim = "res-g1-s0"  # its sandbox dies under it: given up at its first failure
    report = run_killing(config, {victim})
    assert set(report.given_up) == {victim}
    acknowledger = open_journal(journal_location, writer="trainer")
    try:
        with TrainerFeed(open_backend(journal_location, read_only=True), acknowledger=acknowledger) as feed:
            groups = list(feed.groups(limit=1, idle_timeout_s=120))  # a consumer's first fetch can lag under load
            groups += feed.groups(idle_timeout_s=2, poll_s=0.5)  # and then nothing more
            [dropped] = feed.dropped()
            assert [g.group_id for g in groups] == ["res-g0"] and victim not in groups[0].rollout_ids
            assert (dropped.group_id, dropped.given_up) == ("res-g1", (victim,))
            assert feed.waiting() == []  # nothing holds the trainer's position back
            position = feed.position()
            for future in feed.acknowledge(groups[0]):
                future.result()
        with TrainerFeed(open_backend(journal_location, read_only=True), position, acknowledger=acknowledger) as feed:
            assert list(feed.groups(idle_timeout_s=2, poll_s=0.5)) == [] and feed.dropped() == []
        # A trainer that lost its checkpoint reads from the start: it drops the group again, and
        # acknowledges nothing twice (a second acknowledgement would damage the rollouts' journals).
        with TrainerFeed(open_backend(journal_location, read_only=True), acknowledger=acknowledger) as feed:
            assert [g.group_id for g in feed.groups(limit=1, idle_timeout_s=120)] == ["res-g0"]
            list(feed.groups(idle_timeout_s=2, poll_s=0.5))
            assert [d.group_id for d in feed.dropped()] == ["res-g1"] and feed.waiting() == []
    finally:
        acknowledger.close()
    if not journal_location.startswith("kafka://"):
        with open_replay(journal_location) as source:
            statuses = {r.rollout_id: r.status for r in list_rollouts(source).rows}
        assert statuses == dict.fromkeys(statuses, "acknowledged") and len(statuses) == 4  # the dropped group's too
    # Kafka: the acknowledgements wait on <ns>.acks for the partitions' next owner: the resume applies them
    rerun = run_workload(config, resume=True)
    assert all(r.acknowledged for r in rerun.rollouts.values())  # a resume offers none of them again
    with open_replay(journal_location) as source:
        statuses = {r.rollout_id: r.status for r in list_rollouts(source).rows}
    assert statuses == dict.fromkeys(statuses, "acknowledged") and len(statuses) == 4  # the dropped group's too


def test_redispatch_runs_a_replacement_group_on_the_same_task_the_trainer_takes_it_whole(journal_location: str) -> None:
    """g1 loses a sibling: replaced by g1r1, which the trainer takes. g2 loses one, and so does its
    replacement g2r1: past max_redispatches, g2r1 is dropped like g2, with no g2r2. A resume keeps
    the replacement groups registered (on Kafka it registers as a group member does)."""
    config = workload(
        journal_location,
        groups=3,
        max_turns=2,
        environment="sandbox",
        turns_in_flight=1,
        failure_policy=FailurePolicy(max_failures=1, group="redispatch", max_redispatches=1),
    )
    report = run_killing(config, {"res-g1-s0", "res-g2-s0", "res-g2r1-s0"})

    assert set(report.given_up) == {"res-g1-s0", "res-g2-s0", "res-g2r1-s0"}
    finished = {"res-g0-s0", "res-g0-s1", "res-g1-s1", "res-g1r1-s0", "res-g1r1-s1", "res-g2-s1", "res-g2r1-s1"}
    assert set(report.outcomes()) == finished
    with open_journal(config.journal, read_only=True) as journal:
        registration = load_rollouts(journal).workloads["res"]
    assert registration.redispatched == {"res-g1": 1, "res-g2": 1}
    specs = {s.rollout_id: s for s in workload_specs(config, registration.redispatched)}
    assert set(registration.rollout_ids) == set(specs) and len(specs) == 10
    assert specs["res-g1r1-s0"].task_seed == specs["res-g1-s0"].task_seed  # the same task, new samples
    with TrainerFeed(open_backend(config.journal, read_only=True)) as feed:
        groups = list(feed.groups(idle_timeout_s=2, poll_s=0.5))
        assert sorted(g.group_id for g in groups) == ["res-g0", "res-g1r1"]
        assert sorted(d.group_id for d in feed.dropped()) == ["res-g1", "res-g2", "res-g2r1"]
        assert feed.waiting() == []

    resumed = run_workload(config, resume=True)  # nothing runs again, no replacement is launched twice

    assert set(resumed.rollouts) == set(specs) and resumed.turns_run == 0
    assert resumed.outcomes() == report.outcomes()
    with open_journal(config.journal, read_only=True) as journal:
        again = load_rollouts(journal).workloads["res"]
    assert (again.redispatched, set(again.rollout_ids)) == ({"res-g1": 1, "res-g2": 1}, set(specs))
    with open_replay(config.journal) as source:
        statuses = {r.rollout_id: r.status for r in list_rollouts(source).rows}
    assert statuses["res-g1r1-s0"] == "finished" and statuses["res-g2r1-s0"] == "given up"


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


def _trainer(
    location: str, checkpoint: Path, groups: int, *, kill: str | None = None, at: int = 0, log: Path | None = None
) -> subprocess.Popen:
    args = [sys.executable, "-m", "tests.support.trainer_child", location, str(checkpoint), "--groups", str(groups)]
    if kill:
        args += ["--kill", kill, "--at", str(at)]
    if log:
        args += ["--log", str(log)]
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(args, cwd=REPO_ROOT, env=env)


@pytest.mark.slow
def test_every_finished_rollout_reaches_the_trainer_once_across_trainer_and_worker_crashes(
    journal_location: str, tmp_path: Path
) -> None:
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
    if not kafka:
        with open_journal(journal_location, read_only=True) as journal:
            plan = load_rollouts(journal)
        assert set(plan.acknowledged) == set(expected) and not plan.rollouts  # every result acknowledged
    # Kafka: the acknowledgements wait on <ns>.acks for the partitions' next owner (the worker finished
    # before the trainer): the resume applies them as it takes each partition, before it admits anything.
    rerun = run_workload(config, resume=True)
    assert all(r.acknowledged for r in rerun.rollouts.values())  # a resume offers none of them again
    with open_journal(journal_location, read_only=True) as journal:
        plan = load_rollouts(journal)
    assert set(plan.acknowledged) == set(expected) and not plan.rollouts  # every result acknowledged


def test_rollouts_a_bucket_names_are_never_offered_again_and_list_as_acknowledged(tmp_path: Path) -> None:
    """The trainer's journal folds acknowledged fences two at a time (its bucket size here): the
    rollouts then have neither fence nor snapshot, only a bucket naming them. A resume offers none
    of them again, and every reader (restore, status, list) counts them acknowledged."""
    config = workload(str(tmp_path / "journal"))
    run_workload(config, resume=False)
    acknowledger = open_journal(config.journal, writer="trainer", acknowledgement_bucket_size=2)
    try:
        with TrainerFeed(open_backend(config.journal, read_only=True), acknowledger=acknowledger) as feed:
            groups = list(feed.groups(limit=3, idle_timeout_s=120))
            for group in groups:  # a step at a time, as a trainer acknowledges
                for future in feed.acknowledge(group):
                    future.result()
    finally:
        acknowledger.close()
    with open_journal(config.journal, read_only=True) as journal:
        kept = compacted(journal.backend.read_snapshots(), 1)
        plan = load_rollouts(journal)
    rollouts = {rid for g in groups for rid in g.rollout_ids}
    assert len(rollouts) == 6 and sum(BUCKET_MARK in key for key in kept) == 2  # 4 folded, 2 fences loose
    assert set(plan.acknowledged) == rollouts and not plan.rollouts
    rerun = run_workload(config, resume=True)
    assert set(rerun.rollouts) == rollouts and all(r.acknowledged for r in rerun.rollouts.values())
    with open_replay(config.journal) as source:
        statuses = {r.rollout_id: r.status for r in list_rollouts(source).rows}
    assert statuses == dict.fromkeys(rollouts, "acknowledged")


def run_writing_snapshots_without_lineage(
    config: WorkloadConfig, monkeypatch: pytest.MonkeyPatch, stop_after: dict[str, int]
) -> None:
    """Run ``config`` fresh until ``stop_after``, its snapshots written as a version before the token
    lineage was kept wrote them (format 2: no lineage)."""
    newer = RolloutState.to_bytes

    def as_the_older_version_wrote_it(self: RolloutState) -> bytes:
        lineage, self.lineage = self.lineage, None
        try:
            return newer(self)
        finally:
            self.lineage = lineage

    with monkeypatch.context() as patch:
        patch.setattr(RolloutState, "to_bytes", as_the_older_version_wrote_it)
        run_workload(config, resume=False, stop_after=stop_after)


def test_a_rollout_resumed_from_an_older_snapshot_publishes_the_record_its_events_hold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A snapshot written before the token lineage was kept (format 2) cannot say who made the
    head's tokens: the resumed rollout is replayed from its first event instead, once."""
    config = workload(str(tmp_path / "journal"), groups=1)
    a, b = (s.rollout_id for s in workload_specs(config))
    run_writing_snapshots_without_lineage(config, monkeypatch, stop_after={a: 2, b: 2})
    report = run_workload(config, resume=True)
    assert not report.failed and not report.set_aside
    with TrainerFeed(open_backend(config.journal, read_only=True)) as feed:
        (group,) = list(feed.groups(limit=1, idle_timeout_s=120))
    expected = exported(config.journal)
    assert {r.rollout_id: digest(r) for r in group.records} == {rid: digest(r) for rid, r in expected.items()}


def published(location: str) -> dict[str, TrainingRecord]:
    """Every training record on the results stream, by rollout."""
    backend = open_backend(location, read_only=True)
    decoder = ResultsDecoder()
    try:
        found = [decoder.add(s) for p in range(backend.partitions) for s in backend.read_results(p, 0)]
    finally:
        backend.close()
    assert not decoder.errors
    return {r.record.rollout_id: r.record for r in found if r is not None}


def test_a_record_names_every_attempt_of_its_rollout_as_the_fence_record_does(tmp_path: Path) -> None:
    """A: three attempts (two crashes), B: two; the record of each lists them all, as the rollout's
    fence record in the snapshot stream does, byte for byte the entries a reader acknowledges with."""
    config = workload(str(tmp_path / "journal"), groups=1)
    a, b = (s.rollout_id for s in workload_specs(config))
    run_workload(config, resume=False, stop_after={a: 1, b: 2})
    run_workload(config, resume=True, stop_after={a: 2})
    run_workload(config, resume=True)

    records = published(config.journal)

    with open_journal(config.journal, read_only=True) as journal:
        fences = journal.snapshots().fences
    assert [(e.attempt, e.epoch) for e in records[a].attempts] == [(1, 1), (2, 2), (3, 3)]
    assert [(e.attempt, e.epoch) for e in records[b].attempts] == [(1, 1), (2, 2)]
    for rollout_id, r in records.items():
        assert r.attempts == list(fences[rollout_id].history)


def test_a_rollout_resumed_after_its_fence_record_was_lost_still_publishes_every_attempt(tmp_path: Path) -> None:
    """The file journal lost its snapshot generation (the fence records with it): the resumed
    rollout is replayed from its first event, so its record still names its first attempt.
    (The record's fence history once came from what the writer had read of fence records.)"""
    config = workload(str(tmp_path / "journal"), groups=1)
    a, b = (s.rollout_id for s in workload_specs(config))
    run_workload(config, resume=False, stop_after={a: 2, b: 2})
    (generation,) = (Path(config.journal) / "snapshots").glob("*.snap")
    generation.unlink()

    resumed = run_workload(config, resume=True)

    assert not resumed.failed and not resumed.set_aside
    records = published(config.journal)
    for rollout_id in (a, b):
        assert [(e.attempt, e.epoch) for e in records[rollout_id].attempts] == [(1, 1), (2, 2)], rollout_id


def test_a_fallback_to_an_older_versions_snapshot_replays_the_rollout_from_its_first_event(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The newest snapshot's exports do not import, so restore falls back to the one before; that
    one was written before the token lineage was kept. The rule that a snapshot without the lineage
    is replaced by a replay from the first event holds there too (it once held only for the newest
    snapshot, and the rollout failed at its last turn: no training record without a lineage)."""
    from rollout_journal.journal.restore import history_from_first_event
    from rollout_journal.participants.rollout import restore_state, snapshot_of

    config = workload(str(tmp_path / "journal"), groups=1, environment="counter")
    a, b = (s.rollout_id for s in workload_specs(config))
    run_writing_snapshots_without_lineage(config, monkeypatch, stop_after={a: 2, b: 2})
    with open_journal(config.journal, writer="vandal") as journal:  # a newer snapshot of a, exports unusable
        history = load_rollouts(journal).rollouts[a]
        exported_ids = restore_state(history).resource_states
        assert exported_ids and history.snapshot is not None
        state = restore_state(history_from_first_event(journal, history))
        journal.append([], snapshot_of(state, {rid: b"<html>503</html>" for rid in exported_ids}, "vandal")).result()

    resumed = run_workload(config, resume=True)

    assert not resumed.failed and not resumed.set_aside
    assert any(a in note and "does not restore its resources" in note for note in resumed.read_errors)
    expected = exported(config.journal)
    assert {rid: digest(r) for rid, r in published(config.journal).items()} == {
        rid: digest(r) for rid, r in expected.items()
    }
