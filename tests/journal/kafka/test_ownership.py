"""One writer per partition, kept by Kafka: every writer is a member of the namespace's consumer
group, writes only the partitions assigned to it, through one transactional producer whose every
transaction carries the group's offsets under the member's generation (KIP-447).

- a member commits all its partitions in one transaction; a partition revoked before its batch
  commits fails alone, the others commit;
- a transaction that outlives ``transaction.timeout.ms`` heals: the producer is re-initialized, the
  batch redone, the partition kept; the stalled records are never visible;
- a SIGSTOPped member (a zombie) whose partitions moved to another member never gets a record
  visible after the new owner's take, however it wakes.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from rollout_journal.journal.backend import OutRecord, Stream, partition_for
from rollout_journal.journal.deadlines import Deadline
from rollout_journal.journal.errors import (
    PartitionRevokedError,
    RecordLocation,
    RecordsRefusedError,
    TransactionRestartedError,
)
from rollout_journal.journal.events import Header, RolloutAcknowledged
from rollout_journal.journal.journal import Journal
from rollout_journal.journal.kafka.backend import KafkaBackend
from rollout_journal.journal.kafka.config import KafkaSettings
from rollout_journal.journal.kafka.group import WorkerGroup
from rollout_journal.journal.kafka.writer import MemberWriter
from rollout_journal.journal.takeover import serve_acknowledgements
from tests.support.journal_conformance import started, turn_done
from tests.support.paths import REPO_ROOT

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(300)]

PARTITIONS = 2


@pytest.fixture
def settings(kafka_bootstrap: str, kafka_namespace: str) -> KafkaSettings:
    return KafkaSettings(bootstrap_servers=kafka_bootstrap, namespace=kafka_namespace, partitions=PARTITIONS)


def rollouts_on(partition: int, count: int) -> list[str]:
    return [f"r{i}" for i in range(1000) if partition_for(f"r{i}", PARTITIONS) == partition][:count]


def rollout_on(partition: int) -> str:
    return rollouts_on(partition, 1)[0]


class Member:
    """A journal that is a member of the namespace's group, taking what it is assigned."""

    def __init__(
        self, settings: KafkaSettings, name: str, *, linger_ms: float = 2.0, backend: type[KafkaBackend] = KafkaBackend
    ) -> None:
        self.backend = backend(settings, member=name)
        self.journal = Journal(self.backend, linger_ms=linger_ms)
        self.taken: dict[int, int] = {}
        self.changed = threading.Condition()
        self.group = WorkerGroup(settings, name, on_assigned=self._assigned, on_revoked=self._gone, on_lost=self._gone)
        self.backend.join(self.group.metadata)
        self.group.start()

    def _assigned(self, partitions: list[int]) -> None:
        tokens = self.backend.own(partitions)
        for p in partitions:
            self.journal.take_partition(p, tokens[p])
        with self.changed:
            self.taken.update(tokens)
            self.changed.notify_all()

    def _gone(self, partitions: list[int]) -> None:
        self.backend.disown(partitions)
        with self.changed:
            for p in partitions:
                self.taken.pop(p, None)
            self.changed.notify_all()

    def wait_for(self, partitions: set[int], timeout_s: float = 120) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: set(self.taken) == partitions, timeout_s), (
                f"still owning {sorted(self.taken)}, waiting for {sorted(partitions)}"
            )

    def close(self) -> None:
        self.group.close()
        self.journal.close()


@pytest.fixture
def member(settings: KafkaSettings) -> Iterator[Member]:
    m = Member(settings, "m1", linger_ms=300)
    yield m
    m.close()


def test_leaving_the_group_is_bounded_when_the_leave_hangs(
    settings: KafkaSettings, caplog: pytest.LogCaptureFixture
) -> None:
    """librdkafka's Consumer.close() has no timeout: a leave that hangs (here the revoke callback
    it runs, standing in for a coordinator that never answers) must not hold a stopping worker."""
    assigned, release = threading.Event(), threading.Event()
    revoke_done = threading.Event()

    def hang(partitions: list[int]) -> None:
        release.wait(120)
        revoke_done.set()

    KafkaBackend(settings, transactional=False).close()  # creates the namespace's topics the group subscribes to
    group = WorkerGroup(settings, "hangs", on_assigned=lambda p: assigned.set(), on_revoked=hang, on_lost=hang)
    group.start()
    try:
        assert assigned.wait(120), "never assigned a partition"
        with caplog.at_level("WARNING", logger="rollout_journal.journal.kafka.group"):
            group.close(bound_s=1.0)
        assert not revoke_done.is_set()  # close returned while the leave was still stuck
        assert any("going on without waiting" in r.getMessage() for r in caplog.records)
    finally:
        release.set()
    assert revoke_done.wait(60)  # and the leave finished in the background once it could


