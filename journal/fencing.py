"""The rollout-epoch fence, applied by every reader and by the writer.

``AttemptStarted`` with a higher epoch fences every earlier attempt of that
rollout: events of an older epoch whose ``seq`` is at or past the seq the new
attempt resumed from (its ``AttemptStarted``'s) are dropped. (Events of the old
attempt below it stay: they were committed before the new attempt began and are
part of the history it resumes from.) Every attempt counts, not only the newest:
the fence history of the snapshot stream names them all.
This epoch is the rollout's own and is unrelated to Kafka's producer epoch.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollout_journal.journal.errors import RecordLocation
from rollout_journal.journal.events import AttemptStarted, RolloutEvent


@dataclass(frozen=True)
class FencedEventDropped:
    """A reader dropped an event written by a superseded attempt."""

    location: RecordLocation
    rollout_id: str
    epoch: int
    current_epoch: int
    record: str

    def __str__(self) -> str:
        return (
            f"dropped {self.record} of rollout {self.rollout_id} at {self.location}: "
            f"epoch {self.epoch} was fenced by epoch {self.current_epoch}"
        )


class EpochFence:
    """What a reader (or the writer) knows of each rollout's attempts: every epoch it has seen
    start, with the seq its ``AttemptStarted`` took.

    An event of epoch E stands if no later attempt began at or before its seq: it is
    dropped once an attempt with a higher epoch is known whose ``AttemptStarted`` seq is
    at or below the event's. That is the point the later attempt resumed from, so what
    it continued from stays and what the superseded attempt wrote past it goes, after
    any number of further attempts. Attempts are learned from the ``AttemptStarted``
    events read, and ahead of them from the fence history of the snapshot stream
    (which also catches a zombie whose transaction got offsets before the new
    ``AttemptStarted`` but committed after it). An epoch known without its seq (a
    snapshot's) supersedes every older epoch's event.
    """

    def __init__(self) -> None:
        self._epochs: dict[str, int] = {}
        self._starts: dict[str, dict[int, int | None]] = {}  # rollout -> epoch -> its AttemptStarted seq

    def current(self, rollout_id: str) -> int:
        return self._epochs.get(rollout_id, 0)

    def raise_to(self, rollout_id: str, epoch: int, resume_seq: int | None = None) -> None:
        """Know that ``rollout_id`` reached ``epoch``; with ``resume_seq``, the seq that
        attempt's ``AttemptStarted`` took (without, it supersedes older epochs entirely)."""
        self._know(rollout_id, epoch, resume_seq)

    def learn(self, rollout_id: str, starts: dict[int, int]) -> None:
        """Know a rollout's attempts from its fence history: epoch -> seq of its ``AttemptStarted``."""
        for epoch, seq in starts.items():
            self._know(rollout_id, epoch, seq)

    def _know(self, rollout_id: str, epoch: int, seq: int | None) -> None:
        if epoch <= 0:
            return
        starts = self._starts.setdefault(rollout_id, {})
        if starts.get(epoch) is None:
            starts[epoch] = seq
        if epoch > self._epochs.get(rollout_id, 0):
            self._epochs[rollout_id] = epoch

    def forget(self, rollout_id: str) -> None:
        self._epochs.pop(rollout_id, None)
        self._starts.pop(rollout_id, None)

    def admit(self, event: RolloutEvent) -> bool:
        """True if ``event`` stands; an ``AttemptStarted`` makes its epoch known first."""
        header = event.header
        rollout_id = header.rollout_id
        if isinstance(event, AttemptStarted) and header.epoch >= self._epochs.get(rollout_id, 0):
            self._know(rollout_id, header.epoch, header.seq)
            return True
        for epoch, seq in self._starts.get(rollout_id, {}).items():
            if epoch > header.epoch and (seq is None or seq <= header.seq):
                return False
        return True
