"""Resource participants: the contract every environment resource honours.

Split by job; import from here, not from the modules:

- :mod:`.canonical`: the one JSON spelling of digests, chain hashes and journaled values;
- :mod:`.redaction`: what the journal keeps instead of a secret argument;
- :mod:`.errors`: every error a resource raises;
- :mod:`.records`: the mutation request and record, and the per-resource hash chain;
- :mod:`.base`: :class:`Resource` (fencing, idempotency, revisions, export/import, replay)
  and the :class:`Recovery` modes.
"""

from rollout_journal.participants.resources.base import EXPORT_FORMAT, Recovery, Resource, weakest_recovery
from rollout_journal.participants.resources.canonical import canonical_json, sha256_hex
from rollout_journal.participants.resources.errors import (
    ChainBrokenError,
    IdempotencyKeyReuseError,
    MalformedRecordError,
    OperationRejectedError,
    PolicyFault,
    RecoveryNotSupportedError,
    ReplayDivergenceError,
    ResourceError,
    RevisionConflictError,
    SecretLeakError,
    StaleEpochError,
    StateImportError,
    UnknownOperationError,
)
from rollout_journal.participants.resources.records import (
    MutationRecord,
    MutationRequest,
    genesis_hash,
    link_hash,
    verify_chain,
)
from rollout_journal.participants.resources.redaction import is_redacted, redact_args, redact_secret

__all__ = [
    "EXPORT_FORMAT",
    "ChainBrokenError",
    "IdempotencyKeyReuseError",
    "MalformedRecordError",
    "MutationRecord",
    "MutationRequest",
    "OperationRejectedError",
    "PolicyFault",
    "Recovery",
    "RecoveryNotSupportedError",
    "ReplayDivergenceError",
    "Resource",
    "ResourceError",
    "RevisionConflictError",
    "SecretLeakError",
    "StaleEpochError",
    "StateImportError",
    "UnknownOperationError",
    "canonical_json",
    "genesis_hash",
    "is_redacted",
    "link_hash",
    "redact_args",
    "redact_secret",
    "sha256_hex",
    "verify_chain",
    "weakest_recovery",
]
