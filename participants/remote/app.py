"""A resource server's HTTP face: the Starlette app over an :class:`EnvironmentHost`.

Every route but ``GET /health`` checks the bearer token (401), then reads its JSON body into
a pydantic model of the fields it takes; a body that is not a JSON object, lacks a field or
holds one of the wrong type is answered 400 ``bad_request`` naming the field. Any error the
host raises becomes the answer :func:`~rollout_journal.participants.remote.protocol.error_answer`
gives it (:mod:`~rollout_journal.participants.remote.protocol` lists the routes).
"""

from __future__ import annotations

import json
import logging
import types
import typing
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rollout_journal.participants.environments.tasks import Task
from rollout_journal.participants.environments.tool_calls import ToolCall
from rollout_journal.participants.remote.host import EnvironmentHost, Session
from rollout_journal.participants.remote.protocol import (
    BadRequestError,
    ServiceToken,
    decode_exports,
    encode_exports,
    error_answer,
)
from rollout_journal.participants.resources import MutationRecord, MutationRequest

__all__ = ["build_app"]

log = logging.getLogger(__name__)


# -- request bodies ----------------------------------------------------------------------------


class _Body(BaseModel):
    """A route's JSON body: the fields it takes, of exactly their JSON types (``true`` is no
    int, ``"3"`` no number); other fields are ignored."""

    model_config = ConfigDict(strict=True, frozen=True)


class _OpenBody(_Body):
    task: dict[str, Any]


class _RestoreBody(_Body):
    mutations: list[Any]
    task: dict[str, Any]
    exports: dict[str, Any]
    fence_epoch: int | None = None


class _StepBody(_Body):
    action: str | dict[str, Any]
    attempt: int
    epoch: int
    key: str
    expected_revisions: dict[str, Any]


class _EpochBody(_Body):  # fence, resume, abort
    epoch: int


class _ExportBody(_Body):
    resource_ids: list[Any]


class _QueryBody(_Body):
    op: str
    args: dict[str, Any]


class _MutateBody(_Body):
    attempt: int
    epoch: int
    idempotency_key: str
    expected_revision: int
    op: str
    args: dict[str, Any]


class _PrepareBody(_Body):
    epoch: int
    hold_s: int | float


class _FaultBody(_Body):
    model_config = ConfigDict(strict=False, frozen=True)  # a drill's knobs: "3" is 3

    route: str
    clear: bool = False
    status: int = 500
    body: str = "injected failure"
    count: int = 0


B = TypeVar("B", bound=_Body)


