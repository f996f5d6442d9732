"""One conformance suite for every journal backend (the eventsourcing library's
pattern: an abstract test case, subclassed once per backend).

A subclass provides the ``open_backend`` fixture: a callable that opens a
backend over the same storage each time it is called (to test reopening).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

from rollout_journal.journal.backend import Backend, OutRecord, StoredRecord, Stream, compacted
from rollout_journal.journal.errors import (
    CorruptRecordError,
    FencedWriteError,
    OversizedEventError,
    RecordLocation,
    UnknownSchemaError,
)
from rollout_journal.journal.event_chunks import split_event
from rollout_journal.journal.events import (
    AttemptStarted,
    BlobChunk,
    Header,
    Message,
    ModelCall,
    RolloutAcknowledged,
    RolloutFinished,
    SamplingParams,
    TurnCompleted,
)
from rollout_journal.journal.journal import Cursor, Journal, ReadReport
from rollout_journal.journal.restore import RolloutHistory, history_from_first_event, load_rollouts
from rollout_journal.journal.snapshots import (
    BLOCK_MARK,
    BUCKET_MARK,
    SnapshotDraft,
    blob_chunk_key,
    block_key,
    bucket_records,
    load_snapshots,
)

OpenBackend = Callable[[], Backend]


def header(rollout: str, seq: int, *, turn: int = 0, attempt: int = 1, epoch: int = 1) -> Header:
    return Header(rollout, "group-1", attempt, epoch, turn, seq, Header.now_ms(), "test-writer")


def model_call(rollout: str, seq: int, *, turn: int = 1, epoch: int = 1, tokens: int = 64) -> ModelCall:
    rng = np.random.default_rng(seq)
    return ModelCall(
        header(rollout, seq, turn=turn, epoch=epoch),
        f"{rollout}-call-{seq}",
        None,
        "policy-v1",
        SamplingParams(0.7, 1.0, 16, seq),
        0,
        rng.integers(0, 500, tokens, dtype=np.int32),
        rng.integers(0, 500, 16, dtype=np.int32),
        -rng.random(16, dtype=np.float32),
        "stop",
        1.0,
    )


def turn_done(rollout: str, seq: int, *, turn: int = 1, epoch: int = 1, attempt: int = 1) -> TurnCompleted:
    return TurnCompleted(
        header(rollout, seq, turn=turn, epoch=epoch, attempt=attempt),
        [Message("assistant", f"turn {turn}")],
        [f"{rollout}-call-{seq - 1}"],
        {"r": turn},
        None,
        [f"act({turn})"],
    )


def started(rollout: str, seq: int, *, attempt: int = 1, epoch: int = 1, turn: int = 0) -> AttemptStarted:
    return AttemptStarted(header(rollout, seq, turn=turn, attempt=attempt, epoch=epoch), turn, "topo", "test")


class JournalConformance:
    """Every backend must pass these."""

    @pytest.fixture
    def open_backend(self) -> OpenBackend:  # pragma: no cover - overridden
        raise NotImplementedError

    @pytest.fixture
    def journal(self, open_backend: OpenBackend):
        j = Journal(open_backend())
        yield j
        j.close()

    def test_a_turn_appends_atomically_and_reads_back_in_order(self, journal: Journal) -> None:
        events = [started("r1", 0), model_call("r1", 1), turn_done("r1", 2)]
        receipt = journal.append_sync(events)
        assert len(receipt.locations) == 3
        read = list(journal.read_rollout("r1"))
        assert [e.event for e in read] == events
        assert [e.location for e in read] == receipt.locations
        offsets = [loc.offset for loc in receipt.locations]
        assert offsets == sorted(offsets)

    def test_appends_from_many_rollouts_share_commits_and_all_become_durable(self, journal: Journal) -> None:
        rollouts = [f"g{i}" for i in range(40)]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = list(pool.map(lambda r: journal.append([started(r, 0), model_call(r, 1)]), rollouts))
        receipts = [f.result(timeout=60) for f in futures]
        assert max(r.batch_appends for r in receipts) > 1, "no two appends shared a commit"
        for r in rollouts:
            assert [e.event.header.seq for e in journal.read_rollout(r)] == [0, 1]

    def test_a_waiter_makes_its_commit_due_without_waiting_out_the_linger(self, open_backend: OpenBackend) -> None:
        # A ten-minute linger: only a waiter (or close) can make these batches due.
        with Journal(open_backend(), linger_ms=600_000) as journal:
            first = journal.append([started("r1", 0)])
            receipt = journal.append([turn_done("r1", 1)]).result(timeout=60)
            assert first.done() and receipt.batch_appends == 2  # both went in the commit the waiter asked for

            async def wait_in_asyncio() -> None:
                await asyncio.wrap_future(journal.append([started("r2", 0)]))

            asyncio.run(asyncio.wait_for(wait_in_asyncio(), 60))
            journal.append([turn_done("r2", 1)])  # nobody waits: close commits it
        with Journal(open_backend()) as reopened:
            assert [e.event.header.seq for e in reopened.read_rollout("r2")] == [0, 1]

    def test_a_hastened_append_commits_with_nobody_waiting(self, open_backend: OpenBackend) -> None:
        # A model call's progress mark: worth little unless durable before a crash, and the call
        # must not wait for it. Hastened, it does not sit out a ten-minute linger.
        with Journal(open_backend(), linger_ms=600_000) as journal:
            mark = journal.append([started("p1", 0)])
            mark.hasten()
            deadline = time.monotonic() + 60
            while not mark.done() and time.monotonic() < deadline:
                time.sleep(0.01)  # polling done() makes nothing due
            assert mark.done(), "the hastened append still lingered"
            with Journal(open_backend()) as reader:  # durable: another reader sees it
                assert [e.event.header.seq for e in reader.read_rollout("p1")] == [0]

    def test_read_from_a_cursor_skips_what_it_covers(self, journal: Journal) -> None:
        first = journal.append_sync([started("r1", 0), model_call("r1", 1)])
        journal.append_sync([turn_done("r1", 2)])
        journal.append_sync([model_call("r1", 3, turn=2)])
        after = list(journal.read_rollout("r1", Cursor(first.locations[1].offset, after_seq=2)))
        assert [e.event.header.seq for e in after] == [3]

    def test_scan_reads_every_rollout(self, journal: Journal) -> None:
        for i in range(10):
            journal.append_sync([started(f"s{i}", 0), turn_done(f"s{i}", 1)])
        seen = {}
        for item in journal.scan():
            seen.setdefault(item.event.header.rollout_id, []).append(item.event.header.seq)
        assert all(seen[f"s{i}"] == [0, 1] for i in range(10))

    def test_records_survive_reopening(self, open_backend: OpenBackend) -> None:
        j = Journal(open_backend())
        j.append_sync([started("r1", 0), model_call("r1", 1)], SnapshotDraft(header("r1", 1), "running", 1, b"st"))
        j.close()
        j2 = Journal(open_backend())
        try:
            assert [e.event.header.seq for e in j2.read_rollout("r1")] == [0, 1]
            assert j2.snapshots().snapshots["r1"].state == b"st"
        finally:
            j2.close()

    def test_latest_snapshot_wins_and_replay_resumes_after_it(self, journal: Journal) -> None:
        journal.append_sync([started("r1", 0)], SnapshotDraft(header("r1", 0), "running", 0, b"v0"))
        journal.append_sync(
            [model_call("r1", 1), turn_done("r1", 2)], SnapshotDraft(header("r1", 2, turn=1), "running", 2, b"v1")
        )
        journal.append_sync([model_call("r1", 3, turn=2), turn_done("r1", 4, turn=2)])
        loaded = journal.snapshots().snapshots["r1"]
        assert loaded.state == b"v1" and loaded.snapshot.covers_seq == 2
        cursor = Cursor(loaded.snapshot.replay_offset, loaded.snapshot.covers_seq, loaded.snapshot.header.epoch)
        assert [e.event.header.seq for e in journal.read_rollout("r1", cursor)] == [3, 4]

    def test_restore_reads_only_the_tails_of_unfinished_rollouts(self, journal: Journal) -> None:
        # "done" finished long ago and was never acknowledged; its partition-mate ran on for 30 turns.
        running = next(
            r for r in (f"run-{i}" for i in range(100)) if journal.partition_of(r) == journal.partition_of("done")
        )
        journal.append_sync([started("done", 0)], SnapshotDraft(header("done", 0), "running", 0, b"done-0"))
        journal.append_sync(
            [RolloutFinished(header("done", 1), 1.0, 1, "{}")],
            SnapshotDraft(header("done", 1), "finished", 1, b"done-final"),
        )
        journal.append_sync([started(running, 0)])
        for seq in range(1, 30):
            journal.append_sync([turn_done(running, seq, turn=seq)])
        journal.append_sync(
            [turn_done(running, 30, turn=30)], SnapshotDraft(header(running, 30, turn=30), "running", 30, b"r")
        )
        journal.append_sync([turn_done(running, 31, turn=31)])
        journal.append_sync([turn_done(running, 32, turn=32)])
        plan = load_rollouts(journal)
        assert plan.rollouts["done"].snapshot.state == b"done-final" and plan.rollouts["done"].events == []
        assert [e.event.header.seq for e in plan.rollouts[running].events] == [31, 32]
        # Read: the running rollout's snapshot turn (stepped over by its seq) and the two turns after it.
        assert plan.report.records_read == 3, f"restore read {plan.report.records_read} records"

    def test_tombstone_and_acknowledge_remove_the_snapshot(self, journal: Journal) -> None:
        for r in ("keep", "gone", "acked"):
            journal.append_sync([started(r, 0)], SnapshotDraft(header(r, 0), "running", 0, r.encode()))
        journal.tombstone("gone").result()
        journal.append_sync(
            [RolloutFinished(header("acked", 1), 1.0, 1, "{}")],
            SnapshotDraft(header("acked", 1), "finished", 1, b"done"),
        )
        journal.acknowledge(RolloutAcknowledged(header("acked", 2), "trainer")).result()
        index = journal.snapshots()
        assert set(index.snapshots) == {"keep"}
        assert [type(e.event).__name__ for e in journal.read_rollout("acked")][-1] == "RolloutAcknowledged"

    def test_a_large_snapshot_is_chunked_and_joined_back(self, journal: Journal) -> None:
        big = np.random.default_rng(0).bytes(3 * journal.inline_snapshot_limit + 123)
        journal.append_sync([started("big", 0)], SnapshotDraft(header("big", 0), "running", 0, big))
        assert journal.snapshots().snapshots["big"].state == big
        journal.append_sync([turn_done("big", 1)], SnapshotDraft(header("big", 1, turn=1), "running", 1, b"small"))
        assert journal.snapshots().snapshots["big"].state == b"small"

    def test_a_corrupt_newest_snapshot_falls_back_to_the_previous_one(self, journal: Journal) -> None:
        journal.append_sync([started("r1", 0)], SnapshotDraft(header("r1", 0), "running", 0, b"good"))
        journal.backend.commit([OutRecord(Stream.SNAPSHOTS, "r1", b"\xc3\x01garbage-garbage", "r1")])
        index = journal.snapshots()
        assert index.snapshots["r1"].state == b"good"
        assert any("r1" in str(e) or "offset" in str(e) or "position" in str(e) for e in index.errors)

    def test_a_large_snapshot_falls_back_to_the_previous_one_and_its_chunks(self, journal: Journal) -> None:
        rng = np.random.default_rng(1)
        older, newer = (rng.bytes(2 * journal.inline_snapshot_limit + n) for n in (5, 7))
        journal.append_sync([started("big", 0)], SnapshotDraft(header("big", 0), "running", 0, older))
        journal.append_sync([turn_done("big", 1)], SnapshotDraft(header("big", 1, turn=1), "running", 1, newer))
        lost = blob_chunk_key("big", hashlib.sha256(newer).hexdigest(), 1)  # the newest one loses a chunk
        journal.backend.commit([OutRecord(Stream.SNAPSHOTS, lost, None, "big")])
        index = journal.snapshots()
        assert index.snapshots["big"] is not None and index.snapshots["big"].state == older
        assert any("lacks chunk 1" in str(e) for e in index.errors)

    def test_a_growing_state_writes_each_block_once_and_reads_back_whole(self, open_backend: OpenBackend) -> None:
        """A state whose sections only grow (a head, a conversation) goes in blocks: each snapshot
        writes the blocks its rollout added, never one a slot names already, and reads back whole."""
        with Journal(open_backend(), snapshot_block_bytes=BLOCK) as journal:
            written: Counter[str] = Counter()
            for turn, state in enumerate(_growing_states(4)):
                before = _block_writes(journal)
                journal.append_sync(
                    [turn_done("grow", turn + 1, turn=turn + 1)], _blocked_draft("grow", turn + 1, state)
                )
                written.update(_block_writes(journal) - before)
                assert journal.snapshots().snapshots["grow"].state == state.data
            assert written and max(written.values()) == 1, "a block was written twice"
            # The first turn's 3 full blocks of its head were written once, and named by every snapshot since.
            first = _growing_states(1)[0]
            assert all(_sha(first.data[i * BLOCK : (i + 1) * BLOCK]) in _named(journal, "grow") for i in range(3))
            # A third and fourth snapshot overwrote the slots: what only those older values named is gone.
            assert set(_live_blocks(journal, "grow")) == _named(journal, "grow")

    def test_a_draft_whose_sections_do_not_fit_fails_its_own_append_only(self, open_backend: OpenBackend) -> None:
        with Journal(open_backend(), snapshot_block_bytes=BLOCK) as journal:
            bad = SnapshotDraft(header("bad", 1), "running", 1, b"short", stable=(BLOCK,))
            with pytest.raises(ValueError, match="rollout bad: stable sections"):
                journal.append([started("bad", 0)], bad)
            state = _growing_states(1)[0]
            journal.append_sync([started("grow", 0)], _blocked_draft("grow", 0, state))  # the journal goes on
            assert journal.snapshots().snapshots["grow"].state == state.data

    def test_a_snapshot_missing_a_block_falls_back_to_the_previous_one(self, open_backend: OpenBackend) -> None:
        with Journal(open_backend(), snapshot_block_bytes=BLOCK) as journal:
            older, newer = _growing_states(2)
            journal.append_sync([started("grow", 0)], _blocked_draft("grow", 0, older))
            journal.append_sync([turn_done("grow", 1)], _blocked_draft("grow", 1, newer))
            only_newer = sorted(_named(journal, "grow", newest=True) - _named(journal, "grow", newest=False))
            journal.backend.commit([OutRecord(Stream.SNAPSHOTS, block_key("grow", only_newer[0]), None, "grow")])
            index = journal.snapshots()
            assert index.snapshots["grow"] is not None and index.snapshots["grow"].state == older.data
            assert any("lacks its block" in str(e) for e in index.errors)

    @pytest.mark.parametrize("damage", ["lost", "flipped"])
    def test_a_block_lost_or_damaged_under_both_slots_is_written_again_by_the_next_snapshot(
        self, open_backend: OpenBackend, damage: str
    ) -> None:
        """A block both slots name, gone or not what its digest says: neither snapshot restores, and a
        writer that restored the rollout must not take the block as stored, or none ever would again."""
        states = _growing_states(3)
        with Journal(open_backend(), snapshot_block_bytes=BLOCK) as first:
            first.append_sync([started("grow", 0)], _blocked_draft("grow", 0, states[0]))
            first.append_sync([turn_done("grow", 1)], _blocked_draft("grow", 1, states[1]))
        shared = _sha(states[0].data[:BLOCK])  # the head's first block: both slots name it
        key = block_key("grow", shared)
        with Journal(open_backend(), snapshot_block_bytes=BLOCK) as second:
            value = None
            if damage == "flipped":
                value = second.codec.encode(BlobChunk(shared, 0, 1, b"\x00" + states[0].data[1:BLOCK]))
            second.backend.commit([OutRecord(Stream.SNAPSHOTS, key, value, "grow")])
            index = second.snapshots()
            assert index.snapshots["grow"] is None  # neither slot restores: a replay from the first event
            assert any(("lacks its block" if damage == "lost" else "fails its SHA-256") in str(e) for e in index.errors)
            load_rollouts(second)
            second.append_sync([turn_done("grow", 2, turn=2)], _blocked_draft("grow", 2, states[2]))
            assert second.snapshots().snapshots["grow"].state == states[2].data

    def test_blocks_an_acknowledger_did_not_know_are_dropped_by_the_next_writer_that_restores(
        self, open_backend: OpenBackend
    ) -> None:
        """A trainer acknowledges from its training record: its journal never learned the rollout's
        slots, so it tombstones the slots and leaves the blocks. A writer's restore finds them named by
        nothing (``RestorePlan.orphans``) and drops them; a reader's leaves them be."""
        with Journal(open_backend(), snapshot_block_bytes=BLOCK) as runner:
            for turn, state in enumerate(_growing_states(2)):
                runner.append_sync(
                    [turn_done("grow", turn + 1, turn=turn + 1)], _blocked_draft("grow", turn + 1, state)
                )
            runner.append_sync(
                [RolloutFinished(header("grow", 3), 1.0, 3, "{}")],
                SnapshotDraft(header("grow", 3), "finished", 3, b"done"),
            )
            runner.append_sync([turn_done("keep", 1)], _blocked_draft("keep", 1, _growing_states(1)[0]))
        with Journal(open_backend()) as trainer:
            trainer.acknowledge(RolloutAcknowledged(header("grow", 4), "trainer")).result()
            assert _live_blocks(trainer, "grow"), "the trainer knew the blocks after all: nothing to test"
        with Journal(open_backend(), snapshot_block_bytes=BLOCK) as writer:
            plan = load_rollouts(writer)
            assert {r.key.split(BLOCK_MARK)[0] for r in plan.orphans} == {"grow"}
            writer.discard(plan.orphans).result()
            assert _live_blocks(writer, "grow") == []
            assert writer.snapshots().snapshots["keep"].state == _growing_states(1)[0].data  # another's blocks stay
            assert load_rollouts(writer).orphans == []

    def test_a_writer_that_restored_a_blocked_rollout_reuses_its_blocks_and_acknowledgement_drops_them(
        self, open_backend: OpenBackend
    ) -> None:
        states = _growing_states(3)
        with Journal(open_backend(), snapshot_block_bytes=BLOCK) as first:
            first.append_sync([started("grow", 0)], _blocked_draft("grow", 0, states[0]))
            first.append_sync([turn_done("grow", 1)], _blocked_draft("grow", 1, states[1]))
        with Journal(open_backend(), snapshot_block_bytes=BLOCK) as second:
            load_rollouts(second)  # what a take does: the writer learns both slots and their blocks
            before = _block_writes(second)
            second.append_sync([turn_done("grow", 2, turn=2)], _blocked_draft("grow", 2, states[2]))
            new = _block_writes(second) - before
            kept = _named(second, "grow", newest=False)  # the slot it kept: turn 1's snapshot
            assert new and not set(new) & kept, "a block the kept slot names was written again"
            assert second.snapshots().snapshots["grow"].state == states[2].data
            assert set(_live_blocks(second, "grow")) == _named(second, "grow")
            second.append_sync(
                [RolloutFinished(header("grow", 3), 1.0, 3, "{}")],
                SnapshotDraft(header("grow", 3), "finished", 3, b"done"),
            )
            second.acknowledge(RolloutAcknowledged(header("grow", 4), "trainer")).result()
            assert _live_blocks(second, "grow") == [], "acknowledgement left blocks behind"

    def test_attempt_n_events_after_the_fence_are_dropped_by_readers(
        self, journal: Journal, open_backend: OpenBackend
    ) -> None:
        journal.append_sync([started("r1", 0), turn_done("r1", 1)])
        journal.append_sync([started("r1", 2, attempt=2, epoch=2, turn=1)])
        # A zombie of attempt 1, in another process that never saw the fence, keeps writing.
        zombie = Journal(journal.backend)
        zombie.append_sync([turn_done("r1", 3, turn=2, epoch=1)])
        journal.append_sync([turn_done("r1", 4, turn=2, epoch=2, attempt=2)])
        report = ReadReport()
        seqs = [e.event.header.seq for e in journal.read_rollout("r1", report=report)]
        assert seqs == [0, 1, 2, 4]
        assert len(report.fenced) == 1 and report.fenced[0].epoch == 1 and "fenced" in str(report.fenced[0])

    def test_the_writer_refuses_an_append_from_a_fenced_epoch(self, journal: Journal) -> None:
        journal.append_sync([started("r1", 0, attempt=2, epoch=2)])
        with pytest.raises(FencedWriteError, match="r1"):
            journal.append([turn_done("r1", 1, epoch=1)])
        with pytest.raises(FencedWriteError, match="r1"):
            journal.append([], SnapshotDraft(header("r1", 1, epoch=1), "running", 1, b"zombie"))

    def test_a_zombie_snapshot_written_after_the_fence_is_ignored_by_restore(self, journal: Journal) -> None:
        journal.append_sync(
            [started("r1", 0), turn_done("r1", 1)], SnapshotDraft(header("r1", 1, turn=1), "running", 1, b"a1")
        )
        journal.append_sync([started("r1", 2, attempt=2, epoch=2, turn=1)])
        zombie = Journal(journal.backend)  # attempt 1, in a process that never saw the fence
        zombie.append_sync(
            [turn_done("r1", 2, turn=2)], SnapshotDraft(header("r1", 2, turn=2), "running", 2, b"zombie")
        )
        plan = load_rollouts(journal)
        history = plan.rollouts["r1"]
        assert history.snapshot.state == b"a1"
        assert (history.fence.epoch, history.fence.attempt) == (2, 2)
        assert [e.event.header.seq for e in history.events] == [2]
        assert any("zombie" in str(e) for e in plan.report.errors)

    def test_a_zombie_event_ahead_of_the_fence_in_log_order_is_dropped_by_restore(self, journal: Journal) -> None:
        journal.append_sync(
            [started("r1", 0), turn_done("r1", 1)], SnapshotDraft(header("r1", 1, turn=1), "running", 1, b"a1")
        )
        zombie = Journal(journal.backend)
        # The zombie's turn commits after attempt 2 folded the journal (through seq 1), but lands before its fence.
        zombie.append_sync([turn_done("r1", 2, turn=2)])
        journal.append_sync([started("r1", 2, attempt=2, epoch=2, turn=2)])
        journal.append_sync([turn_done("r1", 3, turn=2, epoch=2, attempt=2)])
        plan = load_rollouts(journal)
        events = plan.rollouts["r1"].events
        assert [(e.event.header.seq, e.event.header.epoch) for e in events] == [(2, 2), (3, 2)]
        assert [d.epoch for d in plan.report.fenced] == [1]

    def test_a_zombie_turn_stays_dropped_after_two_later_attempts(self, journal: Journal) -> None:
        # Attempt 2 resumes from seq 2; attempt 1, a zombie, commits its seq-2 turn after that fence.
        # Attempt 3 takes over and crashes before its first snapshot: restore must still drop the zombie's turn.
        journal.append_sync(
            [started("r1", 0), turn_done("r1", 1)], SnapshotDraft(header("r1", 1, turn=1), "running", 1, b"a1")
        )
        journal.append_sync([started("r1", 2, attempt=2, epoch=2, turn=1)])
        zombie = Journal(journal.backend)  # attempt 1, in a process that never saw the fence
        zombie.append_sync([turn_done("r1", 2, turn=1)])
        journal.append_sync([turn_done("r1", 3, turn=1, epoch=2, attempt=2)])
        journal.append_sync([started("r1", 4, attempt=3, epoch=3, turn=2)])

        plan = load_rollouts(journal)

        history = plan.rollouts["r1"]
        assert [(e.event.header.seq, e.event.header.epoch) for e in history.events] == [(2, 2), (3, 2), (4, 3)]
        assert [(d.epoch, d.record) for d in plan.report.fenced] == [(1, "TurnCompleted")]
        assert [(a.epoch, a.seq) for a in history.fence.history] == [(1, 0), (2, 2), (3, 4)]

    def test_a_zombie_snapshot_after_acknowledgement_does_not_bring_the_rollout_back(self, journal: Journal) -> None:
        journal.append_sync(
            [started("r1", 0), turn_done("r1", 1)], SnapshotDraft(header("r1", 1, turn=1), "running", 1, b"a1")
        )
        journal.append_sync([started("r1", 2, attempt=2, epoch=2, turn=1)])
        journal.append_sync(
            [RolloutFinished(header("r1", 3, epoch=2, attempt=2), 1.0, 2, "{}")],
            SnapshotDraft(header("r1", 3, epoch=2, attempt=2), "finished", 3, b"done"),
        )
        journal.acknowledge(RolloutAcknowledged(header("r1", 4, epoch=2, attempt=2), "trainer")).result()
        zombie = Journal(journal.backend)  # attempt 1 wakes up long after and snapshots its turn 2
        zombie.append_sync(
            [turn_done("r1", 2, turn=2)], SnapshotDraft(header("r1", 2, turn=2), "running", 2, b"zombie")
        )

        plan = load_rollouts(journal)

        assert "r1" not in plan.rollouts
        assert plan.acknowledged["r1"].acknowledged_epoch == 2
        assert [(a.epoch, a.seq) for a in plan.acknowledged["r1"].history] == [(1, 0), (2, 2)]
        assert any("acknowledged" in str(e) and "zombie" in str(e) for e in plan.report.errors)

    def test_a_slot_value_whose_tombstone_a_long_read_missed_is_moot_not_a_zombies(self, journal: Journal) -> None:
        # A read that outlasts delete.retention.ms may see a slot's value and miss its tombstone: the
        # cleaner removed it while the read ran. No broker does that on demand, so the tombstones are
        # dropped from a real read. "done" ran, filled both slots and was acknowledged; "late" was
        # acknowledged too, then its zombie attempt 1 snapshotted.
        for rollout in ("done", "late"):
            journal.append_sync(
                [started(rollout, 0), turn_done(rollout, 1)],
                SnapshotDraft(header(rollout, 1, turn=1), "running", 1, b"a1"),
            )
            journal.append_sync(
                [RolloutFinished(header(rollout, 2), 1.0, 1, "{}")],
                SnapshotDraft(header(rollout, 2), "finished", 2, b"done"),
            )
            journal.acknowledge(RolloutAcknowledged(header(rollout, 3), "trainer")).result()
        Journal(journal.backend).append_sync(
            [turn_done("late", 2, turn=2)], SnapshotDraft(header("late", 2, turn=2), "running", 2, b"zombie")
        )
        read = [record for record in journal.backend.read_snapshots() if record.value is not None]
        assert {"done", "done/snapshot/1"} <= {record.key for record in read}  # both slots' values, untombstoned

        index = load_snapshots(journal.codec, read)

        assert not {"done", "late"} & set(index.snapshots)
        assert index.fences["done"].acknowledged_epoch == index.fences["late"].acknowledged_epoch == 1
        assert [e for e in index.errors if "done" in str(e)] == []  # moot: it lies before the fence
        assert [("late" in str(e), "zombie" in str(e)) for e in index.errors] == [(True, True)]

    def test_acknowledged_fences_fold_into_a_bucket_that_restore_reads_instead(self, open_backend: OpenBackend) -> None:
        # Bucket size 3: the fourth acknowledgement folds the three fences before it, the seventh the
        # next three; the last one stays a fence record. One rollout still runs.
        with Journal(open_backend(), acknowledgement_bucket_size=3) as writer:
            done = _on_one_partition(writer, "done", 7)
            for rollout in done:
                _finish(writer, rollout)
                writer.acknowledge(RolloutAcknowledged(header(rollout, 3), "trainer")).result()
            writer.append_sync([started("live", 0)], SnapshotDraft(header("live", 0), "running", 0, b"s"))
            stream = list(writer.backend.read_snapshots())
            kept = compacted(stream, 1)

            buckets = [key for key in kept if BUCKET_MARK in key]
            assert len(buckets) == 2
            # a set: "live" may lie on another partition, and a Kafka read interleaves partitions as it fetches
            assert {key for key in kept if key.endswith("/fence")} == {f"{done[-1]}/fence", "live/fence"}

            reader = Journal(writer.backend)
            plan = load_rollouts(reader)
            assert set(plan.rollouts) == {"live"}
            assert sorted(plan.acknowledged) == sorted(done)
            assert all(plan.acknowledged[r].acknowledged_epoch == 1 for r in done)
            assert plan.report.errors == []
            assert reader.snapshots().fences["done-0"].acknowledged  # what a trainer asks before acknowledging
            assert reader.apply_acknowledgement(_ack_record(reader, "done-0", stream[-1].location)) is None

    def test_a_writer_folds_the_acknowledged_fences_it_restored(self, open_backend: OpenBackend) -> None:
        with Journal(open_backend()) as before_buckets:  # a writer that never folds (the default size is 256)
            a, b, c, d = _on_one_partition(before_buckets, "r", 4)
            for rollout in (a, b, c):
                _finish(before_buckets, rollout)
                before_buckets.acknowledge(RolloutAcknowledged(header(rollout, 3), "trainer")).result()
            _finish(before_buckets, d)
        with Journal(open_backend(), acknowledgement_bucket_size=3) as resumed:
            load_rollouts(resumed)
            resumed.acknowledge(RolloutAcknowledged(header(d, 3), "trainer")).result()

            kept = compacted(resumed.backend.read_snapshots(), 1)
            assert [key for key in kept if key.endswith("/fence")] == [f"{d}/fence"]
            plan = load_rollouts(Journal(resumed.backend))
            assert sorted(plan.acknowledged) == [a, b, c, d] and plan.rollouts == {}

    def test_overlapping_buckets_and_an_unfolded_fence_agree_and_a_later_zombie_is_named(
        self, journal: Journal
    ) -> None:
        # Two writers that both folded "a" (a take overlapping the old owner's last commit) wrote two
        # buckets naming it; "b" was folded but its fence tombstone is missing (a read that outlasted
        # delete.retention.ms). Then a zombie of "a" snapshots: after the buckets, so a zombie's.
        a, b, c = _on_one_partition(journal, "r", 3)
        for rollout in (a, b, c):
            _finish(journal, rollout)
            journal.acknowledge(RolloutAcknowledged(header(rollout, 3), "trainer")).result()
        partition = journal.partition_of(a)
        first = bucket_records(journal.codec, partition, {a: (1, 1), b: (1, 1)})
        second = bucket_records(journal.codec, partition, {a: (1, 1), c: (1, 1)})
        journal.backend.commit([first[0], second[0], *second[1:]])  # b's fence stays
        Journal(journal.backend).append_sync(
            [turn_done(a, 4, turn=2)], SnapshotDraft(header(a, 4, turn=2), "running", 4, b"zombie")
        )

        plan = load_rollouts(journal)

        assert sorted(plan.acknowledged) == [a, b, c] and plan.rollouts == {}
        assert plan.acknowledged[b].history  # its fence record, which holds the attempts, wins
        assert (plan.acknowledged[c].acknowledged_epoch, plan.acknowledged[c].attempt) == (1, 1)
        assert not plan.acknowledged[c].history
        assert [(f"rollout {a} " in str(e), "zombie" in str(e)) for e in plan.report.errors] == [(True, True)]

    def test_the_rollouts_of_a_bucket_that_does_not_decode_are_found_in_the_log_as_acknowledged(
        self, journal: Journal
    ) -> None:
        # What a fold leaves, with its bucket unreadable (a flipped byte, or a newer schema version):
        # the folded fences tombstoned, nothing naming the rollouts but their events.
        a, b, c = _on_one_partition(journal, "r", 3)
        for rollout in (a, b):
            _finish(journal, rollout)
            journal.acknowledge(RolloutAcknowledged(header(rollout, 3), "trainer")).result()
        _finish(journal, c)
        fold = bucket_records(journal.codec, journal.partition_of(a), {a: (1, 1), b: (1, 1)})
        journal.backend.commit([OutRecord(Stream.SNAPSHOTS, fold[0].key, b"\xc3\x01junk", a), *fold[1:]])

        plan = load_rollouts(journal)

        assert [BUCKET_MARK in str(e) for e in plan.report.errors] == [True]
        assert set(plan.rollouts) == {a, b, c}  # a and b from their first event: not run again, but known taken
        for rollout in (a, b):
            assert plan.rollouts[rollout].snapshot is None
            assert isinstance(plan.rollouts[rollout].events[-1].event, RolloutAcknowledged)

    def test_a_rollout_a_bucket_names_reloads_with_every_attempt(self, open_backend: OpenBackend) -> None:
        # A bucket keeps no attempt history: a reload from the first event must not take the
        # acknowledged epoch for the only one (it would drop attempt 1's turn as superseded).
        with Journal(open_backend(), acknowledgement_bucket_size=1) as journal:
            a, b = _on_one_partition(journal, "r", 2)
            journal.append_sync([started(a, 0), turn_done(a, 1)])
            journal.append_sync([started(a, 2, attempt=2, epoch=2, turn=1)])
            journal.append_sync([RolloutFinished(header(a, 3, epoch=2, attempt=2), 1.0, 2, "{}")])
            journal.acknowledge(RolloutAcknowledged(header(a, 4, epoch=2, attempt=2), "trainer")).result()
            _finish(journal, b)
            journal.acknowledge(RolloutAcknowledged(header(b, 3), "trainer")).result()  # folds a
            fence = load_rollouts(Journal(journal.backend)).acknowledged[a]
            assert (fence.acknowledged_epoch, fence.attempt, fence.history) == (2, 2, ())

            history = history_from_first_event(journal, RolloutHistory(a, None, fence=fence))

            assert [(e.event.header.epoch, e.event.header.seq) for e in history.events] == [
                (1, 0),
                (1, 1),
                (2, 2),
                (2, 3),
                (2, 4),
            ]

    def test_a_fence_written_before_0_3_as_an_attempt_started_still_reads(self, journal: Journal) -> None:
        journal.append_sync(
            [started("r1", 0), turn_done("r1", 1)], SnapshotDraft(header("r1", 1, turn=1), "running", 1, b"a1")
        )
        attempt_2 = started("r1", 2, attempt=2, epoch=2, turn=1)
        journal.backend.commit(
            [
                OutRecord(Stream.EVENTS, "r1", journal.codec.encode(attempt_2), "r1"),
                OutRecord(Stream.SNAPSHOTS, "r1/fence", journal.codec.encode(attempt_2), "r1"),
            ]
        )
        Journal(journal.backend).append_sync([turn_done("r1", 2, turn=1)])  # a zombie of attempt 1

        plan = load_rollouts(journal)

        history = plan.rollouts["r1"]
        assert (history.fence.epoch, history.fence.attempt, history.fence.seq) == (2, 2, 2)
        assert [(e.event.header.seq, e.event.header.epoch) for e in history.events] == [(2, 2)]

    def test_an_event_of_a_few_megabytes_travels_in_pieces_and_reads_back_whole(self, journal: Journal) -> None:
        big = model_call("big", 1, tokens=1_500_000)  # a long model call: about 6 MB of prompt tokens
        journal.append_sync([started("big", 0)])
        # In the same commit as the big one, if the committer gathers them, another rollout's turn.
        pending = [
            journal.append([big], SnapshotDraft(header("big", 1), "running", 1, b"after-the-big-call")),
            journal.append([started("other", 0), turn_done("other", 1)]),
        ]
        receipt, _ = (future.result(timeout=120) for future in pending)
        assert len(receipt.locations) == 1  # one event, one location: where its first piece is
        journal.append_sync([turn_done("big", 2)])
        read = list(journal.read_rollout("big"))
        assert [e.event.header.seq for e in read] == [0, 1, 2] and read[1].event == big
        assert read[1].location == receipt.locations[0]
        assert [e.event.header.seq for e in journal.read_rollout("other")] == [0, 1]
        assert [e.event for e in journal.scan() if e.event.header.rollout_id == "big"][1] == big
        plan = load_rollouts(journal)  # the snapshot covers the big call: restore steps over its pieces by seq
        assert [e.event.header.seq for e in plan.rollouts["big"].events] == [2] and plan.report.clean

    def test_an_event_over_max_event_bytes_fails_only_its_own_append(self, open_backend: OpenBackend) -> None:
        with Journal(open_backend(), max_event_bytes=2 * 1024 * 1024) as journal:
            other = journal.append([started("other", 0)])
            with pytest.raises(OversizedEventError, match=r"rollout huge turn 3: its ModelCall encodes to \d+ bytes"):
                journal.append([started("huge", 0), model_call("huge", 1, turn=3, tokens=1_000_000)])
            assert other.result(timeout=60).locations
            journal.append_sync([turn_done("other", 1)])  # the writer goes on
            assert [e.event.header.seq for e in journal.read_rollout("other")] == [0, 1]
            assert list(journal.read_rollout("huge")) == []

    def test_a_chunked_event_missing_its_last_piece_is_reported(self, journal: Journal) -> None:
        big = model_call("r1", 1, tokens=400_000)
        pieces = split_event(
            journal.codec, big, journal.codec.encode(big), journal.max_record_bytes, journal.max_event_bytes
        )
        assert len(pieces) > 2
        journal.append_sync([started("r1", 0)])
        first = journal.backend.commit([OutRecord(Stream.EVENTS, "r1", p, "r1") for p in pieces[:-1]])[0]
        journal.append_sync([turn_done("r1", 2)])
        with pytest.raises(CorruptRecordError, match="stops after"):
            list(journal.read_rollout("r1"))
        report = ReadReport()
        assert [e.event.header.seq for e in journal.read_rollout("r1", report=report)] == [0, 2]
        assert [e.location for e in report.errors] == [first]
        assert f"stops after {len(pieces) - 1} of its {len(pieces)} pieces" in str(report.errors[0])

    def test_a_cancelled_wait_does_not_stop_the_committer(self, journal: Journal) -> None:
        future = journal.append([started("r1", 0)])
        future.cancel()
        journal.append_sync([turn_done("r1", 1)])
        assert [e.event.header.seq for e in journal.read_rollout("r1")][-1] == 1

    def test_a_corrupt_record_is_named_and_its_neighbours_still_read(self, journal: Journal) -> None:
        journal.append_sync([started("r1", 0)])
        bad = journal.backend.commit([OutRecord(Stream.EVENTS, "r1", b"\xc3\x01" + b"\x00" * 8 + b"junk", "r1")])[0]
        wrong_magic = journal.backend.commit([OutRecord(Stream.EVENTS, "r1", b"NOTAVRO", "r1")])[0]
        journal.append_sync([turn_done("r1", 1)])
        with pytest.raises(UnknownSchemaError) as info:
            list(journal.read_rollout("r1"))
        assert str(bad.offset) in str(info.value)
        report = ReadReport()
        assert [e.event.header.seq for e in journal.read_rollout("r1", report=report)] == [0, 1]
        assert [e.location.offset for e in report.errors] == [bad.offset, wrong_magic.offset]
        assert isinstance(report.errors[1], CorruptRecordError) and "magic" in str(report.errors[1])

    def test_an_event_record_without_a_value_is_refused_at_commit(self, journal: Journal) -> None:
        with pytest.raises(ValueError, match="r1"):
            journal.backend.commit([OutRecord(Stream.EVENTS, "r1", None, "r1")])
        journal.append_sync([started("r1", 0)])  # the writer goes on
        assert [e.event.header.seq for e in journal.read_rollout("r1")] == [0]

    def test_a_snapshot_stream_record_on_the_events_stream_is_reported(self, journal: Journal) -> None:
        journal.append_sync([started("r1", 0)], SnapshotDraft(header("r1", 0), "running", 0, b"s"))
        snapshot_bytes = next(r.value for r in journal.backend.read_snapshots() if r.key == "r1")
        loc = journal.backend.commit([OutRecord(Stream.EVENTS, "r1", snapshot_bytes, "r1")])[0]
        journal.append_sync([turn_done("r1", 1)])
        for cursor in (Cursor(), Cursor(0, after_seq=0)):  # a full read, and one that peeks seqs
            report = ReadReport()
            assert [e.event.header.seq for e in journal.read_rollout("r1", cursor, report)][-1] == 1
            assert [e.location for e in report.errors] == [loc] and "Snapshot" in str(report.errors[0])

    def test_an_unreadable_avro_body_is_named(self, journal: Journal) -> None:
        good = journal.codec.encode(turn_done("r1", 1))
        journal.append_sync([started("r1", 0)])
        loc = journal.backend.commit([OutRecord(Stream.EVENTS, "r1", good[:20], "r1")])[0]
        journal.append_sync([turn_done("r1", 2)])
        report = ReadReport()
        assert [e.event.header.seq for e in journal.read_rollout("r1", report=report)] == [0, 2]
        assert str(loc.offset) in str(report.errors[0]) and "TurnCompleted" in str(report.errors[0])

    def test_concurrent_appends_and_reads_see_only_whole_turns(self, journal: Journal) -> None:
        stop = threading.Event()
        torn = []

        def reader() -> None:
            while not stop.is_set():
                seqs = [e.event.header.seq for e in journal.read_rollout("w")]
                if len(seqs) % 3:
                    torn.append(seqs)

        thread = threading.Thread(target=reader)
        thread.start()
        for t in range(30):
            journal.append_sync(
                [model_call("w", 3 * t, turn=t), model_call("w", 3 * t + 1, turn=t), turn_done("w", 3 * t + 2, turn=t)]
            )
        stop.set()
        thread.join()
        assert not torn, f"a reader saw part of a turn: {torn[:1]}"


