"""The tool gateway: NeMo Gym resources servers behind the session API.

NeMo Gym's resources-server protocol (read from NVIDIA-NeMo/Gym 07d6b0d):
``POST /seed_session`` opens a session (``nemo_gym/base_resources_server.py:136-147``), one
``POST /{tool_name}`` route per tool with the tool's JSON arguments as the body
(``resources_servers/example_session_state_mgmt/app.py:59-65``), ``POST /verify`` returns the
reward (``base_resources_server.py:88-113``). The server keys its state by a signed session cookie
that its middleware sets on every request (``nemo_gym/server_utils.py:552-577``), and an unknown
or lost session silently gets default state (``example_session_state_mgmt/app.py:67-85``): a
server cannot say it lost a rollout.

An agent is given ``http://gw/r/<rollout>/tools/<server>`` as the server's URL. The gateway holds
the server's cookie per rollout (the agent's own cookies are not forwarded: the path names the
rollout), and every call is an effect of the rollout's session: a ``ResourceMutation``
(``resource_id = <rollout>/<server>``, ``kind = nemo_gym``, ``op`` the route, the body as args,
``{"status", "body", "content_type"}`` as the result; a 4xx/5xx answer of a tool route is a valid
observation, as NeMo Gym's simple agent treats it, ``responses_api_agents/simple_agent/app.py:186``),
durable before the agent sees it. A re-driven agent is answered from the journal.

When the live server session is not known here (a new attempt, this gateway restarted, the server
restarted: connection refused or reset), the server's declared recovery decides:

- ``event_sourced`` (default): seed a fresh session with the journaled ``seed_session`` body and
  re-apply every journaled call of the rollout's life in order, each answer compared with the
  journal's (another answer: :class:`ToolReplayDivergedError`); then the live call.
- ``restart_only``: the rollout starts over from turn 0 on a new attempt (the gateway opens it so
  when such a server holds journaled calls of the rollout).
- ``stateless``: nothing to rebuild.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rollout_journal.participants.remote.gateway.cookies import keeps_no_cookies
from rollout_journal.participants.remote.gateway.errors import (
    GatewayError,
    ToolReplayDivergedError,
    ToolServerUnavailableError,
)
from rollout_journal.participants.remote.gateway.retry import backoff
from rollout_journal.participants.resources import Recovery
from rollout_journal.participants.resources.canonical import canonical_json
from rollout_journal.participants.rollout.effects import Effect, tool_digest
from rollout_journal.participants.session.api import RolloutSession, ToolContext, ToolOutcome, ToolRequest

__all__ = ["SEED", "VERIFY", "ToolGateway", "ToolServer", "parse_tool_servers"]

log = logging.getLogger(__name__)
SEED, VERIFY = "seed_session", "verify"


@dataclass(frozen=True)
class ToolServer:
    name: str
    url: str
    recovery: Recovery = Recovery.EVENT_SOURCED


def parse_tool_servers(specs: list[str]) -> dict[str, ToolServer]:
    """``NAME=URL[,recovery=MODE]`` per server (the CLI's ``--tools``)."""
    servers: dict[str, ToolServer] = {}
    for spec in specs:
        name, _, rest = spec.partition("=")
        url, *options = rest.split(",")
        if not name or not url.startswith(("http://", "https://")):
            raise GatewayError(
                400, "invalid_option", f"--tools {spec!r}: expected NAME=http://HOST:PORT[,recovery=MODE]"
            )
        recovery = Recovery.EVENT_SOURCED
        for option in options:
            key, _, value = option.partition("=")
            if key != "recovery":
                raise GatewayError(400, "invalid_option", f"--tools {spec!r}: unknown option {key!r}")
            try:
                recovery = Recovery(value)
            except ValueError:
                modes = ", ".join(m.value for m in Recovery)
                raise GatewayError(400, "invalid_option", f"--tools {spec!r}: recovery is one of {modes}") from None
        servers[name] = ToolServer(name, url.rstrip("/"), recovery)
    return servers


@dataclass
class _Live:
    """A rollout's live session at one server: its cookies, for one attempt of the rollout."""

    attempt: int
    cookies: dict[str, str] = field(default_factory=dict)


class ToolGateway:
    def __init__(
        self, servers: Mapping[str, ToolServer], *, retries: int = 3, backoff_s: float = 0.2, timeout_s: float = 300.0
    ) -> None:
        self.servers = dict(servers)
        self.retries = retries
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s  # a call the server has not answered by then is a server gone (see _post)
        self.rebuilds = 0  # server sessions rebuilt by re-applying journaled calls
        self._live: dict[tuple[str, str], _Live] = {}
        self._client: Any = None

    def client(self) -> Any:
        """One HTTP client for every rollout, with a cookie jar that keeps nothing: each rollout's
        session cookies are its own (``_Live.cookies``, sent by hand). A jar that kept the server's
        cookies would send the last rollout's session with the next rollout's first call, and two
        rollouts would share one server session."""
        import httpx

        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=self.timeout_s,
                limits=httpx.Limits(max_connections=256),
                cookies=keeps_no_cookies(),
            )
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    def server(self, name: str) -> ToolServer:
        server = self.servers.get(name)
        if server is None:
            known = ", ".join(sorted(self.servers)) or "none (start the gateway with --tools NAME=URL)"
            raise GatewayError(404, "unknown_tool_server", f"no tool server {name!r} here; known: {known}")
        return server

    def needs_restart(self, session_effects: list[Effect], rollout_id: str) -> bool:
        """Whether a new attempt of the rollout must start over: a restart-only server holds journaled
        calls of its life that no live session here carries."""
        for name, server in self.servers.items():
            held = any(e.resource_id == f"{rollout_id}/{name}" for e in session_effects)
            if server.recovery is Recovery.RESTART_ONLY and (rollout_id, name) not in self._live and held:
                return True
        return False

    def forget(self, rollout_id: str) -> None:
        for key in [k for k in self._live if k[0] == rollout_id]:
            del self._live[key]

    def is_retry(self, effect: Effect, rollout_id: str, name: str, op: str, body: bytes) -> bool:
        """Whether a call is the journaled ``effect`` again (same server, route and arguments)."""
        try:
            args = json.loads(body or b"{}")
        except ValueError:
            return False
        if effect.kind != "tool" or not isinstance(args, dict):
            return False
        return effect.digest == tool_digest(f"{rollout_id}/{name}", op, canonical_json(args))

    async def call(self, session: RolloutSession, name: str, op: str, body: bytes) -> tuple[int, bytes, str]:
        """One call of the rollout's agent to ``name``'s route ``op``: (status, body, content type)."""
        server = self.server(name)
        try:
            args = json.loads(body or b"{}")
        except ValueError as exc:
            raise GatewayError(400, "invalid_request", f"tool {name}.{op}: the body is no JSON ({exc})") from None
        if not isinstance(args, dict):
            raise GatewayError(400, "invalid_request", f"tool {name}.{op}: the body must be a JSON object")

        async def run(ctx: ToolContext) -> ToolOutcome:
            return await self._live_call(session, server, op, args, ctx)

        answer = await session.tool_call(ToolRequest(name, op, args, kind="nemo_gym"), run)
        result = answer.result
        return (
            int(result["status"]),
            str(result["body"]).encode(),
            str(result.get("content_type") or "application/json"),
        )

    async def _live_call(
        self, session: RolloutSession, server: ToolServer, op: str, args: dict[str, Any], ctx: ToolContext
    ) -> ToolOutcome:
        key = (session.rollout_id, server.name)
        try:
            async for attempt in backoff(f"tool {server.name}.{op}", self.retries, self.backoff_s, OSError):
                with attempt:
                    try:
                        live = self._live.get(key)
                        if live is None or live.attempt != ctx.attempt:
                            live = await self._rebuild(session, server, op, ctx)
                        status, text, content_type, cookies = await self._post(server, op, args, live.cookies)
                    except OSError:  # the server went away: it may have lost every session
                        self._live.pop(key, None)
                        raise
                    live.cookies.update(cookies)
                    return ToolOutcome({"status": status, "body": text, "content_type": content_type})
        except OSError as exc:
            raise ToolServerUnavailableError(
                server.name, server.url, f"{type(exc).__name__}: {exc}", self.retries + 1
            ) from exc
        raise AssertionError("unreachable")

    async def _rebuild(self, session: RolloutSession, server: ToolServer, op: str, ctx: ToolContext) -> _Live:
        """A live server session for the rollout, brought to what its journal holds. Kept for the
        rollout's next calls only once whole: a rebuild cut off half way (a server error, the
        request cancelled) leaves the next call to start it again, never a session missing the
        rest of the journaled calls."""
        key = (session.rollout_id, server.name)
        self._live.pop(key, None)
        live = _Live(ctx.attempt)
        journaled = ctx.journaled
        if op == SEED or not journaled or server.recovery is Recovery.STATELESS:
            self._live[key] = live
            return live
        log.info(
            "rollout %s: rebuilding its session at tool server %s from %d journaled calls",
            session.rollout_id,
            server.name,
            len(journaled),
        )
        for effect in journaled:
            status, text, _, cookies = await self._post(server, effect.op, json.loads(effect.args_json), live.cookies)
            live.cookies.update(cookies)
            then = json.loads(effect.result_json)
            if effect.op != VERIFY and (status, text) != (then["status"], then["body"]):
                raise ToolReplayDivergedError(
                    session.rollout_id,
                    server.name,
                    effect.op,
                    json.dumps(then),
                    json.dumps({"status": status, "body": text}),
                )
        self.rebuilds += 1
        self._live[key] = live
        return live

    async def _post(
        self, server: ToolServer, op: str, args: dict[str, Any], cookies: dict[str, str]
    ) -> tuple[int, str, str, dict[str, str]]:
        import httpx

        headers = {"cookie": "; ".join(f"{k}={v}" for k, v in cookies.items())} if cookies else {}
        try:
            response = await self.client().post(f"{server.url}/{op}", json=args, headers=headers)
        except httpx.TransportError as exc:  # its timeouts included
            # Lost, or not answered in time: the server may have applied the call, so the rollout's
            # session there is no longer what the journal says. Both leave that session for a new
            # one rebuilt from the journal (_live_call), never a retry on top of a half-known state.
            raise ConnectionError(f"{type(exc).__name__}: {exc}") from exc
        fresh = {name: value for name, value in response.cookies.items()}
        return response.status_code, response.text, response.headers.get("content-type", ""), fresh
