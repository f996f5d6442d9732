"""Per-rollout summaries: what ``replay list`` reads instead of every event.

Each append of a rollout's events also writes, in the same commit, the rollout's
:class:`~rollout_journal.journal.events.RolloutSummary`: the fold of every event it has
(:class:`SummaryFold`: the bookkeeping ``RolloutProgress``, the ``CrashCount`` and the
number of events), which is exactly what a reader folding all of them finds. The
summaries stream is compacted, so a listing reads about one small record per rollout
whatever the rollouts' lengths, instead of every event.

The key is ``<rollout>/e<epoch>``: a superseded attempt (a zombie still writing after a
newer attempt began) writes under its own, older epoch, and a reader takes the newest
epoch's record, so a zombie's summary never stands for the rollout, wherever it lands in
the log. The attempt that supersedes tombstones the older keys.

The writer must know a rollout's whole history to fold it: it does for a rollout it
starts, and for one it restores (the snapshot it restores from carries the summary
through its ``covers_seq``; the events after it are folded on top, see
:func:`summary_of`). Where it does not (a snapshot written before summaries), it writes
the rollout's summary marked incomplete, and a reader folds that rollout's events
itself: only speed depends on the writer knowing, never what a listing shows.

Only a namespace whose summaries stream was created with it holds a summary of every
rollout: its creator writes :data:`COMPLETE_KEY` there. A reader that does not find it
(a namespace written before summaries) folds every event, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rollout_journal.journal.backend import OutRecord, StoredRecord, Stream, compacted
from rollout_journal.journal.codec import Codec, peek_seq
from rollout_journal.journal.errors import CorruptRecordError, JournalError, RecordLocation
from rollout_journal.journal.events import AttemptStarted, Header, RolloutEvent, RolloutSummary
from rollout_journal.journal.progress import CrashCount, RolloutProgress, StateFoldError
from rollout_journal.journal.whole_numbers import whole_number

if TYPE_CHECKING:
    from rollout_journal.journal.restore import RolloutHistory

log = logging.getLogger(__name__)

EPOCH_MARK = "/e"
COMPLETE_KEY = "/complete"  # on partition 0 of a namespace whose summaries stream began with it
COMPLETE_VALUE = b"every rollout of this namespace has a summary here"

__all__ = [
    "COMPLETE_KEY",
    "SummaryFold",
    "SummaryIndex",
    "load_summaries",
    "summary_key",
    "summary_of",
]


def summary_key(rollout_id: str, epoch: int) -> str:
    return f"{rollout_id}{EPOCH_MARK}{epoch}"


def _parse_key(key: str) -> tuple[str, int] | None:
    rollout_id, mark, text = key.rpartition(EPOCH_MARK)
    epoch = whole_number(text)
    if not mark or not rollout_id or epoch is None:
        return None
    return rollout_id, epoch


@dataclass
class SummaryFold:
    """A rollout's events folded into what a listing shows of it."""

    progress: RolloutProgress
    crashes: CrashCount = field(default_factory=CrashCount)
    events: int = 0
    first_offset: int = -1  # where its first event lies on its events partition (-1: not known)

    @classmethod
    def empty(cls, rollout_id: str, group_id: str) -> SummaryFold:
        return cls(RolloutProgress(rollout_id, group_id))

    def apply(self, event: RolloutEvent) -> None:
        """Raises :class:`StateFoldError` where the events do not apply in order (as a reader's fold would)."""
        self.events += 1
        self.progress.apply(event)
        self.crashes.feed(event)

    def record(self) -> RolloutSummary:
        return RolloutSummary(*self.values())

    def values(self, epoch: int | None = None, complete: bool = True) -> tuple[Any, ...]:
        """The fields of its summary record, in order (what :class:`SummaryWriter` encodes without
        building the record); ``epoch`` and ``complete`` stand in for those of an incomplete one."""
        p, c = self.progress, self.crashes
        return (
            p.rollout_id,
            p.group_id,
            p.epoch if epoch is None else epoch,
            complete,
            p.attempt,
            p.next_turn,
            p.next_seq,
            p.finished,
            p.reward,
            p.acknowledged,
            p.given_up,
            p.restarts,
            p.model_calls,
            p.output_tokens,
            p.mutation_count,
            list(p.policy_versions),  # a copy: the fold goes on appending to its own
            p.topology,
            p.failure,
            p.failures,
            p.progress_tokens,
            p.calls_this_turn,
            c.crashes,
            c.ran,
            c.ended,
            c.fork_copy,
            self.events,
            self.first_offset,
            Header.now_ms(),
        )

    @classmethod
    def of(cls, r: RolloutSummary) -> SummaryFold:
        """The fold a complete summary record holds."""
        progress = RolloutProgress(
            r.rollout_id,
            r.group_id,
            attempt=r.attempt,
            epoch=r.epoch,
            next_turn=r.next_turn,
            next_seq=r.next_seq,
            finished=r.finished,
            reward=r.reward,
            acknowledged=r.acknowledged,
            restarts=r.restarts,
            model_calls=r.model_calls,
            output_tokens=r.output_tokens,
            mutation_count=r.mutation_count,
            policy_versions=list(r.policy_versions),
            topology=r.topology,
            failure=r.failure,
            failures=r.failures,
            given_up=r.given_up,
            progress_tokens=r.progress_tokens,
            calls_this_turn=r.calls_this_turn,
        )
        crashes = CrashCount(r.crashes, r.newest_attempt_ran, r.newest_attempt_ended, r.newest_attempt_forked)
        return cls(progress, crashes, r.events, r.first_offset)


