"""The gateway's model upstream: a vLLM OpenAI server, token ids in and token ids out.

vLLM's chat endpoint takes no prompt ids (vllm #25051), so the gateway renders the prompt itself
and calls a tokens-in endpoint: ``/inference/v1/generate`` (vLLM's dedicated tokens-in/tokens-out
route; served by ``vllm serve`` only with ``--enable-scale-out``) or, where that is not served,
``/v1/completions`` with a token-id prompt (what SkyRL and verifiers' train client do). Both stream,
ask for the sampled token's logprob and its id, and are :class:`GenerationBackend` s, so the
gateway's calls go through the same admission gate, progress marks and prefix continuation as
the project's own agent.

Retries: a connection error, a 429 or a 5xx is retried (``retries`` times, with the gateway's backoff,
:mod:`~rollout_journal.participants.remote.gateway.retry`)
only before the first token; after tokens flowed, a broken stream fails the call (its journaled
progress lets the next try continue from there). Then :class:`UpstreamUnavailableError` names the
upstream, the status and the tries; a 4xx is :class:`UpstreamRejectedError` with its message.

Logprobs and weights, as the project's :class:`~rollout_journal.participants.model.openai_backend.OpenAIBackend`:
the server does not say whether its logprobs are processed (vLLM's ``--logprobs-mode
processed_logprobs``) or raw, so :func:`open_upstream` asks it with that backend's probe (or is
told); every request carries ``top_k`` and ``cache_salt=policy_version``, and
``set_policy_version`` names the weights after a sync.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any, NoReturn

import aiohttp
import numpy as np
from tenacity import AsyncRetrying

from rollout_journal.journal.events import LOGPROB_PROCESSED, LOGPROB_RAW, LOGPROB_UNKNOWN
from rollout_journal.participants.model.folders import policy_version_of
from rollout_journal.participants.model.generation import (
    FINISH_LENGTH,
    FINISH_STOP,
    BackendError,
    GenerationRequest,
    TokenChunk,
)
from rollout_journal.participants.model.openai_backend import completions_body, generate_body
from rollout_journal.participants.model.tokenizer import ChatTokenizer
from rollout_journal.participants.remote.gateway.retry import backoff

__all__ = [
    "CompletionsUpstream",
    "GenerateUpstream",
    "UpstreamClient",
    "UpstreamRejectedError",
    "UpstreamUnavailableError",
    "open_upstream",
]

log = logging.getLogger(__name__)
RETRIED_STATUS = frozenset({429})  # and every 5xx
# What a try that met a broken connection, a timeout or a cut-off body raises (aiohttp's
# ServerTimeoutError is both a ClientError and a TimeoutError; a connect timeout is a TimeoutError).
_TRANSPORT_ERRORS = (aiohttp.ClientError, TimeoutError)


class UpstreamUnavailableError(BackendError):
    """The upstream did not answer (down, or 5xx) after every retry; nothing was journaled as its answer."""

    def __init__(self, url: str, detail: str, tries: int, status: int | None = None, timeout: bool = False) -> None:
        super().__init__(f"upstream {url} unavailable after {tries} tries: {detail}")
        self.url = url
        self.status = status
        self.tries = tries
        self.timeout = timeout


class UpstreamRejectedError(BackendError):
    """The upstream refused the request (a 4xx): its message says why (a prompt over the model's
    context length, an id out of vocabulary)."""

    def __init__(self, url: str, status: int, message: str) -> None:
        super().__init__(f"upstream {url} refused the request (HTTP {status}): {message}")
        self.url = url
        self.status = status
        self.upstream_message = message

    @property
    def context_length(self) -> bool:
        text = self.upstream_message.lower()
        return "maximum model length" in text or "context length" in text or "longer than the maximum" in text


class _Transient(Exception):
    """A try that failed in a way worth another (a connection error, a timeout, a 429 or 5xx)."""

    def __init__(self, detail: str, *, status: int | None = None, timeout: bool = False) -> None:
        super().__init__(detail)
        self.detail, self.status, self.timeout = detail, status, timeout

    @classmethod
    def of(cls, exc: Exception) -> _Transient:
        return cls(f"{type(exc).__name__}: {exc}", timeout=isinstance(exc, TimeoutError))


class UpstreamClient:
    """What both endpoints share: the tokenizer, one pooled HTTP session per event loop, retries."""

    deterministic = False  # a server batching other requests: every answer is journaled before it is given
    resumes_constrained = False
    api = ""
    path = ""

    def __init__(
        self,
        url: str,
        model_dir: str | Path,
        *,
        served_model: str | None = None,
        retries: int = 3,
        backoff_s: float = 0.2,
        timeout_s: float = 600.0,
        max_connections: int = 512,
        logprob_mode: str = LOGPROB_UNKNOWN,
    ) -> None:
        """``logprob_mode``: what the server's logprobs are (journaled with each call; unknown unless
        told: :func:`open_upstream` asks the server)."""
        self.base = url.rstrip("/").removesuffix("/v1")
        self.logprob_mode = logprob_mode
        self.tokenizer = ChatTokenizer.from_folder(model_dir)
        self.policy_version = policy_version_of(model_dir)
        self.served_model = served_model
        self.retries = retries
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self.max_connections = max_connections
        self.tries = 0  # requests sent, retries included
        self.retried = 0
        # per loop: its session, and the task that closes it when the loop ends (see session())
        self._sessions: dict[asyncio.AbstractEventLoop, tuple[aiohttp.ClientSession, asyncio.Task[None]]] = {}

    @property
    def url(self) -> str:
        return self.base + self.path

    def set_policy_version(self, version: str) -> None:
        """Name the weights from the next call on (after a sync; see ``ModelParticipant.sync_weights``)."""
        self.policy_version = version

    def session(self) -> aiohttp.ClientSession:
        """This loop's HTTP session: its connections to the upstream are kept alive and reused.
        aiohttp, not httpx: at 64 streams httpx took about 3 ms of CPU a call (its connection pool
        polls each idle connection per request), more than the rest of the gateway's work on it."""
        loop = asyncio.get_running_loop()
        held = self._sessions.get(loop)
        if held is not None and not held[0].closed:
            return held[0]
        for old in [k for k in self._sessions if k.is_closed()]:
            del self._sessions[old]
        # No total: a long generation streams for as long as it takes; each read and the connect are bounded.
        timeout = aiohttp.ClientTimeout(total=None, connect=self.timeout_s, sock_read=self.timeout_s)
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.max_connections), timeout=timeout)
        # A caller that drives calls from several asyncio.run()s may never call aclose() in each: the
        # session is closed as its loop ends (asyncio.run cancels the tasks left), not left open.
        self._sessions[loop] = (session, loop.create_task(_close_when_cancelled(session)))
        return session

    async def get_json(self, path: str) -> Any:
        """``GET`` ``path`` of the upstream's base URL, its JSON (``BackendError`` if it has none)."""
        try:
            async with self.session().get(self.base + path) as response:
                text = (await response.read()).decode("utf-8", "replace")
        except _TRANSPORT_ERRORS as exc:
            raise BackendError(f"upstream {self.base}: GET {path}: {type(exc).__name__}: {exc}") from exc
        try:
            return json.loads(text)
        except ValueError:
            raise BackendError(f"upstream {self.base}: GET {path} answered no JSON ({text[:200]})") from None

    async def model_name(self) -> str:
        if self.served_model is None:
            listed = await self.get_json("/v1/models")
            try:
                self.served_model = str(listed["data"][0]["id"])
            except (KeyError, IndexError, TypeError):
                raise BackendError(f"upstream {self.base}: /v1/models lists no model ({str(listed)[:200]})") from None
        return self.served_model

    def body(self, request: GenerationRequest, model: str) -> dict[str, Any]:
        raise NotImplementedError

    def tokens_of(self, chunk: dict[str, Any], where: str) -> tuple[list[int], list[float], str | None]:
        raise NotImplementedError

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[TokenChunk, None]:
        body = self.body(request, await self.model_name())
        if request.chunk_tokens == 0:  # one chunk at the end: one plain request, no event stream to parse
            body["stream"] = False
            yield await self._whole(request, body)
            return
        where = f"upstream {self.url}, call {request.request_id}"
        try:
            async for attempt in self._tries(where):
                with attempt:
                    self.tries += 1
                    started = False
                    try:
                        async with self.session().post(self.url, json=body) as response:
                            if response.status != 200:
                                text = (await response.read()).decode("utf-8", "replace")
                                self._refused(response.status, text)
                            async for line in _lines(response.content):
                                if not line.startswith("data:"):
                                    continue
                                data = line[5:].strip()
                                if data == "[DONE]":
                                    break
                                try:
                                    chunk = json.loads(data)
                                except ValueError:
                                    raise BackendError(f"{where}: a streamed chunk is no JSON: {data[:200]}") from None
                                if "error" in chunk and "choices" not in chunk:
                                    raise BackendError(f"{where}: the upstream ended the stream with {chunk['error']}")
                                ids, logprobs, reason = self.tokens_of(chunk, where)
                                if ids or reason is not None:
                                    started = True
                                    yield TokenChunk(
                                        np.asarray(ids, dtype=np.int32),
                                        np.asarray(logprobs, dtype=np.float32),
                                        _finish(reason, where) if reason is not None else None,
                                    )
                                    if reason is not None:
                                        return
                        raise BackendError(f"{where}: the stream ended without a finish reason")
                    except _TRANSPORT_ERRORS as exc:
                        if started:  # tokens were handed on: the call cannot start over silently
                            raise BackendError(
                                f"{where}: the stream broke after tokens flowed ({type(exc).__name__}: {exc})"
                            ) from exc
                        raise _Transient.of(exc) from exc
        except _Transient as exc:
            raise self._unavailable(exc) from exc.__cause__

    async def _whole(self, request: GenerationRequest, body: dict[str, Any]) -> TokenChunk:
        """A non-streaming call, retried as a stream's start is."""
        where = f"upstream {self.url}, call {request.request_id}"
        payload = b""
        try:
            async for attempt in self._tries(where):
                with attempt:
                    self.tries += 1
                    try:
                        async with self.session().post(self.url, json=body) as response:
                            status, payload = response.status, await response.read()
                    except _TRANSPORT_ERRORS as exc:
                        raise _Transient.of(exc) from exc
                    if status != 200:
                        self._refused(status, payload.decode("utf-8", "replace"))
        except _Transient as exc:
            raise self._unavailable(exc) from exc.__cause__
        try:
            ids, logprobs, reason = self.tokens_of(json.loads(payload), where)
        except ValueError:
            text = payload.decode("utf-8", "replace")
            raise BackendError(f"{where}: the answer is no JSON: {text[:200]}") from None
        if reason is None:
            raise BackendError(f"{where}: the answer has no finish reason")
        return TokenChunk(
            np.asarray(ids, dtype=np.int32), np.asarray(logprobs, dtype=np.float32), _finish(reason, where)
        )

    def _tries(self, where: str) -> AsyncRetrying:
        """The gateway's retry policy (:func:`~rollout_journal.participants.remote.gateway.retry.backoff`)
        over :class:`_Transient` failures, counted in ``retried``."""

        def count() -> None:
            self.retried += 1

        return backoff(where, self.retries, self.backoff_s, _Transient, on_retry=count)

    def _refused(self, status: int, text: str) -> NoReturn:
        """A non-200 answer: a 429 or 5xx is worth another try, any other a refusal."""
        if status in RETRIED_STATUS or status >= 500:
            raise _Transient(f"HTTP {status}: {text[:300]}", status=status)
        raise UpstreamRejectedError(self.url, status, _message(text))

    def _unavailable(self, last: _Transient) -> UpstreamUnavailableError:
        """What the last of the ``retries + 1`` tries met, as the call's error."""
        return UpstreamUnavailableError(self.base, last.detail, self.retries + 1, last.status, timeout=last.timeout)

    async def aclose(self) -> None:
        held = self._sessions.pop(asyncio.get_running_loop(), None)
        if held is not None:
            session, closer = held
            closer.cancel()
            await session.close()


