"""A resource server: the environments of one kind, one per rollout, behind HTTP.

As NeMo Gym's resource servers do, one process hosts many rollouts' environments
(tools, resources, reward) and the workers call it over HTTP
(:mod:`participants.resource_protocol` lists the routes). The resource contract holds
at the server itself: every step and mutation carries the rollout's epoch (a stale one
is refused), the expected revisions (compare-and-set) and an idempotency key (a
repeated key is answered with the stored result, nothing applied twice).

Start one with ``rollout-journal serve-resources --environment workplace --port 8700``
(:func:`serve_resources`), or in this process on a background thread with
:class:`ResourceServer` (tests, notebooks). Environment code runs on worker threads,
one request per rollout at a time, so a slow tool (a sandbox's interpreter) never holds
another rollout's request.

Sessions live in memory: a restarted server knows no rollout, answers 404, and the
worker brings each rollout back from its journal (``restore``: reconcile by revision
when this server's heads already equal the journal's, else import the last snapshot's
exports and re-apply the mutations since).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .environments.base import Environment, StepContext
from .environments.registry import environment_class
from .environments.tasks import Task
from .environments.tool_calls import ToolCall
from .resource_protocol import (
    BadRequestError,
    ControlError,
    ServiceToken,
    SessionPreparedError,
    TransientControlError,
    UnknownRolloutError,
    decode_exports,
    encode_exports,
    error_answer,
    head_of,
)
from .resources import (
    IdempotencyKeyReuseError,
    MutationRecord,
    MutationRequest,
    Resource,
    RevisionConflictError,
    StaleEpochError,
    genesis_hash,
)

__all__ = ["ControlError", "EnvironmentHost", "ResourceServer", "TransientControlError", "build_app",
           "serve_resources"]

log = logging.getLogger(__name__)
T = TypeVar("T")
_STEPS_KEPT = 8  # a rollout's steps are sequential: only a retry of a recent one comes back


class StepKeyReuseError(IdempotencyKeyReuseError):
    """A step key already answered is reused for another action (an agent bug, not a retry)."""

    def __init__(self, rollout_id: str, key: str, recorded: str, action: str) -> None:
        self.resource_id, self.idempotency_key = rollout_id, key
        Exception.__init__(self, f"rollout {rollout_id!r}: step key {key!r} was answered for {recorded} and is now "
                                 f"reused for {action}; keys derive from (rollout, turn) and a re-executed turn "
                                 "must send the same call")


@dataclass
class Session:
    """One rollout's environment in this server."""

    env: Environment
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    steps: OrderedDict[str, tuple[str, dict[str, Any]]] = field(default_factory=OrderedDict)  # key -> (call, answer)
    prepared: int | None = None  # epoch of the coordinated checkpoint holding it
    prepared_until: float = 0.0  # monotonic: a checkpoint whose worker never resumes lets go by itself
    pristine: bool = True  # built from its task and not changed since

    def fenced_epoch(self) -> tuple[int, str]:
        """The lowest epoch still accepted, and the resource holding that fence."""
        rid = self.env.rollout_id
        return max(((r.fenced_epoch(rid), r.resource_id) for r in self.env.resources.values()), default=(0, rid))


