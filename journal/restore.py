"""Restore, the journal half: what attempt N+1 needs to continue each rollout.

Reads the compacted snapshot stream to its end, then replays, for every
unfinished rollout still in it, only the events after its snapshot. A rollout
whose newest snapshot is final (finished, not yet acknowledged) is taken from
that snapshot alone: its result is in it, and reading from its old cursor
would read everything its partition-mates wrote since. The cost grows with the
number of rollouts in the snapshot stream and the unfinished ones' tails, never
with the whole history. Folding those events into a running
rollout is the participants' job (they know what the state means), and so is
deciding that a snapshot cannot be trusted after all: :func:`reload_rollout`
and :func:`history_from_first_event` are the means that decision uses.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from dataclasses import dataclass, field, replace

from rollout_journal.journal.errors import RecordLocation, SnapshotsLostError
from rollout_journal.journal.events import WorkloadRegistered
from rollout_journal.journal.journal import Cursor, Journal, JournaledEvent, ReadReport
from rollout_journal.journal.snapshots import RUNNING, Fence, LoadedSnapshot, load_snapshots

log = logging.getLogger(__name__)


@dataclass
class RolloutHistory:
    """One rollout as the journal holds it: its newest valid snapshot and the events after it."""

    rollout_id: str
    snapshot: LoadedSnapshot | None  # None: replay from the rollout's first event
    events: list[JournaledEvent] = field(default_factory=list)
    fence: Fence | None = None  # its newest attempt, from the snapshot stream


@dataclass
class RestorePlan:
    rollouts: dict[str, RolloutHistory]  # every rollout to restore: unfinished, or finished and not acknowledged
    workloads: dict[str, WorkloadRegistered]
    report: ReadReport
    seconds: float
    events_replayed: int
    acknowledged: dict[str, Fence] = field(default_factory=dict)  # the trainer took these: nothing to restore


def load_rollouts(
    journal: Journal,
    report: ReadReport | None = None,
    *,
    partitions: Collection[int] | None = None,
    only: Collection[str] | None = None,
) -> RestorePlan:
    """Every rollout still in the snapshot stream (on ``partitions`` only, if given: what a fleet's
    worker owns; of the rollouts ``only`` names, if given: the workloads it knows), with the events
    since its snapshot. The journal's writer learns each loaded rollout's fence and snapshot slots."""
    started = time.perf_counter()
    report = report if report is not None else ReadReport()
    index = journal.snapshots(partitions)
    report.errors.extend(index.errors)
    cursors: dict[str, Cursor] = {}
    histories: dict[str, RolloutHistory] = {}
    acknowledged: dict[str, Fence] = {}
    for rollout_id in index.snapshots.keys() | index.fences.keys():
        if only is not None and rollout_id not in only:
            continue
        loaded, fence = index.snapshots.get(rollout_id), index.fences.get(rollout_id)
        if fence is not None:
            journal.note_fence(rollout_id, fence)
        if fence is not None and fence.acknowledged:
            acknowledged[rollout_id] = fence
            continue
        histories[rollout_id] = RolloutHistory(rollout_id, loaded, fence=fence)
        if rollout_id in index.slots:
            journal.note_snapshot_slots(rollout_id, index.slots[rollout_id])
        if _final(loaded, fence):
            continue  # nothing of it follows its snapshot, so it must not pin where the read starts
        cursors[rollout_id] = _cursor(rollout_id, loaded, fence)
    for rollout_id in _rollouts_only_the_log_names(journal, set(histories) | set(acknowledged), partitions):
        if only is not None and rollout_id not in only:
            continue
        log.warning(
            "rollout %s is missing from the damaged snapshot stream; replaying it from its first event", rollout_id
        )
        histories[rollout_id] = RolloutHistory(rollout_id, None)
        cursors[rollout_id] = Cursor()
    replayed = 0
    for item in journal.read_rollouts(cursors, report):
        histories[item.event.header.rollout_id].events.append(item)
        replayed += 1
    return RestorePlan(histories, index.workloads, report, time.perf_counter() - started, replayed, acknowledged)


def reload_rollout(
    journal: Journal, rollout_id: str, exclude: Collection[RecordLocation], report: ReadReport | None = None
) -> RolloutHistory:
    """One rollout's history as :func:`load_rollouts` finds it, with the snapshots at ``exclude``
    left out: restore found them unusable (their state does not import), so it falls back to
    the previous snapshot the stream keeps, or to a replay from the rollout's first event."""
    kept = (record for record in journal.backend.read_snapshots() if record.location not in exclude)
    index = load_snapshots(journal.codec, kept)
    loaded, fence = index.snapshots.get(rollout_id), index.fences.get(rollout_id)
    history = RolloutHistory(rollout_id, loaded, fence=fence)
    history.events = list(journal.read_rollout(rollout_id, _cursor(rollout_id, loaded, fence), report))
    return history


def history_from_first_event(
    journal: Journal, history: RolloutHistory, report: ReadReport | None = None
) -> RolloutHistory:
    """``history`` without its snapshot: every event of the rollout from its first, fenced (a
    snapshot written by an older version lacks what the rollout's next turns need)."""
    cursor = Cursor()
    fence = history.fence
    if fence is not None:
        cursor = Cursor(0, -1, fence.epoch, resume_seq=fence.seq, history=tuple(fence.starts().items()))
    events = list(journal.read_rollout(history.rollout_id, cursor, report))
    return RolloutHistory(history.rollout_id, None, events, fence)


def _final(loaded: LoadedSnapshot | None, fence: Fence | None) -> bool:
    """A finished rollout's last snapshot holds its result: no event of it follows, unless
    a newer attempt (a fence of a later epoch) started after it."""
    if loaded is None or loaded.snapshot.status == RUNNING:
        return False
    return fence is None or fence.epoch <= loaded.snapshot.header.epoch


def _cursor(rollout_id: str, loaded: LoadedSnapshot | None, fence: Fence | None) -> Cursor:
    """Where a rollout's replay starts: after its snapshot (or at its first event), fenced."""
    cursor = Cursor()
    if loaded is None:
        log.warning("rollout %s has no valid snapshot left; replaying it from its first event", rollout_id)
    else:
        s = loaded.snapshot
        cursor = Cursor(s.replay_offset, s.covers_seq, s.header.epoch)
    if fence is not None and fence.epoch > cursor.epoch:  # its AttemptStarted lies ahead of the cursor
        cursor = Cursor(cursor.offset, cursor.after_seq, fence.epoch, resume_seq=fence.seq)
    if fence is not None:
        cursor = replace(cursor, history=tuple(fence.starts().items()))
    return cursor


def _rollouts_only_the_log_names(journal: Journal, known: set[str], partitions: Collection[int] | None) -> list[str]:
    """When the backend lost part of the snapshot stream (a file journal's missing snapshot
    generation), the stream no longer lists every rollout, but the event log, keyed by
    rollout, still does: one pass over the keys, nothing decoded. An acknowledged rollout is
    found too (its tombstone was lost with the stream), so its result is offered again
    rather than the rollout run from scratch."""
    if not any(isinstance(damage, SnapshotsLostError) for damage in journal.backend.damage()):
        return []
    named: set[str] = set()
    for partition in range(journal.backend.partitions) if partitions is None else sorted(partitions):
        named.update(record.key for record in journal.backend.read_events(partition, 0) if record.error is None)
    return sorted(named - known)
