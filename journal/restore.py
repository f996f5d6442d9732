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
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace

from rollout_journal.journal.backend import OutRecord
from rollout_journal.journal.deadlines import Deadline
from rollout_journal.journal.errors import RecordLocation, SnapshotsLostError
from rollout_journal.journal.events import WorkloadRegistered
from rollout_journal.journal.journal import Cursor, Journal, JournaledEvent, ReadReport
from rollout_journal.journal.snapshots import RUNNING, Fence, Fences, LoadedSnapshot, load_snapshots

log = logging.getLogger(__name__)

# Reading again a rollout an open transaction held back (see _read_again_while_behind): past the
# backend's transaction_hold_s, the broker's abort scan and its commit markers (a second or so).
_ABORT_MARGIN_S = 2.0
_FIRST_PAUSE_S = 0.05
_LONGEST_PAUSE_S = 1.0


@dataclass
class RolloutHistory:
    """One rollout as the journal holds it: its newest valid snapshot and the events after it."""

    rollout_id: str
    snapshot: LoadedSnapshot | None  # None: replay from the rollout's first event
    events: list[JournaledEvent] = field(default_factory=list)
    fence: Fence | None = None  # its newest attempt, from the snapshot stream
    first_offset: int = -1  # where its first event lies, where the read passed over it (-1: not seen)


@dataclass
class RestorePlan:
    rollouts: dict[str, RolloutHistory]  # every rollout to restore: unfinished, or finished and not acknowledged
    workloads: dict[str, WorkloadRegistered]
    report: ReadReport
    seconds: float
    events_replayed: int
    acknowledged: Fences = field(default_factory=Fences)  # the trainer took these: nothing to restore
    # Tombstones for what no snapshot names any more on the partitions read (``SnapshotIndex.orphans``):
    # the partition's writer commits them (``Journal.discard``), a reader leaves them.
    orphans: list[OutRecord] = field(default_factory=list)


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
    # Rollouts only a bucket names are acknowledged, handled in bulk: a long history has thousands.
    acknowledged = Fences()
    acknowledged.folded = folded = index.fences.only_folded()
    if only is not None:  # a set operation, not a Python step per past rollout
        wanted = folded.keys() & (only if isinstance(only, (set, frozenset)) else set(only))
        acknowledged.folded = folded = {rollout_id: folded[rollout_id] for rollout_id in wanted}
    journal.note_folded(folded)
    for rollout_id in index.snapshots.keys() | index.fences.records.keys():
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
    for rollout_id in _rollouts_only_the_log_names(journal, histories, acknowledged, partitions, index.unaccounted):
        if only is not None and rollout_id not in only:
            continue
        log.warning(
            "rollout %s is missing from the damaged snapshot stream; replaying it from its first event", rollout_id
        )
        histories[rollout_id] = RolloutHistory(rollout_id, None)
        cursors[rollout_id] = Cursor()
    replayed = 0
    first_offsets: dict[str, int] = {}
    for item in journal.read_rollouts(cursors, report, first_offsets):
        histories[item.event.header.rollout_id].events.append(item)
        replayed += 1
    for rollout_id, offset in first_offsets.items():
        histories[rollout_id].first_offset = offset
    replayed += _read_again_while_behind(journal, histories, cursors, report)
    orphans = [r for p, found in sorted(index.orphans.items()) if partitions is None or p in partitions for r in found]
    seconds = time.perf_counter() - started
    return RestorePlan(histories, index.workloads, report, seconds, replayed, acknowledged, orphans)


