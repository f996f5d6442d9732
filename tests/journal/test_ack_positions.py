"""``AckPositions``: the acks position a member commits never passes an acknowledgement that is not
durable, and what an earlier round of a partition reports is ignored."""

from __future__ import annotations

from rollout_journal.journal.takeover import AckPositions


def test_the_position_waits_for_the_oldest_acknowledgement_not_yet_durable() -> None:
    positions = AckPositions()
    for offset in (5, 6, 7):
        positions.begin(0, offset)
    now = positions.round_of(0)
    assert positions.durable(0, 6, now) == 5  # 5 failed or is still in flight: not passed
    assert positions.durable(0, 7, now) == 5
    assert positions.durable(0, 5, now) == 8  # applied again, durable: past all three
    positions.begin(1, 0)
    assert positions.durable(1, 0, positions.round_of(1)) == 1  # partitions keep their own order


def test_a_partition_followed_anew_ignores_its_earlier_round() -> None:
    positions = AckPositions()
    old = positions.round_of(0)
    positions.begin(0, 9)
    positions.restart([0])  # revoked and taken again: acks come again from the committed position
    positions.begin(0, 3)
    assert positions.durable(0, 9, old) is None  # a late report of the earlier round moves nothing
    assert positions.durable(0, 3, positions.round_of(0)) == 4