class EnvironmentHost:
    """The environments of one kind, one per rollout. Every method is called on the event loop;
    environment code runs in the thread pool under the rollout's lock."""

    def __init__(self, environment: str) -> None:
        self.environment = environment
        self.env_class = environment_class(environment)
        self.boot_id = uuid.uuid4().hex
        self.sessions: dict[str, Session] = {}
        self.stats: Counter[str] = Counter()
        self._creating = asyncio.Lock()

    # -- sessions ----------------------------------------------------------------
    def session(self, rollout_id: str) -> Session:
        session = self.sessions.get(rollout_id)
        if session is None:
            raise UnknownRolloutError(f"resource server for {self.environment!r} (boot {self.boot_id[:8]}) holds no "
                                      f"session for rollout {rollout_id!r}: it was restarted, or the rollout never "
                                      "opened here; restore the rollout from its journal")
        return session

    async def open(self, rollout_id: str, task: Task) -> Session:
        """The rollout's session, built from its task if this server has none."""
        async with self._creating:
            session = self.sessions.get(rollout_id)
            if session is None:
                env = await run_in_threadpool(self.env_class, rollout_id, task)
                session = self.sessions[rollout_id] = Session(env)
                self.stats["opens"] += 1
            return session

    async def describe(self, session: Session) -> dict[str, Any]:
        env = session.env
        return await run_in_threadpool(lambda: {
            "environment": self.environment, "boot_id": self.boot_id, "task_prompt": env.task_prompt(),
            "recovery": env.recovery.value, "actions": env.action_space(), "heads": self._heads(env)})

    @staticmethod
    def _heads(env: Environment) -> list[dict[str, Any]]:
        return [head_of(r, env.rollout_id) for r in env.resources.values()]

    async def close(self, rollout_id: str) -> None:
        session = self.sessions.pop(rollout_id, None)
        if session is not None:
            async with session.lock:
                await run_in_threadpool(session.env.close)

    async def close_all(self) -> None:
        for rollout_id in list(self.sessions):
            await self.close(rollout_id)

    # -- restore: reconcile by revision, or import ----------------------------------
    async def restore(self, rollout_id: str, task: Task, exports: dict[str, bytes], mutations: list[MutationRecord],
                      fence_epoch: int | None) -> tuple[Session, str]:
        """Bring the rollout's session to the journal's point. ``reconciled``: this server's heads
        already equal the journal's (nothing moves); ``imported``: a new environment took the
        exports and the mutations since; ``fresh``: no journal material, the task's initial state."""
        session = await self.open(rollout_id, task)
        async with session.lock:
            fenced, holder = session.fenced_epoch()
            if fence_epoch is not None and fence_epoch < fenced:
                raise StaleEpochError(holder, rollout_id, 0, fence_epoch, fenced, "restore")
            fresh = not exports and not mutations
            if fresh and session.pristine:
                mode = "fresh"
            elif not fresh and await run_in_threadpool(self._heads_match, session.env, exports, mutations):
                mode = "reconciled"
            else:
                env = await run_in_threadpool(self._rebuilt, rollout_id, task, exports, mutations)
                old, session.env = session.env, env
                await run_in_threadpool(old.close)
                session.steps.clear()
                session.pristine = fresh
                mode = "fresh" if fresh else "imported"
            if fence_epoch is not None:
                session.env.fence(rollout_id, fence_epoch)
            session.prepared = None  # a restore supersedes a checkpoint its worker never finished
            self.stats[mode] += 1
            return session, mode

    @staticmethod
    def _heads_match(env: Environment, exports: Mapping[str, bytes], mutations: list[MutationRecord]) -> bool:
        if set(exports) - set(env.resources):
            return False  # the import will name the resource this environment lacks
        implied: dict[str, tuple[int, str]] = {}
        for rid, resource in env.resources.items():
            implied[rid] = resource.exported_head(exports[rid]) if rid in exports else (0, genesis_hash(rid))
        for record in mutations:
            implied[record.resource_id] = (record.revision, record.chain_hash)
        return all((r.revision, r.chain_hash) == implied.get(rid) for rid, r in env.resources.items())

    def _rebuilt(self, rollout_id: str, task: Task, exports: dict[str, bytes],
                 mutations: list[MutationRecord]) -> Environment:
        env = self.env_class(rollout_id, task)
        try:
            env.restore(exports, mutations)
        except BaseException:
            env.close()
            raise
        return env

    # -- the rollout's calls --------------------------------------------------------
    async def step(self, rollout_id: str, action: str | ToolCall, attempt: int, epoch: int, key: str,
                   expected: Mapping[str, int]) -> dict[str, Any]:
        session = self.session(rollout_id)
        spelled = action.to_json() if isinstance(action, ToolCall) else action
        async with session.lock:
            self._check_epoch(session, epoch, attempt, "step")
            stored = session.steps.get(key)
            if stored is not None:
                if stored[0] != spelled:
                    raise StepKeyReuseError(rollout_id, key, stored[0], spelled)
                self.stats["step_replays"] += 1
                return stored[1]
            self._check_not_prepared(session, rollout_id)
            env = session.env
            for rid, resource in env.resources.items():
                if expected.get(rid, 0) != resource.revision:
                    raise RevisionConflictError(rid, expected.get(rid, 0), resource.revision, key, "step")

            def run() -> dict[str, Any]:
                observation, records = env.step(action, StepContext(rollout_id, attempt, epoch, key))
                return {"observation": {"text": observation.text, "done": observation.done},
                        "records": [r.to_dict() for r in records], "heads": self._heads(env),
                        "actions": env.action_space()}

            answer = await run_in_threadpool(run)
            session.pristine = False
            session.steps[key] = (spelled, answer)
            while len(session.steps) > _STEPS_KEPT:
                session.steps.popitem(last=False)
            self.stats["steps"] += 1
            return answer

    async def call(self, rollout_id: str, fn: Callable[[Session], T], *, mutates: bool = False) -> T:
        """Run ``fn(session)`` in the thread pool under the rollout's lock."""
        session = self.session(rollout_id)
        async with session.lock:
            if mutates:
                self._check_not_prepared(session, rollout_id)
            result = await run_in_threadpool(fn, session)
            if mutates:
                session.pristine = False
            return result

    async def mutate(self, rollout_id: str, name: str, request: MutationRequest, op: str,
                     args: Mapping[str, Any]) -> dict[str, Any]:
        def run(session: Session) -> dict[str, Any]:
            record = self._resource(session, name).mutate(request, op, args)
            return {"record": record.to_dict(), "heads": self._heads(session.env)}

        return await self.call(rollout_id, run, mutates=True)

    async def prepare(self, rollout_id: str, epoch: int, hold_s: float) -> dict[str, Any]:
        """Hold the session for a coordinated checkpoint (at most ``hold_s``) and export its resources."""
        session = self.session(rollout_id)
        async with session.lock:
            self._check_epoch(session, epoch, 0, "prepare")
            session.prepared, session.prepared_until = epoch, time.monotonic() + hold_s
            exports = await session.env.aprepare_checkpoint(epoch)
            self.stats["prepares"] += 1
            return {"exports": encode_exports(exports), "heads": self._heads(session.env)}

    async def finish_checkpoint(self, rollout_id: str, epoch: int, committed: bool) -> None:
        session = self.session(rollout_id)
        async with session.lock:
            if session.prepared == epoch:
                session.prepared = None
            self.stats["resumes" if committed else "aborts"] += 1

    # -- checks ----------------------------------------------------------------------
    @staticmethod
    def _check_epoch(session: Session, epoch: int, attempt: int, what: str) -> None:
        fenced, holder = session.fenced_epoch()
        if epoch < fenced:
            raise StaleEpochError(holder, session.env.rollout_id, attempt, epoch, fenced, what)

    @staticmethod
    def _check_not_prepared(session: Session, rollout_id: str) -> None:
        if session.prepared is not None and time.monotonic() > session.prepared_until:
            log.warning("rollout %s: the checkpoint at epoch %d was neither resumed nor aborted in time; "
                        "letting it go", rollout_id, session.prepared)
            session.prepared = None
        if session.prepared is not None:
            raise SessionPreparedError(f"rollout {rollout_id!r} is held by a coordinated checkpoint (epoch "
                                       f"{session.prepared}) until it is resumed or aborted; retry")

    @staticmethod
    def _resource(session: Session, name: str) -> Resource:
        rid = session.env.resource_id(name)
        resource = session.env.resources.get(rid)
        if resource is None:
            raise BadRequestError(f"rollout {session.env.rollout_id!r} has no resource {name!r}; it has "
                                  + ", ".join(sorted(r.rsplit("/", 1)[-1] for r in session.env.resources)))
        return resource


