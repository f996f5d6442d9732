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

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the command line imports this module to build its parser: keep it light
    from rollout_journal.journal.progress import RolloutProgress

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
