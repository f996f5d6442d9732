"""The journaling gateway: an OpenAI-compatible server in front of a vLLM server, for agents that
only know a base URL.

``rollout-journal gateway --upstream URL --journal URL --port P`` (:func:`serve_gateway`), or
:class:`GatewayServer` on a background thread. Every call goes through the session API, so a
model answer and a tool answer are durable in the journal before the agent sees them, and a
re-driven agent (its job restarted) is answered from the journal for every call it already made.

Routes (``{prefix}`` names the rollout: ``/r/<rollout_id>``, NeMo Gym's own
``/ng-rollout/<rollout_id>``, or none with an ``X-Rollout-Id`` header):

- ``POST {prefix}/v1/chat/completions`` (``stream`` true or false), ``POST {prefix}/v1/responses``,
  ``GET {prefix}/v1/models``; ``POST {prefix}/inference/v1/generate`` for token-native clients;
- ``POST {prefix}/tools/<server>/<route>``: a NeMo Gym resources server (``--tools NAME=URL``);
- ``POST /r/<id>/open`` (``{"group_id", "group_size"}``), ``POST /r/<id>/finish`` (``{"reward"}``),
  ``POST /r/<id>/give-up`` (``{"error", "reason", "group_policy"}``: the agent's retry budget is
  spent; as ``RolloutSession.give_up``, its given-up record lets the trainer resolve its group),
  ``GET /r/<id>/status``; ``GET /health``, ``GET /metrics``.

Token-in-token-out: messages are rendered with the model's own chat template and ids go upstream
(``participants.remote.gateway.upstream``); sampled ids are never re-encoded. Streaming sends the
tokens as they come; the last chunk and ``[DONE]`` wait until the call is durable (a journal that
refuses it ends the stream with an error event and no ``[DONE]``, so the client raises). A client
that disconnects mid-stream does not cancel its call: it runs on and is journaled, and the
re-driven agent gets it from the journal.

A request is served only by the rollout's owner (``participants.session.ownership``): with
``ownership="group"`` several gateways share a Kafka namespace as members of its consumer group,
each writing the rollouts of the partitions the group assigns it; a request for another member's
rollout is forwarded once to that member (``participants.remote.gateway.forwarding``; 421 with its
address if it cannot be), and one for a partition changing hands is answered 503 with
``Retry-After``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, Field
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from rollout_journal.journal.errors import RolloutJournalError
from rollout_journal.journal.events import SamplingParams
from rollout_journal.journal.journal import Journal
from rollout_journal.journal.whole_numbers import whole_number
from rollout_journal.participants.adapters.nemo_gym import rollout_of_capture_id
from rollout_journal.participants.cancelling import cancel_and_wait
from rollout_journal.participants.model.gate import ModelParticipant
from rollout_journal.participants.model.generation import TokenChunk
from rollout_journal.participants.model.tokenizer import ChatTokenizer
from rollout_journal.participants.remote.gateway import openai_shapes as shapes
from rollout_journal.participants.remote.gateway.cookies import attempt_cookie, give_attempt_cookie
from rollout_journal.participants.remote.gateway.errors import GatewayError, answer_for
from rollout_journal.participants.remote.gateway.forwarding import Forwarder
from rollout_journal.participants.remote.gateway.response_stream import ResponseStream
from rollout_journal.participants.remote.gateway.tools import SEED, VERIFY, ToolGateway, parse_tool_servers
from rollout_journal.participants.remote.gateway.upstream import UpstreamClient
from rollout_journal.participants.session.api import ModelRequest, RolloutRef, SessionFactory
from rollout_journal.participants.session.chat import ChatAnswer, ChatSession, Redrive, TemplatePrompts
from rollout_journal.participants.session.errors import (
    EffectNotDurableError,
    NotOwnerError,
    OwnerMovingError,
    RolloutFinishedError,
    RolloutNotFoundError,
    StaleAttemptError,
)
from rollout_journal.participants.session.ownership import GroupOwnership, Local, Moving, Remote, RolloutOwnership

__all__ = ["Gateway", "GatewayConfig", "ROLLOUT_ID"]

log = logging.getLogger(__name__)
ROLLOUT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")  # NeMo Gym's pattern (rollout_correlation.py:38)
_PREFIXES = ("/r/", "/ng-rollout/")


class GatewayConfig(BaseModel):
    """What ``rollout-journal gateway`` takes."""

    upstream: str = Field(description="the model server's base URL (vLLM's OpenAI server)")
    journal: str = Field(description="a directory, or kafka://host:port/namespace")
    model_dir: str | None = Field(None, description="the served model's folder (tokenizer, chat template)")
    host: str = "127.0.0.1"
    port: int = 8100
    upstream_api: Literal["auto", "generate", "completions"] = "auto"
    # What the upstream's logprobs are: probe asks it (a raw server is refused); processed or raw says so
    upstream_logprobs: Literal["probe", "processed", "raw"] = "probe"
    tools: list[str] = Field(default_factory=list, description="NAME=URL[,recovery=MODE] per resources server")
    require_open: bool = False  # refuse rollouts not opened with POST /r/<id>/open (404 unknown_rollout)
    max_body_bytes: int = 8 * 1024 * 1024
    # The writer named in the events: a Kafka namespace's writer slot (single), this member's name
    # (group; default gateway-<host>-<pid>, so members are told apart in the journal and in status)
    writer: str | None = None
    # single: this gateway writes the whole journal (a second one on a Kafka namespace fences it);
    # group: one member of the namespace's consumer group among several gateways (Kafka only)
    ownership: Literal["single", "group"] = "single"
    # group: the base URL other gateways forward this one's rollouts to (default: where it listens)
    advertise: str | None = None
    default_max_tokens: int = 256
    snapshot_every_turns: int = 4
    upstream_retries: int = 3
    # A tool server that has not answered a call by then is taken as gone: the rollout's session there
    # is rebuilt from the journal and the call made again (see ToolGateway)
    tool_timeout_s: float = Field(300.0, gt=0.0)
    finish_on_verify: bool = True  # a tool server's /verify reward finishes the rollout
    max_in_flight: int = 512  # model calls admitted at once
    progress_every_tokens: int = 0  # journal a long call's progress every that many tokens (0: off)
    # The tool server NeMo Gym's own /ng-rollout/<id>/<route> calls go to (its ServerClient prefixes
    # resources-server calls with the rollout when observability is on: server_utils.py:341-358).
    ng_resources: str | None = None

    def writer_name(self) -> str:
        if self.writer is not None:
            return self.writer
        if self.ownership == "group":
            from rollout_journal.journal.kafka.group import default_member_name

            return f"gateway-{default_member_name()}"
        return "gateway"


class _TooLarge(GatewayError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, "request_too_large", f"the request body is over the gateway's limit of {limit} bytes")


class Gateway:
    """The gateway's state: sessions per rollout over one factory, the upstream, the tool servers."""

    def __init__(
        self,
        config: GatewayConfig,
        journal: Journal,
        upstream: UpstreamClient,
        *,
        ownership: RolloutOwnership | None = None,
    ) -> None:
        self.config = config
        self.journal = journal
        self.upstream = upstream
        self.tokenizer = upstream.tokenizer
        self.prompts = TemplatePrompts(self.tokenizer)
        self.writer = ownership.name if isinstance(ownership, GroupOwnership) else config.writer_name()
        self.factory = SessionFactory(
            journal,
            ModelParticipant(upstream, max_in_flight=config.max_in_flight),
            writer=self.writer,
            ownership=ownership,
            snapshot_every_turns=config.snapshot_every_turns,
            progress_every_tokens=config.progress_every_tokens,
        )
        self.tools = ToolGateway(parse_tool_servers(config.tools), timeout_s=config.tool_timeout_s)
        self.chats: dict[str, ChatSession] = {}
        self.attempt_keys: dict[str, str] = {}
        self.fenced_keys: dict[str, set[str]] = {}
        self.opened: dict[str, RolloutRef] = {}  # refs given by POST /open (group, size)
        self.metrics: Counter[str] = Counter()
        self._locks: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[Any]] = set()  # calls whose client left: they run on to be journaled
        self._models: Any = None
        self.forwarder = Forwarder(self.writer)

    def start(self) -> None:
        """Read what the journal holds (blocking; before serving) and, under group ownership, join
        the namespace's group (from within the serving loop)."""
        self.factory.start()
        self.factory.ownership.start()

    async def aclose(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for chat in list(self.chats.values()):
            try:
                await chat.session.close()
            except RolloutJournalError:
                pass
        await self.factory.ownership.aclose()  # a member leaves its group: its partitions move on at once
        await self.forwarder.aclose()
        await self.tools.aclose()
        await self.upstream.aclose()

    # -- the ASGI app ---------------------------------------------------------------------
    def app(self) -> ASGIApp:
        """Every request to :meth:`dispatch` (GET, HEAD and POST; any other method 405), which answers
        every error itself: a Starlette router with one catch-all route did the same, with a
        middleware stack of awaits per request on the gateway's busiest path."""

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":  # lifespan is off; nothing else is served
                return
            request = Request(scope, receive, send)
            if request.method in ("GET", "HEAD", "POST"):
                response = await self.dispatch(request)
            else:
                response = PlainTextResponse("Method Not Allowed", 405, headers={"Allow": "GET, HEAD, POST"})
            await response(scope, receive, send)

        return app

    async def dispatch(self, request: Request) -> Response:
        path = request.url.path
        rollout: str | None = None
        try:
            if path == "/health":
                ownership = self.factory.ownership
                stopped = ownership.stopped  # why this gateway writes nothing more (None: it writes)
                return JSONResponse({"ok": stopped is None, "stopped": stopped, **ownership.describe()})
            if path == "/metrics":
                return JSONResponse(self.metrics_json())
            rollout, rest = self._route(request, path)
            self.metrics["requests"] += 1
            ownership = self.factory.ownership
            route = ownership.route(rollout)
            if ownership.stopped is not None and isinstance(route, Local):
                raise NotOwnerError(rollout, None)  # it writes nothing more: a group member forwards instead
            if isinstance(route, Remote):
                response = await self.forwarder.forward(request, rollout, route, await self._body(request))
                self.metrics["forwarded"] += 1
            elif isinstance(route, Moving):
                raise OwnerMovingError(rollout, route.retry_after_s)
            else:
                response = await self._serve(request, rollout, rest)
            self.metrics[f"status_{response.status_code}"] += 1
            return self._with_run_cookie(request, rollout, response)
        except ClientDisconnect:
            return Response(status_code=499)
        except Exception as exc:
            answer = answer_for(self._moved(exc, rollout), rollout)
            self.metrics[f"status_{answer.status_code}"] += 1
            body = json.loads(bytes(answer.body))
            self.metrics[f"error_{body['error']['type']}"] += 1
            return self._with_run_cookie(request, rollout, answer) if rollout is not None else answer

    def _with_run_cookie(self, request: Request, rollout: str, response: Response) -> Response:
        """``response`` with the run cookie its request brought (gateway.cookies), errors included: a
        NeMo Gym agent sends on only its last answer's cookies, so an answer without the cookie would
        leave its next call with no key, unfenced. Only ever the request's own key: the current run's
        key is given by a ``seed_session`` alone, never to a request that showed none."""
        key, from_header = self._attempt_key(request, rollout)
        name = attempt_cookie(rollout).encode() + b"="
        given = any(k == b"set-cookie" and v.startswith(name) for k, v in response.raw_headers)
        if key is not None and not from_header and not given:  # given: a seed_session's new run, or the owner's
            give_attempt_cookie(response, rollout, key)
        return response

    def _moved(self, exc: Exception, rollout: str | None) -> Exception:
        """A call cut off because the rollout's partition left this gateway mid-way (its session was
        closed, its append refused) is answered as the move it is: 503 or 421, not a stale attempt."""
        if rollout is None or not isinstance(exc, (StaleAttemptError, EffectNotDurableError)):
            return exc
        route = self.factory.ownership.route(rollout)
        if isinstance(route, Moving):
            return OwnerMovingError(rollout, route.retry_after_s)
        if isinstance(route, Remote):
            return NotOwnerError(rollout, route.base_url, route.member)
        return exc

    def _route(self, request: Request, path: str) -> tuple[str, str]:
        for prefix in _PREFIXES:
            if path.startswith(prefix):
                rollout, _, rest = path[len(prefix) :].partition("/")
                rest = "/" + rest
                if prefix == "/ng-rollout/":  # NeMo Gym's capture id: a re-dispatch's carries -a<n>
                    rollout = rollout_of_capture_id(rollout)
                    if rest.startswith("/training-token-capture/"):
                        rest = rest[len("/training-token-capture") :]
                break
        else:
            rollout, rest = request.headers.get("x-rollout-id", ""), path
        if not rollout:
            raise GatewayError(
                400,
                "rollout_required",
                "name the rollout: use the base URL http://<gateway>/r/<rollout_id>/v1, or send X-Rollout-Id",
            )
        if not ROLLOUT_ID.match(rollout):
            raise GatewayError(
                400, "invalid_rollout_id", f"rollout id {rollout[:80]!r} does not match {ROLLOUT_ID.pattern}"
            )
        return rollout, rest

    async def _serve(self, request: Request, rollout: str, rest: str) -> Response:
        method = request.method
        if method == "POST" and rest in ("/v1/chat/completions", "/chat/completions"):
            return await self.chat_completions(request, rollout)
        if method == "POST" and rest in ("/v1/responses", "/responses"):
            return await self.responses(request, rollout)
        if method == "GET" and rest in ("/v1/models", "/models"):
            return JSONResponse(await self.models())
        if method == "POST" and rest == "/inference/v1/generate":
            return await self.generate(request, rollout)
        if method == "POST" and rest.startswith("/tools/"):
            server, _, op = rest[len("/tools/") :].partition("/")
            return await self.tool(request, rollout, server, op.strip("/"))
        if method == "POST" and rest == "/open":
            return await self.open(request, rollout)
        if method == "POST" and rest == "/finish":
            return await self.finish(request, rollout)
        if method == "POST" and rest == "/give-up":
            return await self.give_up(request, rollout)
        if method == "GET" and rest == "/status":
            return JSONResponse(self.status(rollout))
        if method == "POST" and self.config.ng_resources and request.url.path.startswith("/ng-rollout/"):
            return await self.tool(request, rollout, self.config.ng_resources, rest.strip("/"))
        raise GatewayError(
            404, "not_found", f"{method} {rest} is no gateway route (see `rollout-journal gateway --help`)"
        )

    async def _body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        length = None if declared is None else whole_number(declared)
        if length is not None and length > limit:
            raise _TooLarge(limit)
        chunks, size = [], 0
        async for piece in request.stream():
            size += len(piece)
            if size > limit:
                raise _TooLarge(limit)
            chunks.append(piece)
        return b"".join(chunks)

    async def _json(self, request: Request) -> Any:
        body = await self._body(request)
        try:
            return json.loads(body or b"{}")
        except ValueError as exc:
            raise GatewayError(400, "invalid_request", f"the body is no JSON: {exc}", "body") from None

    # -- sessions per rollout --------------------------------------------------------------
    def _attempt_key(self, request: Request, rollout: str) -> tuple[str | None, bool]:
        """The run of the agent a request comes from, and whether a new one may start here: the
        header an agent gives (a new key is a new run), else the cookie the gateway gave its
        ``seed_session`` (see :meth:`tool`; only a seed_session starts a run, so a cookie that is
        not the current run's is a zombie's)."""
        header = request.headers.get("x-rj-attempt-key") or request.headers.get("x-session-id")
        if header:
            return header, True
        return request.cookies.get(attempt_cookie(rollout)) or None, False

    def _stale(self, rollout: str) -> StaleAttemptError:
        state = self.factory.state_of(rollout)
        current = self.chats.get(rollout)
        return StaleAttemptError(
            rollout,
            0,
            0,
            current.session.epoch if current else (state.epoch if state else 0),
            "a newer run of the agent",
        )

    async def chat_for(
        self, request: Request, rollout: str, *, fresh: bool = False, key: str | None = None
    ) -> ChatSession:
        """The rollout's current chat session; a new attempt when ``fresh`` (a re-driven agent), when
        the request names another attempt key than the session's (``key``: the one the gateway gave
        it, else the request's own), or when none is open here."""
        starts_runs = key is not None
        if key is None:
            key, starts_runs = self._attempt_key(request, rollout)
        lock = self._locks.setdefault(rollout, asyncio.Lock())
        async with lock:
            held = self.chats.get(rollout)
            if held is not None and held.session is not self.factory.sessions.get(rollout):
                self._forget_runs(rollout)  # it left this gateway since (its partition moved): stale knowledge
            if key is not None:
                self._refuse_an_older_run(rollout, key, starts_runs)
            if key is not None and key in self.fenced_keys.get(rollout, set()):
                raise self._stale(rollout)
            if key is not None and not starts_runs and self.attempt_keys.get(rollout) not in (None, key):
                raise self._stale(rollout)
            chat = self.chats.get(rollout)
            usable = chat is not None and chat.session is self.factory.sessions.get(rollout)
            same_run = key is None or self.attempt_keys.get(rollout) in (None, key)
            if chat is not None and usable and same_run and not fresh:
                if key is None or rollout in self.attempt_keys:
                    return chat
                # A run takes over a session opened without its key (an orchestrator's open, a keyless
                # call after a restart): the run this session serves from now on. Where the journal
                # names another run as current, an attempt that names this one opens below instead,
                # so the journal never lags (a journal that names none yet is left as it is: a new
                # attempt there would count a re-drive that never happened).
                if not chat.session.writes or chat.session.state.run_standing(key) in (None, "current"):
                    self.attempt_keys[rollout] = key
                    return chat
            if self.config.require_open and rollout not in self.opened and not self.factory.known(rollout):
                raise RolloutNotFoundError(rollout)
            ref = self.opened.get(rollout) or self._ref(request, rollout)
            state = self.factory.state_of(rollout)
            restart = (
                state is not None and not state.terminal and self.tools.needs_restart(state.effects.all(), rollout)
            )
            reason = "re-driven by the agent" if fresh else "opened by the gateway"
            if restart:
                reason = "restart from turn 0: a restart_only tool server lost the rollout's session"
            session = await self.factory.open(ref, reason=reason, restart_from_zero=restart, run_key=key)
            self.tools.forget(rollout)
            previous = self.attempt_keys.get(rollout)
            if key is not None:
                if previous is not None and previous != key:
                    self.fenced_keys.setdefault(rollout, set()).add(previous)
                self.attempt_keys[rollout] = key
            chat = ChatSession(session, self.prompts, self.tokenizer)
            self.chats[rollout] = chat
            self.metrics["sessions_opened"] += 1
            return chat

    def _refuse_an_older_run(self, rollout: str, key: str, starts_runs: bool) -> None:
        """The journal knows the rollout's runs, each attempt naming the one it served, whatever this
        gateway remembers (it may have restarted, or the rollout's session may have left it and come
        back). A run a newer one fenced is stale; so is a key the journal never named, unless it may
        start a run (a header key: a new run of the agent), which a cookie may not (only a
        ``seed_session`` mints one, and the attempt it opens names it), or this gateway serves it
        already. A finished rollout's runs are left to memory: they replay, and journal nothing."""
        state = self.factory.state_of(rollout)
        if state is None or state.terminal:  # a finished rollout's runs only replay: nothing to protect
            return
        standing = state.run_standing(key)
        if standing == "older" or (standing == "unknown" and not starts_runs and self.attempt_keys.get(rollout) != key):
            raise self._stale(rollout)

    def _ref(self, request: Request, rollout: str) -> RolloutRef:
        size = request.headers.get("x-rollout-group-size", "1")
        return RolloutRef(
            rollout,
            request.headers.get("x-rollout-group", ""),
            group_size=whole_number(size) or 1,
            topology=f"gateway:{self.upstream.policy_version}",
        )

    async def _complete(
        self, request: Request, rollout: str, chat_request: shapes.ChatRequest, on_tokens: Any
    ) -> ChatAnswer:
        chat = await self.chat_for(request, rollout)
        try:
            answer = await chat.complete(
                chat_request.messages, chat_request.params, tools=chat_request.tools, on_tokens=on_tokens
            )
        except Redrive:
            self.metrics["redrives"] += 1
            chat = await self.chat_for(request, rollout, fresh=True)
            answer = await chat.complete(
                chat_request.messages, chat_request.params, tools=chat_request.tools, on_tokens=on_tokens
            )
        self._count(answer)
        return answer

    def _count(self, answer: ChatAnswer) -> None:
        a = answer.answer
        self.metrics["calls_replayed" if a.replayed else "calls_live"] += 1
        self.metrics["tokens_generated"] += a.new_tokens
        self.metrics["tokens_continued"] += a.continued_from

    # -- Chat Completions ---------------------------------------------------------------------
    async def chat_completions(self, request: Request, rollout: str) -> Response:
        req = shapes.chat_request(await self._json(request), default_max_tokens=self.config.default_max_tokens)
        model = req.model or await self.model_name()
        if not req.stream:
            answer = await self._complete(request, rollout, req, None)
            return JSONResponse(shapes.chat_completion(answer, model, token_ids=req.token_ids))
        queue = _Chunks()
        task = self._spawn(self._complete(request, rollout, req, queue.put_chunk))
        await _first_event(queue, task)
        if task.done() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
        return StreamingResponse(self._chat_events(queue, task, model, req), media_type="text/event-stream")

    def _spawn(self, work: Any) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _chat_events(
        self, queue: asyncio.Queue[TokenChunk], task: asyncio.Task[Any], model: str, req: shapes.ChatRequest
    ) -> AsyncIterator[str]:
        text = _VisibleText(self.tokenizer)
        # One id and one time for every chunk of the stream, as OpenAI's: the call's own id is known only
        # once it is journaled, after the first tokens went out (a client may group chunks by id).
        call_id, created, started = f"stream-{uuid.uuid4().hex}", int(time.time()), False
        async for chunk in _drain(queue, task):
            delta = text.add(chunk.ids)
            if not started:
                started = True
                yield shapes.chunk(call_id, created, model, {"role": "assistant", "content": ""})
            if delta:
                yield shapes.chunk(call_id, created, model, {"content": delta})
        try:
            answer: ChatAnswer = task.result()
        except Exception as exc:
            body = json.loads(bytes(answer_for(exc).body))
            yield "data: " + json.dumps(body) + "\n\n"  # no [DONE]: the client raises
            return
        a = answer.answer
        if not started:
            yield shapes.chunk(call_id, created, model, {"role": "assistant", "content": ""})
        rest = answer.content[len(text.sent) :] if answer.content.startswith(text.sent) else ""
        if rest:
            yield shapes.chunk(call_id, created, model, {"content": rest})
        if answer.tool_calls:
            calls = [{"index": i, **c} for i, c in enumerate(answer.tool_calls)]
            yield shapes.chunk(call_id, created, model, {"tool_calls": calls})
        yield shapes.chunk(call_id, created, model, {}, answer.finish_reason)
        if req.include_usage:
            yield shapes.usage_chunk(call_id, created, model, a.prompt_ids, a.output_ids)
        yield "data: [DONE]\n\n"

    # -- the Responses API ----------------------------------------------------------------------
    async def responses(self, request: Request, rollout: str) -> Response:
        body = await self._json(request)
        req = shapes.responses_request(body, default_max_tokens=self.config.default_max_tokens)
        token_ids = req.token_ids or request.headers.get("x-rj-token-ids") == "1"
        model = req.chat.model or await self.model_name()
        if not req.chat.stream:
            answer = await self._complete(request, rollout, req.chat, None)
            return JSONResponse(shapes.response_object(answer, body, model, token_ids=token_ids))
        queue = _Chunks()
        task = self._spawn(self._complete(request, rollout, req.chat, queue.put_chunk))
        await _first_event(queue, task)
        if task.done() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
        return StreamingResponse(
            self._response_events(queue, task, model, body, token_ids), media_type="text/event-stream"
        )

    async def _response_events(
        self,
        queue: asyncio.Queue[TokenChunk],
        task: asyncio.Task[Any],
        model: str,
        body: Mapping[str, Any],
        token_ids: bool,
    ) -> AsyncIterator[str]:
        text = _VisibleText(self.tokenizer)
        stream = ResponseStream(body, model)
        for event in stream.created():
            yield event
        async for chunk in _drain(queue, task):
            for event in stream.text(text.add(chunk.ids)):
                yield event
        try:
            answer: ChatAnswer = task.result()
        except Exception as exc:
            for event in stream.failed(json.loads(bytes(answer_for(exc).body))):
                yield event
            return
        for event in stream.closing(answer, token_ids=token_ids):
            yield event

    # -- token-native clients -----------------------------------------------------------------
    async def generate(self, request: Request, rollout: str) -> Response:
        """vLLM's ``/inference/v1/generate`` (non-streaming): ids in, ids and logprobs out; each call
        its own turn, in arrival order (``X-RJ-Attempt: new`` starts the next attempt)."""
        body = await self._json(request)
        if not isinstance(body, dict) or not isinstance(body.get("token_ids"), list) or not body["token_ids"]:
            raise GatewayError(400, "invalid_request", "token_ids must be a non-empty array of ints", "token_ids")
        if body.get("stream"):
            raise GatewayError(400, "unsupported_parameter", "stream: token-native calls are answered whole", "stream")
        sp = body.get("sampling_params") or {}
        try:
            prompt = np.asarray([int(t) for t in body["token_ids"]], dtype=np.int32)
            params = SamplingParams(
                float(sp.get("temperature", 1.0)),
                float(sp.get("top_p", 1.0)),
                int(sp.get("max_tokens", 16)),
                sp.get("seed"),
            )
        except (TypeError, ValueError) as exc:
            raise GatewayError(
                400, "invalid_request", f"token_ids or sampling_params: {exc}", "sampling_params"
            ) from None
        fresh = request.headers.get("x-rj-attempt") == "new"
        chat = await self.chat_for(request, rollout, fresh=fresh)
        session = chat.session
        if session.model_index:  # the previous call's turn is over (each token-native call is a turn)
            await session.end_turn([])
        answer = await session.model_call(ModelRequest(prompt, params, describe="generate"))
        self.metrics["calls_replayed" if answer.replayed else "calls_live"] += 1
        return JSONResponse(
            {
                "request_id": answer.call_id,
                "model": await self.model_name(),
                "choices": [
                    {
                        "index": 0,
                        "token_ids": answer.output_ids.tolist(),
                        "logprobs": {
                            "content": [
                                {"token_id": int(t), "logprob": float(lp)}
                                for t, lp in zip(answer.output_ids, answer.logprobs)
                            ]
                        },
                        "finish_reason": answer.finish_reason,
                    }
                ],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(answer.output_ids)},
            }
        )

    # -- tools ----------------------------------------------------------------------------------
    async def tool(self, request: Request, rollout: str, server: str, op: str) -> Response:
        if not op:
            raise GatewayError(404, "not_found", f"POST /tools/{server}/<route>: name the route")
        self.tools.server(server)
        body = await self._body(request)
        # A NeMo Gym agent names its run by the cookie its tool answers carry (gateway.cookies): a
        # seed_session without a header key starts a run, whatever cookie it brings along.
        minted = uuid.uuid4().hex if op == SEED and not self._attempt_key(request, rollout)[1] else None
        chat = await self.chat_for(request, rollout, key=minted)
        session = chat.session
        if op == SEED and session.position != (0, 0):  # an episode starts with seed_session: a re-drive
            chat = await self.chat_for(request, rollout, fresh=True, key=minted)
        elif op != SEED and session.fresh and len(session.state.effects):
            # A tool call mid-episode on a session just opened here: the agent outlived the gateway
            # that served it. It goes on after what the journal holds (a retry of the last call is
            # answered from the journal).
            last = session.skip_to_end()
            if last is not None and self.tools.is_retry(last, rollout, server, op, body):
                session.step -= 1
        status, text, content_type = await self.tools.call(chat.session, server, op, body)
        self.metrics["tool_calls"] += 1
        if op == VERIFY and self.config.finish_on_verify and status == 200 and not chat.session.state.terminal:
            reward = _reward(text)
            if reward is not None:
                await chat.finish(reward)
                self._retire_chats()
        response = Response(text, status, media_type=content_type.split(";")[0] or "application/json")
        if minted is not None:  # the new run's key (the dispatch gives every later answer the request's)
            give_attempt_cookie(response, rollout, minted)
        return response

    # -- control --------------------------------------------------------------------------------
    async def open(self, request: Request, rollout: str) -> Response:
        body = await self._json(request)
        if not isinstance(body, dict):
            raise GatewayError(400, "invalid_request", "the body must be a JSON object", "body")
        size = body.get("group_size", 1)
        self.opened[rollout] = RolloutRef(
            rollout,
            str(body.get("group_id") or ""),
            sibling=int(body.get("sibling", 0)),
            group_size=int(size) if isinstance(size, int) else 1,
            topology=f"gateway:{self.upstream.policy_version}",
        )
        chat = await self.chat_for(request, rollout)
        return JSONResponse(chat.session.status())

    def _forget_runs(self, rollout: str) -> None:
        self.attempt_keys.pop(rollout, None)
        self.fenced_keys.pop(rollout, None)

    def _retire_chats(self) -> None:
        """Drop what the gateway holds of rollouts the factory let go of (finished, beyond what it
        keeps): their chat sessions, tool-server sessions, attempt keys and refs, and their locks
        where nobody holds one (a finished rollout journals nothing more, so a request that comes
        later and takes a new lock races nothing). A long-lived gateway holds what its live and
        recently finished rollouts need, not one entry per rollout it ever served."""
        for rid in [r for r, chat in self.chats.items() if self.factory.sessions.get(r) is not chat.session]:
            if chat_is_done(self.chats[rid]):
                del self.chats[rid]
                self.tools.forget(rid)
                self._forget_runs(rid)
                self.opened.pop(rid, None)
                lock = self._locks.get(rid)
                if lock is not None and not lock.locked():
                    del self._locks[rid]

    async def finish(self, request: Request, rollout: str) -> Response:
        body = await self._json(request)
        reward = body.get("reward") if isinstance(body, dict) else None
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise GatewayError(400, "invalid_request", "finish needs a numeric reward", "reward")
        chat = await self.chat_for(request, rollout)
        if chat.session.state.finished:
            raise RolloutFinishedError(rollout, chat.session.state.next_turn, chat.session.state.reward)
        messages = body.get("messages")
        await chat.finish(float(reward), messages if isinstance(messages, list) else None)
        self._retire_chats()
        return JSONResponse(chat.session.status())

    async def give_up(self, request: Request, rollout: str) -> Response:
        """End the rollout for good without a result (``RolloutSession.give_up``). Giving a given-up
        rollout up again answers its status; a finished one is refused (it has its result)."""
        body = await self._json(request)
        if not isinstance(body, dict):
            raise GatewayError(400, "invalid_request", "the body must be a JSON object", "body")
        error, reason = body.get("error"), body.get("reason", "given up by the agent")
        if not isinstance(error, str) or not error:
            raise GatewayError(400, "invalid_request", "give-up needs an error: the failure's kind", "error")
        if not isinstance(reason, str):
            raise GatewayError(400, "invalid_request", "give-up's reason must be a string", "reason")
        policy = body.get("group_policy", "drop")
        if policy not in ("drop", "redispatch"):
            raise GatewayError(400, "invalid_request", "group_policy must be 'drop' or 'redispatch'", "group_policy")
        chat = await self.chat_for(request, rollout)
        state = chat.session.state
        if state.finished:
            raise RolloutFinishedError(rollout, state.next_turn, state.reward)
        await chat.session.give_up(error, reason, group_policy=policy)
        self._retire_chats()
        return JSONResponse(chat.session.status())

    def status(self, rollout: str) -> dict[str, Any]:
        chat = self.chats.get(rollout)
        if chat is not None:
            return {**chat.session.status(), "served_here": True}
        state = self.factory.state_of(rollout)
        if state is None:
            raise RolloutNotFoundError(rollout)
        return {
            "rollout": rollout,
            "attempt": state.attempt,
            "epoch": state.epoch,
            "committed_turns": state.next_turn,
            "finished": state.finished,
            "given_up": state.given_up,
            "reward": state.reward,
            "effects": len(state.effects),
            "served_here": False,
        }

    async def model_name(self) -> str:
        return await self.upstream.model_name()

    async def models(self) -> Any:
        if self._models is None:
            self._models = await self.upstream.get_json("/v1/models")
        return self._models

    def metrics_json(self) -> dict[str, Any]:
        return {
            **dict(self.metrics),
            "sessions": len(self.chats),
            "upstream_tries": self.upstream.tries,
            "upstream_retries": self.upstream.retried,
            "tool_sessions_rebuilt": self.tools.rebuilds,
        }