def test_a_partition_revoked_before_its_batch_commits_fails_alone(member: Member) -> None:
    member.wait_for({0, 1})
    kept, revoked = rollout_on(0), rollout_on(1)
    member.journal.append_sync([started(kept, 0)])
    member.journal.append_sync([started(revoked, 0)])

    # Both queued in one batch (the linger); the group takes partition 1 away before it commits.
    pending = [member.journal.append([turn_done(kept, 1)]), member.journal.append([turn_done(revoked, 1)])]
    member.backend.disown([1])
    assert pending[0].result(timeout=60).locations
    with pytest.raises(PartitionRevokedError, match="partition 1"):
        pending[1].result(timeout=60)
    with pytest.raises(PartitionRevokedError):  # and at once, for an append made after
        member.journal.append([turn_done(revoked, 2, turn=2)])
    member.journal.append_sync([turn_done(kept, 2, turn=2)])  # the member goes on with what it still owns

    with Journal(KafkaBackend(member.backend.settings, transactional=False, create_topics=False)) as reader:
        seqs = {r: [e.event.header.seq for e in reader.read_rollout(r)] for r in (kept, revoked)}
    assert seqs == {kept: [0, 1, 2], revoked: [0]}


def test_a_transaction_past_its_timeout_heals_and_the_partition_stays_owned(
    kafka_bootstrap: str, kafka_namespace: str
) -> None:
    settings = KafkaSettings(
        bootstrap_servers=kafka_bootstrap, namespace=kafka_namespace, partitions=PARTITIONS, transaction_timeout_ms=1000
    )
    member = Member(settings, "stalls")
    try:
        member.wait_for({0, 1})
        writer = member.backend.writer
        assert isinstance(writer, MemberWriter)
        r = rollout_on(0)
        stalled = OutRecord(Stream.EVENTS, r, json.dumps({"stalled": True}).encode(), r)

        def stall() -> set[int]:  # the process stops between producing and sending the offsets (a GC pause)
            time.sleep(4.0)  # > transaction.timeout.ms + the broker's cleanup interval (1 s in the test broker)
            return set()

        with pytest.raises(TransactionRestartedError, match="re-initialized"):
            writer.commit([stalled], revoked=stall)
        assert writer.reinits == 1 and member.backend.owned_partitions == {0, 1}
        redone = OutRecord(Stream.EVENTS, r, json.dumps({"redone": True}).encode(), r)
        [location] = member.backend.commit_partitions({0: [redone]})[0]  # type: ignore[misc]
        with KafkaBackend(settings, transactional=False, create_topics=False) as reader:
            values = [json.loads(rec.value) for rec in reader.read_events(0) if rec.value]
        assert values == [{"redone": True}]
        assert location.partition == 0
    finally:
        member.close()


# -- a zombie: a member SIGSTOPped past its session, woken after its partitions moved -------------------


def start_child(bootstrap: str, namespace: str, name: str, log_dir: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "KAFKA_BOOTSTRAP_SERVERS"}
    env["PYTHONPATH"] = f"{REPO_ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.member_child",
            bootstrap,
            namespace,
            name,
            "--partitions",
            str(PARTITIONS),
        ],
        cwd=REPO_ROOT,
        env=env,
        stdout=(log_dir / f"{name}.out").open("w"),
        stderr=(log_dir / f"{name}.err").open("w"),
    )


