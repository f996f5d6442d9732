"""One writer per partition on a real broker: the journal half of a worker fleet.

Each worker's backend holds one transactional producer per partition it owns
(``<namespace>.p<N>``). Taking a partition fences its previous owner and ends that
owner's open transaction; a commit is one transaction per partition, so losing one
partition fails only that partition's appends.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from journal.backend import OutRecord, Stream, partition_for
from journal.errors import PartitionFencedError
from journal.events import AttemptStarted
from journal.journal import Journal
from journal.kafka_backend import KafkaBackend
from journal.kafka_config import KafkaSettings
from journal.restore import load_rollouts
from journal.snapshots import SnapshotDraft
from tests.journal_conformance import header, started, turn_done

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]

PARTITIONS = 2


@pytest.fixture
def settings(kafka_bootstrap: str, kafka_namespace: str) -> KafkaSettings:
    return KafkaSettings(bootstrap_servers=kafka_bootstrap, namespace=kafka_namespace, partitions=PARTITIONS,
                         operation_timeout_ms=20_000, stable_read_timeout_ms=2_000)


def worker(settings: KafkaSettings) -> Journal:
    return Journal(KafkaBackend(settings, partition_writers=True))


@pytest.fixture
def rollouts() -> dict[int, str]:
    """One rollout id on each partition."""
    found: dict[int, str] = {}
    for i in range(100):
        found.setdefault(partition_for(f"r{i}", PARTITIONS), f"r{i}")
    return found


@pytest.fixture
def first(settings: KafkaSettings) -> Iterator[Journal]:
    journal = worker(settings)
    yield journal
    journal.close()


def resume(journal: Journal, rollout_id: str) -> AttemptStarted:
    """What a worker does on taking a rollout's partition: restore it, then start attempt N+1."""
    history = load_rollouts(journal, partitions={journal.partition_of(rollout_id)}).rollouts[rollout_id]
    newest = max([history.snapshot.snapshot.header.epoch if history.snapshot else 0]
                 + [e.event.header.epoch for e in history.events])
    seq = max([history.snapshot.snapshot.covers_seq if history.snapshot else -1]
              + [e.event.header.seq for e in history.events]) + 1
    return started(rollout_id, seq, attempt=newest + 1, epoch=newest + 1, turn=1)


def test_a_fenced_partition_fails_only_its_own_appends(settings: KafkaSettings, first: Journal,
                                                        rollouts: dict[int, str]) -> None:
    kept, lost = rollouts[0], rollouts[1]
    for p in (0, 1):
        first.take_partition(p)
    first.append_sync([started(kept, 0)])
    first.append_sync([started(lost, 0)])

    with worker(settings) as second:
        second.take_partition(1)  # fences the first worker's writer of partition 1
        pending = [first.append([turn_done(kept, 1)]), first.append([turn_done(lost, 1)])]

        assert pending[0].result(timeout=60).locations
        with pytest.raises(PartitionFencedError, match="partition 1") as fenced:
            pending[1].result(timeout=60)
        assert fenced.value.partition == 1
        first.append_sync([turn_done(kept, 2, turn=2)])  # the worker goes on with what it still owns
        second.append_sync([turn_done(lost, 1, epoch=1)])

    with worker(settings) as reader:
        seqs = {r: [e.event.header.seq for e in reader.read_rollout(r)] for r in (kept, lost)}
    assert seqs == {kept: [0, 1, 2], lost: [0, 1]}


def test_two_workers_resuming_one_rollout_at_once_cannot_both_take_an_epoch(
        settings: KafkaSettings, first: Journal, rollouts: dict[int, str]) -> None:
    r = rollouts[0]
    first.take_partition(0)
    first.append_sync([started(r, 0), turn_done(r, 1)], SnapshotDraft(header(r, 1, turn=1), "running", 1, b"s"))
    first.release_partition(0)  # the first worker dies

    a, b = worker(settings), worker(settings)
    try:
        a.take_partition(0)
        attempt_a = resume(a, r)
        b.take_partition(0)  # a second worker was assigned the partition too (a rebalance under way)
        attempt_b = resume(b, r)
        assert attempt_a.header.epoch == attempt_b.header.epoch == 2  # both read the same journal

        with pytest.raises(PartitionFencedError):
            a.append_sync([attempt_a])
        b.append_sync([attempt_b])
    finally:
        a.close()
        b.close()

    with worker(settings) as third:
        third.take_partition(0)
        plan = load_rollouts(third, partitions={0})
    history = plan.rollouts[r]
    assert [(e.event.header.epoch, e.event.header.writer) for e in history.events] == [(2, "test-writer")]
    assert [(a.epoch, a.seq) for a in history.fence.history] == [(1, 0), (2, 2)]


def test_taking_a_partition_ends_the_previous_owners_open_transaction_before_restore(
        settings: KafkaSettings, first: Journal, rollouts: dict[int, str]) -> None:
    r = rollouts[1]
    first.take_partition(1)
    first.append_sync([started(r, 0), turn_done(r, 1)], SnapshotDraft(header(r, 1, turn=1), "running", 1, b"s"))
    # The first worker stalls (a long GC pause, a network partition) inside its next transaction.
    stalled = turn_done(r, 2, turn=2)
    staged = first.backend.stage([OutRecord(Stream.EVENTS, r, first.codec.encode(stalled), r)])

    with worker(settings) as second:
        second.take_partition(1)  # aborts the stalled transaction: nothing holds the partition back
        history = load_rollouts(second, partitions={1}).rollouts[r]  # no wait, no UnstableReadError
        assert [e.event.header.seq for e in history.events] == []
        with pytest.raises(PartitionFencedError):
            staged.commit()
