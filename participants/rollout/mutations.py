"""Resource mutations as the journal records them, both ways, and the signed heads of their chains.

A resource hands back a :class:`~rollout_journal.participants.resources.MutationRecord` for each
mutation it applied; the journal holds a ``ResourceMutation`` event. :func:`mutation_event` turns
the one into the other for the live path (and for a fork, which applies its origin's mutations
again), :func:`mutation_record` the other way for every reader (restore re-applies them, audit
checks their chain). :func:`head_checkpoint` signs where every chain of a rollout stands.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING

from rollout_journal.journal.events import ChainHead, HeadCheckpoint, Header, ResourceMutation
from rollout_journal.participants.resources import MutationRecord, Resource, canonical_json

if TYPE_CHECKING:  # annotations only: folding events needs no signing key (cryptography) and no cycle
    from rollout_journal.journal.anchoring import HeadSigner
    from rollout_journal.participants.rollout.state import RolloutProgress

__all__ = ["head_checkpoint", "mutation_event", "mutation_record"]


def mutation_event(header: Header, record: MutationRecord) -> ResourceMutation:
    """The journal's event of a mutation a resource applied (its args and result as canonical JSON)."""
    return ResourceMutation(
        header=header,
        resource_id=record.resource_id,
        kind=record.kind,
        op=record.op,
        args_json=canonical_json(record.args),
        idempotency_key=record.idempotency_key,
        prev_revision=record.prev_revision,
        revision=record.revision,
        result_json=canonical_json(record.result),
        state_digest=record.state_digest,
        chain_hash=record.chain_hash,
    )


def mutation_record(event: ResourceMutation) -> MutationRecord:
    """The resource-side record of a journaled mutation (what ``Resource.replay`` takes)."""
    h = event.header
    return MutationRecord(
        resource_id=event.resource_id,
        kind=event.kind,
        op=event.op,
        args=json.loads(event.args_json),
        idempotency_key=event.idempotency_key,
        prev_revision=event.prev_revision,
        revision=event.revision,
        result=json.loads(event.result_json),
        state_digest=event.state_digest,
        chain_hash=event.chain_hash,
        rollout_id=h.rollout_id,
        attempt=h.attempt,
        epoch=h.epoch,
    )


def head_checkpoint(
    signer: HeadSigner, state: RolloutProgress, resources: Mapping[str, Resource], writer: str, turn: int
) -> HeadCheckpoint:
    """The signed chain heads of every resource of a rollout, in this life of it (the agent's
    after a turn's mutations; a fork's after each turn it copies): the next event of ``state``."""
    heads = [ChainHead(rid, r.revision, r.chain_hash) for rid, r in sorted(resources.items())]
    return signer.checkpoint(state.header(writer, turn=turn), state.restarts, heads)