class GenerateUpstream(UpstreamClient):
    """vLLM's ``POST /inference/v1/generate`` (``vllm serve --enable-scale-out``)."""

    api = "generate"
    path = "/inference/v1/generate"

    def body(self, request: GenerationRequest, model: str) -> dict[str, Any]:
        return generate_body(request, model, self.policy_version)

    def tokens_of(self, chunk: dict[str, Any], where: str) -> tuple[list[int], list[float], str | None]:
        choice = _first_choice(chunk, where)
        ids = [int(t) for t in choice.get("token_ids") or []]
        content = (choice.get("logprobs") or {}).get("content") or []
        if len(content) != len(ids):
            raise BackendError(f"{where}: {len(ids)} token ids came with {len(content)} logprobs")
        return ids, [float(c["logprob"]) for c in content], choice.get("finish_reason")


class CompletionsUpstream(UpstreamClient):
    """``POST /v1/completions`` with a token-id prompt, ``return_token_ids`` and ``logprobs: 0``."""

    api = "completions"
    path = "/v1/completions"

    def body(self, request: GenerationRequest, model: str) -> dict[str, Any]:
        return completions_body(request, model, self.policy_version)

    def tokens_of(self, chunk: dict[str, Any], where: str) -> tuple[list[int], list[float], str | None]:
        choice = _first_choice(chunk, where)
        ids = [int(t) for t in choice.get("token_ids") or []]
        values = (choice.get("logprobs") or {}).get("token_logprobs") or []
        if len(values) != len(ids) or any(v is None for v in values):
            raise BackendError(
                f"{where}: the server returned {len(ids)} token ids without a logprob for each "
                "(does it support return_token_ids and logprobs?)"
            )
        return ids, [float(v) for v in values], choice.get("finish_reason")


