"""Every error a resource raises: each names the resource and says what to do."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from rollout_journal.journal.errors import RolloutJournalError
from rollout_journal.participants.resources.canonical import canonical_json

if TYPE_CHECKING:
    from rollout_journal.participants.resources.records import MutationRecord

__all__ = [
    "ChainBrokenError",
    "IdempotencyKeyReuseError",
    "MalformedRecordError",
    "OperationRejectedError",
    "PolicyFault",
    "RecoveryNotSupportedError",
    "ReplayDivergenceError",
    "ResourceError",
    "RevisionConflictError",
    "SecretLeakError",
    "StaleEpochError",
    "StateImportError",
    "UnknownOperationError",
]


class ResourceError(RolloutJournalError):
    """Base class of every error a resource raises."""


class StaleEpochError(ResourceError):
    """A mutation came from an epoch older than the fence for its rollout: that attempt is superseded."""

    def __init__(self, resource_id: str, rollout_id: str, attempt: int, epoch: int, fenced_epoch: int, op: str) -> None:
        self.resource_id, self.rollout_id, self.attempt = resource_id, rollout_id, attempt
        self.epoch, self.fenced_epoch, self.op = epoch, fenced_epoch, op
        super().__init__(
            f"resource {resource_id!r} refused {op!r} from rollout {rollout_id!r} attempt {attempt} "
            f"epoch {epoch}: the rollout is fenced at epoch {fenced_epoch}; this attempt was superseded, stop it"
        )


class RevisionConflictError(ResourceError):
    """The caller expected a different revision than the resource has (and the idempotency key is new)."""

    def __init__(self, resource_id: str, expected: int, current: int, idempotency_key: str, op: str) -> None:
        self.resource_id, self.expected, self.current = resource_id, expected, current
        self.idempotency_key, self.op = idempotency_key, op
        super().__init__(
            f"resource {resource_id!r}: {op!r} (key {idempotency_key!r}) expected revision {expected} "
            f"but the resource is at revision {current}; re-read the revision (another writer got there first)"
        )


class UnknownOperationError(ResourceError):
    """The op name is not one this resource implements."""

    def __init__(self, resource_id: str, kind: str, op: str, known: Iterable[str]) -> None:
        self.resource_id, self.kind, self.op = resource_id, kind, op
        super().__init__(
            f"resource {resource_id!r} ({kind}) has no operation {op!r}; known: {', '.join(sorted(known))}"
        )


class OperationRejectedError(ResourceError):
    """The resource refused the op on its current state (bad args, unknown item); nothing changed."""


class PolicyFault(ResourceError):
    """What the action itself caused, not the infrastructure: the model's code raised or ran too
    long, it asked for something the task forbids. An environment raises it (from ``_perform``,
    ``_call_tool`` or a resource's ``_apply``, before anything changed) and ``Environment.step``
    tells the model as an observation; the rollout goes on and is scored, never failed.
    ``ends_episode``: the action ended the episode (the observation says done)."""

    def __init__(self, message: str, *, ends_episode: bool = False) -> None:
        super().__init__(message)
        self.ends_episode = ends_episode


class IdempotencyKeyReuseError(ResourceError):
    """An idempotency key already applied is reused for a different op or args (an agent bug, not a retry)."""

    def __init__(self, resource_id: str, idempotency_key: str, recorded: MutationRecord, op: str, args: Any) -> None:
        self.resource_id, self.idempotency_key = resource_id, idempotency_key
        super().__init__(
            f"resource {resource_id!r}: idempotency key {idempotency_key!r} was applied at revision "
            f"{recorded.revision} as {recorded.op}({canonical_json(recorded.args)}) and is now reused for "
            f"{op}({canonical_json(args)}); derive keys from (rollout, turn, index) and keep re-executed turns identical"
        )


class ReplayDivergenceError(ResourceError):
    """Re-applying a journaled mutation did not reproduce the journaled revision/digest/chain.

    The resource instance is left half-applied: discard it.
    """

    def __init__(self, resource_id: str, revision: int, reason: str) -> None:
        self.resource_id, self.revision = resource_id, revision
        super().__init__(
            f"replay of resource {resource_id!r} diverged at revision {revision}: {reason}; discard this instance"
        )


class ChainBrokenError(ResourceError):
    """A resource's journaled hash chain does not verify: a mutation was altered, dropped or reordered."""

    def __init__(self, resource_id: str, revision: int, reason: str) -> None:
        self.resource_id, self.revision = resource_id, revision
        super().__init__(f"hash chain of resource {resource_id!r} is broken at revision {revision}: {reason}")


class RecoveryNotSupportedError(ResourceError):
    """The resource's recovery mode does not offer this hook (e.g. export of a subprocess)."""


class StateImportError(ResourceError):
    """Exported bytes could not be imported (wrong resource, wrong format, digest mismatch)."""


class MalformedRecordError(ResourceError):
    """A dict could not be turned into a MutationRecord."""


class SecretLeakError(ResourceError):
    """A resource put a raw secret into its result or canonical state (a bug in that resource)."""
