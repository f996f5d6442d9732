"""The rollout as an aggregate: its state, changed only by ``apply(event)``, and what is built from it.

Every reader folds a rollout's events here, the live path as well as restore, replay, audit and
export, so none can drift from what ran. The room stands on the journal, the schemas and the
resource contract alone (no environment, model or live path), so an offline reader imports it
without what runs a rollout.

- :mod:`.state`: :class:`RolloutProgress` (the bookkeeping every reader keeps) and
  :class:`RolloutState` (the continuation an agent needs), their snapshot bytes, ``restore_state``;
- :mod:`.lineage`: who made each token of the lineage head, and its logprob;
- :mod:`.mutations`: resource mutations as events and as resource records, both ways, and the
  signed heads of their chains;
- :mod:`.snapshot`: a snapshot draft of a state;
- :mod:`.restore`: which snapshot a rollout is restored from, decided once.
"""

from rollout_journal.participants.rollout.lineage import LineageMismatch, TokenLineage, TokenSegment, extended_segments
from rollout_journal.participants.rollout.mutations import head_checkpoint, mutation_event, mutation_record
from rollout_journal.participants.rollout.restore import trusted_restore
from rollout_journal.participants.rollout.snapshot import snapshot_of
from rollout_journal.participants.rollout.state import (
    SNAPSHOT_FORMAT,
    ModelCallView,
    PartialCall,
    RolloutProgress,
    RolloutState,
    StateFoldError,
    full_prompt,
    outcome_of,
    prompt_digest,
    restore_state,
)

__all__ = [
    "SNAPSHOT_FORMAT",
    "LineageMismatch",
    "ModelCallView",
    "PartialCall",
    "RolloutProgress",
    "RolloutState",
    "StateFoldError",
    "TokenLineage",
    "TokenSegment",
    "extended_segments",
    "full_prompt",
    "head_checkpoint",
    "mutation_event",
    "mutation_record",
    "outcome_of",
    "prompt_digest",
    "restore_state",
    "snapshot_of",
    "trusted_restore",
]