def open_upstream(
    url: str,
    model_dir: str | Path | None = None,
    *,
    api: str = "auto",
    served_model: str | None = None,
    retries: int = 3,
    logprobs: str = "probe",
) -> UpstreamClient:
    """The upstream client for ``api``: ``generate``, ``completions``, or ``auto`` (``generate`` when
    the server serves it, else ``completions``). Without ``model_dir``, the folder the server names
    as its model's root (``/v1/models``) is used, which works when it is on this machine.
    ``logprobs``: ``probe`` asks the server what its logprobs are (a raw server is refused, naming
    the flag), ``processed`` or ``raw`` says so without asking (``raw``: journaled as raw).
    Blocking: it asks the server once or twice."""
    import httpx

    base = url.rstrip("/").removesuffix("/v1")
    try:
        listed = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]
    except Exception as exc:
        raise UpstreamUnavailableError(base, f"GET /v1/models: {type(exc).__name__}: {exc}", 1) from exc
    served = served_model or str(listed["id"])
    folder = model_dir or listed.get("root")
    if not folder or not Path(str(folder)).is_dir():
        raise BackendError(
            f"upstream {base}: its model's folder {folder!r} is not on this machine; pass --model-dir with the "
            "served model's tokenizer and chat template"
        )
    kinds: dict[str, type[UpstreamClient]] = {"generate": GenerateUpstream, "completions": CompletionsUpstream}
    if api == "auto":
        probe = {"model": served, "token_ids": [0], "sampling_params": {"max_tokens": 1}}
        try:
            status = httpx.post(base + GenerateUpstream.path, json=probe, timeout=60).status_code
        except Exception as exc:
            raise UpstreamUnavailableError(
                base, f"POST {GenerateUpstream.path}: {type(exc).__name__}: {exc}", 1
            ) from exc
        api = "generate" if status == 200 else "completions"
        if api == "completions":
            log.info(
                "upstream %s does not serve %s (HTTP %d): using /v1/completions", base, GenerateUpstream.path, status
            )
    if api not in kinds:
        raise BackendError(f"upstream API {api!r}: expected generate, completions or auto")
    if logprobs == "probe":
        mode = probe_logprob_mode(base, str(folder), served)
    elif logprobs in (LOGPROB_PROCESSED, LOGPROB_RAW):
        mode = logprobs
    else:
        raise BackendError(f"upstream logprobs {logprobs!r}: expected probe, processed or raw")
    return kinds[api](url, str(folder), served_model=served, retries=retries, logprob_mode=mode)


