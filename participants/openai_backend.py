"""Any OpenAI-compatible completions server as a backend (vLLM's ``api_server`` and others).

Requests go to ``POST {url}/completions`` with the prompt as token ids (built here with
the model folder's own chat template: ids, never text, so a continued call is exactly
prompt + prefix), ``return_token_ids`` and ``logprobs`` (the sampled token's), streamed
(``"stream": true``) so a long generation's progress arrives as it is made. The action
list goes as a structured-output ``choice`` (vLLM's ``structured_outputs``). The HTTP
client is async (``httpx``): a call waiting on the server never blocks other rollouts.

A server is not assumed bit-deterministic (a GPU server batching other requests is
not), so the agent journals each call before its tool call (``durable_model_calls:
auto``) and a redone turn replays it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import numpy as np

from .generation import FINISH_LENGTH, FINISH_STOP, BackendError, GenerationRequest, TokenChunk
from .tiny_model import policy_version_of
from .tokenizer import ChatTokenizer


class OpenAIBackend:
    """``GenerationBackend`` over an OpenAI-compatible server's completions endpoint."""

    deterministic = False
    resumes_constrained = False

    def __init__(self, url: str, model_dir: str | Path, *, served_model: str | None = None,
                 timeout_s: float = 300.0) -> None:
        self.url = url.rstrip("/")
        self.tokenizer = ChatTokenizer.from_folder(model_dir)
        self.policy_version = policy_version_of(model_dir)
        self.served_model = served_model
        self.timeout_s = timeout_s
        self._clients: dict[asyncio.AbstractEventLoop, Any] = {}  # an httpx client belongs to one event loop

    def _client(self) -> Any:
        import httpx

        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            for old in [k for k in self._clients if k.is_closed()]:
                del self._clients[old]
            client = self._clients[loop] = httpx.AsyncClient(timeout=self.timeout_s)
        return client

    async def model_name(self) -> str:
        """The served model's name (``served_model``, else the first ``/v1/models`` lists)."""
        if self.served_model is None:
            body = await self._get("/models")
            try:
                self.served_model = str(body["data"][0]["id"])
            except (KeyError, IndexError, TypeError):
                raise BackendError(f"server {self.url}: /models lists no model ({str(body)[:200]})") from None
        return self.served_model

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[TokenChunk, None]:
        body = await self._request_body(request)
        ids: list[int] = []
        logprobs: list[float] = []
        where = f"server {self.url}, call {request.request_id}"
        try:
            async with self._client().stream("POST", self.url + "/completions", json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode("utf-8", "replace")
                    raise BackendError(f"{where}: HTTP {response.status_code}: {text[:500]}")
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    choice = _first_choice(json.loads(data), where)
                    new = choice.get("token_ids") or []
                    ids.extend(int(t) for t in new)
                    logprobs.extend(_token_logprobs(choice, len(new), where))
                    reason = choice.get("finish_reason")
                    if reason is not None or (request.chunk_tokens and len(ids) >= request.chunk_tokens):
                        yield TokenChunk(np.asarray(ids, dtype=np.int32), np.asarray(logprobs, dtype=np.float32),
                                         _finish(reason, where) if reason is not None else None)
                        ids, logprobs = [], []
                        if reason is not None:
                            return
        except BackendError:
            raise
        except Exception as exc:  # httpx's transport errors, a malformed stream
            raise BackendError(f"{where}: {type(exc).__name__}: {exc}") from exc
        raise BackendError(f"{where}: the stream ended without a finish reason")

    async def _request_body(self, request: GenerationRequest) -> dict[str, Any]:
        p = request.params
        body: dict[str, Any] = {
            "model": await self.model_name(),
            "prompt": [int(t) for t in request.prompt_ids] + [int(t) for t in request.prefix_ids],
            "max_tokens": request.remaining_tokens,
            "temperature": float(np.float32(p.temperature)), "top_p": float(np.float32(p.top_p)),
            "logprobs": 0, "return_token_ids": True, "stream": True,
        }
        if p.seed is not None:
            body["seed"] = int(p.seed)
        if request.constraint is not None:
            choices = getattr(request.constraint, "choices", None)
            if not choices:
                raise BackendError(f"server {self.url}: a constraint goes to the server as a list of choices; this "
                                   f"{type(request.constraint).__name__} names none")
            body["structured_outputs"] = {"choice": list(choices)}
        return body

    async def _get(self, path: str) -> Any:
        try:
            response = await self._client().get(self.url + path)
        except Exception as exc:
            raise BackendError(f"server {self.url}: GET {path} failed: {type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            raise BackendError(f"server {self.url}: GET {path}: HTTP {response.status_code}: {response.text[:300]}")
        return response.json()

    async def aclose(self) -> None:
        loop = asyncio.get_running_loop()
        client = self._clients.pop(loop, None)
        if client is not None:
            await client.aclose()


def _first_choice(chunk: Any, where: str) -> dict:
    try:
        return chunk["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise BackendError(f"{where}: a streamed chunk has no choice: {str(chunk)[:300]}") from None


def _token_logprobs(choice: dict, count: int, where: str) -> list[float]:
    if count == 0:
        return []
    values = (choice.get("logprobs") or {}).get("token_logprobs")
    if not isinstance(values, list) or len(values) != count or any(v is None for v in values):
        raise BackendError(f"{where}: the server returned {count} token ids without a logprob for each "
                           "(does it support return_token_ids and logprobs?)")
    return [float(v) for v in values]


def _finish(reason: str, where: str) -> str:
    if reason == "length":
        return FINISH_LENGTH
    if reason == "stop":
        return FINISH_STOP
    raise BackendError(f"{where}: the server ended the call with finish reason {reason!r}")