def incomplete_values(rollout_id: str, group_id: str, epoch: int) -> tuple[Any, ...]:
    """The fields of the summary of a rollout whose history its writer does not know: a reader folds
    its events."""
    return SummaryFold.empty(rollout_id, group_id).values(epoch, complete=False)


def incomplete(rollout_id: str, group_id: str, epoch: int) -> RolloutSummary:
    return RolloutSummary(*incomplete_values(rollout_id, group_id, epoch))


class SummaryWriter:
    """The writer's side: each rollout's fold as this writer knows it, and the records an append adds.

    Not thread-safe: the journal calls it under its fence lock."""

    def __init__(self, codec: Codec, max_bytes: int | None = None) -> None:
        self.codec = codec
        self._encode_values = codec.values_encoder(RolloutSummary) or (lambda v: codec.encode(RolloutSummary(*v)))
        # The largest summary record written whole (a record is not chunked): a larger one (a failure
        # carrying a long message) is written incomplete, and a listing folds that rollout's events.
        self.max_bytes = max_bytes
        self._folds: dict[str, SummaryFold | None] = {}  # None: its history is not known here
        self._locating: set[str] = set()  # started here, their first event's offset not yet known

    def note(self, rollout_id: str, fold: SummaryFold | None) -> None:
        """What restore learned of a rollout (None: not enough to fold it)."""
        self._folds[rollout_id] = fold

    def forget(self, rollout_id: str) -> None:
        """An append of it failed: what this writer folded may be ahead of the journal."""
        if rollout_id in self._folds:
            self._folds[rollout_id] = None
        self._locating.discard(rollout_id)

    def drop(self, rollout_ids: Iterable[str]) -> None:
        for rollout_id in list(rollout_ids):
            self._folds.pop(rollout_id, None)
            self._locating.discard(rollout_id)

    def known(self) -> list[str]:
        return list(self._folds)

    def encoded(self, rollout_id: str, covers_seq: int) -> bytes | None:
        """The summary to keep in a snapshot covering events through ``covers_seq``; None unless this
        writer's fold is exactly there."""
        fold = self._folds.get(rollout_id)
        if fold is None or fold.progress.next_seq != covers_seq + 1:
            return None
        encoded = self._encode_values(fold.values())
        return None if self.max_bytes is not None and len(encoded) > self.max_bytes else encoded

    def located(self, records: Sequence[OutRecord], locations: Sequence[RecordLocation]) -> None:
        """``records`` were committed at ``locations``: a rollout's first event (seq 0) tells where
        its events begin, which its next summaries carry."""
        if not self._locating:  # the committer's every commit passes here: most have no rollout to locate
            return
        for record, location in zip(records, locations):
            if record.key not in self._locating or record.stream is not Stream.EVENTS or record.continuation:
                continue
            fold = self._folds.get(record.key)
            if fold is not None and record.value is not None and peek_seq(record.value) == 0:
                fold.first_offset = location.offset
                self._locating.discard(record.key)

    def records(self, events: Sequence[RolloutEvent], earlier_epochs: Iterable[int] = ()) -> list[OutRecord]:
        """Fold ``events`` (one rollout's, in order) and return its summary record, plus tombstones of
        the keys of ``earlier_epochs`` (an attempt that supersedes them)."""
        if not events:
            return []
        first = events[0].header
        rollout_id = first.rollout_id
        fold = self._folds.get(rollout_id)
        if fold is None and _starts_rollout(events[0]):  # seq 0: nothing of it came before
            fold = SummaryFold.empty(rollout_id, first.group_id)
            self._locating.add(rollout_id)
        if fold is not None:
            try:
                for event in events:
                    fold.apply(event)
            except StateFoldError as exc:
                log.warning("rollout %s: its summary is incomplete from here on: %s", rollout_id, exc)
                fold = None
        self._folds[rollout_id] = fold
        epoch = max(e.header.epoch for e in events)
        value = (
            self._encode_values(fold.values())
            if fold is not None
            else self._incomplete(rollout_id, first.group_id, epoch)
        )
        if self.max_bytes is not None and len(value) > self.max_bytes:  # the fold stays: it is right, only large
            log.warning(
                "rollout %s: its summary (%d bytes) is over a record's %d: written incomplete",
                rollout_id,
                len(value),
                self.max_bytes,
            )
            value = self._incomplete(rollout_id, first.group_id, epoch)
        out = [OutRecord(Stream.SUMMARIES, summary_key(rollout_id, epoch), value, rollout_id)]
        out += [
            OutRecord(Stream.SUMMARIES, summary_key(rollout_id, old), None, rollout_id)
            for old in sorted(set(earlier_epochs))
            if old < epoch
        ]
        return out

    def _incomplete(self, rollout_id: str, group_id: str, epoch: int) -> bytes:
        return self._encode_values(incomplete_values(rollout_id, group_id, epoch))


