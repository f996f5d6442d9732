"""The trainer's side of the journal: complete prompt groups, exactly once, as torch tensors.

A worker publishes each finished rollout's :class:`~rollout_journal.journal.events.TrainingRecord`
on the results stream in the same commit as its final turn, so a record exists
exactly when its rollout is durably finished, and an aborted transaction (a
fenced zombie, a crash mid-commit) never reaches the trainer (Kafka
``read_committed``; the file journal's commit markers).

:class:`TrainerFeed` reads that stream and hands on a :class:`PromptGroup` once all
``group_size`` siblings of a group are in. Exactly once across a trainer crash
rests on the trainer, not on consumer-group commits: each group carries a
:class:`FeedPosition` (per partition, where to read again, and the groups already
handed on whose records lie past it). The trainer saves it inside its own
checkpoint, atomically with the weights its step produced; a feed built from a
saved position hands on every group after it and none before it. A trainer killed
after its step but before saving resumes from the previous position and trains
that group again from the same weights: the step is lost with the crash, not
doubled.

Duplicates: a redone final turn cannot publish twice, since the record and the
turn commit together and restore finds a committed final turn finished (it is
offered again, never rerun). The feed still keeps a rollout once per group (the
first record wins), so a repeat within its window is dropped.

A rollout given up after its infrastructure failures (the workload's ``failure_policy``)
publishes a given-up record instead of a result, so its group resolves instead of waiting
forever: once every sibling has a record, a group with a given-up sibling is dropped, not
handed on (:meth:`TrainerFeed.dropped` lists it, with the given-up rollouts). The trainer
never sees a partial group and never trains on a given-up rollout's record (it has no
tokens and no reward). The feed consumes a dropped group like a handed-on one: the
position moves past its records, and with an acknowledger its rollouts are acknowledged
at once (nothing is trained on them, so no step has to be durable first), so a resumed
workload never offers them again. With ``failure_policy.group: redispatch`` the workload
also runs a replacement group on the same task, which arrives under its own id
(``<group>r<k>``) like any other group.

After a step is durable, :meth:`TrainerFeed.acknowledge` journals
``RolloutAcknowledged`` for the group's rollouts and tombstones their snapshots (the
runner's acknowledgement records), so a resumed workload never offers them again. On Kafka
the trainer never writes a worker's partitions: each acknowledgement is one record on
``<namespace>.acks`` (idempotent, no transaction, so it can never hold an owner's restore back),
and the rollout's partition owner applies it in its own transaction; with no owner running it
waits there for the next one.
A position names the rollouts handed on but not yet acknowledged, so a trainer
killed between saving its checkpoint and acknowledging has a successor that
acknowledges them (those the journal does not show acknowledged already).
"""

from __future__ import annotations

import json
import logging
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollout_journal.journal.backend import Backend, StoredRecord
from rollout_journal.journal.errors import ConfigurationError, JournalError, RecordLocation
from rollout_journal.journal.events import RECORD_GIVEN_UP, FenceEntry, TrainingRecord
from rollout_journal.journal.journal import AppendReceipt, Journal
from rollout_journal.journal.results import PublishedResult, ResultsDecoder, ResultsFollower, follow_results
from rollout_journal.participants.rollout.state import RolloutProgress

log = logging.getLogger(__name__)

__all__ = ["DroppedGroup", "FeedPosition", "PromptGroup", "TrainerFeed", "WaitingGroup"]

# A rollout a trainer took, as a feed position keeps it until acknowledged: its RolloutFinished
# header's (rollout_id, group_id, attempt, epoch, turn, seq) and its fence history, each entry a
# FenceEntry's (attempt, epoch, seq, writer, ts_ms).
AckEntry = tuple[str, str, int, int, int, int, tuple[tuple[int, int, int, str, int], ...]]


