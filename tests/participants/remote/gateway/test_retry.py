"""The gateway's one retry policy, and where the upstream applies it: a refused or unreachable
upstream is tried ``retries + 1`` times, waits that start at ``backoff_s`` and double (a bounded
jitter on top); a 4xx is not retried, nor a stream that already handed tokens on."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import numpy as np
import pytest
from aiohttp import web
from tenacity import RetryCallState

from rollout_journal.journal.events import SamplingParams
from rollout_journal.participants.model.generation import BackendError, GenerationRequest, TokenChunk
from rollout_journal.participants.model.tiny_model import tiny_model_dir
from rollout_journal.participants.remote.gateway.retry import backoff
from rollout_journal.participants.remote.gateway.upstream import (
    CompletionsUpstream,
    UpstreamRejectedError,
    UpstreamUnavailableError,
)


def test_the_waits_start_at_backoff_s_and_double_with_at_most_backoff_s_of_jitter() -> None:
    policy = backoff("a call", 3, 0.1, OSError)
    for failed, doubled in ((1, 0.1), (2, 0.2), (3, 0.4)):
        state = RetryCallState(policy, None, (), {})
        state.attempt_number = failed
        waits = [policy.wait(state) for _ in range(200)]
        assert all(doubled <= w <= doubled + 0.1 for w in waits), (failed, min(waits), max(waits))
        assert max(waits) - min(waits) > 0.05  # spread: the calls that failed together come back apart


def test_a_transient_failure_is_tried_retries_plus_one_times_then_raised_as_it_was() -> None:
    tries: list[int] = []
    retried: list[int] = []

    async def scenario() -> None:
        async for attempt in backoff("a call", 2, 0.001, OSError, on_retry=lambda: retried.append(1)):
            with attempt:
                tries.append(1)
                raise ConnectionError(f"try {len(tries)}")

    with pytest.raises(ConnectionError, match="try 3"):
        asyncio.run(scenario())
    assert (len(tries), len(retried)) == (3, 2)


Answer = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _Scripted(CompletionsUpstream):
    """The upstream, a real HTTP server on this machine that answers each try with the next of
    ``answers`` (:func:`_call` serves it while the call runs)."""

    def __init__(self, answers: list[Answer], **kwargs: object) -> None:
        super().__init__("http://127.0.0.1:1", tiny_model_dir(), served_model="m", **kwargs)  # type: ignore[arg-type]
        self.answers = answers

    async def serve(self) -> web.AppRunner:
        async def next_answer(request: web.Request) -> web.StreamResponse:
            return await self.answers.pop(0)(request)

        app = web.Application()
        app.router.add_post(self.path, next_answer)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        self.base = f"http://127.0.0.1:{port}"
        return runner


def _chunk(ids: list[int], finish: str | None) -> str:
    choice = {"token_ids": ids, "logprobs": {"token_logprobs": [-0.5] * len(ids)}, "finish_reason": finish}
    return "data: " + json.dumps({"choices": [choice]}) + "\n\n"


async def _streamed(request: web.Request) -> web.StreamResponse:
    text = _chunk([5, 6], None) + _chunk([7], "stop") + "data: [DONE]\n\n"
    return web.Response(text=text, content_type="text/event-stream")


def _status(code: int) -> Answer:
    async def answer(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": f"status {code}"}}, status=code)

    return answer


async def _dropped_connection(request: web.Request) -> web.StreamResponse:
    """The connection closed with no answer (a server that died or restarted meanwhile)."""
    assert request.transport is not None
    request.transport.close()
    return web.Response()


async def _timed_out(request: web.Request) -> web.StreamResponse:
    await asyncio.sleep(2)  # past the client's read timeout (_Scripted's timeout_s)
    return web.Response()


async def _broken_after_a_token(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(_chunk([5], None).encode())
    assert request.transport is not None
    request.transport.close()  # mid-body: the chunked body never ends
    return response


def _call(upstream: _Scripted, chunk_tokens: int = 1) -> list[TokenChunk]:
    request = GenerationRequest(
        np.asarray([1, 2, 3], dtype=np.int32), SamplingParams(max_tokens=8), request_id="c1", chunk_tokens=chunk_tokens
    )

    async def run() -> list[TokenChunk]:
        runner = await upstream.serve()
        try:
            return [chunk async for chunk in upstream.stream(request)]
        finally:
            await upstream.aclose()
            await runner.cleanup()

    return asyncio.run(run())


@pytest.mark.parametrize("chunk_tokens", [1, 0], ids=["streamed", "whole"])
def test_a_503_and_a_dropped_connection_are_retried_then_the_call_goes_through(chunk_tokens: int) -> None:
    async def whole(request: web.Request) -> web.StreamResponse:
        choice = {"token_ids": [5, 6, 7], "logprobs": {"token_logprobs": [-0.5] * 3}, "finish_reason": "stop"}
        return web.json_response({"choices": [choice]})

    upstream = _Scripted([_status(503), _dropped_connection, _streamed if chunk_tokens else whole], backoff_s=0.001)
    chunks = _call(upstream, chunk_tokens)
    assert [int(i) for c in chunks for i in c.ids] == [5, 6, 7] and chunks[-1].finish_reason is not None
    assert (upstream.tries, upstream.retried) == (3, 2)


@pytest.mark.parametrize("chunk_tokens", [1, 0], ids=["streamed", "whole"])
def test_an_upstream_down_on_every_try_is_unavailable_naming_the_tries_and_the_last_failure(chunk_tokens: int) -> None:
    upstream = _Scripted([_dropped_connection, _status(429), _status(502)], retries=2, backoff_s=0.001)
    with pytest.raises(UpstreamUnavailableError, match="after 3 tries: HTTP 502") as failure:
        _call(upstream, chunk_tokens)
    assert (failure.value.status, failure.value.tries, failure.value.timeout) == (502, 3, False)
    assert failure.value.__cause__ is None

    upstream = _Scripted([_status(503), _timed_out], retries=1, backoff_s=0.001, timeout_s=0.3)
    with pytest.raises(UpstreamUnavailableError, match=r"after 2 tries: \w*Timeout\w*: ") as failure:
        _call(upstream, chunk_tokens)
    assert (failure.value.status, failure.value.timeout) == (None, True)
    assert isinstance(failure.value.__cause__, TimeoutError)


@pytest.mark.parametrize("chunk_tokens", [1, 0], ids=["streamed", "whole"])
def test_a_4xx_is_refused_on_the_first_try(chunk_tokens: int) -> None:
    upstream = _Scripted([_status(400), _streamed], backoff_s=0.001)
    with pytest.raises(UpstreamRejectedError, match="HTTP 400.*status 400"):
        _call(upstream, chunk_tokens)
    assert (upstream.tries, upstream.retried) == (1, 0)


def test_a_stream_that_broke_after_tokens_flowed_is_not_tried_again() -> None:
    upstream = _Scripted([_broken_after_a_token, _streamed], backoff_s=0.001)
    with pytest.raises(BackendError, match=r"the stream broke after tokens flowed \(ClientPayloadError: "):
        _call(upstream)
    assert (upstream.tries, upstream.retried) == (1, 0)
