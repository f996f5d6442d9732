"""Attacks on the summaries' promise (``journal/summary.py``): sequences where ``replay list``
(the summaries) and ``replay list --scan`` (every event, fenced) must still agree, and where the
writer path must keep working as it did before summaries. Real broker, real journals."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from bench.common import turn_events
from rollout_journal.journal.events import AttemptStarted, Header, Message, RolloutEvent, RolloutFailed
from rollout_journal.journal.open import open_journal
from rollout_journal.journal.restore import load_rollouts
from rollout_journal.journal.summary import summary_of
from rollout_journal.replay.listing import Listing, list_rollouts
from rollout_journal.replay.source import open_replay

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]


def start(rid: str, attempt: int = 1, seq: int = 0, resumed_from_turn: int = 0) -> AttemptStarted:
    header = Header(rid, rid.rsplit("-", 1)[0], attempt, attempt, resumed_from_turn, seq, Header.now_ms(), "test")
    return AttemptStarted(header, resumed_from_turn, "topology", "test", [Message("user", "task")])


def turn(rid: str, t: int, seq: int, attempt: int = 1) -> list[RolloutEvent]:
    return turn_events(rid, t, seq, np.random.default_rng(t), prompt_delta=8, output=4, attempt=attempt)


def listings(location: str) -> tuple[Listing, Listing]:
    """(``replay list``, ``replay list --scan``)."""
    with open_replay(location) as source:
        return list_rollouts(source), list_rollouts(source, scan=True)


def rows(listing: Listing) -> dict[str, dict]:
    return {row.rollout_id: row.as_json() for row in listing.rows}


@pytest.fixture
def location(kafka_bootstrap: str) -> str:
    return f"kafka://{kafka_bootstrap}/atk{uuid.uuid4().hex[:8]}?partitions=2"


def test_a_zombie_event_committed_between_the_successors_restore_and_its_start(location: str) -> None:
    """The successor restores (reading seq 0-3), the zombie then commits one more event (seq 4,
    epoch 1), then the successor's AttemptStarted takes seq 4 (epoch 2). The scan admits the
    zombie's event (its fence learns epoch 2 only at the AttemptStarted, which comes later in the
    log) and folds it without damage; the successor's summary, folded from its restore, lacks it."""
    rid = "race-g0-s0"
    with open_journal(location, writer="a") as zombie:
        zombie.append_sync([start(rid), *turn(rid, 0, 1)])
        with open_journal(location, writer="b") as successor:
            history = load_rollouts(successor).rollouts[rid]
            successor.note_summary(rid, summary_of(successor.codec, history))  # what a restore does
            zombie.append_sync(turn(rid, 1, 4)[:1])  # the zombie's model call of turn 1, seq 4
            successor.append_sync([start(rid, attempt=2, seq=4, resumed_from_turn=1)])
            successor.append_sync(turn(rid, 1, 5, attempt=2))
    summarized, scanned = listings(location)
    assert not any(row.damaged for row in scanned.rows)  # the scan folds it cleanly
    assert summarized.read == "summaries"
    diff = {k: (v, rows(scanned)[rid][k]) for k, v in rows(summarized)[rid].items() if rows(scanned)[rid][k] != v}
    assert diff == {}, f"summaries vs scan: {diff}; events {summarized.events} vs {scanned.events}"
    assert summarized.events == scanned.events


def test_a_failure_whose_reason_is_large_is_journaled_as_before(location: str) -> None:
    """A RolloutFailed whose reason is over a record's size was journaled in pieces (EventChunk)
    before summaries; its summary carries the reason whole in one record (``failure``), and the
    snapshot of that commit carries that summary."""
    rid = "bigfail-g0-s0"
    with open_journal(location, writer="w0") as journal:
        journal.append_sync([start(rid), *turn(rid, 0, 1)])
        header = Header(rid, "bigfail-g0", 1, 1, 1, 4, Header.now_ms(), "test")
        reason = "tool output: " + "x" * 1_500_000  # an exception's message carrying a tool's output
        journal.append_sync([RolloutFailed(header, "ToolError", reason)])
    summarized, scanned = listings(location)
    assert rows(summarized) == rows(scanned)
    assert rows(scanned)[rid]["failures"] == 1
