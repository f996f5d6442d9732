"""The gateway's HTTP errors: OpenAI's error body, one ``type`` per refusal (the table of issue 19's
design, section 6.9), each message naming the rollout and the thing at fault.

``{"error": {"message", "type", "param", "code"}, "rollout": ..., "position": [turn, step]}``
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.responses import JSONResponse

from rollout_journal.journal.errors import FencedWriteError, RolloutJournalError
from rollout_journal.participants.model.generation import BackendError
from rollout_journal.participants.remote.gateway.upstream import UpstreamRejectedError, UpstreamUnavailableError
from rollout_journal.participants.session.chat import HistoryMismatchError
from rollout_journal.participants.session.errors import (
    EffectNotDurableError,
    NondeterminismError,
    NotOwnerError,
    OwnerMovingError,
    RolloutFinishedError,
    RolloutNotFoundError,
    StaleAttemptError,
)

__all__ = ["GatewayError", "ToolServerUnavailableError", "ToolReplayDivergedError", "answer_for", "error_body"]

log = logging.getLogger(__name__)


class GatewayError(RolloutJournalError):
    """A request the gateway refuses before it reaches a session."""

    def __init__(self, status: int, type_: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.param = param


class ToolServerUnavailableError(RolloutJournalError):
    """A tool (resources) server did not answer after every retry; nothing was journaled."""

    def __init__(self, server: str, url: str, detail: str, tries: int) -> None:
        super().__init__(f"tool server {server} at {url} unavailable after {tries} tries: {detail}")
        self.server = server


class ToolReplayDivergedError(RolloutJournalError):
    """Re-applying a rollout's journaled tool calls to a fresh server session gave another result: the
    server is not deterministic on re-apply, so its state cannot be brought back by replay."""

    def __init__(self, rollout_id: str, server: str, op: str, journaled: str, now: str) -> None:
        super().__init__(
            f"rollout {rollout_id}: tool server {server} answered {op} with {now[:200]} on re-apply, the journal holds "
            f"{journaled[:200]}; its state cannot be rebuilt by replay (declare it restart_only, or make it "
            "deterministic)"
        )
        self.rollout_id = rollout_id


def error_body(
    type_: str, message: str, *, param: str | None = None, rollout: str | None = None, **extra: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {"error": {"message": message, "type": type_, "param": param, "code": type_}}
    if rollout is not None:
        body["rollout"] = rollout
    body.update(extra)
    return body


def answer_for(exc: BaseException, rollout: str | None = None) -> JSONResponse:
    """The HTTP answer to a refusal or failure."""
    status, type_, extra, headers = _classify(exc)
    if status >= 500:
        log.warning("rollout %s: %s %s: %s", rollout, status, type_, exc)
    param = exc.param if isinstance(exc, GatewayError) else None
    return JSONResponse(error_body(type_, str(exc), param=param, rollout=rollout, **extra), status, headers=headers)


def _classify(exc: BaseException) -> tuple[int, str, dict[str, Any], dict[str, str] | None]:
    if isinstance(exc, GatewayError):
        return exc.status, exc.type, {}, None
    if isinstance(exc, NondeterminismError):
        extra: dict[str, Any] = {"position": list(exc.position), "request": exc.now.as_json()}
        if exc.journaled is not None:
            extra["journaled"] = exc.journaled.as_json()
        return 409, "nondeterministic_request", extra, None
    if isinstance(exc, HistoryMismatchError):
        return 409, "unknown_history", {}, None
    if isinstance(exc, StaleAttemptError):
        return (
            409,
            "stale_attempt",
            {"attempt": exc.attempt, "epoch": exc.epoch, "current_epoch": exc.current_epoch},
            None,
        )
    if isinstance(exc, RolloutFinishedError):
        return 409, "rollout_finished", {"turns": exc.turns, "reward": exc.reward}, None
    if isinstance(exc, RolloutNotFoundError):
        return 404, "unknown_rollout", {}, None
    if isinstance(exc, NotOwnerError):
        return 421, "not_owner", {"owner": exc.owner_url, "owner_member": exc.owner_member or None}, None
    if isinstance(exc, OwnerMovingError):
        return 503, "owner_moving", {}, {"Retry-After": f"{max(1, round(exc.retry_after_s))}"}
    if isinstance(exc, EffectNotDurableError):
        if isinstance(exc.cause, FencedWriteError):
            return 409, "stale_attempt", {}, None
        return 503, "journal_unavailable", {"cause": type(exc.cause).__name__}, None
    if isinstance(exc, UpstreamRejectedError):
        return 400, "context_length_exceeded" if exc.context_length else "upstream_rejected", {}, None
    if isinstance(exc, UpstreamUnavailableError):
        return 504 if exc.timeout else 502, "upstream_unavailable", {"tries": exc.tries}, None
    if isinstance(exc, BackendError):
        return 502, "upstream_unavailable", {}, None
    if isinstance(exc, ToolServerUnavailableError):
        return 502, "tool_server_unavailable", {"server": exc.server}, None
    if isinstance(exc, ToolReplayDivergedError):
        return 502, "tool_replay_diverged", {}, None
    if isinstance(exc, RolloutJournalError):
        return 500, "journal_error", {}, None
    log.error("gateway: unexpected %s", type(exc).__name__, exc_info=exc)
    return 500, "internal_error", {}, None