def chat_is_done(chat: ChatSession) -> bool:
    return chat.session.state.terminal


def _reward(text: bytes) -> float | None:
    try:
        body = json.loads(text)
    except ValueError:
        return None
    reward = body.get("reward") if isinstance(body, dict) else None
    return float(reward) if isinstance(reward, (int, float)) and not isinstance(reward, bool) else None


class _Chunks(asyncio.Queue[TokenChunk]):
    """A streaming call's chunks; ``first`` is set once one arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.first = asyncio.Event()

    async def put_chunk(self, chunk: TokenChunk) -> None:
        self.put_nowait(chunk)
        self.first.set()


async def _first_event(queue: _Chunks, task: asyncio.Task[Any]) -> None:
    """Wait for a first token or the call's end (a call that fails before any token is answered
    with a plain HTTP error, not a broken stream)."""
    if queue.first.is_set() or task.done():
        return
    waiter = asyncio.ensure_future(queue.first.wait())
    try:
        await asyncio.wait({waiter, task}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when the client went away: no waiter outlives the request
        await cancel_and_wait(waiter)


async def _drain(queue: asyncio.Queue[TokenChunk], task: asyncio.Task[Any]) -> AsyncIterator[TokenChunk]:
    """The call's chunks as they come, until it ended and every chunk was taken."""
    while True:
        if not queue.empty():
            yield queue.get_nowait()
            continue
        if task.done():
            return
        getter = asyncio.ensure_future(queue.get())
        try:
            await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # a getter cancelled before it took its chunk leaves it in the queue
            await cancel_and_wait(getter)  # nothing, for a getter that took its chunk
        if not getter.cancelled():
            yield getter.result()


class _VisibleText:
    """The text of a streaming call so far, as far as it can be shown: bytes of an unfinished UTF-8
    character and tool-call markup are held back (the markup goes out parsed, at the end)."""

    _MARK = "<tool_call>"

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = ""

    def add(self, ids: np.ndarray) -> str:
        self.ids.extend(int(t) for t in ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True).rstrip("\ufffd")
        cut = text.find(self._MARK)
        if cut >= 0:
            text = text[:cut]
        else:
            for n in range(len(self._MARK) - 1, 0, -1):  # a mark may be arriving
                if text.endswith(self._MARK[:n]):
                    text = text[:-n]
                    break
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta
