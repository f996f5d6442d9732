"""The resource servers' wire protocol: authentication, JSON shapes, and errors both ways.

A resource server (:mod:`rollout_journal.participants.remote.server`) hosts the environments of one
kind for many rollouts; a worker talks to it with :mod:`rollout_journal.participants.remote.client`.
Every request but ``GET /health`` carries ``Authorization: Bearer <token>``, the token
read from ``ROLLOUT_JOURNAL_RESOURCE_TOKEN`` on both sides; a missing or wrong one gets
401. The token lives in a :class:`ServiceToken`, whose repr and str never show it.

Routes (``{rid}`` is the rollout id, URL-quoted)::

    GET  /health                                   liveness: environment, boot id (no token)
    GET  /v1/stats                                 sessions, steps, imports, reconciles
    POST /v1/rollouts/{rid}/open                   {task} -> description (created if absent)
    POST /v1/rollouts/{rid}/restore                {task, exports, mutations, fence_epoch}
                                                   -> description, "mode": reconciled|imported|fresh
    POST /v1/rollouts/{rid}/step                   {action, attempt, epoch, key, expected_revisions}
    POST /v1/rollouts/{rid}/verify                 -> {reward}
    POST /v1/rollouts/{rid}/fence                  {epoch}
    POST /v1/rollouts/{rid}/export                 {resource_ids} -> {exports}
    POST /v1/rollouts/{rid}/resources/{name}/mutate {op, args, attempt, epoch, idempotency_key,
                                                    expected_revision} -> {record}
    POST /v1/rollouts/{rid}/resources/{name}/query  {op, args} -> {result}
    POST /v1/rollouts/{rid}/prepare                {epoch} -> {exports}; steps wait until resume/abort
    POST /v1/rollouts/{rid}/resume | abort         {epoch}
    DELETE /v1/rollouts/{rid}                      the rollout is done here
    POST /v1/faults                                {route, count, status, body, clear}: the next
                                                   requests of a route answer that (only when the
                                                   server was started with fault injection)

A description is ``{"environment", "task_prompt", "recovery", "actions", "heads"}``; every
answer that can change a resource carries the new ``heads``: per resource its revision,
chain hash, state digest and fence, so the worker reads revisions without asking.
Exports travel base64-encoded; mutation records as :meth:`MutationRecord.to_dict`.

Errors are ``{"error": code, "message": ..., "detail": {...}}`` with the status below;
:func:`raise_error` turns one back into the exception the server raised, so a stale epoch
stops the worker's attempt just as an in-process resource's would.
"""

from __future__ import annotations

import base64
import hmac
import os
from collections.abc import Mapping
from typing import Any, NoReturn

from rollout_journal.journal.errors import ConfigurationError, RolloutJournalError
from rollout_journal.participants.resources import (
    IdempotencyKeyReuseError,
    OperationRejectedError,
    RecoveryNotSupportedError,
    ReplayDivergenceError,
    Resource,
    ResourceError,
    RevisionConflictError,
    StaleEpochError,
    StateImportError,
    UnknownOperationError,
)

__all__ = [
    "TOKEN_ENV_VAR",
    "BadRequestError",
    "ControlError",
    "ResourceAuthError",
    "ResourceServerUnavailableError",
    "ResourceServiceError",
    "ResourceSessionLostError",
    "ServiceToken",
    "SessionPreparedError",
    "TransientControlError",
    "UnknownRolloutError",
    "decode_exports",
    "encode_exports",
    "error_answer",
    "head_of",
    "raise_error",
]

TOKEN_ENV_VAR = "ROLLOUT_JOURNAL_RESOURCE_TOKEN"


class ControlError(RolloutJournalError):
    """A resource server call failed for good (a 4xx, or retries exhausted)."""


class TransientControlError(ControlError):
    """A resource server call failed in a way worth retrying (HTTP 5xx, connection refused or reset,
    timeout, a session held by a checkpoint)."""


class ResourceServiceError(ResourceError):
    """A resource server could not serve a rollout's request."""


class ResourceSessionLostError(ResourceServiceError):
    """The resource server does not know the rollout (it was restarted and lost its sessions):
    bring the rollout's resources back from the journal, or restart a restart-only rollout."""


class ResourceServerUnavailableError(ResourceServiceError):
    """A resource server did not answer within the workload's ``resource_server_wait_s``."""


class ResourceAuthError(ConfigurationError):
    """A resource server refused the token (HTTP 401): set the same ROLLOUT_JOURNAL_RESOURCE_TOKEN
    for the server and the workers."""


