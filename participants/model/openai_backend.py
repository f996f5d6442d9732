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

Logprobs: vLLM's server reports raw logprobs unless started with ``--logprobs-mode
processed_logprobs``, and says nothing about it in its answers. So before its first call the
backend asks (:meth:`OpenAIBackend.logprob_mode_of_server`): one token sampled at temperature
0.5, then the same position's prompt logprob, which vLLM always reports raw; equal means a raw
server, refused (``BackendError`` naming the flag) unless ``accept_raw``, which journals them as
``logprob_mode="raw"``.

Weights: the server cannot say which weights answered a request, so the side that syncs them
names them (SkyRL's way): ``ModelParticipant.sync_weights`` runs a swap with no call in flight
(``reload_swap``: vLLM's dev-mode ``/collective_rpc reload_weights`` and
``/reset_prefix_cache``, for a server started with ``VLLM_SERVER_DEV_MODE=1``) and calls
``set_policy_version``. Every request carries ``cache_salt=policy_version``, so the server never
reuses KV blocks computed under other weights.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from rollout_journal.journal.events import LOGPROB_PROCESSED, LOGPROB_RAW
from rollout_journal.participants.model.folders import policy_version_of
from rollout_journal.participants.model.generation import (
    FINISH_LENGTH,
    FINISH_STOP,
    BackendError,
    GenerationRequest,
    TokenChunk,
    cache_salt,
)
from rollout_journal.participants.model.tokenizer import ChatTokenizer


def sampling_fields(request: GenerationRequest) -> dict[str, Any]:
    """The sampling parameters of a tokens-in call that continues ``request``, as vLLM takes them
    at both of its token-id endpoints: the tokens still to generate, the parameters as the backend
    gets them (float32), the sampled tokens' logprobs asked back, and the seed when there is one.
    ``/v1/completions`` takes them at the top of its body (:func:`completions_body`),
    ``/inference/v1/generate`` as its ``sampling_params`` (:func:`generate_body`)."""
    p = request.params
    fields: dict[str, Any] = {
        "max_tokens": request.remaining_tokens,
        "temperature": float(np.float32(p.temperature)),
        "top_p": float(np.float32(p.top_p)),
        "top_k": p.top_k if p.top_k > 0 else 0,
        "logprobs": 0,
    }
    if p.seed is not None:
        fields["seed"] = int(p.seed)
    return fields


def continued_ids(request: GenerationRequest) -> list[int]:
    """The token ids a call that continues ``request`` sends: its prompt and the prefix generated so far."""
    ids: list[int] = np.concatenate([request.prompt_ids, request.prefix_ids]).astype(np.int32).tolist()
    return ids


def completions_body(request: GenerationRequest, model: str, policy_version: str) -> dict[str, Any]:
    """The body of a streamed ``/v1/completions`` request that continues ``request``: its prompt
    and the prefix generated so far as token ids, its :func:`sampling_fields`, the sampled tokens'
    ids asked back, and the prefix cache salted by the weights' version (a cached prefix of other
    weights is never reused). The one spelling for this backend and the journaling gateway's upstream."""
    return {
        "model": model,
        "prompt": continued_ids(request),
        **sampling_fields(request),
        "return_token_ids": True,
        "stream": True,
        "cache_salt": cache_salt(policy_version),
    }


def generate_body(request: GenerationRequest, model: str, policy_version: str) -> dict[str, Any]:
    """The body of a streamed ``/inference/v1/generate`` request (vLLM's tokens-in/tokens-out
    endpoint) that continues ``request``: what :func:`completions_body` sends, in that endpoint's
    shape (``token_ids``, ``sampling_params``; it always answers with ids)."""
    return {
        "model": model,
        "token_ids": continued_ids(request),
        "sampling_params": sampling_fields(request),
        "stream": True,
        "cache_salt": cache_salt(policy_version),
    }


class OpenAIBackend:
    """``GenerationBackend`` over an OpenAI-compatible server's completions endpoint."""

    deterministic = False
    resumes_constrained = False

    def __init__(
        self,
        url: str,
        model_dir: str | Path,
        *,
        served_model: str | None = None,
        timeout_s: float = 300.0,
        accept_raw_logprobs: bool = False,
    ) -> None:
        self.url = url.rstrip("/")
        self.tokenizer = ChatTokenizer.from_folder(model_dir)
        self.policy_version = policy_version_of(model_dir)
        self.served_model = served_model
        self.timeout_s = timeout_s
        self.accept_raw_logprobs = accept_raw_logprobs
        self._mode: str | None = None  # the server's logprob mode, asked before the first call
        self._clients: dict[asyncio.AbstractEventLoop, Any] = {}  # an httpx client belongs to one event loop

    @property
    def logprob_mode(self) -> str:
        """What the server's logprobs are (processed unless a raw server was accepted); known once
        a call has started (the gate reads it for the record after the stream)."""
        return self._mode or LOGPROB_PROCESSED

    def set_policy_version(self, version: str) -> None:
        """Name the weights from the next call on (after a sync; see ``ModelParticipant.sync_weights``)."""
        self.policy_version = version

    @property
    def server_root(self) -> str:
        """The server's address without the API prefix (where vLLM's dev endpoints live)."""
        return self.url.removesuffix("/v1")

    def reload_swap(self, folder: str | Path) -> Callable[[], Awaitable[None]]:
        """A weight swap for ``ModelParticipant.sync_weights``: the server loads ``folder``'s
        checkpoint in place and drops its prefix cache (vLLM with ``VLLM_SERVER_DEV_MODE=1``: the
        folder is read by the server, so it must see the same path)."""
        path = str(Path(folder).resolve())

        async def swap() -> None:
            await self._post_dev("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}})
            await self._post_dev("/reset_prefix_cache", None)

        return swap

    async def _post_dev(self, path: str, body: Any) -> None:
        where = f"server {self.server_root}: POST {path}"
        try:
            response = await self._client().post(self.server_root + path, json=body)
        except Exception as exc:
            raise BackendError(f"{where} failed: {type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            hint = " (start the server with VLLM_SERVER_DEV_MODE=1)" if response.status_code == 404 else ""
            raise BackendError(f"{where}: HTTP {response.status_code}{hint}: {response.text[:300]}")

    async def logprob_mode_of_server(self) -> str:
        """``processed`` or ``raw``: what the server's sampled-token logprobs are, asked with a few
        short requests (a sampled token's logprob at temperature 0.5 against the raw prompt logprob
        of the same position; a near-certain token tells nothing, so up to four prompts are tried)."""
        for text in ("The", "Hello", "1", " a"):
            prompt = [int(t) for t in self.tokenizer.encode(text)] or [self.tokenizer.eos_id]
            sampled = await self._completion(
                {
                    "prompt": prompt,
                    "max_tokens": 1,
                    "temperature": 0.5,
                    "seed": 0,
                    "logprobs": 0,
                    "return_token_ids": True,
                }
            )
            token = int(sampled["token_ids"][0])
            processed = float(sampled["logprobs"]["token_logprobs"][0])
            scored = await self._completion(
                {"prompt": [*prompt, token], "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
            )
            entry = (scored.get("prompt_logprobs") or [None])[-1] or {}
            raw = entry.get(str(token), {}).get("logprob") if isinstance(entry, dict) else None
            if raw is None:
                raise BackendError(f"server {self.url}: no prompt logprobs (is it vLLM's server?): {str(scored)[:200]}")
            if abs(float(raw)) < 0.05:
                continue  # a near-certain token: both modes give about 0
            return LOGPROB_RAW if abs(float(raw) - processed) < 1e-3 else LOGPROB_PROCESSED
        raise BackendError(f"server {self.url}: cannot tell its logprob mode (every probe token was near-certain)")

    async def _completion(self, body: dict[str, Any]) -> dict[str, Any]:
        where = f"server {self.url}"
        try:
            response = await self._client().post(
                self.url + "/completions", json={"model": await self.model_name(), **body}
            )
        except Exception as exc:
            raise BackendError(f"{where}: POST /completions failed: {type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            raise BackendError(f"{where}: POST /completions: HTTP {response.status_code}: {response.text[:300]}")
        return _first_choice(response.json(), where)

    async def _check_mode(self) -> None:
        if self._mode is not None:
            return
        mode = await self.logprob_mode_of_server()
        if mode == LOGPROB_RAW and not self.accept_raw_logprobs:
            raise BackendError(
                f"server {self.url} reports raw logprobs (log_softmax before temperature, top_k, top_p): "
                "not those of the distribution it samples from; start it with --logprobs-mode "
                "processed_logprobs, or set model.server_logprobs: accept_raw to journal them as raw"
            )
        self._mode = mode

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
        await self._check_mode()
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
                        yield TokenChunk(
                            np.asarray(ids, dtype=np.int32),
                            np.asarray(logprobs, dtype=np.float32),
                            _finish(reason, where) if reason is not None else None,
                        )
                        ids, logprobs = [], []
                        if reason is not None:
                            return
        except BackendError:
            raise
        except Exception as exc:  # httpx's transport errors, a malformed stream
            raise BackendError(f"{where}: {type(exc).__name__}: {exc}") from exc
        raise BackendError(f"{where}: the stream ended without a finish reason")

    async def _request_body(self, request: GenerationRequest) -> dict[str, Any]:
        body = completions_body(request, await self.model_name(), self.policy_version)
        if request.constraint is not None:
            choices = getattr(request.constraint, "choices", None)
            if not choices:
                raise BackendError(
                    f"server {self.url}: a constraint goes to the server as a list of choices; this "
                    f"{type(request.constraint).__name__} names none"
                )
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


def _first_choice(chunk: Any, where: str) -> dict[str, Any]:
    try:
        choice: dict[str, Any] = chunk["choices"][0]  # a completion chunk's choice: a JSON object
        return choice
    except (KeyError, IndexError, TypeError):
        raise BackendError(f"{where}: a streamed chunk has no choice: {str(chunk)[:300]}") from None


def _token_logprobs(choice: dict[str, Any], count: int, where: str) -> list[float]:
    if count == 0:
        return []
    values = (choice.get("logprobs") or {}).get("token_logprobs")
    if not isinstance(values, list) or len(values) != count or any(v is None for v in values):
        raise BackendError(
            f"{where}: the server returned {count} token ids without a logprob for each "
            "(does it support return_token_ids and logprobs?)"
        )
    return [float(v) for v in values]


def _finish(reason: str, where: str) -> str:
    if reason == "length":
        return FINISH_LENGTH
    if reason == "stop":
        return FINISH_STOP
    raise BackendError(f"{where}: the server ended the call with finish reason {reason!r}")
