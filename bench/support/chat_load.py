"""The gateway bench's load: closed-loop streams, each a multi-turn chat conversation, each turn one
non-streaming ``/chat/completions`` call whose answer goes back into the conversation. Standard
library and httpx only: verifiers' venv runs it too (the peer's side of the comparison)."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any

import httpx


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q / 100
    low = int(k)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


async def run_load(
    url_of: Callable[[int], str],
    *,
    streams: int,
    turns: int,
    max_tokens: int,
    headers_of: Callable[[int], dict[str, str]] = lambda i: {},
    tag: str = "",
) -> dict[str, Any]:
    """``streams`` conversations at once (stream ``i`` posts to ``url_of(i)``); completions/s over the
    wall time, per-call latency percentiles, and dropped connections (retried once each, counted)."""
    latencies: list[float] = []
    dropped = 0

    async def stream(client: httpx.AsyncClient, i: int) -> None:
        nonlocal dropped
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"conversation {tag}{i}: say something"}]
        for turn in range(turns):
            body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
            for tries in (1, 2):
                started = time.perf_counter()
                try:
                    response = await client.post(url_of(i), json=body, headers=headers_of(i))
                    break
                except (httpx.ReadError, httpx.RemoteProtocolError, httpx.ConnectError):
                    dropped += 1
                    if tries == 2:
                        raise
            response.raise_for_status()
            latencies.append(time.perf_counter() - started)
            message = response.json()["choices"][0]["message"]
            messages += [
                {"role": "assistant", "content": message.get("content") or ""},
                {"role": "user", "content": f"turn {turn + 1}: go on"},
            ]

    limits = httpx.Limits(max_connections=streams * 2, max_keepalive_connections=streams * 2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        started = time.perf_counter()
        await asyncio.gather(*(stream(client, i) for i in range(streams)))
        elapsed = time.perf_counter() - started
    return {
        "completions": len(latencies),
        "completions_per_s": round(len(latencies) / elapsed, 2),
        "p50_ms": round(1000 * statistics.median(latencies), 1),
        "p99_ms": round(1000 * percentile(latencies, 99), 1),
        "dropped_connections_retried": dropped,
    }
