"""The resource base class: the contract every environment resource honours.

A resource is a piece of mutable state a rollout acts on (a mailbox, a Python
interpreter, a counter store). Every mutation carries the rollout's identity
``(rollout_id, attempt, epoch, idempotency_key, expected_revision)`` so that

* a fenced (superseded) attempt cannot change anything any more,
* a turn re-executed after a crash maps to the same idempotency keys and gets
  the recorded results back instead of applying twice,
* the journal holds, per resource, a tamper-evident hash chain of mutations.

The shared mechanics live here once, in :class:`Resource`; a concrete resource
implements only ``_apply`` (a deterministic state transition), ``_query`` and
``_canonical_state`` (plus ``_load_state`` / ``_reset`` if it supports export
or restart).

Secrets
-------
Argument values named in ``secret_arg_names`` never reach a
:class:`MutationRecord`: they are replaced by :func:`redact_secret`, i.e.
``"<redacted:" + sha256(value)[:12] + ">"``. Replay hands ``_apply`` those
redacted args, so the rule for a resource that takes secrets is: keep at most
``redact_secret(value)`` in the canonical state and in results (redacting a
placeholder returns it unchanged, so live and replayed runs derive the same
digest). The raw value may live on the instance outside ``_canonical_state()``
for the live session only; it is gone after replay or import. A resource that
needs the raw secret after recovery cannot be ``event_sourced``: declare it
``restart_only``. :class:`SecretLeakError` is raised when a live mutation's
result or canonical state contains a raw secret of that call.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar

from rollout_journal.participants.resources.canonical import canonical_json, sha256_hex
from rollout_journal.participants.resources.errors import (
    IdempotencyKeyReuseError,
    MalformedRecordError,
    OperationRejectedError,
    RecoveryNotSupportedError,
    ReplayDivergenceError,
    RevisionConflictError,
    SecretLeakError,
    StaleEpochError,
    StateImportError,
    UnknownOperationError,
)
from rollout_journal.participants.resources.records import MutationRecord, MutationRequest, genesis_hash, link_hash
from rollout_journal.participants.resources.redaction import MIN_LEAK_CHECK_LEN, redact_args, secret_values

__all__ = ["EXPORT_FORMAT", "Recovery", "Resource", "weakest_recovery"]

EXPORT_FORMAT = "rollout-journal/resource-state/1"


class Recovery(str, Enum):
    """How a resource's state comes back after a crash."""

    EVENT_SOURCED = "event_sourced"  # state = fold of its journaled mutations
    EXPORTABLE = "exportable"  # opaque state exported at a checkpoint, imported on restore
    RESTART_ONLY = "restart_only"  # state is lost: dependent rollouts restart from turn 0
    STATELESS = "stateless"  # nothing to recover


# Weakest first: an environment recovers only as well as its weakest resource.
_RECOVERY_STRENGTH: dict[Recovery, int] = {
    Recovery.RESTART_ONLY: 0,
    Recovery.EXPORTABLE: 1,
    Recovery.EVENT_SOURCED: 2,
    Recovery.STATELESS: 3,
}


def weakest_recovery(modes: Iterable[Recovery]) -> Recovery:
    """The weakest mode (restart_only < exportable < event_sourced < stateless); STATELESS if none."""
    return min(modes, key=_RECOVERY_STRENGTH.__getitem__, default=Recovery.STATELESS)


def _json_clean(value: Any, what: str) -> Any:
    """Round-trip through canonical JSON so live and journaled values compare equal.

    Tuples become lists and non-string keys become strings here, once, instead of
    making a replayed run differ from the live one.
    """
    try:
        return json.loads(canonical_json(value))
    except (TypeError, ValueError) as exc:
        raise OperationRejectedError(
            f"{what} is not JSON-serialisable ({exc}); pass plain dicts, lists, str, int, float, bool or None"
        ) from exc