def _spelled(annotation: object) -> str:
    """A field's type as the 400 answer names it: ``int``, ``dict``, ``str or dict``."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " or ".join(_spelled(arg) for arg in typing.get_args(annotation))
    origin = typing.get_origin(annotation) or annotation
    return "None" if origin is type(None) else getattr(origin, "__name__", str(origin))


def _validated(model: type[B], body: Mapping[str, Any]) -> B:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        name = str(error["loc"][0])
        if error["type"] == "missing":
            raise BadRequestError(f"the request lacks {name!r}") from None
        expected = _spelled(model.model_fields[name].annotation)
        raise BadRequestError(f"{name!r} must be {expected}, got {type(body[name]).__name__}") from None


async def _json_body(request: Request) -> dict[str, Any]:
    if request.method == "GET" or request.method == "DELETE":
        return {}
    raw = await request.body()
    try:
        body = json.loads(raw) if raw else {}
    except ValueError as exc:
        raise BadRequestError(f"the request body is not JSON ({exc})") from None
    if not isinstance(body, dict):
        raise BadRequestError("the request body must be a JSON object")
    return body


def _task(raw: dict[str, Any]) -> Task:
    try:
        return Task.from_json(raw)
    except (KeyError, TypeError, ValueError) as exc:
        raise BadRequestError(f"'task' is no task ({exc!r})") from None


# -- the app -----------------------------------------------------------------------------------


@dataclass
class _Fault:
    route: str
    status: int
    body: bytes


def build_app(host: EnvironmentHost, token: ServiceToken, *, faults: bool = False) -> Starlette:
    """The Starlette app serving ``host``. With ``faults``, ``POST /v1/faults`` makes the next
    requests of a route answer an injected status and body (drills and tests)."""
    injected: list[_Fault] = []

    def handler(
        route: str, fn: Callable[[Request, B], Awaitable[dict[str, Any] | None]], model: type[B]
    ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            if not token.accepts(request.headers.get("authorization")):
                return JSONResponse(
                    {"error": "unauthorized", "message": "missing or wrong bearer token"},
                    status_code=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
            for fault in injected:
                if fault.route == route:
                    injected.remove(fault)
                    return Response(fault.body, status_code=fault.status)
            try:
                body = _validated(model, await _json_body(request))
                result = await fn(request, body)
            except ClientDisconnect:  # the worker gave up on this request (its run ended): nobody listens
                log.debug("%s %s: the client went away", request.method, request.url.path)
                return Response(status_code=499)
            except Exception as exc:  # every error is an answer; the worker raises it again
                status, answer = error_answer(exc)
                if status >= 500:
                    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
                return JSONResponse(answer, status_code=status)
            return JSONResponse(result if result is not None else {"ok": True})

        return endpoint

    def rid(request: Request) -> str:
        rollout_id: str = request.path_params["rollout_id"]  # the route's {rollout_id:path}: a str
        return rollout_id

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "environment": host.environment, "boot_id": host.boot_id})

    async def stats(request: Request, body: _Body) -> dict[str, Any]:
        return {"boot_id": host.boot_id, "sessions": len(host.sessions), **host.stats}

    async def open_(request: Request, body: _OpenBody) -> dict[str, Any]:
        return await host.describe(await host.open(rid(request), _task(body.task)))

    async def restore(request: Request, body: _RestoreBody) -> dict[str, Any]:
        mutations = [MutationRecord.from_dict(m) for m in body.mutations]
        session, mode = await host.restore(
            rid(request), _task(body.task), decode_exports(body.exports), mutations, body.fence_epoch
        )
        return await host.describe(session) | {"mode": mode}

    async def step(request: Request, body: _StepBody) -> dict[str, Any]:
        raw = body.action
        action = ToolCall(str(raw.get("name", "")), dict(raw.get("arguments") or {})) if isinstance(raw, dict) else raw
        return await host.step(rid(request), action, body.attempt, body.epoch, body.key, body.expected_revisions)

    async def verify(request: Request, body: _Body) -> dict[str, Any]:
        return {"reward": await host.call(rid(request), lambda s: s.env.verify())}

    async def fence(request: Request, body: _EpochBody) -> dict[str, Any]:
        def fenced(session: Session) -> list[dict[str, Any]]:
            session.env.fence(session.env.rollout_id, body.epoch)
            return host.heads(session.env)

        return {"heads": await host.call(rid(request), fenced)}

    async def export(request: Request, body: _ExportBody) -> dict[str, Any]:
        wanted = body.resource_ids
        return {
            "exports": encode_exports(
                await host.call(
                    rid(request),
                    lambda s: {r: s.env.resources[r].export_state() for r in wanted if r in s.env.resources},
                )
            )
        }

    async def mutate(request: Request, body: _MutateBody) -> dict[str, Any]:
        req = MutationRequest(rid(request), body.attempt, body.epoch, body.idempotency_key, body.expected_revision)
        return await host.mutate(rid(request), request.path_params["name"], req, body.op, body.args)

    async def query(request: Request, body: _QueryBody) -> dict[str, Any]:
        name = request.path_params["name"]
        return {"result": await host.call(rid(request), lambda s: host.resource(s, name).query(body.op, body.args))}

    async def prepare(request: Request, body: _PrepareBody) -> dict[str, Any]:
        return await host.prepare(rid(request), body.epoch, float(body.hold_s))

    async def resume(request: Request, body: _EpochBody) -> None:
        await host.finish_checkpoint(rid(request), body.epoch, committed=True)

    async def abort(request: Request, body: _EpochBody) -> None:
        await host.finish_checkpoint(rid(request), body.epoch, committed=False)

    async def close(request: Request, body: _Body) -> None:
        await host.close(rid(request))

    async def inject(request: Request, body: _FaultBody) -> dict[str, Any]:
        if body.clear:
            injected[:] = [f for f in injected if f.route != body.route]
        injected.extend([_Fault(body.route, body.status, body.body.encode())] * body.count)
        return {"pending": len(injected)}

    one = "/v1/rollouts/{rollout_id:path}"
    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/stats", handler("stats", stats, _Body), methods=["GET"]),
        Route(f"{one}/resources/{{name}}/mutate", handler("mutate", mutate, _MutateBody), methods=["POST"]),
        Route(f"{one}/resources/{{name}}/query", handler("query", query, _QueryBody), methods=["POST"]),
        Route(f"{one}/open", handler("open", open_, _OpenBody), methods=["POST"]),
        Route(f"{one}/restore", handler("restore", restore, _RestoreBody), methods=["POST"]),
        Route(f"{one}/step", handler("step", step, _StepBody), methods=["POST"]),
        Route(f"{one}/verify", handler("verify", verify, _Body), methods=["POST"]),
        Route(f"{one}/fence", handler("fence", fence, _EpochBody), methods=["POST"]),
        Route(f"{one}/export", handler("export", export, _ExportBody), methods=["POST"]),
        Route(f"{one}/prepare", handler("prepare", prepare, _PrepareBody), methods=["POST"]),
        Route(f"{one}/resume", handler("resume", resume, _EpochBody), methods=["POST"]),
        Route(f"{one}/abort", handler("abort", abort, _EpochBody), methods=["POST"]),
        Route(one, handler("close", close, _Body), methods=["DELETE"]),
    ]
    if faults:
        routes.append(Route("/v1/faults", handler("faults", inject, _FaultBody), methods=["POST"]))
    return Starlette(routes=routes)
