"""The one deadline the polling loops keep: how much is left, clamped for the next blocking call,
and whether it has passed (no clock is faked and no duration is asserted)."""

from __future__ import annotations

from rollout_journal.journal.deadlines import Deadline


def test_a_deadline_an_hour_away_has_not_passed_and_lends_each_call_at_most_what_it_asks() -> None:
    deadline = Deadline(3600)
    assert not deadline.passed()
    assert deadline.left(at_most=0.2) == 0.2
    assert 0 < deadline.left() <= 3600


def test_a_deadline_of_zero_has_passed_and_still_lends_a_last_call_its_minimum() -> None:
    deadline = Deadline(0)
    assert deadline.passed()
    assert deadline.left() == 0.0
    assert deadline.left(at_least=0.1) == 0.1
    deadline.sleep(3600)  # nothing is left: returns at once


def test_a_deadline_in_the_past_leaves_nothing_never_a_negative_timeout() -> None:
    assert Deadline(-5).left() == 0.0