# -- HTTP ----------------------------------------------------------------------------------

@dataclass
class _Fault:
    route: str
    status: int
    body: bytes


def build_app(host: EnvironmentHost, token: ServiceToken, *, faults: bool = False) -> Starlette:
    """The Starlette app serving ``host``. With ``faults``, ``POST /v1/faults`` makes the next
    requests of a route answer an injected status and body (drills and tests)."""
    injected: list[_Fault] = []

    def handler(route: str, fn: Callable[[Request, dict[str, Any]], Any]) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            if not token.accepts(request.headers.get("authorization")):
                return JSONResponse({"error": "unauthorized", "message": "missing or wrong bearer token"},
                                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
            for fault in injected:
                if fault.route == route:
                    injected.remove(fault)
                    return Response(fault.body, status_code=fault.status)
            try:
                body = await _json_body(request)
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
        return request.path_params["rollout_id"]

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "environment": host.environment, "boot_id": host.boot_id})

    async def stats(request: Request, body: dict) -> dict:
        return {"boot_id": host.boot_id, "sessions": len(host.sessions), **host.stats}

    async def open_(request: Request, body: dict) -> dict:
        return await host.describe(await host.open(rid(request), _task(body)))

    async def restore(request: Request, body: dict) -> dict:
        mutations = [MutationRecord.from_dict(m) for m in _field(body, "mutations", list)]
        session, mode = await host.restore(rid(request), _task(body), decode_exports(_field(body, "exports", dict)),
                                           mutations, _field(body, "fence_epoch", (int, type(None))))
        return await host.describe(session) | {"mode": mode}

    async def step(request: Request, body: dict) -> dict:
        raw = _field(body, "action", (str, dict))
        action = ToolCall(str(raw.get("name", "")), dict(raw.get("arguments") or {})) if isinstance(raw, dict) else raw
        return await host.step(rid(request), action, _field(body, "attempt", int), _field(body, "epoch", int),
                               _field(body, "key", str), _field(body, "expected_revisions", dict))

    async def verify(request: Request, body: dict) -> dict:
        return {"reward": await host.call(rid(request), lambda s: s.env.verify())}

    async def fence(request: Request, body: dict) -> dict:
        epoch = _field(body, "epoch", int)

        def fenced(session: Session) -> list[dict[str, Any]]:
            session.env.fence(session.env.rollout_id, epoch)
            return host._heads(session.env)

        return {"heads": await host.call(rid(request), fenced)}

    async def export(request: Request, body: dict) -> dict:
        wanted = _field(body, "resource_ids", list)
        return {"exports": encode_exports(await host.call(
            rid(request), lambda s: {r: s.env.resources[r].export_state() for r in wanted if r in s.env.resources}))}

    async def mutate(request: Request, body: dict) -> dict:
        req = MutationRequest(rid(request), _field(body, "attempt", int), _field(body, "epoch", int),
                              _field(body, "idempotency_key", str), _field(body, "expected_revision", int))
        return await host.mutate(rid(request), request.path_params["name"], req, _field(body, "op", str),
                                 _field(body, "args", dict))

    async def query(request: Request, body: dict) -> dict:
        name, op, args = request.path_params["name"], _field(body, "op", str), _field(body, "args", dict)
        return {"result": await host.call(rid(request), lambda s: host._resource(s, name).query(op, args))}

    async def prepare(request: Request, body: dict) -> dict:
        return await host.prepare(rid(request), _field(body, "epoch", int), float(_field(body, "hold_s", (int, float))))

    async def resume(request: Request, body: dict) -> None:
        await host.finish_checkpoint(rid(request), _field(body, "epoch", int), committed=True)

    async def abort(request: Request, body: dict) -> None:
        await host.finish_checkpoint(rid(request), _field(body, "epoch", int), committed=False)

    async def close(request: Request, body: dict) -> None:
        await host.close(rid(request))

    async def inject(request: Request, body: dict) -> dict:
        route = _field(body, "route", str)
        if body.get("clear"):
            injected[:] = [f for f in injected if f.route != route]
        fault = _Fault(route, int(body.get("status", 500)), str(body.get("body", "injected failure")).encode())
        injected.extend([fault] * int(body.get("count", 0)))
        return {"pending": len(injected)}

    one = "/v1/rollouts/{rollout_id:path}"
    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/stats", handler("stats", stats), methods=["GET"]),
        Route(f"{one}/resources/{{name}}/mutate", handler("mutate", mutate), methods=["POST"]),
        Route(f"{one}/resources/{{name}}/query", handler("query", query), methods=["POST"]),
        *(Route(f"{one}/{name}", handler(name, fn), methods=["POST"]) for name, fn in (
            ("open", open_), ("restore", restore), ("step", step), ("verify", verify), ("fence", fence),
            ("export", export), ("prepare", prepare), ("resume", resume), ("abort", abort))),
        Route(one, handler("close", close), methods=["DELETE"]),
    ]
    if faults:
        routes.append(Route("/v1/faults", handler("faults", inject), methods=["POST"]))
    return Starlette(routes=routes)


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