def _read_again_while_behind(
    journal: Journal, histories: dict[str, RolloutHistory], cursors: Mapping[str, Cursor], report: ReadReport
) -> int:
    """Read the rollouts whose events fall short of their fence again, with a doubling pause, until
    they reach it or the backend's ``transaction_hold_s`` (and a margin) has passed; the events it
    added. Why: the snapshot stream showed a newer attempt's fence, but the event read ended at an
    open transaction another writer began before that attempt committed (a read to the last stable
    offset). By the time the broker has aborted that transaction, the events are readable. A rollout
    still behind then is left as read: the fold sets it aside, naming the fence. ``report`` gains
    only what a pass adds (see :meth:`ReadReport.merge`): a partition whose every rollout was read
    again loses its held-back note once a pass reads it unhindered."""
    behind = _behind_their_fence(histories, cursors)
    hold_s = journal.backend.transaction_hold_s
    if not behind or hold_s <= 0:
        return 0
    log.info(
        "%d rollout(s) read short of their fence (%s): an open transaction may hold their events back; "
        "reading them again for up to %.0f s",
        len(behind),
        ", ".join(sorted(behind)[:5]),
        hold_s + _ABORT_MARGIN_S,
    )
    read_by_partition: dict[int, set[str]] = {}
    for rollout_id in cursors:
        read_by_partition.setdefault(journal.partition_of(rollout_id), set()).add(rollout_id)
    deadline, pause, added = Deadline(hold_s + _ABORT_MARGIN_S), _FIRST_PAUSE_S, 0
    while behind and not deadline.passed():
        deadline.sleep(pause)
        pause = min(2 * pause, _LONGEST_PAUSE_S)
        again = ReadReport()  # a pass reads records the first read reported: the report takes only what is new
        events: dict[str, list[JournaledEvent]] = {rollout_id: [] for rollout_id in behind}
        for item in journal.read_rollouts({rollout_id: cursors[rollout_id] for rollout_id in behind}, again):
            events[item.event.header.rollout_id].append(item)
        for rollout_id, items in events.items():
            added += len(items) - len(histories[rollout_id].events)
            histories[rollout_id].events = items
        reread = set(behind)
        report.merge(again, {p for p, read in read_by_partition.items() if read <= reread})
        behind = _behind_their_fence({rollout_id: histories[rollout_id] for rollout_id in behind}, cursors)
    if behind:
        log.info("%d rollout(s) still short of their fence after reading again: %s", len(behind), sorted(behind))
    return added


def _behind_their_fence(histories: Mapping[str, RolloutHistory], cursors: Collection[str]) -> list[str]:
    """The rollouts read (those in ``cursors``) whose snapshot and events do not reach the epoch of
    their fence: the check the participants' fold makes before it continues a rollout. From its
    newest event back: where the events reach the fence, the last one does, so one look each."""
    behind = []
    for rollout_id, history in histories.items():
        fence = history.fence
        if fence is None or rollout_id not in cursors or fence.epoch <= 0:
            continue
        if history.snapshot is not None and history.snapshot.snapshot.header.epoch >= fence.epoch:
            continue
        if not any(item.event.header.epoch >= fence.epoch for item in reversed(history.events)):
            behind.append(rollout_id)
    return behind


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
    if fence is not None and fence.history:
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
    """Where a rollout's replay starts: after its snapshot (or at its first event), fenced. A fence
    that names no attempt (an acknowledged rollout a bucket names, or one a writer that knew none
    of its attempts acknowledged) fences nothing: which of its events were superseded, it cannot say."""
    cursor = Cursor()
    if fence is not None and not fence.history:
        fence = None
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


def _rollouts_only_the_log_names(
    journal: Journal,
    histories: Collection[str],
    acknowledged: Collection[str],
    partitions: Collection[int] | None,
    unaccounted: Collection[int],
) -> list[str]:
    """When the backend lost part of the snapshot stream (a file journal's missing snapshot
    generation), or a record there that may have been an acknowledgement bucket is unreadable
    (``unaccounted``: its rollouts have neither fence nor snapshot left), the stream no longer
    lists every rollout, but the event log, keyed by rollout, still does: one pass over the keys of
    those partitions, nothing decoded. Such a rollout is replayed from its first event: an
    acknowledged one's events end in its ``RolloutAcknowledged``, so it is known taken, never
    run again; one whose tombstone was lost with the stream has its result offered again."""
    if any(isinstance(damage, SnapshotsLostError) for damage in journal.backend.damage()):
        scan = range(journal.backend.partitions) if partitions is None else sorted(partitions)
    else:
        scan = sorted(p for p in unaccounted if partitions is None or p in partitions)
    if not scan:
        return []
    named: set[str] = set()
    for partition in scan:
        named.update(record.key for record in journal.backend.read_events(partition, 0) if record.error is None)
    return sorted(named - set(histories) - set(acknowledged))
