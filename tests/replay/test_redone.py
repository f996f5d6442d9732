"""Work a restart redid, counted from the journal (replay/redone.py), on journals built
event by event, so that the expected figure is known without any runner.

Each rollout commits turns 0 and 1 in attempt 1 (the crash comes after), then attempt 2
journals what it executed. The count must follow what attempt 2 journaled, whatever
attempt 2 claims about itself: a restore that lost a committed turn resumes "at turn 1"
(no restart recorded) and still redid turn 1.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.common import turn_events
from rollout_journal.journal import (
    AppendReceipt,
    AttemptFenced,
    AttemptStarted,
    Header,
    Message,
    SnapshotDraft,
    open_journal,
)
from rollout_journal.participants.rollout.state import RolloutState
from rollout_journal.replay.redone import (
    UncountableJournalError,
    committed_at_crash,
    redone_after_crash,
)

OUTPUT = {0: 5, 1: 7, 2: 3}  # output tokens of each turn's model call


class Writer:
    """Appends one rollout's events with consecutive seqs, as one commit per call."""

    def __init__(self, journal, rollout_id: str) -> None:
        self.journal, self.rollout_id, self.seq = journal, rollout_id, 0
        self.state = RolloutState(rollout_id, rollout_id.rsplit("-", 1)[0])
        self.rng = np.random.default_rng(0)

    def header(self, attempt: int, turn: int) -> Header:
        return Header(self.rollout_id, self.state.group_id, attempt, attempt, turn, self.seq, 0, "test")

    def commit(self, events: list, snapshot: bool = False) -> AppendReceipt:
        for event in events:
            self.state.apply(event)
        self.seq = self.state.next_seq
        draft = None
        if snapshot:
            draft = SnapshotDraft(events[-1].header, "running", self.seq - 1, self.state.to_bytes())
        return self.journal.append(events, draft).result()

    def start(self, attempt: int, resumed_from_turn: int) -> None:
        messages = [Message("system", "s"), Message("user", "u")] if resumed_from_turn == 0 else []
        events = [AttemptStarted(self.header(attempt, resumed_from_turn), resumed_from_turn, "topo", "test", messages)]
        if attempt > 1:
            self.seq += 1
            events.append(AttemptFenced(self.header(attempt, resumed_from_turn), attempt - 1, attempt - 1, "test"))
        self.commit(events, snapshot=attempt == 1)

    def turn(self, attempt: int, turn: int, *, snapshot: bool = False) -> AppendReceipt:
        events = turn_events(
            self.rollout_id,
            turn,
            self.seq,
            self.rng,
            prompt_delta=4,
            output=OUTPUT[turn],
            attempt=attempt,
            prefix_len=len(self.state.head_tokens),
        )  # folds onto the head
        return self.commit(events, snapshot=snapshot)


def crashed_after_two_turns(journal, rollout_id: str) -> Writer:
    writer = Writer(journal, rollout_id)
    writer.start(1, 0)
    writer.turn(1, 0, snapshot=True)
    writer.turn(1, 1)
    return writer


def test_committed_turns_redone_are_counted_from_what_later_attempts_journaled(tmp_path: Path) -> None:
    with open_journal(str(tmp_path / "journal"), writer="test") as journal:
        resumed = crashed_after_two_turns(journal, "w-g0-s0")  # resumes at turn 2: nothing redone
        lost_turn = crashed_after_two_turns(journal, "w-g0-s1")  # resumes at turn 1: turn 1 redone, no restart
        restarted = crashed_after_two_turns(journal, "w-g0-s2")  # starts over: turns 0 and 1 redone
        finished_nothing = Writer(journal, "w-g0-s3")
        finished_nothing.start(1, 0)  # started, nothing committed
        journal.flush()

        at_crash = committed_at_crash(journal)
        assert {rid: (a.turns, a.output_tokens, a.attempt) for rid, a in at_crash.items()} == {
            "w-g0-s0": (2, 12, 1),
            "w-g0-s1": (2, 12, 1),
            "w-g0-s2": (2, 12, 1),
            "w-g0-s3": (0, 0, 1),
        }
        # the newest snapshot covers turn 0 only: snapshot-only recovery would redo turn 1
        assert (at_crash["w-g0-s0"].snapshot_turns, at_crash["w-g0-s0"].snapshot_tokens) == (1, 5)

        resumed.start(2, 2)
        resumed.turn(2, 2)
        lost_turn.start(2, 1)
        lost_turn.turn(2, 1)
        lost_turn.turn(2, 2)
        restarted.start(2, 0)
        for turn in (0, 1, 2):
            restarted.turn(2, turn)
        finished_nothing.start(2, 0)
        finished_nothing.turn(2, 0)
        journal.flush()

        redone = redone_after_crash(journal, at_crash)
    assert {rid: (r.turns, r.tokens, r.restarted) for rid, r in redone.items()} == {
        "w-g0-s0": (0, 0, False),
        "w-g0-s1": (1, OUTPUT[1], False),  # a flag-based figure says 0 here: no restart was recorded
        "w-g0-s2": (2, OUTPUT[0] + OUTPUT[1], True),
        "w-g0-s3": (0, 0, False),  # turn 0 was never committed: running it is new work, not redone
    }


def test_attempt_one_s_own_turns_are_never_redone_work(tmp_path: Path) -> None:
    """Read before any restart, the journal shows nothing redone: the crashed attempt's
    own turns are what was committed, not work done again."""
    with open_journal(str(tmp_path / "journal"), writer="test") as journal:
        crashed_after_two_turns(journal, "w-g0-s0")
        journal.flush()
        at_crash = committed_at_crash(journal)
        redone = redone_after_crash(journal, at_crash)
    assert (redone["w-g0-s0"].turns, redone["w-g0-s0"].tokens) == (0, 0)


def test_a_journal_that_does_not_read_whole_is_not_counted(tmp_path: Path) -> None:
    """A committed turn lost to a bad record must not turn into a better figure (one turn
    fewer committed at the crash, so one redone turn fewer): counting refuses."""
    with open_journal(str(tmp_path / "journal"), writer="test") as journal:
        writer = Writer(journal, "w-g0-s0")
        writer.start(1, 0)
        first = writer.turn(1, 0)
        writer.turn(1, 1)
    with open(first.locations[0].source, "r+b") as segment:  # one byte of turn 0's model call inverted
        segment.seek(first.locations[0].offset + 20)
        byte = segment.read(1)
        segment.seek(first.locations[0].offset + 20)
        segment.write(bytes([byte[0] ^ 0xFF]))
    with (
        open_journal(str(tmp_path / "journal"), writer="test", read_only=True) as journal,
        pytest.raises(UncountableJournalError, match="w-g0-s0"),
    ):
        committed_at_crash(journal)
