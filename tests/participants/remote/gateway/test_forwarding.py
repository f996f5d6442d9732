"""The forwarder relays the owner's answer as the owner sent it: over real HTTP, an owner app behind
a front app whose every request goes through ``Forwarder.forward``."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from rollout_journal.participants.remote.gateway.forwarding import FORWARDED_BY, Forwarder
from rollout_journal.participants.remote.serving import ThreadedServer
from rollout_journal.participants.session.ownership import Remote

# Expires dates hold a comma: two cookies joined into one header with ", " no longer parse apart.
SESSION = "session=abc; Path=/; Expires=Wed, 09 Jun 2027 10:18:14 GMT"
ATTEMPT = "rj_attempt.r1=k2; Path=/; HttpOnly"


def _owner() -> Starlette:
    async def seed(request: Request) -> Response:
        answer = Response(b'{"ok": true}', media_type="application/json")
        answer.raw_headers.append((b"set-cookie", SESSION.encode()))
        answer.raw_headers.append((b"set-cookie", ATTEMPT.encode()))
        answer.headers["x-seen-forwarded-by"] = request.headers.get(FORWARDED_BY, "")
        return answer

    return Starlette(routes=[Route("/seed_session", seed, methods=["POST"])])


@pytest.fixture
def front() -> Iterator[str]:
    with ThreadedServer(_owner, name="owner") as owner:
        forwarder = Forwarder("front")

        def make_front() -> Starlette:
            async def passed_on(request: Request) -> Response:
                return await forwarder.forward(request, "r1", Remote(0, owner.url, "m-owner"), await request.body())

            return Starlette(routes=[Route("/seed_session", passed_on, methods=["POST"])])

        with ThreadedServer(make_front, name="front", on_stop=forwarder.aclose) as server:
            yield server.url


def test_each_set_cookie_of_the_owner_reaches_the_agent_as_its_own_header(front: str) -> None:
    """httpx's header mapping joins repeated headers with ", ": the forwarder used to send the
    owner's two cookies as one ``Set-Cookie``, which no client parses back into two."""
    answer = httpx.post(front + "/seed_session", json={})
    assert answer.status_code == 200 and answer.json() == {"ok": True}
    assert answer.headers.get_list("set-cookie") == [SESSION, ATTEMPT]
    assert dict(answer.cookies) == {"session": "abc", "rj_attempt.r1": "k2"}
    assert answer.headers["x-seen-forwarded-by"] == "front"  # the owner knows it was passed on once