def _field(body: Mapping[str, Any], name: str, typ: type | tuple[type, ...]) -> Any:
    if name not in body:
        if isinstance(typ, tuple) and type(None) in typ:
            return None
        raise BadRequestError(f"the request lacks {name!r}")
    value = body[name]
    if not isinstance(value, typ) or (isinstance(value, bool) and typ is int):
        raise BadRequestError(f"{name!r} must be {getattr(typ, '__name__', typ)}, got {type(value).__name__}")
    return value


def _task(body: Mapping[str, Any]) -> Task:
    try:
        return Task.from_json(_field(body, "task", dict))
    except (KeyError, TypeError, ValueError) as exc:
        raise BadRequestError(f"'task' is no task ({exc!r})") from None


# -- running it ------------------------------------------------------------------------------

def _bind(host: str, port: int) -> socket.socket:
    # IPPROTO_TCP spelled out: asyncio sets TCP_NODELAY only on sockets that say so, and without it
    # every answer waits ~40 ms for a delayed ACK (headers and body are two writes).
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted server takes its port back at once
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


def _uvicorn(app: Starlette) -> uvicorn.Server:
    # No access log: request lines carry rollout ids at a rate nobody reads; errors are logged above.
    return uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                         timeout_keep_alive=30))


def serve_resources(environment: str, *, host: str = "127.0.0.1", port: int = 0, token: ServiceToken | None = None,
                    faults: bool = False, ready: Callable[[str], None] = lambda url: None) -> None:
    """Serve ``environment`` until SIGINT or SIGTERM (the CLI's ``serve-resources``); ``ready(url)``
    is called once the port listens. Closes every session (sandbox interpreters) on the way out."""
    token = token or ServiceToken.from_environment("serve-resources")
    sock = _bind(host, port)

    async def main() -> None:
        env_host = EnvironmentHost(environment)
        server = _uvicorn(build_app(env_host, token, faults=faults))
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)
        if server.started:
            ready(_url(sock))
        try:
            await serving
        finally:
            await env_host.close_all()

    asyncio.run(main())


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


