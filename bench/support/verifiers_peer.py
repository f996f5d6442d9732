"""The peer: verifiers 0.4.0's own interception server (``verifiers.v1.interception``), in memory, in
front of the same upstream, under the same load as the gateway. Runs in verifiers' venv, standalone
(no Env, no harness): one verifiers ``RolloutSession`` per stream, its bearer secret on each request
(``interception/server.py``). Prints one JSON object per repetition: direct, then through the peer.

    .venv-verifiers/bin/python bench/support/verifiers_peer.py UPSTREAM_BASE STREAMS TURNS MAX_TOKENS REPS
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.support.chat_load import run_load  # noqa: E402


async def main() -> None:
    upstream, streams, turns, max_tokens, reps = sys.argv[1], *map(int, sys.argv[2:6])
    os.environ.setdefault("RJ_KEY", "unused")
    import verifiers.v1 as vf
    from verifiers.v1.interception import InterceptionServer
    from verifiers.v1.session import RolloutSession
    from verifiers.v1.trace import AgentInfo, Trace, TraceTask

    def session() -> Any:
        ctx = vf.ModelContext(
            model="tiny",
            client=vf.EvalClientConfig(base_url=upstream + "/v1", api_key_var="RJ_KEY"),
            sampling=vf.SamplingConfig(temperature=0.0, max_tokens=max_tokens),
        )
        trace = Trace(
            task=TraceTask(type="Task", data={"prompt": "p"}, key="k", hash="h"),
            agent=AgentInfo(config=vf.AgentConfig()),
        )
        return RolloutSession(ctx=ctx, trace=trace)

    async with InterceptionServer() as server:
        for rep in range(reps):
            direct = await run_load(
                lambda i: upstream + "/v1/chat/completions",
                streams=streams,
                turns=turns,
                max_tokens=max_tokens,
                tag=f"p{rep}d",
            )
            slots = [server.acquire(session()) for _ in range(streams)]
            secrets = [(await slot.__aenter__())[1] for slot in slots]
            peer = await run_load(
                lambda i: server.base_url + "/v1/chat/completions",
                streams=streams,
                turns=turns,
                max_tokens=max_tokens,
                headers_of=lambda i, secrets=secrets: {"Authorization": f"Bearer {secrets[i]}"},  # type: ignore[misc]
                tag=f"p{rep}p",
            )
            for slot in slots:
                await slot.__aexit__(None, None, None)
            print(json.dumps({"direct": direct, "peer": peer}), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