def wait_until(condition, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.parametrize("round_", range(3))
def test_a_sigstopped_zombie_member_writes_nothing_visible_after_its_partitions_moved(
    kafka_bootstrap: str, kafka_namespace: str, tmp_path: Path, round_: int
) -> None:
    settings = KafkaSettings(bootstrap_servers=kafka_bootstrap, namespace=kafka_namespace, partitions=PARTITIONS)
    KafkaBackend(settings, transactional=False).close()  # the topics
    zombie = start_child(kafka_bootstrap, kafka_namespace, "zombie", tmp_path)
    out = tmp_path / "zombie.out"
    try:
        wait_until(lambda: out.read_text().count("committed") >= 10, 120, "the zombie's commits")
        time.sleep(round_ * 0.037)  # land the stop at another point of its commit cycle each round
        os.kill(zombie.pid, signal.SIGSTOP)
        successor = Member(settings, "successor")
        try:
            successor.wait_for({0, 1}, timeout_s=120)  # after the zombie's session timed out
            for p in (0, 1):
                successor.backend.commit_partitions(
                    {p: [OutRecord(Stream.EVENTS, f"s{p}", b'{"writer": "successor"}', rollout_on(p))]}
                )
            os.kill(zombie.pid, signal.SIGCONT)
            wait_until(lambda: "lost" in out.read_text() or "revoked" in out.read_text(), 60, "the zombie to learn")
            time.sleep(2.0)  # let it try to write what it still holds
            for p in (0, 1):
                successor.backend.commit_partitions(
                    {p: [OutRecord(Stream.EVENTS, f"t{p}", b'{"writer": "successor"}', rollout_on(p))]}
                )
        finally:
            successor.close()
    finally:
        os.kill(zombie.pid, signal.SIGCONT)
        zombie.terminate()
        zombie.wait(60)
    # Woken, the zombie finds its partitions lost and rejoins: it may be assigned some again, legitimately,
    # from a take of its own. What it had in flight when it stopped must never land after the successor's.
    lines = out.read_text().splitlines()
    rejoined = next(i for i, line in enumerate(lines) if line.startswith(("lost", "revoked")))
    owned_again = {int(line.split()[2]) for line in lines[rejoined:] if line.startswith("committed")}
    with KafkaBackend(settings, transactional=False, create_topics=False) as reader:
        for p in (0, 1):
            rows = [json.loads(rec.value) for rec in reader.read_events(p) if rec.value]
            first = next(i for i, row in enumerate(rows) if row["writer"] == "successor")
            assert any(row["writer"] == "zombie" for row in rows[:first]), f"partition {p}: nothing before the stop"
            late = [row["seq"] for row in rows[first:] if row["writer"] == "zombie" and row["seq"] not in owned_again]
            assert not late, f"partition {p}: zombie records {late} visible after the successor's take"


def test_the_ack_loop_goes_on_when_an_acknowledged_partition_is_revoked_as_it_applies(
    member: Member, caplog: pytest.LogCaptureFixture
) -> None:
    """``serve_acknowledgements`` looks at ``owned()``, then applies: the group's revocation (on its
    own thread) may land in between. Here the look is stale for good (partition 1 revoked right
    after it, before the acknowledgement applies): the append is refused, and that must cost the
    loop nothing. Before, the refusal escaped it, which stopped a gateway's writes for good and
    ended a fleet worker, on an ordinary rebalance."""
    member.wait_for({0, 1})
    lost, kept = rollout_on(1), rollout_on(0)
    trainer = Journal(KafkaBackend(member.backend.settings, transactional=False, create_topics=False))
    try:
        for rid in (lost, kept):
            header = Header(rid, "g", 1, 1, 0, 0, Header.now_ms(), "trainer")
            trainer.request_acknowledgement(RolloutAcknowledged(header, "trainer")).result(timeout=60)
    finally:
        trainer.close()
    member.backend.disown([1])  # revoked after the loop's look (which stays {0, 1}: stale)
    durable: list[str] = []

    async def serve() -> BaseException | None:
        task = asyncio.create_task(
            serve_acknowledgements(member.journal, lambda: {0, 1}, on_durable=lambda rid, p: durable.append(rid))
        )
        deadline = Deadline(120)
        try:
            while not (kept in durable and any(lost in r.getMessage() for r in caplog.records)):
                if task.done():
                    return task.exception()
                assert not deadline.passed(), f"applied {durable}; the revoked one never seen"
                await asyncio.sleep(0.05)
            return None
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    with caplog.at_level("INFO", logger="rollout_journal.journal.takeover"):
        failed = asyncio.run(serve())
    assert failed is None, f"the ack loop ended on {failed!r}"
    assert durable == [kept]
    with Journal(KafkaBackend(member.backend.settings, transactional=False, create_topics=False)) as reader:
        assert [type(e.event).__name__ for e in reader.read_rollout(lost)] == []  # its next owner applies it
        assert [type(e.event).__name__ for e in reader.read_rollout(kept)] == ["RolloutAcknowledged"]


class RefusingBackend(KafkaBackend):
    """A member's backend on the real broker whose partition batches that carry the events of the
    rollout ``refusing`` names come back refused, as the broker refuses records too large or
    invalid (``RecordsRefusedError`` for that partition alone); the others commit."""

    refusing: str | None = None

    def commit_partitions(
        self, batches: Mapping[int, Sequence[OutRecord]]
    ) -> dict[int, list[RecordLocation] | BaseException]:
        target = self.refusing
        refused = {
            p for p, records in batches.items() if any(r.stream is Stream.EVENTS and r.key == target for r in records)
        }
        out: dict[int, list[RecordLocation] | BaseException] = {
            p: RecordsRefusedError(f"partition {p} refused (test)", {p: "refused by the test"}) for p in refused
        }
        out.update(super().commit_partitions({p: r for p, r in batches.items() if p not in refused}))
        return out


def test_an_acknowledgement_whose_append_failed_is_applied_again(
    settings: KafkaSettings, caplog: pytest.LogCaptureFixture
) -> None:
    """The trainer acknowledges a rollout; its append fails (the broker refused its partition's
    records) while the partition stays owned: the member commits no acks position past it, and
    applies it again until it commits. Before, a failed one was marked applied in memory and never
    applied again: its rollout stayed unacknowledged for good, and the next acknowledgement that
    committed moved the position past it (``AckPositions`` keeps that order)."""
    member = Member(settings, "m1", linger_ms=50, backend=RefusingBackend)
    try:
        member.wait_for({0, 1})
        acked, other = rollout_on(0), rollout_on(1)  # other's appends: transactions that A's refusal spares
        backend = member.backend
        assert isinstance(backend, RefusingBackend)
        backend.refusing = acked
        trainer = Journal(KafkaBackend(settings, transactional=False, create_topics=False))
        try:
            header = Header(acked, "g", 1, 1, 0, 0, Header.now_ms(), "trainer")
            trainer.request_acknowledgement(RolloutAcknowledged(header, "trainer")).result(timeout=60)
        finally:
            trainer.close()
        durable: list[str] = []
        seqs = itertools.count()

        def committed_ack_position() -> int | None:
            """The acks position the group holds after one more transaction of the member's (its
            every transaction commits the acks positions of all its partitions)."""
            seq = next(seqs)
            member.journal.append_sync([started(other, 0) if seq == 0 else turn_done(other, seq, turn=seq)])
            return backend.commit_points([0])[(backend.acks_topic, 0)]

        def refusals() -> int:
            return sum(1 for r in caplog.records if acked in r.getMessage() and "did not commit" in r.getMessage())

        async def serve() -> tuple[int | None, int | None]:
            task = asyncio.create_task(
                serve_acknowledgements(member.journal, lambda: {0, 1}, on_durable=lambda rid, p: durable.append(rid))
            )
            try:
                deadline = Deadline(120)
                while refusals() < 2:  # refused, applied again, refused again
                    assert not task.done(), f"the ack loop ended: {task.exception()!r}"
                    assert not deadline.passed(), f"refusals seen: {refusals()}"
                    await asyncio.sleep(0.05)
                while_refused = await asyncio.to_thread(committed_ack_position)
                backend.refusing = None
                while acked not in durable:
                    assert not task.done(), f"the ack loop ended: {task.exception()!r}"
                    assert not deadline.passed(), f"{acked} never applied again"
                    await asyncio.sleep(0.05)
                return while_refused, await asyncio.to_thread(committed_ack_position)
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

        with caplog.at_level("INFO", logger="rollout_journal.journal.takeover"):
            while_refused, after = asyncio.run(serve())
    finally:
        member.close()
    with Journal(KafkaBackend(settings, transactional=False, create_topics=False)) as reader:
        assert [type(e.event).__name__ for e in reader.read_rollout(acked)] == ["RolloutAcknowledged"]
    assert while_refused is None or while_refused == 0  # the acknowledgement at offset 0 not passed
    assert after == 1