def probe_logprob_mode(base: str, model_dir: str, served: str) -> str:
    """``processed``, or a :class:`BackendError` for a server whose logprobs are raw: the project's
    probe (:meth:`OpenAIBackend.logprob_mode_of_server`), so the gateway journals what its agent does.
    Blocking, on a thread of its own (a gateway is built inside its server's event loop)."""
    from concurrent.futures import ThreadPoolExecutor

    from rollout_journal.participants.model.openai_backend import OpenAIBackend

    backend = OpenAIBackend(base + "/v1", model_dir, served_model=served)

    async def ask() -> str:
        try:
            return await backend.logprob_mode_of_server()
        finally:
            await backend.aclose()

    with ThreadPoolExecutor(1, thread_name_prefix="logprob-probe") as pool:
        mode = pool.submit(asyncio.run, ask()).result()
    if mode == LOGPROB_RAW:
        raise BackendError(
            f"upstream {base} reports raw logprobs (log_softmax before temperature, top_k, top_p): not those "
            "of the distribution it samples from; start it with --logprobs-mode processed_logprobs, or run the "
            "gateway with --upstream-logprobs raw to journal them as raw"
        )
    return mode


async def _close_when_cancelled(session: aiohttp.ClientSession) -> None:
    try:
        await asyncio.Event().wait()
    finally:
        await session.close()


async def _lines(body: aiohttp.StreamReader) -> AsyncGenerator[str, None]:
    """An event stream's lines, without their ends, as its bytes arrive (of any length: aiohttp's own
    line iterator refuses a line over its buffer's limit, and one chunk may carry a long answer)."""
    pending = b""
    async for data in body.iter_any():
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode("utf-8")
    if pending:
        yield pending.rstrip(b"\r").decode("utf-8")


def _first_choice(chunk: Any, where: str) -> dict[str, Any]:
    try:
        choice = chunk["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise BackendError(f"{where}: a streamed chunk has no choice: {str(chunk)[:300]}") from None
    if not isinstance(choice, dict):
        raise BackendError(f"{where}: a streamed chunk's choice is no object: {str(choice)[:300]}")
    return choice


def _finish(reason: str, where: str) -> str:
    if reason == "length":
        return FINISH_LENGTH
    if reason in ("stop", "eos"):
        return FINISH_STOP
    raise BackendError(f"{where}: the server ended the call with finish reason {reason!r}")


def _message(text: str) -> str:
    try:
        body = json.loads(text)
    except ValueError:
        return text[:500]
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])[:500]
        if "detail" in body:
            return str(body["detail"])[:500]
        if "message" in body:
            return str(body["message"])[:500]
    return text[:500]
