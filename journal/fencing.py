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
    """Current epoch per rollout, as established by ``AttemptStarted`` events."""

    def __init__(self) -> None:
        self._epochs: dict[str, int] = {}

    def current(self, rollout_id: str) -> int:
        return self._epochs.get(rollout_id, 0)

    def raise_to(self, rollout_id: str, epoch: int) -> None:
        if epoch > self._epochs.get(rollout_id, 0):
            self._epochs[rollout_id] = epoch

    def admit(self, event: RolloutEvent) -> bool:
        """True if ``event`` stands; an ``AttemptStarted`` raises the fence first."""
        header = event.header
        current = self._epochs.get(header.rollout_id, 0)
        if isinstance(event, AttemptStarted) and header.epoch > current:
            self._epochs[header.rollout_id] = header.epoch
            return True
        return header.epoch >= current