@dataclass(frozen=True)
class FeedPosition:
    """Where a trainer's feed stands: save it in the trainer's checkpoint with the step.

    ``offsets``: per partition, the offset to read from again (the first record of a group not
    yet handed on, else the end of what was read). ``delivered``: groups handed on whose
    records lie at or past those offsets, so a resumed feed skips them."""

    offsets: dict[int, int] = field(default_factory=dict)
    delivered: frozenset[str] = frozenset()
    # Rollouts handed on and not yet acknowledged when the position was taken: a feed built from it
    # acknowledges those its journal does not show acknowledged (a trainer killed between saving its
    # checkpoint and acknowledging). Each: the RolloutFinished header's fields and the fence history.
    unacknowledged: tuple[AckEntry, ...] = ()

    def to_json(self) -> str:
        return json.dumps(
            {
                "offsets": {str(p): o for p, o in sorted(self.offsets.items())},
                "delivered": sorted(self.delivered),
                "unacknowledged": [list(u) for u in self.unacknowledged],
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str) -> FeedPosition:
        try:
            doc = json.loads(text)
            unacked = tuple((*u[:6], tuple(tuple(a) for a in u[6])) for u in doc.get("unacknowledged", []))
            return cls({int(p): int(o) for p, o in doc["offsets"].items()}, frozenset(doc["delivered"]), unacked)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            raise ConfigurationError(
                f"a trainer feed position must be what FeedPosition.to_json wrote; got {text[:80]!r} ({exc})"
            ) from None


@dataclass
class PromptGroup:
    """Every sibling of one prompt group, ordered by rollout id, and the feed position after it."""

    group_id: str
    records: list[TrainingRecord]
    position: FeedPosition

    @property
    def rollout_ids(self) -> list[str]:
        return [r.rollout_id for r in self.records]

    @property
    def rewards(self) -> list[float]:
        return [float("nan") if r.reward is None else float(r.reward) for r in self.records]

    def tensors(self, pad_id: int = 0) -> dict[str, Any]:
        """The group as one right-padded batch: ``input_ids`` int64 [G, T], ``logprobs`` float32
        [G, T], ``loss_mask`` and ``attention_mask`` bool [G, T], ``rewards`` float32 [G],
        ``policy_versions`` (per rollout, the versions that sampled its tokens). One rollout's
        own tensors, with its per-segment labels: ``group.records[i].tensors()``."""
        import torch

        split = [r.rollout_id for r in self.records if len(r.sequence_starts)]
        if split:
            raise ValueError(
                f"group {self.group_id}: rollouts {', '.join(split)} hold several token sequences "
                "(model.history_policy new_sequence): one row each would attend across them; "
                "take them per record (record.sequence_bounds(), tensors()['sequence_id'])"
            )
        n = len(self.records)
        width = max((len(r.input_ids) for r in self.records), default=0)
        input_ids = np.full((n, width), pad_id, dtype=np.int64)
        logprobs = np.zeros((n, width), dtype=np.float32)
        loss_mask = np.zeros((n, width), dtype=bool)
        attention = np.zeros((n, width), dtype=bool)
        for i, r in enumerate(self.records):
            k = len(r.input_ids)
            input_ids[i, :k], logprobs[i, :k], loss_mask[i, :k], attention[i, :k] = (
                r.input_ids,
                r.logprobs,
                r.loss_mask,
                True,
            )
        return {
            "group_id": self.group_id,
            "rollout_ids": self.rollout_ids,
            "input_ids": torch.from_numpy(input_ids),
            "logprobs": torch.from_numpy(logprobs),
            "loss_mask": torch.from_numpy(loss_mask),
            "attention_mask": torch.from_numpy(attention),
            "rewards": torch.tensor(self.rewards, dtype=torch.float32),
            "policy_versions": [sorted({s.policy_version for s in r.token_segments}) for r in self.records],
        }


@dataclass(frozen=True)
class WaitingGroup:
    """A group the feed holds back, its siblings not all in: each record of it pins where a resumed
    feed starts on its partition (results are keyed by rollout, so a group spans partitions), so
    one that never completes (a sibling failed for good, or set aside) makes a restarted trainer
    reread everything after them. What an operator needs to find the missing."""

    group_id: str
    size: int  # siblings the group needs
    arrived: tuple[str, ...]  # rollout ids of those in, sorted
    first: RecordLocation  # where its first record read lies
    locations: tuple[RecordLocation, ...]  # where each of ``arrived`` lies, in that order

    @property
    def missing(self) -> int:
        return self.size - len(self.arrived)


@dataclass(frozen=True)
class DroppedGroup:
    """A group the feed resolved without handing it on: a sibling was given up. Its records were
    consumed (the position moved past them; acknowledged, with an acknowledger)."""

    group_id: str
    rollout_ids: tuple[str, ...]  # every sibling, sorted
    given_up: tuple[str, ...]  # those given up, sorted
    locations: tuple[RecordLocation, ...]  # where each of ``rollout_ids``' records lies, in that order


def given_up(record: TrainingRecord) -> bool:
    """Whether a results record is a given-up rollout's (no tokens, no reward), not a result."""
    # TrainingRecord.v2 says so (status); a v1 record by finished=False, as only a given-up
    # rollout publishes an unfinished record on the results stream
    return record.status == RECORD_GIVEN_UP or not record.finished


@dataclass
class _Pending:
    results: dict[str, PublishedResult] = field(default_factory=dict)  # rollout -> its record
    size: int = 0


class TrainerFeed:
    """Complete prompt groups from a journal's results stream, exactly once with the trainer's
    checkpoint. Not thread-safe: one trainer loop reads it."""

    def __init__(
        self,
        backend: Backend,
        position: FeedPosition | None = None,
        *,
        acknowledger: Journal | None = None,
        trainer: str = "trainer",
        follower: ResultsFollower | None = None,
    ) -> None:
        """``backend``: the journal opened for reading (``open_backend(location, read_only=True)``).
        ``position``: what the trainer's checkpoint saved (None: the stream's start).
        ``acknowledger``: a journal this trainer may write acknowledgements through (Kafka: any
        writable one, ``open_journal(url, mode="plain")`` is enough: the requests go to
        ``<namespace>.acks``; a file journal: the worker's own, in its process)."""
        self.backend = backend
        start = position or FeedPosition()
        self._follower = follower or follow_results(backend, start.offsets)
        self._decoder = ResultsDecoder()
        self._read_to: dict[int, int] = {p: start.offsets.get(p, 0) for p in range(backend.partitions)}
        self._pending: dict[str, _Pending] = {}
        # Handed on before the checkpoint, their records (some) ahead: how many of them met again.
        self._skip: dict[str, int] = dict.fromkeys(start.delivered, 0)
        self._handed: set[str] = set(start.delivered)  # every group this feed handed on (or was told of)
        self._delivered: set[str] = set(start.delivered)  # handed on, with records at or past the offsets
        # Per partition: offsets of pending records (in read order, so ascending), and those handed on since.
        self._pending_offsets: dict[int, deque[int]] = {p: deque() for p in range(backend.partitions)}
        self._released: set[tuple[int, int]] = set()
        # Per partition, every record read at or past the offsets a position would name: (offset, group).
        self._window: dict[int, deque[tuple[int, str]]] = {p: deque() for p in range(backend.partitions)}
        self._in_window: Counter[str] = Counter()
        self._ready: deque[PromptGroup] = deque()
        self._unacked: dict[str, list[AckEntry]] = {}  # group -> its rollouts' acknowledgement entries
        self._dropped: list[DroppedGroup] = []
        self.acknowledger = acknowledger
        self.trainer = trainer
        self.records_read = 0
        self.duplicates_dropped = 0
        self.reacknowledged: list[str] = []  # rollouts the previous trainer took but never acknowledged
        if start.unacknowledged and acknowledger is not None:
            self._acknowledge_left_over(start.unacknowledged)

    @property
    def errors(self) -> list[JournalError]:
        """Results records that did not decode (logged; the feed read past them)."""
        return self._decoder.errors

    def poll(self, timeout_s: float = 1.0) -> PromptGroup | None:
        """The next complete group, waiting up to ``timeout_s`` for records; None if none completed."""
        if not self._ready:
            self._take(self._follower.poll(timeout_s))
        return self._ready.popleft() if self._ready else None

    def groups(
        self, limit: int | None = None, idle_timeout_s: float | None = None, poll_s: float = 0.5
    ) -> Iterator[PromptGroup]:
        """Complete groups as they come: ``limit`` of them, or until nothing completes for
        ``idle_timeout_s`` (None: forever)."""
        handed, idle = 0, 0.0
        while limit is None or handed < limit:
            group = self.poll(poll_s)
            if group is None:
                idle += poll_s
                if idle_timeout_s is not None and idle >= idle_timeout_s:
                    return
                continue
            idle = 0.0
            handed += 1
            yield group

    def _take(self, stored: list[StoredRecord]) -> None:
        for record in stored:
            self.records_read += 1
            published = self._decoder.add(record)
            p = record.location.partition
            self._read_to[p] = max(self._read_to.get(p, 0), record.location.offset + 1)
            if published is None:
                continue
            result, group_id, offset = published.record, published.record.group_id, published.location.offset
            self._window[p].append((offset, group_id))
            self._in_window[group_id] += 1
            if group_id in self._skip:  # handed on before the checkpoint
                self._skip[group_id] += 1
                if self._skip[group_id] >= result.group_size:
                    del self._skip[group_id]  # every record of it met again: its window closes as any other's
                continue
            if group_id in self._handed:
                self.duplicates_dropped += 1
                self._delivered.add(group_id)  # a resumed feed must step over this repeat too
                continue
            pending = self._pending.setdefault(group_id, _Pending(size=result.group_size))
            if result.rollout_id in pending.results:
                self.duplicates_dropped += 1
                continue
            pending.results[result.rollout_id] = published
            self._pending_offsets[p].append(offset)
            if len(pending.results) >= max(1, pending.size):
                self._complete(group_id)

    def _complete(self, group_id: str) -> None:
        """Every sibling of the group has a record: hand it on, or drop it if one was given up."""
        pending = self._pending.pop(group_id)
        self._released.update((r.location.partition, r.location.offset) for r in pending.results.values())
        self._delivered.add(group_id)
        self._handed.add(group_id)
        records = [pending.results[rid].record for rid in sorted(pending.results)]
        lost = tuple(r.rollout_id for r in records if given_up(r))
        if lost:
            where = tuple(pending.results[r.rollout_id].location for r in records)
            self._dropped.append(DroppedGroup(group_id, tuple(r.rollout_id for r in records), lost, where))
            log.warning("group %s dropped: its rollouts %s were given up", group_id, ", ".join(lost))
            if self.acknowledger is not None:
                self._acknowledge_dropped([_ack_entry(r) for r in records])
            return
        if self.acknowledger is not None:  # without one there is nothing a successor could acknowledge
            self._unacked[group_id] = [_ack_entry(r) for r in records]
        self._ready.append(PromptGroup(group_id, records, self.position()))

    def dropped(self) -> list[DroppedGroup]:
        """The groups dropped so far because a sibling was given up, in the order they resolved."""
        return list(self._dropped)

    def waiting(self) -> list[WaitingGroup]:
        """The groups read but not complete yet, in the order their first records were read."""
        groups = []
        for group_id, pending in self._pending.items():
            arrived = tuple(sorted(pending.results))
            first = next(iter(pending.results.values())).location  # results keep the order they were read in
            groups.append(
                WaitingGroup(
                    group_id, pending.size, arrived, first, tuple(pending.results[rid].location for rid in arrived)
                )
            )
        return groups

    def position(self) -> FeedPosition:
        """Where a feed built now would resume: before every record of a group not yet handed on
        (and every piece of a record still being joined), after everything else; the groups handed
        on whose records lie past that. Costs the records that fell behind since the last call."""
        offsets = dict(self._read_to)
        joining = self._decoder.joining()
        for p, pending in self._pending_offsets.items():
            while pending and (p, pending[0]) in self._released:  # handed on: no longer pins the partition
                self._released.discard((p, pending.popleft()))
            if pending:
                offsets[p] = min(offsets[p], pending[0])
            if p in joining:
                offsets[p] = min(offsets[p], joining[p])
            window = self._window[p]
            while window and window[0][0] < offsets[p]:  # a resumed feed never reads these again
                group_id = window.popleft()[1]
                self._in_window[group_id] -= 1
                if not self._in_window[group_id]:
                    del self._in_window[group_id]
                    if group_id not in self._skip:
                        self._delivered.discard(group_id)
        unacked = tuple(entry for entries in self._unacked.values() for entry in entries)
        return FeedPosition(offsets, frozenset(self._delivered), unacked)

    def acknowledge(self, group: PromptGroup) -> list[Future[AppendReceipt]]:
        """Journal that the trainer took ``group`` (call once its step is durable): per rollout,
        ``RolloutAcknowledged`` after its ``RolloutFinished``, its snapshots tombstoned, its fence
        marked. Returns the appends' futures."""
        if self.acknowledger is None:
            raise ConfigurationError(
                "this TrainerFeed has no acknowledger: pass acknowledger=Journal(...) (Kafka: "
                "opened with a transactional id of the trainer's own) to acknowledge groups"
            )
        futures = [self._acknowledge(entry) for entry in map(_ack_entry, group.records)]
        self._unacked.pop(group.group_id, None)
        return futures

    def _acknowledge(self, entry: AckEntry) -> Future[AppendReceipt]:
        rollout_id, group_id, attempt, epoch, turn, seq, attempts = entry
        # where the rollout stands after its RolloutFinished: the acknowledgement follows it
        after = RolloutProgress(rollout_id, group_id, attempt, epoch, next_turn=turn, next_seq=seq + 1)
        assert self.acknowledger is not None
        event = after.acknowledgement(self.trainer, self.trainer)
        return self.acknowledger.request_acknowledgement(event, attempts=[FenceEntry(*a) for a in attempts])

    def _acknowledge_dropped(self, entries: list[AckEntry]) -> None:
        """Acknowledge a dropped group's rollouts, unless the journal shows them done: a feed
        resumed from a position before the group drops it again, and a second
        ``RolloutAcknowledged`` would repeat a sequence number."""
        assert self.acknowledger is not None
        fences = self.acknowledger.snapshots({self.acknowledger.partition_of(e[0]) for e in entries}).fences
        for future in [self._acknowledge(e) for e in entries if not (e[0] in fences and fences[e[0]].acknowledged)]:
            future.result()

    def _acknowledge_left_over(self, entries: tuple[AckEntry, ...]) -> None:
        """Acknowledge what the saved position says was taken, unless the journal shows it done:
        a second ``RolloutAcknowledged`` would repeat a sequence number."""
        assert self.acknowledger is not None
        fences = self.acknowledger.snapshots({self.acknowledger.partition_of(e[0]) for e in entries}).fences
        todo = [e for e in entries if not (e[0] in fences and fences[e[0]].acknowledged)]
        for future in [self._acknowledge(e) for e in todo]:
            future.result()
        self.reacknowledged = [e[0] for e in todo]
        if todo:
            log.info(
                "acknowledged %d rollouts the previous trainer took but did not acknowledge: %s",
                len(todo),
                ", ".join(self.reacknowledged),
            )

    def close(self) -> None:
        self._follower.close()

    def __enter__(self) -> TrainerFeed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _ack_entry(r: TrainingRecord) -> AckEntry:
    h = r.header
    return (
        h.rollout_id,
        h.group_id,
        h.attempt,
        h.epoch,
        h.turn,
        h.seq,
        tuple((a.attempt, a.epoch, a.seq, a.writer, a.ts_ms) for a in r.attempts),
    )