def _starts_rollout(event: RolloutEvent) -> bool:
    h = event.header
    return isinstance(event, AttemptStarted) and h.attempt == 1 and h.seq == 0


def summary_of(codec: Codec, history: RolloutHistory) -> SummaryFold | None:
    """A restored rollout's fold: its snapshot's summary with the events after it, or every event
    from its first when it has no snapshot; None when its snapshot keeps no summary (written before
    summaries) or the events do not fold."""
    loaded = history.snapshot
    if loaded is None:
        events = [item.event for item in history.events]
        if not events:
            return None
        fold = SummaryFold.empty(history.rollout_id, events[0].header.group_id)
        if events[0].header.seq == 0:
            fold.first_offset = history.events[0].location.offset
    else:
        encoded = loaded.snapshot.summary
        if encoded is None:
            return None
        try:
            record = codec.decode(encoded, loaded.location)
        except JournalError as exc:
            log.warning("rollout %s: the summary in its snapshot is unreadable: %s", history.rollout_id, exc)
            return None
        if not isinstance(record, RolloutSummary) or not record.complete:
            return None
        fold = SummaryFold.of(record)
        if fold.first_offset < 0:  # the snapshot was taken before its first event's offset was known
            fold.first_offset = history.first_offset
        events = [item.event for item in history.events]
    try:
        for event in events:
            fold.apply(event)
    except StateFoldError:
        return None
    return fold


@dataclass
class SummaryIndex:
    """What the summaries stream holds: each rollout's newest epoch's summary."""

    complete: bool = False  # the stream began with its namespace: every rollout has a summary here
    summaries: dict[str, RolloutSummary] = field(default_factory=dict)
    errors: list[JournalError] = field(default_factory=list)
    records: int = 0


def load_summaries(codec: Codec, stored: Iterable[StoredRecord]) -> SummaryIndex:
    """Each rollout's newest epoch's summary, from every retained record of the summaries stream;
    unreadable records go to ``errors`` (their rollouts are folded from their events by a listing)."""
    index = SummaryIndex()

    def bad(record: StoredRecord) -> None:
        index.errors.append(CorruptRecordError(record.location, record.error or "unreadable"))

    def counted() -> Iterator[StoredRecord]:
        for record in stored:
            index.records += 1
            yield record

    newest: dict[str, tuple[int, StoredRecord]] = {}
    for key, kept in compacted(counted(), 1, bad).items():
        if key == COMPLETE_KEY:
            index.complete = True
            continue
        parsed = _parse_key(key)
        if parsed is None:
            index.errors.append(CorruptRecordError(kept[-1].location, f"key {key!r} is no summary's"))
            continue
        rollout_id, epoch = parsed
        if rollout_id not in newest or newest[rollout_id][0] < epoch:
            newest[rollout_id] = (epoch, kept[-1])
    for rollout_id, (_, record) in newest.items():
        try:
            assert record.value is not None  # compacted() drops tombstones
            summary = codec.decode(record.value, record.location)
            if not isinstance(summary, RolloutSummary) or summary.rollout_id != rollout_id:
                raise CorruptRecordError(record.location, f"holds no summary of rollout {rollout_id}")
        except JournalError as exc:
            index.errors.append(exc)
            summary = incomplete(rollout_id, "", 0)  # its events tell
        index.summaries[rollout_id] = summary
    return index
