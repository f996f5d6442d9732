"""A resources server and an agent loop written to NeMo Gym's protocol, for the tool gateway's tests.

NeMo Gym itself needs Python >= 3.13.14 (its ``pyproject.toml:28``) and does not install here, so
these follow its source (NVIDIA-NeMo/Gym at 07d6b0d, 2026-08-22) line by line; each cites what it
follows. Nothing here imports NeMo Gym.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import uuid
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rollout_journal.participants.remote.serving import ThreadedServer

__all__ = ["CounterServer", "simple_agent_loop", "COUNTER_TOOLS"]

# The session cookie: NeMo Gym's setup_session_middleware (nemo_gym/server_utils.py:552-577) installs
# Starlette's SessionMiddleware with secret_key = session_cookie = f"{ServerClass.__name__}___{config.name}",
# and a middleware that sets request.session["session_id"] = existing or uuid4() on every request
# (:569-574; SESSION_ID_KEY = "session_id", :422). Starlette signs the cookie with itsdangerous, which
# this project does not install: the cookie here is the same JSON, base64, HMAC-signed with that key.
COOKIE = "CounterServer___counter"

COUNTER_TOOLS = [
    {
        "type": "function",
        "name": "increment_counter",
        "description": "Add count to the counter.",
        "parameters": {"type": "object", "properties": {"count": {"type": "integer"}}, "required": ["count"]},
    },
    {"type": "function", "name": "get_counter_value", "description": "The counter's value.", "parameters": {}},
]


def _sign(data: dict[str, Any]) -> str:
    payload = base64.urlsafe_b64encode(json.dumps(data).encode()).decode()
    mac = hmac.new(COOKIE.encode(), payload.encode(), hashlib.sha256).hexdigest()[:32]
    return f"{payload}.{mac}"


def _unsign(value: str | None) -> dict[str, Any]:
    if not value or "." not in value:
        return {}
    payload, mac = value.rsplit(".", 1)
    if not hmac.compare_digest(mac, hmac.new(COOKIE.encode(), payload.encode(), hashlib.sha256).hexdigest()[:32]):
        return {}
    try:
        return json.loads(base64.urlsafe_b64decode(payload))
    except ValueError:
        return {}


def counter_app(state: dict[str, int], requests: list[str], *, noisy: bool = False) -> Starlette:
    """NeMo Gym's ``example_session_state_mgmt`` resources server (its ``app.py:59-95``): state keyed
    by the session id; ``seed_session`` does ``setdefault(session_id, initial_count)`` (:67-72), each
    tool ``setdefault(session_id, 0)`` (:74-85), so an unknown or lost session silently gets default
    state; ``verify`` returns the request with ``reward`` (:87-95, ``BaseVerifyResponse``).
    ``noisy``: tools also answer a fresh uuid (a server that is not deterministic on re-apply)."""

    def session_of(request: Request) -> tuple[str, dict[str, Any]]:
        session = _unsign(request.cookies.get(COOKIE))
        session.setdefault("session_id", str(uuid.uuid4()))  # server_utils.py:569-574
        return session["session_id"], session

    def answer(body: Any, session: dict[str, Any]) -> Response:
        response = JSONResponse(body)
        response.set_cookie(COOKIE, _sign(session), httponly=True)
        return response

    async def seed_session(request: Request) -> Response:
        sid, session = session_of(request)
        body = await request.json()
        requests.append("seed_session")
        state.setdefault(sid, int(body.get("initial_count", 0)))
        return answer({}, session)

    async def increment_counter(request: Request) -> Response:
        sid, session = session_of(request)
        body = await request.json()
        requests.append("increment_counter")
        state[sid] = state.setdefault(sid, 0) + int(body.get("count", 1))
        out: dict[str, Any] = {"success": True}
        if noisy:
            out["nonce"] = str(uuid.uuid4())
        return answer(out, session)

    async def get_counter_value(request: Request) -> Response:
        sid, session = session_of(request)
        requests.append("get_counter_value")
        return answer({"count": state.setdefault(sid, 0)}, session)

    async def verify(request: Request) -> Response:
        sid, session = session_of(request)
        body = await request.json()
        requests.append("verify")
        reward = 1.0 if state.get(sid, 0) == int(body.get("expected_count", 0)) else 0.0
        return answer({**body, "reward": reward}, session)

    return Starlette(
        routes=[
            Route("/seed_session", seed_session, methods=["POST"]),
            Route("/increment_counter", increment_counter, methods=["POST"]),
            Route("/get_counter_value", get_counter_value, methods=["POST"]),
            Route("/verify", verify, methods=["POST"]),
        ]
    )


class CounterServer:
    """The counter server on a background thread; ``restart()`` loses every session, as a
    restarted NeMo Gym server does (its state is in memory), on the same port."""

    def __init__(self, *, noisy: bool = False) -> None:
        self.noisy = noisy
        self.state: dict[str, int] = {}
        self.requests: list[str] = []
        self.server: ThreadedServer | None = ThreadedServer(
            lambda: counter_app(self.state, self.requests, noisy=noisy), name="counter"
        )
        self.port = self.server.port
        self.url = self.server.url

    def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        self.state.clear()

    def start(self) -> None:
        self.server = ThreadedServer(
            lambda: counter_app(self.state, self.requests, noisy=self.noisy), port=self.port, name="counter"
        )

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()


class ServerCookies:
    """How NeMo Gym's agents hold a server's cookies: none kept by the HTTP client (its aiohttp
    session has a ``DummyCookieJar``, ``nemo_gym/server_utils.py``), the last answer's sent with the
    next call to the same server, replaced by each answer's (``simple_agent/app.py``:
    ``resources_server_cookies = api_response.cookies``, ``model_server_cookies =
    model_response.cookies``)."""

    def __init__(self, client: httpx.Client, url: str) -> None:
        self.client = client
        self.url = url
        self.cookies: dict[str, str] = {}

    def post(self, route: str, body: dict[str, Any]) -> httpx.Response:
        headers = {"cookie": "; ".join(f"{k}={v}" for k, v in self.cookies.items())} if self.cookies else {}
        answer = self.client.post(f"{self.url}/{route}", json=body, headers=headers)
        self.cookies = dict(answer.cookies)
        return answer


def cookieless_client(timeout_s: float = 120) -> httpx.Client:
    """An HTTP client that keeps no cookies, as NeMo Gym's."""
    return httpx.Client(timeout=timeout_s, cookies=CookieJar(DefaultCookiePolicy(allowed_domains=[])))