def _finish(journal: Journal, rollout: str) -> None:
    """``rollout`` starts, runs a turn and finishes (its snapshot final), all durable."""
    journal.append_sync([started(rollout, 0), turn_done(rollout, 1)])
    journal.append_sync(
        [RolloutFinished(header(rollout, 2), 1.0, 1, "{}")], SnapshotDraft(header(rollout, 2), "finished", 2, b"done")
    )


def _on_one_partition(journal: Journal, prefix: str, count: int) -> list[str]:
    """``count`` rollout ids that share a partition (a bucket folds one partition's fences)."""
    ids = (f"{prefix}-{i}" for i in range(10_000))
    first = next(ids)
    return [first, *[r for r in ids if journal.partition_of(r) == journal.partition_of(first)][: count - 1]]


def _ack_record(journal: Journal, rollout: str, location: RecordLocation) -> StoredRecord:
    """An acknowledgement request for ``rollout`` as an owner reads it from ``<namespace>.acks``."""
    value = journal.codec.encode(RolloutAcknowledged(header(rollout, 3), "trainer"))
    return StoredRecord(rollout, value, RecordLocation(location.source, journal.partition_of(rollout), 0))


BLOCK = 1024  # small blocks: a few kilobytes of state fill several


@dataclass(frozen=True)
class _GrowingState:
    """A state laid out as a rollout's is for blocks: two growing sections, then the rest."""

    data: bytes
    stable: tuple[int, int]


