"""The trainer lag a worker's endpoint shows, without a broker: what counts, from when, until when."""

from __future__ import annotations

from rollout_journal.participants.workload.trainer_lag import AwaitingTrainer


def test_results_awaiting_the_trainer_are_counted_until_acknowledged_or_let_go() -> None:
    """What the two lag gauges read: a result counts from when the worker learned of it until its
    acknowledgement is durable, or its partition goes; one acknowledged before the worker counted
    it (a take still admitting) is never counted."""
    now = [100.0]
    awaiting = AwaitingTrainer(clock=lambda: now[0])
    assert (awaiting.count(), awaiting.oldest_seconds()) == (0, 0.0)
    awaiting.add("a", 0)
    now[0] = 103.0
    awaiting.add("b", 1)
    awaiting.add("a", 0)  # told again: it waits since the first time
    now[0] = 110.0
    assert (awaiting.count(), awaiting.oldest_seconds()) == (2, 10.0)
    awaiting.acknowledged("a", 0)
    assert (awaiting.count(), awaiting.oldest_seconds()) == (1, 7.0)
    awaiting.acknowledged("c", 2)  # before the take that restores it finished counted it
    awaiting.add("c", 2)
    awaiting.add("d", 2)
    awaiting.let_go([1])
    assert (awaiting.count(), awaiting.oldest_seconds()) == (1, 0.0)  # d, since now
    awaiting.let_go([2])
    assert (awaiting.count(), awaiting.oldest_seconds()) == (0, 0.0)
