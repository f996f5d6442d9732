"""A request for a rollout another gateway owns, passed on to it once.

Under group ownership a gateway writes only the rollouts of the partitions the namespace's group
assigns it; an agent may still reach any gateway (one base URL per host, a load balancer in front).
The gateway that receives a request for another member's rollout sends it on, once, to the address
the owner advertises, and relays the answer as it comes (a stream stays a stream). The forwarded
request carries ``X-RJ-Forwarded-By``: a gateway that receives one for a rollout it does not own
either (the partition moved meanwhile) answers 421 naming the owner it knows instead of passing it
on again, so a request never circles. An owner that cannot be reached (it died, and the group has
not yet noticed: its session timeout) is answered 421 with its address, nothing sent anywhere.
"""

from __future__ import annotations

import logging

import httpx
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from rollout_journal.participants.remote.gateway.cookies import keeps_no_cookies
from rollout_journal.participants.session.errors import NotOwnerError
from rollout_journal.participants.session.ownership import Remote

__all__ = ["FORWARDED_BY", "Forwarder"]

log = logging.getLogger(__name__)

FORWARDED_BY = "x-rj-forwarded-by"
# Hop-by-hop headers (RFC 9110 7.6.1) and the ones the client library sets again for the new hop.
_NOT_PASSED = frozenset(
    ("host", "connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "content-length")
)


class Forwarder:
    """Passes requests on to their owner (one connection pool, made in the serving loop)."""

    def __init__(self, name: str, *, connect_timeout_s: float = 5.0) -> None:
        self.name = name
        self.connect_timeout_s = connect_timeout_s
        self._client: httpx.AsyncClient | None = None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            # No read timeout: the owner answers when its model call is done, as it would directly.
            timeout = httpx.Timeout(None, connect=self.connect_timeout_s)
            self._client = httpx.AsyncClient(
                timeout=timeout, limits=httpx.Limits(max_connections=None), cookies=keeps_no_cookies()
            )
        return self._client

    async def forward(self, request: Request, rollout: str, route: Remote, body: bytes) -> Response:
        """The owner's answer to ``request``; ``NotOwnerError`` (421, naming the owner) when it was
        forwarded here already or the owner cannot be reached."""
        if route.base_url is None or request.headers.get(FORWARDED_BY):
            raise NotOwnerError(rollout, route.base_url, route.member)
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _NOT_PASSED]
        headers.append((FORWARDED_BY, self.name))
        url = route.base_url.rstrip("/") + request.url.path
        if request.url.query:
            url += "?" + request.url.query
        client = self._http()
        try:
            sent = client.build_request(request.method, url, headers=headers, content=body)
            answer = await client.send(sent, stream=True)
        except httpx.TransportError as exc:
            log.warning("rollout %s: owner %s at %s unreachable: %s", rollout, route.member, route.base_url, exc)
            raise NotOwnerError(rollout, route.base_url, route.member) from None
        relayed = StreamingResponse(
            answer.aiter_raw(), status_code=answer.status_code, background=BackgroundTask(answer.aclose)
        )
        # The owner's header list as it came, repeats kept: a mapping joins them with ", ", and two
        # Set-Cookie headers joined (an Expires date holds a comma) no longer parse apart.
        relayed.raw_headers = [(k, v) for k, v in answer.headers.raw if k.decode("latin-1").lower() not in _NOT_PASSED]
        return relayed

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
