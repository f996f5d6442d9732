"""What a mutation carries (:class:`MutationRequest`), what the journal keeps of it
(:class:`MutationRecord`), and the per-resource hash chain over those records."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from rollout_journal.participants.resources.canonical import canonical_json, sha256_hex
from rollout_journal.participants.resources.errors import ChainBrokenError, MalformedRecordError

__all__ = ["MutationRecord", "MutationRequest", "genesis_hash", "link_hash", "verify_chain"]


@dataclass(frozen=True)
class MutationRequest:
    """What a rollout sends with every mutation; built by the agent for each call."""

    rollout_id: str
    attempt: int
    epoch: int
    idempotency_key: str
    expected_revision: int


@dataclass(frozen=True)
class MutationRecord:
    """What the journal stores for one applied mutation (args redacted, JSON-clean).

    Treat it as immutable: the same object is handed back for a replayed key.
    """

    resource_id: str
    kind: str
    op: str
    args: dict[str, Any]
    idempotency_key: str
    prev_revision: int
    revision: int
    result: dict[str, Any]
    state_digest: str
    chain_hash: str
    rollout_id: str
    attempt: int
    epoch: int

    def chain_payload(self) -> dict[str, Any]:
        """The record minus its chain hash: what the chain link hashes."""
        payload = self.to_dict()
        del payload["chain_hash"]
        return payload

    def to_dict(self) -> dict[str, Any]:
        """The fields as a new dict; ``args`` and ``result`` are the record's own (not copies:
        the record is immutable, and every caller serializes or reads them). ``asdict``'s deep
        copy was most of what writing a long rollout's snapshot cost."""
        return {name: getattr(self, name) for name in _RECORD_FIELDS}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MutationRecord:
        missing = [n for n in _RECORD_FIELDS if n not in data]
        if missing:
            raise MalformedRecordError(
                f"mutation record for {data.get('resource_id')!r} lacks {', '.join(missing)}; was it written by this version?"
            )
        return cls(**{n: data[n] for n in _RECORD_FIELDS})


_RECORD_FIELDS = tuple(f.name for f in fields(MutationRecord))


def genesis_hash(resource_id: str) -> str:
    """Chain head of a resource with no mutations."""
    return sha256_hex(resource_id)


def link_hash(prev_chain_hash: str, payload: Mapping[str, Any]) -> str:
    """sha256(prev_chain_hash || canonical_json(mutation minus chain_hash))."""
    return sha256_hex(prev_chain_hash + canonical_json(payload))


def verify_chain(resource_id: str, records: Sequence[MutationRecord]) -> str:
    """Check a resource's records from revision 1 on; returns the chain head.

    Raises :class:`ChainBrokenError` naming the first revision that does not verify.
    """
    head = genesis_hash(resource_id)
    revision = 0
    for record in records:
        if record.resource_id != resource_id:
            raise ChainBrokenError(resource_id, record.revision, f"record belongs to {record.resource_id!r}")
        if record.prev_revision != revision or record.revision != revision + 1:
            raise ChainBrokenError(
                resource_id,
                record.revision,
                f"expected {revision} -> {revision + 1}, found {record.prev_revision} -> {record.revision}",
            )
        expected = link_hash(head, record.chain_payload())
        if record.chain_hash != expected:
            raise ChainBrokenError(
                resource_id, record.revision, "chain hash does not match the record's contents and its predecessor"
            )
        head, revision = expected, record.revision
    return head