class ResourceServer:
    """A resource server on a background thread of this process (tests, notebooks); the CLI's
    ``serve-resources`` runs the same app in a process of its own."""

    def __init__(self, environment: str, *, host: str = "127.0.0.1", port: int = 0,
                 token: ServiceToken | None = None, faults: bool = False) -> None:
        self.token = token or ServiceToken.from_environment("ResourceServer")
        self._sock = _bind(host, port)
        self.url = _url(self._sock)
        self._started = threading.Event()
        self._failure: BaseException | None = None
        self.host: EnvironmentHost | None = None
        self._server: uvicorn.Server | None = None
        self._thread = threading.Thread(target=self._run, args=(environment, faults), name="resource-server",
                                        daemon=True)
        self._thread.start()
        self._started.wait(30)
        if self._failure is not None or self._server is None or not self._server.started:
            raise ControlError(f"resource server for {environment!r} did not start: {self._failure!r}")

    def _run(self, environment: str, faults: bool) -> None:
        async def main() -> None:
            self.host = EnvironmentHost(environment)
            self._server = _uvicorn(build_app(self.host, self.token, faults=faults))
            serving = asyncio.create_task(self._server.serve(sockets=[self._sock]))
            while not self._server.started and not serving.done():
                await asyncio.sleep(0.01)
            self._started.set()
            try:
                await serving
            finally:
                await self.host.close_all()

        try:
            asyncio.run(main())
        except BaseException as exc:  # reported by __init__ (or lost at interpreter exit)
            self._failure = exc
            self._started.set()

    def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        self._thread.join(30)
        self._sock.close()

    def __enter__(self) -> ResourceServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
