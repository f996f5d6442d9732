"""The gateway's cookies: the one it gives, and the ones its HTTP clients must never keep.

A NeMo Gym agent sends no attempt key. What it does carry is cookies: those of its resources
server's last answer go with its next tool call and its ``verify``, replaced by each answer's
(``responses_api_agents/simple_agent/app.py``, ``resources_server_cookies = api_response.cookies``;
its HTTP client keeps none itself). So the gateway names a run of such an agent with a cookie it
sets on every tool answer of that run, ``rj_attempt.<rollout>``: named after the rollout and valid
on every path, so a client with one jar for many rollouts sends each rollout its own.

The gateway's own HTTP clients (to tool servers, to the owner of a rollout) serve every rollout:
a client that kept cookies would send one rollout's session with another's request.
"""

from __future__ import annotations

from http.cookiejar import CookieJar, DefaultCookiePolicy

from starlette.responses import Response

__all__ = ["attempt_cookie", "give_attempt_cookie", "keeps_no_cookies"]


def attempt_cookie(rollout: str) -> str:
    """The cookie that names a run of the agent of ``rollout``: ``rj_attempt.<rollout>``."""
    return f"rj_attempt.{rollout}"


def give_attempt_cookie(response: Response, rollout: str, key: str) -> None:
    response.set_cookie(attempt_cookie(rollout), key, path="/", httponly=True, samesite="strict")


def keeps_no_cookies() -> CookieJar:
    """A cookie jar for an HTTP client that serves many rollouts: it stores nothing, so every cookie
    a request carries is one it was given by hand."""
    return CookieJar(DefaultCookiePolicy(allowed_domains=[]))