class ServiceToken:
    """The shared bearer token. Its repr and str never show the secret (logs, reports, journals)."""

    __slots__ = ("_secret",)

    def __init__(self, secret: str) -> None:
        if not secret.strip():
            raise ConfigurationError(f"{TOKEN_ENV_VAR} is blank; set a long random token (e.g. `openssl rand -hex 32`)")
        self._secret = secret.strip()

    @classmethod
    def from_environment(cls, needed_by: str) -> ServiceToken:
        secret = os.environ.get(TOKEN_ENV_VAR, "")
        if not secret.strip():
            raise ConfigurationError(
                f"{needed_by} needs the resource servers' token in {TOKEN_ENV_VAR}; set the "
                "same value for the servers and the workers (e.g. `openssl rand -hex 32`)"
            )
        return cls(secret)

    def header(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._secret}"}

    def accepts(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header carries this token (compared in constant time)."""
        scheme, _, given = (authorization or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self._secret.encode())

    def __repr__(self) -> str:
        return "ServiceToken(***)"

    __str__ = __repr__


def head_of(resource: Resource, rollout_id: str) -> dict[str, Any]:
    """What a worker mirrors of a resource hosted by a server."""
    return {
        "resource_id": resource.resource_id,
        "kind": resource.kind,
        "recovery": resource.recovery.value,
        "supports_export": resource.supports_export,
        "revision": resource.revision,
        "chain_hash": resource.chain_hash,
        "state_digest": resource.state_digest(),
        "fenced_epoch": resource.fenced_epoch(rollout_id),
    }


def encode_exports(exports: Mapping[str, bytes]) -> dict[str, str]:
    return {rid: base64.b64encode(data).decode("ascii") for rid, data in exports.items()}


def decode_exports(exports: Mapping[str, str]) -> dict[str, bytes]:
    try:
        return {str(rid): base64.b64decode(text, validate=True) for rid, text in exports.items()}
    except (ValueError, TypeError) as exc:
        raise StateImportError(f"an export in the request is not base64 ({exc})") from None


# -- errors: the server's answer for an exception, and the exception again on the worker --------------


def error_answer(exc: Exception) -> tuple[int, dict[str, Any]]:
    """``(status, body)`` for an exception raised while serving a request."""
    message = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, StaleEpochError):
        return 409, _body(
            "stale_epoch",
            message,
            resource_id=exc.resource_id,
            rollout_id=exc.rollout_id,
            attempt=exc.attempt,
            epoch=exc.epoch,
            fenced_epoch=exc.fenced_epoch,
            op=exc.op,
        )
    if isinstance(exc, RevisionConflictError):
        return 409, _body(
            "revision_conflict",
            message,
            resource_id=exc.resource_id,
            expected=exc.expected,
            current=exc.current,
            idempotency_key=exc.idempotency_key,
            op=exc.op,
        )
    if isinstance(exc, ReplayDivergenceError):
        return 422, _body("replay_divergence", message, resource_id=exc.resource_id, revision=exc.revision)
    for cls, status, code in _SIMPLE:
        if isinstance(exc, cls):
            return status, _body(code, message)
    if isinstance(exc, ResourceError):
        return 422, _body("resource_error", f"{type(exc).__name__}: {message}")
    return 500, _body("internal", f"{type(exc).__name__}: {message}")


def raise_error(status: int, body: Any, what: str) -> NoReturn:
    """Raise the exception a server's error answer stands for; ``what`` names the request."""
    doc = body if isinstance(body, dict) else {}
    code, message, detail = doc.get("error"), str(doc.get("message") or body)[:500], doc.get("detail") or {}
    if status == 401:
        raise ResourceAuthError(
            f"{what}: the resource server refused the token (HTTP 401); set the same "
            f"{TOKEN_ENV_VAR} for the server and the workers"
        )
    if code == "unknown_rollout":
        raise ResourceSessionLostError(f"{what}: {message}")
    if code == "stale_epoch":
        raise StaleEpochError(
            detail["resource_id"],
            detail["rollout_id"],
            detail["attempt"],
            detail["epoch"],
            detail["fenced_epoch"],
            detail["op"],
        )
    if code == "revision_conflict":
        raise RevisionConflictError(
            detail["resource_id"], detail["expected"], detail["current"], detail["idempotency_key"], detail["op"]
        )
    if code == "replay_divergence":
        error = ReplayDivergenceError(detail["resource_id"], detail["revision"], "")
        error.args = (message,)
        raise error
    for cls, _, known in _SIMPLE:
        if code == known:
            raise _with_message(cls, message)
    if status >= 500 or code in ("prepared", "busy"):
        raise TransientControlError(f"{what}: HTTP {status}: {message}")
    if code == "resource_error":
        raise ResourceServiceError(f"{what}: {message}")
    raise ControlError(f"{what}: HTTP {status}: {message}")


class UnknownRolloutError(ResourceServiceError):
    """The server holds no session for the rollout (raised by the server, answered 404)."""


class SessionPreparedError(ResourceServiceError):
    """A coordinated checkpoint holds the rollout's session (raised by the server, answered 409)."""


class BadRequestError(ResourceServiceError):
    """A request body is not what the route takes (raised by the server, answered 400)."""


_SIMPLE: tuple[tuple[type[Exception], int, str], ...] = (
    (UnknownRolloutError, 404, "unknown_rollout"),
    (SessionPreparedError, 409, "prepared"),
    (BadRequestError, 400, "bad_request"),
    (IdempotencyKeyReuseError, 409, "key_reuse"),
    (UnknownOperationError, 422, "unknown_operation"),
    (OperationRejectedError, 422, "rejected"),
    (StateImportError, 422, "state_import"),
    (RecoveryNotSupportedError, 422, "recovery_not_supported"),
    (ConfigurationError, 422, "configuration"),
)


def _with_message(cls: type[Exception], message: str) -> Exception:
    """An instance of ``cls`` carrying the server's message, whatever ``cls.__init__`` takes."""
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    return error


def _body(code: str, message: str, **detail: Any) -> dict[str, Any]:
    return {"error": code, "message": message, "detail": detail}
