"""Which call, attempt and policy produced each token of a rollout's lineage: see
:mod:`participants.token_lineage` (the live worker labels its training records with the same code)."""

from participants.token_lineage import TokenLineage, TokenSegment

__all__ = ["TokenLineage", "TokenSegment"]
