"""``replay list`` orders its rows by rollout id, numbers compared as numbers, and never fails on an
id: any string is a valid rollout id (a framework names rollouts as it likes)."""

from __future__ import annotations

from pathlib import Path

from rollout_journal.journal.events import AttemptStarted, Header, Message
from rollout_journal.journal.open import open_journal
from rollout_journal.replay.listing import list_rollouts
from rollout_journal.replay.source import open_replay


def started(rollout_id: str) -> AttemptStarted:
    header = Header(rollout_id, "group", 1, 1, 0, 0, Header.now_ms(), "test")
    return AttemptStarted(header, 0, "topology", "test", [Message("user", "task")])


def test_rows_come_in_rollout_id_order_with_numbers_as_numbers(tmp_path: Path) -> None:
    ordered = ["", "1", "1a", "a", "a001", "a01", "a1", "a2", "a10", "g0-s2", "g0-s10", "x\u0663y", "x²", "²"]
    location = str(tmp_path / "journal")
    with open_journal(location, writer="w0") as journal:
        for rollout_id in reversed(ordered):
            journal.append_sync([started(rollout_id)])
    with open_replay(location) as source:
        listed = [row.rollout_id for row in list_rollouts(source).rows]
    assert listed == ordered  # '٣' (Arabic-Indic three) is a digit: x٣y sorts as x3y; '²' is not
