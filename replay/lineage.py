"""Which call, attempt and policy produced each token of a rollout's lineage: see
:mod:`rollout_journal.participants.rollout.lineage` (the live worker labels its training records with the same code)."""

from rollout_journal.participants.rollout.lineage import TokenLineage, TokenSegment

__all__ = ["TokenLineage", "TokenSegment"]