def simple_agent_loop(
    model_url: str, resources_url: str, body: dict[str, Any], *, max_steps: int = 8, stop_after_calls: int | None = None
) -> dict[str, Any] | None:
    """NeMo Gym's simple agent (``responses_api_agents/simple_agent/app.py``), line by line:

    - ``run`` (:277-352): ``POST /seed_session`` with the run body (:280-287) and keep the cookies;
      the episode; then ``POST /verify`` with ``body | {"response": ...}`` and the cookies (:334-344).
    - ``_create_episode`` (:80-250): a string ``input`` becomes a user message (:97-98); each step posts
      ``input + new_outputs`` to the model server's ``/v1/responses`` (:106-121), appends its ``output``
      (:129-130), stops on ``incomplete_details`` (:163-165) or an answer with no ``function_call``
      (:167-172); each function call's arguments are parsed (bad JSON: an error output, :179-184), posted
      to ``/{name}`` with the cookies (:187-192), and the raw response text, whatever its status, becomes a
      ``function_call_output`` (:186, :193, :216-222); ``max_steps`` bounds it (:228-230).

    ``stop_after_calls``: the process dies after that many HTTP calls (the crash drill); returns None then.
    """
    calls = 0

    def counted() -> bool:
        nonlocal calls
        calls += 1
        return stop_after_calls is not None and calls > stop_after_calls

    with cookieless_client() as client:
        resources, model = ServerCookies(client, resources_url), ServerCookies(client, f"{model_url}/v1")
        if counted():
            return None
        resources.post("seed_session", body)
        params = body["responses_create_params"]
        first = params["input"]
        inputs = [{"role": "user", "content": first, "type": "message"}] if isinstance(first, str) else list(first)
        new_outputs: list[dict[str, Any]] = []
        response: dict[str, Any] = {}
        for _ in range(max_steps):
            if counted():
                return None
            reply = model.post("responses", {**params, "input": inputs + new_outputs})
            reply.raise_for_status()
            response = reply.json()
            output = response["output"]
            new_outputs.extend(output)
            if response.get("incomplete_details"):
                break
            function_calls = [o for o in output if o["type"] == "function_call"]
            if not function_calls and any(o["type"] == "message" for o in output):
                break
            for call in function_calls:
                try:
                    args = json.loads(call["arguments"])
                except ValueError as exc:
                    text = json.dumps({"error": f"Invalid tool call arguments: {exc}"})
                else:
                    if counted():
                        return None
                    text = resources.post(call["name"], args).text
                new_outputs.append({"type": "function_call_output", "call_id": call["call_id"], "output": text})
        if counted():
            return None
        verified = resources.post("verify", {**body, "response": response})
        return verified.json()
