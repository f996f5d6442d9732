"""``replay list``'s row order (``rollout_journal.replay.listing``): rollout id order, numbers
compared as numbers, the same whatever order the rollouts were written or read in, and for any
rollout id a journal accepts."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_journal.journal.events import AttemptStarted, Header, Message
from rollout_journal.journal.open import open_journal
from rollout_journal.replay.listing import list_rollouts
from rollout_journal.replay.source import open_replay


def started(location: str, ids: list[str]) -> None:
    with open_journal(location, writer="w0") as journal:
        for rid in ids:
            header = Header(rid, f"{rid}-group", 1, 1, 0, 0, Header.now_ms(), "test")
            journal.append_sync([AttemptStarted(header, 0, "topology", "new rollout", [Message("user", "task")])])


def listed(location: str) -> list[str]:
    with open_replay(location) as source:
        return [row.rollout_id for row in list_rollouts(source, scan=True).rows]


@pytest.mark.parametrize(
    "ids",
    [
        ["g01", "g1"],  # leading zeros: the same number
        ["g1", "g\u0661"],  # an ASCII and an Arabic-Indic one: both the number 1
        ["r-0", "r-00", "r-000"],
    ],
    ids=["leading-zeros", "arabic-indic", "zeros"],
)
def test_ids_of_one_number_are_listed_in_one_order_whatever_was_written_first(tmp_path: Path, ids: list[str]) -> None:
    """Two ids whose numbers are equal come in one order, not in the order they were read (a scan
    reads in log order, the summaries in the consumer's)."""
    forward, backward = str(tmp_path / "forward"), str(tmp_path / "backward")
    started(forward, ids)
    started(backward, list(reversed(ids)))
    assert listed(forward) == listed(backward)


@pytest.mark.parametrize(
    "ids",
    [
        ["run1\u00b22-g0-s0", "run1-g0-s0"],  # a superscript two: str.isdigit() is True, int() refuses it
        ["\u2460", "1"],  # a circled one
        ["n" + "7" * 5000, "n8"],  # more digits than int() converts by default
        ["", "a", "1", "a1", "1a", "\u00b2", "\u0663", "\U0001d7d9"],
    ],
    ids=["superscript", "circled", "long-number", "mixed"],
)
def test_any_rollout_id_is_listed(tmp_path: Path, ids: list[str]) -> None:
    location = str(tmp_path / "j")
    started(location, ids)
    assert sorted(listed(location)) == sorted(ids)


def test_numbers_are_compared_as_numbers_however_long(tmp_path: Path) -> None:
    location = str(tmp_path / "j")
    ids = ["n10", "n" + "9" * 5000, "n9", "n010", "m", "n"]
    started(location, ids)
    assert listed(location) == ["m", "n", "n9", "n010", "n10", "n" + "9" * 5000]
