"""Pytest plugin: a fixed-rate model upstream and journaling gateways on background threads, and
an unmodified OpenAI-SDK chat agent to drive them (``pytest_plugins`` in ``tests/conftest.py``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rollout_journal.participants.model.tiny_model import tiny_model_dir
from rollout_journal.participants.remote.gateway import GatewayConfig, GatewayServer
from tests.support.fixed_rate_upstream import FixedRateUpstream


@pytest.fixture
def upstream() -> Iterator[FixedRateUpstream]:
    """A model server streaming deterministic tokens (no rate limit: the tests time nothing)."""
    server = FixedRateUpstream(tiny_model_dir(), chunk=2)
    try:
        yield server
    finally:
        server.close()


GatewayFactory = Callable[..., GatewayServer]


@pytest.fixture
def start_gateway(tmp_path: Path, upstream: FixedRateUpstream) -> Iterator[GatewayFactory]:
    """``start_gateway(**config)``: a gateway in front of ``upstream`` on the test's file journal
    (``tmp_path / "journal"`` unless ``journal=`` says otherwise); all are closed at the end."""
    started: list[GatewayServer] = []

    def start(**overrides: Any) -> GatewayServer:
        config = GatewayConfig(
            **{
                "upstream": upstream.url,
                "journal": str(tmp_path / "journal"),
                "port": 0,
                "upstream_retries": 2,
                "upstream_logprobs": "processed",  # the fixed-rate upstream's constant logprobs, declared
                **overrides,
            }
        )
        server = GatewayServer(config)
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in reversed(started):
            server.close()


def chat_agent(
    base_url: str, turns: int, *, stream: bool = False, max_tokens: int = 8, prompt: str = "hi"
) -> list[str]:
    """An agent that knows only an OpenAI base URL: ``turns`` chat turns, each reply sent back as it
    came, then a user message; returns the replies."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": prompt}]
    replies = []
    for turn in range(turns):
        if stream:
            text = ""
            for chunk in client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=max_tokens, temperature=0, stream=True
            ):
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
        else:
            reply = client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=max_tokens, temperature=0
            )
            text = reply.choices[0].message.content or ""
        replies.append(text)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"turn {turn + 1}: go on"}]
    return replies
