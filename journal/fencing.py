"""The rollout-epoch fence, applied by every reader and by the writer.

``AttemptStarted`` with a higher epoch fences every earlier attempt of that
rollout: events of an older epoch that follow it in log order are dropped.
(Events of the old attempt that precede the fence stay: they were committed
before the new attempt began and are part of the history it resumes from.)
This epoch is the rollout's own and is unrelated to Kafka's producer epoch.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import RecordLocation
from .events import AttemptStarted, RolloutEvent


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
    """Current epoch per rollout, as established by ``AttemptStarted`` events.

    A fence can also be known before its ``AttemptStarted`` is read (restore
    learns it from the snapshot stream): then an older-epoch event is history
    only if its ``seq`` precedes the point the new attempt resumed from. That
    also catches a zombie whose transaction committed after the new attempt
    began but got offsets before its ``AttemptStarted``.
    """

    def __init__(self) -> None:
        self._epochs: dict[str, int] = {}
        self._resume_seq: dict[str, int] = {}  # fences known ahead of their AttemptStarted in the log

    def current(self, rollout_id: str) -> int:
        return self._epochs.get(rollout_id, 0)

    def raise_to(self, rollout_id: str, epoch: int, resume_seq: int | None = None) -> None:
        """Fence ``rollout_id`` at ``epoch``; with ``resume_seq``, the fence's
        ``AttemptStarted`` (at that seq) is still ahead in log order."""
        if epoch > self._epochs.get(rollout_id, 0):
            self._epochs[rollout_id] = epoch
            if resume_seq is None:
                self._resume_seq.pop(rollout_id, None)
            else:
                self._resume_seq[rollout_id] = resume_seq

    def admit(self, event: RolloutEvent) -> bool:
        """True if ``event`` stands; an ``AttemptStarted`` raises the fence first."""
        header = event.header
        rollout_id = header.rollout_id
        current = self._epochs.get(rollout_id, 0)
        if isinstance(event, AttemptStarted) and header.epoch >= current:
            self._epochs[rollout_id] = header.epoch
            self._resume_seq.pop(rollout_id, None)  # the fence itself is here: from now on, strictly
            return True
        if header.epoch >= current:
            return True
        resume_seq = self._resume_seq.get(rollout_id)
        return resume_seq is not None and header.seq < resume_seq
