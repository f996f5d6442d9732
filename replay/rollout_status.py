"""Where a rollout stands, in one word: the one place every command derives it.

``list``, ``show``, ``status``, the HTML report and their ``--json`` all call
:func:`rollout_status`, so a rollout reads the same everywhere:

- ``damaged``: its events stop applying in order (a record lost or doubled); what it shows stops there;
- ``acknowledged``: the trainer took its result;
- ``finished``: it has a result the trainer has not acknowledged yet;
- ``given up``: its infrastructure failures reached the workload's budget
  (``failure_policy.max_failures``; ``RolloutGivenUp``): terminal, no result, never run again;
- ``failed``: its newest attempt stopped on an infrastructure failure (``RolloutFailed``, never a
  reward) and was not retried yet (a crash came first): a resume retries it, or gives it up;
- ``running``: its newest attempt has not finished: running now, or crashed and not resumed yet.

(``status`` adds ``pending``: a registered rollout the journal holds no event of yet.) A status a
later policy adds goes here, in this order, and in :data:`STATUSES`; the commands' filters and
pages take their choices from there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollout_journal.journal.events import (
    AttemptStarted,
    ModelCall,
    ModelCallProgress,
    ResourceMutation,
    RolloutEvent,
    RolloutFailed,
    RolloutFinished,
    RolloutGivenUp,
    TurnCompleted,
)

if TYPE_CHECKING:  # the command line imports this module to build its parser: keep it light
    from rollout_journal.participants.rollout.state import RolloutProgress

RUNNING, FINISHED, ACKNOWLEDGED, FAILED, DAMAGED = "running", "finished", "acknowledged", "failed", "damaged"
GIVEN_UP = "given up"
STATUSES = (RUNNING, FINISHED, ACKNOWLEDGED, GIVEN_UP, FAILED, DAMAGED)


def rollout_status(progress: RolloutProgress, *, damaged: bool = False) -> str:
    """The status of a rollout whose events folded into ``progress`` (``damaged``: they stopped folding)."""
    if damaged:
        return DAMAGED
    if progress.acknowledged:
        return ACKNOWLEDGED
    if progress.given_up:
        return GIVEN_UP
    if progress.finished:
        return FINISHED
    if progress.failure is not None:
        return FAILED
    return RUNNING


# An attempt "started running" once it journaled work of its own. The first attempt's AttemptStarted
# is written when the rollout is admitted, before it waits for a concurrency slot; one superseded
# before it journaled anything (queued at the crash, or killed before its first call was durable)
# lost nothing, so it is no crash.
WORK_EVENTS: tuple[type, ...] = (ModelCall, ModelCallProgress, ResourceMutation, TurnCompleted, RolloutFailed)


@dataclass
class CrashCount:
    """A rollout's crashes, from its events in log order: attempts a later attempt superseded after
    they started running and before they finished or failed. A fork's first attempt, which only
    copies its origin's turns and stops there by design, is none."""

    crashes: int = 0
    ran: bool = False  # the newest attempt journaled work of its own
    ended: bool = False  # ... and finished or failed
    fork_copy: bool = False  # ... is a fork's first attempt

    def feed(self, event: RolloutEvent) -> None:
        if isinstance(event, AttemptStarted):
            if self.ran and not self.ended and not self.fork_copy:
                self.crashes += 1
            self.ran, self.ended, self.fork_copy = False, False, event.forked_from is not None
        elif isinstance(event, WORK_EVENTS):
            self.ran = True
            self.ended = self.ended or isinstance(event, RolloutFailed)
        elif isinstance(event, (RolloutFinished, RolloutGivenUp)):
            self.ended = True

    @property
    def stopped_unfinished(self) -> bool:
        """The newest attempt ran and has not ended: running now, or crashed and not resumed yet."""
        return self.ran and not self.ended and not self.fork_copy
