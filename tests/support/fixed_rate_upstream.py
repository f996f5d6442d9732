"""An OpenAI-shaped model server that streams deterministic tokens at a fixed rate.

It stands where ``vllm serve`` stands, for the tests and for the gateway bench's second baseline
(the gateway's own cost, without a model's): ``/inference/v1/generate``, ``/v1/completions``
(token-id prompts) and ``/v1/chat/completions`` (rendered with the model folder's template), all
streaming or not, ``/v1/models`` and ``/health``. A completion is ``max_tokens`` ids drawn from a
generator seeded by the prompt's ids and the request's seed, so the same prompt gets the same
answer and another prompt another one; ``script`` texts instead answer the k-th call of a
conversation (k = generation prompts in the prompt) with that text and the eos. Tokens come
``chunk`` at a time, ``rate`` tokens per second per stream (0: as fast as it can). Every logprob,
sampled or (``prompt_logprobs``) of the prompt, is log(1/2): the server reports them raw.

Faults for the tests: ``POST /faults {"status": 503, "count": 2}`` answers the next two requests
503; ``{"drop_after": 3, "count": 1}`` drops the next stream's connection after 3 tokens.
``GET /stats`` counts the completions requested and the tokens generated.

Run it alone: ``python -m tests.support.fixed_rate_upstream --model-dir DIR --port P --rate 500``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rollout_journal.participants.model.tokenizer import ROLE_TOKENS, SPECIAL_TOKENS, ChatTokenizer
from rollout_journal.participants.remote.serving import ThreadedServer, bind, run_loop, serve

LOGPROB = -0.6931472  # log(1/2) for every token
MAX_MODEL_LEN = 2048
Choice = Callable[[np.ndarray, str | None], dict[str, Any]]  # a piece of the answer and its finish reason


@dataclass
class Faults:
    status: int = 0
    status_count: int = 0
    drop_after: int = -1
    drop_count: int = 0


@dataclass
class Upstream:
    tokenizer: ChatTokenizer
    rate: float = 0.0
    chunk: int = 1
    script: list[str] = field(default_factory=list)
    model: str = "tiny"
    root: str = ""  # the model folder, as vLLM's /v1/models names it
    faults: Faults = field(default_factory=Faults)
    completions: int = 0
    tokens: int = 0
    requests: int = 0

    def __post_init__(self) -> None:
        self._assistant = self.tokenizer._tok.token_to_id(ROLE_TOKENS["assistant"])
        self._vocab = self.tokenizer.vocab_size
        self._scripted = [
            np.concatenate([self.tokenizer.encode(t), [self.tokenizer.eos_id]]).astype(np.int32) for t in self.script
        ]

    def answer(self, prompt: list[int], max_tokens: int, seed: int | None) -> np.ndarray:
        if self._scripted:
            k = max(0, prompt.count(self._assistant) - 1)
            return self._scripted[min(k, len(self._scripted) - 1)][:max_tokens]
        digest = hashlib.sha256(np.asarray(prompt, dtype="<i4").tobytes() + str(seed).encode()).digest()
        rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
        return rng.integers(len(SPECIAL_TOKENS), self._vocab, size=max_tokens).astype(np.int32)

    async def pieces(self, ids: np.ndarray) -> AsyncIterator[np.ndarray]:
        drop = self.faults.drop_after if self.faults.drop_count > 0 else -1
        if drop >= 0:
            self.faults.drop_count -= 1
        started = time.monotonic()
        sent = 0
        for start in range(0, len(ids), self.chunk):
            piece = ids[start : start + self.chunk]
            if self.rate > 0:
                due = started + (start + len(piece)) / self.rate
                delay = due - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            if drop >= 0 and sent + len(piece) > drop:
                raise ConnectionResetError("fault injection: connection dropped mid-stream")
            sent += len(piece)
            self.tokens += len(piece)
            yield piece

    def too_long(self, prompt: list[int], max_tokens: int) -> Response | None:
        """vLLM's answer to a prompt over the model's length (its message, its status)."""
        if len(prompt) + max_tokens <= MAX_MODEL_LEN:
            return None
        message = (
            f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested "
            f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the messages, {max_tokens} in the completion)."
        )
        return JSONResponse({"error": {"message": message, "type": "BadRequestError", "code": 400}}, 400)

    def fault(self) -> Response | None:
        self.requests += 1
        if self.faults.status_count > 0:
            self.faults.status_count -= 1
            return JSONResponse({"error": {"message": "fault injection", "type": "fault"}}, self.faults.status)
        return None


def build_app(upstream: Upstream) -> Starlette:
    u = upstream

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def models(request: Request) -> Response:
        return JSONResponse(
            {"object": "list", "data": [{"id": u.model, "object": "model", "root": u.root, "max_model_len": 2048}]}
        )

    async def stats(request: Request) -> Response:
        return JSONResponse({"completions": u.completions, "tokens": u.tokens, "requests": u.requests})

    async def faults(request: Request) -> Response:
        body = await request.json()
        if "status" in body:
            u.faults.status, u.faults.status_count = int(body["status"]), int(body.get("count", 1))
        if "drop_after" in body:
            u.faults.drop_after, u.faults.drop_count = int(body["drop_after"]), int(body.get("count", 1))
        return JSONResponse({"ok": True})

    def finish(n: int, max_tokens: int, ids: np.ndarray) -> str:
        return "stop" if len(ids) and int(ids[-1]) == u.tokenizer.eos_id else ("length" if n >= max_tokens else "stop")

    async def answered(ids: np.ndarray, max_tokens: int, stream: bool, choice: Choice) -> Response:
        """The completion ``ids`` whole, or streamed as server-sent events, each piece's choice
        spelled by ``choice`` (the endpoint's shape)."""
        if not stream:
            async for _ in u.pieces(ids):
                pass
            return JSONResponse({"model": u.model, "choices": [choice(ids, finish(len(ids), max_tokens, ids))]})

        async def events() -> AsyncIterator[str]:
            n = 0
            async for piece in u.pieces(ids):
                n += len(piece)
                reason = finish(n, max_tokens, ids) if n >= len(ids) else None
                yield "data: " + json.dumps({"model": u.model, "choices": [choice(piece, reason)]}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def generate(request: Request) -> Response:
        failed = u.fault()
        if failed is not None:
            return failed
        body = await request.json()
        sp = body.get("sampling_params") or {}
        prompt = [int(t) for t in body["token_ids"]]
        max_tokens = int(sp.get("max_tokens") or 16)
        refused = u.too_long(prompt, max_tokens)
        if refused is not None:
            return refused
        ids = u.answer(prompt, max_tokens, sp.get("seed"))
        u.completions += 1

        def choice(piece: np.ndarray, reason: str | None) -> dict[str, Any]:
            return {
                "index": 0,
                "token_ids": piece.tolist(),
                "logprobs": {"content": [{"token_id": int(t), "logprob": LOGPROB} for t in piece]},
                "finish_reason": reason,
            }

        return await answered(ids, max_tokens, bool(body.get("stream")), choice)

    async def completions(request: Request) -> Response:
        failed = u.fault()
        if failed is not None:
            return failed
        body = await request.json()
        prompt = body["prompt"]
        if isinstance(prompt, str):
            prompt = u.tokenizer.encode(prompt).tolist()
        max_tokens = int(body.get("max_tokens") or 16)
        refused = u.too_long(list(prompt), max_tokens)
        if refused is not None:
            return refused
        ids = u.answer([int(t) for t in prompt], max_tokens, body.get("seed"))
        u.completions += 1
        # vLLM's shape of a scored prompt: None for the first token, {id: {"logprob": ...}} after
        scored = [None] + [{str(t): {"logprob": LOGPROB}} for t in prompt[1:]]

        def choice(piece: np.ndarray, reason: str | None) -> dict[str, Any]:
            return {
                "index": 0,
                "text": u.tokenizer.decode(piece),
                "token_ids": piece.tolist(),
                "logprobs": {"token_logprobs": [LOGPROB] * len(piece), "tokens": [""] * len(piece)},
                "finish_reason": reason,
                **({"prompt_logprobs": scored} if body.get("prompt_logprobs") is not None else {}),
            }

        return await answered(ids, max_tokens, bool(body.get("stream")), choice)

    async def chat(request: Request) -> Response:
        failed = u.fault()
        if failed is not None:
            return failed
        body = await request.json()
        prompt = u.tokenizer.chat_prompt((m["role"], m.get("content") or "") for m in body["messages"]).tolist()
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        ids = u.answer(prompt, max_tokens, body.get("seed"))
        u.completions += 1
        async for _ in u.pieces(ids):
            pass
        text = u.tokenizer.decode(ids)
        return JSONResponse(
            {
                "id": "chatcmpl-fixed",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": u.model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": finish(len(ids), max_tokens, ids),
                    }
                ],
                "usage": {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": len(ids),
                    "total_tokens": len(prompt) + len(ids),
                },
            }
        )

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/v1/models", models),
            Route("/stats", stats),
            Route("/faults", faults, methods=["POST"]),
            Route("/inference/v1/generate", generate, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
        ]
    )


