"""The gateway in front of the session's ``vllm serve`` (CPU, the tiny model): token ids go upstream,
every call's prompt is its parent's prompt and sampled ids plus the new messages (nothing sampled
is re-encoded), logprobs are journaled, and a rerun is answered from the journal byte for byte."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

from rollout_journal.journal import ModelCall, open_journal
from rollout_journal.participants.remote.gateway import GatewayConfig, GatewayServer
from tests.support.gateway_fixtures import chat_agent


@pytest.mark.slow
def test_token_in_token_out_through_vllm_and_a_byte_identical_rerun(tmp_path: Path, vllm_server: str) -> None:
    journal = tmp_path / "journal"
    generate = GatewayServer(GatewayConfig(upstream=vllm_server, journal=str(journal), port=0))
    try:
        assert generate.gateway is not None and generate.gateway.upstream.api == "generate"
        replies = chat_agent(generate.base_url("v"), 3, max_tokens=12)
        assert chat_agent(generate.base_url("s"), 3, max_tokens=12, stream=True) == replies  # greedy
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "temperature": 0}
        first = httpx.post(generate.url + "/r/v/v1/chat/completions", json=body, timeout=120)
        again = httpx.post(generate.url + "/r/v/v1/chat/completions", json=body, timeout=120)
        assert first.status_code == 200 and first.content == again.content
    finally:
        generate.close()

    calls = [
        e.event for e in open_journal(str(journal), read_only=True).read_rollout("v") if isinstance(e.event, ModelCall)
    ]
    assert len(calls) == 3
    head = np.zeros(0, dtype=np.int32)
    for call in calls:
        assert call.prefix_len == len(head)  # the whole parent head is kept: prompt + sampled ids
        head = np.concatenate([head[: call.prefix_len], call.prompt_delta, call.output_ids])
        assert len(call.logprobs) == len(call.output_ids) and np.all(call.logprobs <= 0)
        assert np.isfinite(call.logprobs).all() and call.logprobs.min() < 0

    # /v1/completions with a token-id prompt gives the same greedy ids (the fallback upstream API)
    completions = GatewayServer(
        GatewayConfig(upstream=vllm_server, journal=str(tmp_path / "other"), port=0, upstream_api="completions")
    )
    try:
        assert chat_agent(completions.base_url("c"), 3, max_tokens=12) == replies
    finally:
        completions.close()