@dataclass(frozen=True)
class _Export:
    """An export document, parsed and checked (see ``Resource.check_export``)."""

    state: Any
    applied: list[MutationRecord]
    fences: dict[str, int]
    revision: int
    chain_hash: str
    state_digest: str


def _preview(data: bytes) -> str:
    """The first bytes of a payload that is not what it claims, for the error message."""
    head = data[:40].decode("utf-8", errors="replace")
    return f"starts {head!r}" + ("..." if len(data) > 40 else "")


class Resource(ABC):
    """State + revision + fences + idempotency table + hash chain.

    Subclasses set ``kind`` and ``recovery`` and implement ``_apply``, ``_query``
    and ``_canonical_state``. ``_apply`` must be deterministic in (state, op, args)
    and must raise :class:`OperationRejectedError` *before* changing anything when
    it refuses an op. Exportable resources set ``supports_export`` and implement
    ``_load_state``; resettable ones implement ``_reset``.
    """

    kind: ClassVar[str]
    recovery: ClassVar[Recovery]
    secret_arg_names: ClassVar[frozenset[str]] = frozenset()
    supports_export: ClassVar[bool] = False

    def __init__(self, resource_id: str) -> None:
        self.resource_id = resource_id
        self._revision = 0
        self._chain_hash = genesis_hash(resource_id)
        self._fences: dict[str, int] = {}  # rollout_id -> lowest epoch still accepted
        self._applied: dict[str, MutationRecord] = {}  # idempotency key -> record

    # -- read-only bookkeeping ---------------------------------------------------
    @property
    def revision(self) -> int:
        """0 for a fresh resource, +1 per applied mutation."""
        return self._revision

    @property
    def chain_hash(self) -> str:
        """Head of this resource's hash chain (``genesis_hash(resource_id)`` when fresh)."""
        return self._chain_hash

    def fenced_epoch(self, rollout_id: str) -> int:
        """The lowest epoch still accepted for ``rollout_id`` (0 if never fenced)."""
        return self._fences.get(rollout_id, 0)

    def applied_record(self, idempotency_key: str) -> MutationRecord | None:
        """The record applied under ``idempotency_key``, if any."""
        return self._applied.get(idempotency_key)

    # -- fencing -----------------------------------------------------------------
    def fence(self, rollout_id: str, epoch: int) -> None:
        """From now on refuse mutations of ``rollout_id`` with an epoch below ``epoch``.

        Fences only move forward; a mutation carrying a newer epoch also moves the
        fence (like a Kafka producer epoch), so a zombie is refused even before
        the restorer calls this.
        """
        if epoch > self._fences.get(rollout_id, 0):
            self._fences[rollout_id] = epoch

    # -- mutation ----------------------------------------------------------------
    def mutate(self, req: MutationRequest, op: str, args: Mapping[str, Any]) -> MutationRecord:
        """Apply ``op`` once for ``req.idempotency_key`` and return its record.

        Order: stale epoch -> :class:`StaleEpochError`; key already applied ->
        the recorded record unchanged (no second apply, whatever the revision);
        ``expected_revision`` mismatch -> :class:`RevisionConflictError`; else
        apply, bump the revision, extend the chain, remember the key.
        """
        fenced = self._fences.get(req.rollout_id, 0)
        if req.epoch < fenced:
            raise StaleEpochError(self.resource_id, req.rollout_id, req.attempt, req.epoch, fenced, op)
        self.fence(req.rollout_id, req.epoch)
        if not isinstance(args, Mapping):
            raise OperationRejectedError(
                f"resource {self.resource_id!r}: args of {op!r} must be a mapping, got {type(args).__name__}"
            )
        live_args = _json_clean(dict(args), f"args of {op!r} on {self.resource_id!r}")
        journal_args = redact_args(live_args, self.secret_arg_names)
        recorded = self._applied.get(req.idempotency_key)
        if recorded is not None:
            if recorded.op != op or recorded.args != journal_args:
                raise IdempotencyKeyReuseError(self.resource_id, req.idempotency_key, recorded, op, journal_args)
            return recorded
        if req.expected_revision != self._revision:
            raise RevisionConflictError(
                self.resource_id, req.expected_revision, self._revision, req.idempotency_key, op
            )
        result = _json_clean(self._apply(op, live_args), f"result of {op!r} on {self.resource_id!r}")
        digest = self.state_digest()
        self._check_no_leak(op, live_args, result)
        record = self._link(
            op, journal_args, result, digest, req.idempotency_key, req.rollout_id, req.attempt, req.epoch
        )
        self._commit(record)
        return record

    def query(self, op: str, args: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Run a read-only tool; no revision change, no fencing, not journaled."""
        clean = _json_clean(dict(args or {}), f"args of query {op!r} on {self.resource_id!r}")
        answer: dict[str, Any] = _json_clean(self._query(op, clean), f"result of query {op!r} on {self.resource_id!r}")
        return answer  # a JSON object stays one through the round trip

    def canonical_state(self) -> object:
        """The resource's state as plain JSON values: what its digest covers (``replay state`` shows it)."""
        return _json_clean(self._canonical_state(), f"state of {self.resource_id!r}")

    def state_digest(self) -> str:
        """sha256 of the canonical JSON of the resource's state."""
        return sha256_hex(canonical_json(self._canonical_state()))

    # -- recovery hooks ----------------------------------------------------------
    def replay(self, record: MutationRecord) -> None:
        """Re-apply a journaled mutation during restore, without fencing checks.

        Verifies the resulting revision, state digest and chain hash equal the
        record's (:class:`ReplayDivergenceError` naming the revision if not) and
        remembers the idempotency key. A record already applied under its key
        is skipped, so at-least-once delivery of the journal is harmless.
        """
        if record.resource_id != self.resource_id or record.kind != self.kind:
            raise ReplayDivergenceError(
                self.resource_id,
                record.revision,
                f"record is for {record.resource_id!r} ({record.kind}), not this {self.kind}",
            )
        known = self._applied.get(record.idempotency_key)
        if known is not None:
            if known == record:
                return
            raise ReplayDivergenceError(
                self.resource_id,
                record.revision,
                f"key {record.idempotency_key!r} was already applied at revision {known.revision} with different contents",
            )
        if record.prev_revision != self._revision:
            raise ReplayDivergenceError(
                self.resource_id,
                record.revision,
                f"record follows revision {record.prev_revision} but the resource is at {self._revision}; a record is missing or out of order",
            )
        self.fence(record.rollout_id, record.epoch)
        result = _json_clean(self._apply(record.op, record.args), f"result of {record.op!r} on {self.resource_id!r}")
        digest = self.state_digest()
        rebuilt = self._link(
            record.op,
            record.args,
            result,
            digest,
            record.idempotency_key,
            record.rollout_id,
            record.attempt,
            record.epoch,
        )
        if rebuilt.revision != record.revision:
            raise ReplayDivergenceError(
                self.resource_id, record.revision, f"replay produced revision {rebuilt.revision}"
            )
        if rebuilt.state_digest != record.state_digest:
            raise ReplayDivergenceError(
                self.resource_id,
                record.revision,
                f"state digest {rebuilt.state_digest[:12]} != journaled {record.state_digest[:12]} (non-deterministic resource or altered journal)",
            )
        if rebuilt.result != record.result:
            raise ReplayDivergenceError(
                self.resource_id,
                record.revision,
                f"result {canonical_json(rebuilt.result)} != journaled {canonical_json(record.result)}",
            )
        if rebuilt.chain_hash != record.chain_hash:
            raise ReplayDivergenceError(
                self.resource_id,
                record.revision,
                "chain hash differs from the journal's: the record or an earlier one was altered",
            )
        self._commit(record)

    def export_state(self) -> bytes:
        """Opaque bytes holding state, revision, chain head, idempotency table and fences."""
        if not self.supports_export:
            raise RecoveryNotSupportedError(
                f"resource {self.resource_id!r} ({self.kind}, {self.recovery.value}) cannot export its state; restore it by {self._recovery_hint()}"
            )
        doc = {
            "format": EXPORT_FORMAT,
            "resource_id": self.resource_id,
            "kind": self.kind,
            "revision": self._revision,
            "chain_hash": self._chain_hash,
            "state_digest": self.state_digest(),
            "state": self._canonical_state(),
            "fences": self._fences,
            "applied": [r.to_dict() for r in self._applied.values()],
        }
        return canonical_json(doc).encode("utf-8")

    def check_export(self, data: bytes) -> None:
        """Refuse (``StateImportError``) bytes that are not this resource's export at its current
        revision: an error page served with HTTP 200, a truncated body, another resource's state,
        a stale copy. A coordinated checkpoint checks every export before it snapshots it, because
        a snapshot that does not import makes every later restore fall back. Changes nothing."""
        export = self._read_export(data)
        if export.revision != self._revision:
            raise StateImportError(
                f"export of resource {self.resource_id!r} is at revision {export.revision}, "
                f"the resource at {self._revision}: a stale or foreign copy"
            )

    def exported_head(self, data: bytes) -> tuple[int, str]:
        """``(revision, chain hash)`` an export of this resource holds (``StateImportError`` if it is
        none): what a resource server compares with its own head before deciding to import."""
        export = self._read_export(data)
        return export.revision, export.chain_hash

    def import_state(self, data: bytes) -> None:
        """Replace this resource's state with bytes from :meth:`export_state` of the same resource."""
        if not self.supports_export:
            raise RecoveryNotSupportedError(
                f"resource {self.resource_id!r} ({self.kind}, {self.recovery.value}) cannot import state; restore it by {self._recovery_hint()}"
            )
        export = self._read_export(data)
        previous = _json_clean(self._canonical_state(), f"state of {self.resource_id!r}")
        try:
            self._load_state(export.state)
        except (KeyError, TypeError, ValueError, AttributeError, MalformedRecordError) as exc:
            self._load_state(previous)
            raise StateImportError(
                f"state for resource {self.resource_id!r} is malformed ({exc!r}); nothing was changed"
            ) from exc
        if self.state_digest() != export.state_digest:
            self._load_state(previous)
            raise StateImportError(
                f"imported state of {self.resource_id!r} does not match its recorded digest; the export is corrupt, nothing was changed"
            )
        self._revision, self._chain_hash = export.revision, export.chain_hash
        self._fences, self._applied = export.fences, {r.idempotency_key: r for r in export.applied}

    def _read_export(self, data: bytes) -> _Export:
        """Parse and check an export document of this resource; nothing is changed."""
        if not self.supports_export:
            raise RecoveryNotSupportedError(
                f"resource {self.resource_id!r} ({self.kind}, {self.recovery.value}) cannot import state; restore it by {self._recovery_hint()}"
            )
        try:
            doc = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise StateImportError(
                f"state for resource {self.resource_id!r} is not valid UTF-8 JSON ({_preview(data)}: {exc}); was it produced by export_state()?"
            ) from exc
        if not isinstance(doc, dict) or doc.get("format") != EXPORT_FORMAT:
            raise StateImportError(f"state for resource {self.resource_id!r} is not in format {EXPORT_FORMAT!r}")
        if doc.get("resource_id") != self.resource_id or doc.get("kind") != self.kind:
            raise StateImportError(
                f"state was exported by {doc.get('resource_id')!r} ({doc.get('kind')}), not {self.resource_id!r} ({self.kind})"
            )
        try:
            return _Export(
                state=doc["state"],
                applied=[MutationRecord.from_dict(r) for r in doc["applied"]],
                fences={str(k): int(v) for k, v in doc["fences"].items()},
                revision=int(doc["revision"]),
                chain_hash=str(doc["chain_hash"]),
                state_digest=str(doc["state_digest"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError, MalformedRecordError) as exc:
            raise StateImportError(
                f"state for resource {self.resource_id!r} is malformed ({exc!r}); nothing was changed"
            ) from exc

    def reset(self) -> None:
        """Back to the initial state with a fresh chain (restart_only); fences are kept."""
        self._reset()
        self._revision = 0
        self._chain_hash = genesis_hash(self.resource_id)
        self._applied.clear()

    def close(self) -> None:
        """Release anything outside the process (subprocesses, sockets); no-op by default."""

    # -- subclass hooks ----------------------------------------------------------
    @abstractmethod
    def _apply(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        """Deterministic state transition; returns the JSON-able result."""

    @abstractmethod
    def _query(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        """Read-only tool; must not change state."""

    @abstractmethod
    def _canonical_state(self) -> object:
        """JSON-able state the digest covers (no raw secrets)."""

    def _load_state(self, state: Any) -> None:
        raise RecoveryNotSupportedError(f"resource {self.resource_id!r} ({self.kind}) cannot load exported state")

    def _reset(self) -> None:
        raise RecoveryNotSupportedError(
            f"resource {self.resource_id!r} ({self.kind}) cannot reset; build a new instance"
        )

    # -- helpers for subclasses --------------------------------------------------
    def _unknown(self, op: str, known: Iterable[str]) -> UnknownOperationError:
        return UnknownOperationError(self.resource_id, self.kind, op, known)

    def _arg(
        self, op: str, args: Mapping[str, Any], name: str, typ: type | tuple[type, ...] = str, default: Any = ...
    ) -> Any:
        """``args[name]`` checked against ``typ``; :class:`OperationRejectedError` if missing or mistyped."""
        if name not in args:
            if default is not ...:
                return default
            raise OperationRejectedError(f"resource {self.resource_id!r}: {op!r} needs argument {name!r}")
        value = args[name]
        # bool is an int subclass; an int argument must not silently accept True.
        if not isinstance(value, typ) or (isinstance(value, bool) and typ is int):
            raise OperationRejectedError(
                f"resource {self.resource_id!r}: argument {name!r} of {op!r} must be {getattr(typ, '__name__', typ)}, got {value!r}"
            )
        return value

    # -- internals ---------------------------------------------------------------
    def _link(
        self,
        op: str,
        args: dict[str, Any],
        result: dict[str, Any],
        digest: str,
        key: str,
        rollout_id: str,
        attempt: int,
        epoch: int,
    ) -> MutationRecord:
        payload: dict[str, Any] = {  # the record's fields but its chain hash: what the link hashes
            "resource_id": self.resource_id,
            "kind": self.kind,
            "op": op,
            "args": args,
            "idempotency_key": key,
            "prev_revision": self._revision,
            "revision": self._revision + 1,
            "result": result,
            "state_digest": digest,
            "rollout_id": rollout_id,
            "attempt": attempt,
            "epoch": epoch,
        }
        return MutationRecord(chain_hash=link_hash(self._chain_hash, payload), **payload)

    def _commit(self, record: MutationRecord) -> None:
        self._revision = record.revision
        self._chain_hash = record.chain_hash
        self._applied[record.idempotency_key] = record

    def _check_no_leak(self, op: str, live_args: dict[str, Any], result: dict[str, Any]) -> None:
        secrets = [s for s in secret_values(live_args, self.secret_arg_names) if len(s) >= MIN_LEAK_CHECK_LEN]
        if not secrets:
            return
        exposed = canonical_json(result) + canonical_json(self._canonical_state())
        if any(s in exposed for s in secrets):
            raise SecretLeakError(
                f"resource {self.resource_id!r} put a raw secret of {op!r} into its result or canonical state; "
                "store redact_secret(value) there instead (the journal must never see secrets)"
            )

    def _recovery_hint(self) -> str:
        return {
            Recovery.EVENT_SOURCED: "replaying its journaled mutations",
            Recovery.RESTART_ONLY: "restarting the rollout from turn 0",
            Recovery.STATELESS: "doing nothing (it is stateless)",
            Recovery.EXPORTABLE: "importing its exported state",
        }[self.recovery]