class FixedRateUpstream(ThreadedServer):
    """The server on a background thread of this process (``.url``, ``.upstream`` for its counters)."""

    def __init__(
        self, model_dir: str | Path, *, rate: float = 0.0, chunk: int = 1, script: list[str] | None = None
    ) -> None:
        self.upstream = Upstream(
            ChatTokenizer.from_folder(model_dir), rate, chunk, list(script or []), root=str(model_dir)
        )
        super().__init__(lambda: build_app(self.upstream), name="fixed-rate-upstream")

    def set_faults(self, **faults: int) -> None:
        f = self.upstream.faults
        if "status" in faults:
            f.status, f.status_count = faults["status"], faults.get("count", 1)
        if "drop_after" in faults:
            f.drop_after, f.drop_count = faults["drop_after"], faults.get("count", 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--rate", type=float, default=0.0, help="tokens per second per stream (0: unbounded)")
    parser.add_argument("--chunk", type=int, default=1, help="tokens per streamed chunk")
    args = parser.parse_args()
    upstream = Upstream(ChatTokenizer.from_folder(args.model_dir), args.rate, args.chunk, root=args.model_dir)
    sock = bind(args.host, args.port)
    run_loop(serve(build_app(upstream), sock, ready=lambda url: print(f"serving at {url}", flush=True)))


if __name__ == "__main__":
    main()