def _growing_states(turns: int) -> list[_GrowingState]:
    """States of ``turns`` turns: each turn adds 3.5 blocks to the head and a third of one to the
    conversation (both sections only grow), and rewrites the rest."""
    head, talk = np.random.default_rng(7).bytes(4 * BLOCK * turns), np.random.default_rng(8).bytes(BLOCK * turns)
    states = []
    for turn in range(1, turns + 1):
        a, b = head[: 3 * BLOCK * turn + BLOCK // 2 * turn], talk[: BLOCK // 3 * turn]
        states.append(_GrowingState(a + b + f"rest of turn {turn}".encode(), (len(a), len(b))))
    return states


def _blocked_draft(rollout: str, seq: int, state: _GrowingState) -> SnapshotDraft:
    return SnapshotDraft(header(rollout, seq, turn=seq), "running", seq, state.data, stable=state.stable)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _block_writes(journal: Journal) -> Counter[str]:
    """How often each block key was written (values, not tombstones) in the raw snapshot stream."""
    return Counter(r.key for r in journal.backend.read_snapshots() if BLOCK_MARK in r.key and r.value is not None)


def _live_blocks(journal: Journal, rollout: str) -> list[str]:
    """The block digests of ``rollout`` that compaction keeps (not tombstoned)."""
    kept = compacted(journal.backend.read_snapshots(), 1)
    return sorted(key.split(BLOCK_MARK)[1] for key in kept if key.startswith(rollout + BLOCK_MARK))


def _named(journal: Journal, rollout: str, newest: bool | None = None) -> set[str]:
    """The block digests the rollout's slots name now (``newest``: only the newest snapshot's, or
    only the other slot's; None: both)."""
    kept = compacted(journal.backend.read_snapshots(), 1)
    values = sorted(
        (kept[key][-1] for key in (rollout, rollout + "/snapshot/1") if key in kept), key=lambda r: r.location.offset
    )
    if newest is not None:
        values = values[-1:] if newest else values[:-1]
    named: set[str] = set()
    for record in values:
        snapshot = journal.codec.decode(record.value or b"", record.location)
        named.update(getattr(snapshot, "blocks", None) or ())
    return named
