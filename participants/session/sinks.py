"""Where a session's appends go: the journal, or nowhere (the overhead baseline).

A session hands its events to a sink and waits on the future it returns; the sink is the only
thing that differs between a journaled run and the same run with journaling off, so both run
the one path of :mod:`~rollout_journal.participants.session.api`.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

from rollout_journal.journal.events import RolloutEvent, TrainingRecord
from rollout_journal.journal.group_commit import AppendReceipt
from rollout_journal.journal.journal import Journal
from rollout_journal.journal.snapshots import SnapshotDraft

__all__ = ["JournalSink", "NullSink", "TurnSink", "durable"]

T = TypeVar("T")


class TurnSink(Protocol):
    """Where appended events go: the journal, or nowhere (overhead baseline)."""

    journals: bool  # events are made durable: snapshots are worth building
    snapshot_block_bytes: int  # the journal's (see Journal): 0 where it writes no blocks

    def submit(
        self, events: list[RolloutEvent], snapshot: SnapshotDraft | None, result: TrainingRecord | None = None
    ) -> Future[Any]:
        """Start making the events durable (with a final turn's training record, in the same commit);
        the future resolves once they are (to what is the sink's: callers only wait for it)."""
        ...


class JournalSink:
    journals = True

    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self.snapshot_block_bytes = journal.snapshot_block_bytes

    def submit(
        self, events: list[RolloutEvent], snapshot: SnapshotDraft | None, result: TrainingRecord | None = None
    ) -> Future[AppendReceipt]:
        return self.journal.append(events, snapshot, result)


class NullSink:
    """Journaling off: the same rollout work with nothing made durable and no snapshots built."""

    journals = False
    snapshot_block_bytes = 0

    def submit(
        self, events: list[RolloutEvent], snapshot: SnapshotDraft | None, result: TrainingRecord | None = None
    ) -> Future[None]:
        done: Future[None] = Future()
        done.set_result(None)
        return done


async def durable(future: Future[T]) -> T:
    """The result of a journal future, awaited without blocking the event loop.

    A turn's commit is usually done long before the agent asks (rollouts take turns,
    so a rollout's next turn comes after its siblings' turns): then the result is read
    at once, and the committer thread never has to wake the event loop for it.
    """
    if not future.done():
        await asyncio.wrap_future(future)
    return future.result()
