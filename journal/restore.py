"""Restore, the journal half: what attempt N+1 needs to continue each rollout.

Reads the compacted snapshot stream to its end, then replays, for every
unfinished rollout still in it, only the events after its snapshot. A rollout
whose newest snapshot is final (finished, not yet acknowledged) is taken from
that snapshot alone: its result is in it, and reading from its old cursor
would read everything its partition-mates wrote since. The cost grows with the
number of rollouts in the snapshot stream and the unfinished ones' tails, never
with the whole history. Folding those events into a running
rollout is the participants' job (they know what the state means).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from .events import AttemptStarted
from .journal import Cursor, Journal, JournaledEvent, ReadReport
from .snapshots import RUNNING, Fence, LoadedSnapshot

log = logging.getLogger(__name__)


@dataclass
class RolloutHistory:
    """One rollout as the journal holds it: its newest valid snapshot and the events after it."""

    rollout_id: str
    snapshot: LoadedSnapshot | None  # None: replay from the rollout's first event
    events: list[JournaledEvent] = field(default_factory=list)
    fence: Fence | None = None  # its newest attempt, from the snapshot stream

    @property
    def epoch(self) -> int:
        epochs = [e.event.header.epoch for e in self.events if isinstance(e.event, AttemptStarted)]
        base = self.snapshot.snapshot.header.epoch if self.snapshot else 0
        return max([base, self.fence.epoch if self.fence else 0, *epochs])

    @property
    def attempt(self) -> int:
        attempts = [e.event.header.attempt for e in self.events if isinstance(e.event, AttemptStarted)]
        base = self.snapshot.snapshot.header.attempt if self.snapshot else 0
        return max([base, self.fence.attempt if self.fence else 0, *attempts])


@dataclass
class RestorePlan:
    rollouts: dict[str, RolloutHistory]
    report: ReadReport
    seconds: float
    events_replayed: int


def load_rollouts(journal: Journal, report: ReadReport | None = None) -> RestorePlan:
    """Every rollout still in the snapshot stream, with the events since its snapshot."""
    started = time.perf_counter()
    report = report if report is not None else ReadReport()
    index = journal.snapshots()
    report.errors.extend(index.errors)
    cursors: dict[str, Cursor] = {}
    histories: dict[str, RolloutHistory] = {}
    for rollout_id in index.snapshots.keys() | index.fences.keys():
        loaded, fence = index.snapshots.get(rollout_id), index.fences.get(rollout_id)
        histories[rollout_id] = RolloutHistory(rollout_id, loaded, fence=fence)
        cursor = Cursor()
        if loaded is None:
            log.warning("rollout %s has no valid snapshot left; replaying it from its first event", rollout_id)
        else:
            s = loaded.snapshot
            cursor = Cursor(s.replay_offset, s.covers_seq, s.header.epoch)
        if rollout_id in index.slots:
            journal.note_snapshot_slots(rollout_id, index.slots[rollout_id])
        if fence is not None and fence.epoch > cursor.epoch:  # its AttemptStarted lies ahead of the cursor
            cursor = Cursor(cursor.offset, cursor.after_seq, fence.epoch, resume_seq=fence.seq)
        elif loaded is not None and loaded.snapshot.status != RUNNING:
            continue  # final: nothing of it follows its snapshot, so it must not pin where the read starts
        cursors[rollout_id] = cursor
    replayed = 0
    for item in journal.read_rollouts(cursors, report):
        histories[item.event.header.rollout_id].events.append(item)
        replayed += 1
    for history in histories.values():
        journal.note_epoch(history.rollout_id, history.epoch)
    return RestorePlan(histories, report, time.perf_counter() - started, replayed)
