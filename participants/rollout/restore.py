"""Which snapshot a rollout is restored from: decided here, once.

The journal finds each rollout's newest valid snapshot and the events after it
(``rollout_journal.journal.restore``); :func:`restore_state` folds such a history. Whether that
snapshot can be trusted to continue the rollout is the aggregate's call, and two things overrule
it: the caller found its resource exports unusable (they do not import), or the state it holds
was written before the token lineage was kept, which the next turns and the training record of a
rollout still running need. :func:`trusted_restore` applies both, the same way for the first
restore and for every fallback after one.
"""

from __future__ import annotations

from collections.abc import Collection

from rollout_journal.journal.errors import RecordLocation
from rollout_journal.journal.journal import Journal
from rollout_journal.journal.restore import RolloutHistory, history_from_first_event, reload_rollout
from rollout_journal.participants.rollout.state import RolloutState, restore_state

__all__ = ["trusted_restore"]


def trusted_restore(
    journal: Journal,
    history: RolloutHistory,
    group_id: str = "",
    *,
    distrusted: Collection[RecordLocation] = (),
    needs_effects: bool = False,
) -> tuple[RolloutHistory, RolloutState]:
    """The rollout's state from the newest snapshot worth trusting, and the history it was folded from:

    - the newest valid one the journal keeps (``history``, as ``load_rollouts`` found it),
    - but none at ``distrusted`` (their resource exports do not import): the newest other one the
      snapshot stream keeps, down to none;
    - and none (a replay from the rollout's first event) when the one chosen was written before the
      token lineage was kept (or, ``needs_effects``: before the effect log a session replays from
      was) and the rollout has not finished.

    Raises :class:`~rollout_journal.participants.rollout.state.StateFoldError` when the events do not fold.
    """
    if distrusted:
        history = reload_rollout(journal, history.rollout_id, distrusted)
    state = restore_state(history, group_id)
    if not state.finished and (state.lineage is None or (needs_effects and not state.effects.known)):
        history = history_from_first_event(journal, history)
        state = restore_state(history, group_id)
    journal.note_restored(history)  # its summaries go on from here
    return history, state
