"""vLLM in process: the engine API (``LLMEngine``) stepped by one thread of this process.

``AsyncLLM`` always runs its engine core in a second process (spawned, importing vLLM
again: 17-26 s to start on a small CPU machine); the engine API with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` runs it here (2-5 s). One thread owns the
engine: it adds the requests the event loops hand it, calls ``step()`` while any
request is unfinished (vLLM batches them all: continuous batching across rollouts)
and hands each request's new tokens back to the event loop that asked. Nothing of it
blocks an event loop.

One engine per model folder and settings per process (``VllmEngine.shared``), however
many backends or runs use it: the tests share one per test session.

The engine runs with ``logprobs_mode="processed_logprobs"``: each sampled token's logprob
is under the distribution it was drawn from (after the grammar mask, temperature, top-k and
top-p, renormalized), not vLLM's default raw log_softmax of the logits.

Weights: ``reload_swap(folder)`` loads another checkpoint in place on the engine thread,
between steps (``collective_rpc("reload_weights")``), and resets the prefix cache; requests also
carry ``cache_salt=policy_version``, so no KV block computed under other weights is reused. The
model gate's ``sync_weights`` runs it with no call in flight and renames the weights after.

The action list is enforced with vLLM's structured outputs (``choice``): the output's
text is one of the actions, though not necessarily in the tokens ``encode`` gives
(the agent reads the action from the text then; the next prompt keeps these very ids). A constrained call interrupted
midway starts over (a grammar cannot resume from a token prefix); free-form calls
continue from their prefix, which vLLM prefills exactly (greedy: the same tokens
and logprobs as uninterrupted).

Settings the CPU build needs (``../shared/notes`` measured them; set unless the
environment already has them): ``VLLM_CPU_KVCACHE_SPACE`` (the KV cache, GiB),
``VLLM_CPU_OMP_THREADS_BIND=nobind``, ``VLLM_NO_USAGE_STATS=1``, compile caches in
a cache folder (``ROLLOUT_JOURNAL_VLLM_CACHE``, default the user's cache), float32 and
eager mode (the model config's ``dtype``; ``enforce_eager``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import os
import queue
import threading
from collections.abc import AsyncGenerator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rollout_journal.journal.events import LOGPROB_PROCESSED
from rollout_journal.participants.model.folders import model_cache_root, policy_version_of
from rollout_journal.participants.model.generation import (
    FINISH_LENGTH,
    FINISH_STOP,
    BackendError,
    GenerationRequest,
    TokenChunk,
    cache_salt,
)
from rollout_journal.participants.model.tokenizer import ChatTokenizer

if TYPE_CHECKING:
    from vllm.outputs import RequestOutput

log = logging.getLogger(__name__)


def vllm_cache_root() -> Path:
    override = os.environ.get("ROLLOUT_JOURNAL_VLLM_CACHE")
    return Path(override) if override else model_cache_root().parent / "vllm"


def vllm_environment(kv_cache_gib: float, cache_root: Path | None = None) -> dict[str, str]:
    """The environment vLLM's CPU build needs here (what ``apply_vllm_environment`` sets)."""
    root = cache_root if cache_root is not None else vllm_cache_root()
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in this process
        "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # "auto" pins the worker to core 0 and reserves the rest
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_LOGGING_STREAM": "ext://sys.stderr",  # its logs never land in a program's output (a --json report)
        "DO_NOT_TRACK": "1",
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
        "VLLM_CACHE_ROOT": str(root / "vllm"),
    }


def apply_vllm_environment(kv_cache_gib: float) -> None:
    """Set vLLM's settings in this process's environment, keeping any the user set."""
    for key, value in vllm_environment(kv_cache_gib).items():
        os.environ.setdefault(key, value)


class VllmEngine:
    """One ``LLMEngine`` and the thread that steps it."""

    _shared: dict[tuple[str, str, int, float], VllmEngine] = {}  # (folder, dtype, max_model_len, kv_cache_gib)
    _shared_lock = threading.Lock()

    def __init__(self, model_dir: Path, *, dtype: str, max_model_len: int, kv_cache_gib: float, seed: int = 0) -> None:
        apply_vllm_environment(kv_cache_gib)
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        self.model_dir = model_dir
        # vLLM types dtype as a Literal of names yet takes any str and names a bad one itself; ours is the
        # user's str. unused-ignore: without vLLM installed (`make lint`'s venv) EngineArgs is Any.
        self.engine = LLMEngine.from_engine_args(
            EngineArgs(
                model=str(model_dir),
                dtype=dtype,  # type: ignore[arg-type, unused-ignore]
                enforce_eager=True,
                max_model_len=max_model_len,
                seed=seed,
                logprobs_mode="processed_logprobs",  # the sampled distribution's, not raw log_softmax
            )
        )
        from vllm.platforms import current_platform

        self.on_cpu = bool(current_platform.is_cpu())
        import torch

        # vLLM's CPU attention checks that it runs with the thread count it was built with;
        # torch's count is process-wide, and another backend may change it later.
        self._threads = torch.get_num_threads()
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput | BaseException]]] = {}
        self._ids = itertools.count()
        self._stopped: BaseException | None = None  # what ended the engine thread; set under _stop_lock
        self._batch: list[tuple[str, Any]] = []  # the commands the engine thread took last
        self._stop_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="vllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def shared(
        cls, model_dir: Path, *, dtype: str = "float32", max_model_len: int = 2048, kv_cache_gib: float = 1.0
    ) -> VllmEngine:
        """The process's engine for this folder and these settings, started on first use."""
        key = (str(Path(model_dir).resolve()), dtype, max_model_len, kv_cache_gib)
        with cls._shared_lock:
            engine = cls._shared.get(key)
            if engine is None:
                engine = cls._shared[key] = cls(
                    Path(model_dir), dtype=dtype, max_model_len=max_model_len, kv_cache_gib=kv_cache_gib
                )
            return engine

    def request_id(self, name: str) -> str:
        return f"{name}#{next(self._ids)}"  # unique in the engine even when a call is retried

    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: Any,
        out: asyncio.Queue[RequestOutput | BaseException],
        cache_salt: str | None = None,
    ) -> None:
        """Add a request; ``cache_salt`` keeps its KV blocks apart from requests salted otherwise
        (the backend salts with its policy version: no block of other weights is reused)."""
        if not self._send("add", (request_id, prompt_ids, params, cache_salt, asyncio.get_running_loop(), out)):
            out.put_nowait(self._ended())

    def abort(self, request_id: str) -> None:
        self._send("abort", request_id)  # an engine that is gone has nothing to abort, and nobody to read it

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future[Any]:
        """Run ``fn(llm_engine)`` on the engine thread between two steps; its result or error."""
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if not self._send("call", (fn, done)):
            done.set_exception(self._ended())
        return done

    def _send(self, kind: str, arg: Any) -> bool:
        """Queue a command for the engine thread; False once the thread has ended. Under the lock
        the thread's end takes: a command is either queued before it (and failed by it, if the
        thread never ran it) or refused here, never left on a queue nobody reads."""
        with self._stop_lock:
            if self._stopped is None:
                self._commands.put((kind, arg))
                return True
        return False

    def _ended(self) -> BackendError:
        return BackendError(f"the vLLM engine thread ended ({self._stopped!r}); restart the process")

    def _run(self) -> None:
        """The engine thread. Whatever ends it (a ``BaseException`` out of vLLM's step) fails every
        call waiting on it and every later one at once: none waits for an engine that is gone."""
        try:
            self._serve()
        except BaseException as exc:
            log.critical("the vLLM engine thread ended", exc_info=True)
            with self._stop_lock:
                self._stopped = exc
            for request_id in list(self._streams):
                self._deliver(request_id, self._ended())
            self._streams.clear()
            left = self._batch  # taken off the queue, perhaps not yet run, when it ended
            while True:
                try:
                    left.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for kind, arg in left:
                if kind == "call" and not arg[1].done():
                    with contextlib.suppress(concurrent.futures.InvalidStateError):  # cancelled meanwhile
                        arg[1].set_exception(self._ended())
                elif kind == "add":
                    request_id, _, _, _, loop, out = arg
                    with contextlib.suppress(RuntimeError):  # that event loop is closed: nobody waits
                        loop.call_soon_threadsafe(out.put_nowait, self._ended())

    def _serve(self) -> None:
        from vllm.inputs import TokensPrompt
        from vllm.outputs import RequestOutput

        while True:
            busy = self.engine.has_unfinished_requests()
            commands = self._batch = []
            try:
                commands.append(self._commands.get(block=not busy))
                while True:
                    commands.append(self._commands.get_nowait())
            except queue.Empty:
                pass
            for kind, arg in commands:
                if kind == "call":
                    fn, done = arg
                    # Its caller may have given up while the engine stepped (a swap's timeout): run it
                    # only if it is not cancelled, and from then on it cannot be (a cancelled future
                    # refuses its result: the error killed this thread, and every later call hung).
                    if not done.set_running_or_notify_cancel():
                        continue
                    try:
                        done.set_result(fn(self.engine))
                    except BaseException as exc:  # the caller's error, whatever it is: the engine runs on
                        done.set_exception(exc)
                elif kind == "add":
                    request_id, prompt_ids, params, salt, loop, out = arg
                    self._streams[request_id] = (loop, out)
                    try:
                        prompt = TokensPrompt(prompt_token_ids=prompt_ids)
                        if salt:
                            prompt["cache_salt"] = salt
                        self.engine.add_request(request_id, prompt, params)
                    except Exception as exc:  # a bad request fails its own call only
                        self._deliver(request_id, BackendError(f"vLLM refused request {request_id}: {exc}"))
                        self._streams.pop(request_id, None)
                else:
                    if self._streams.pop(arg, None) is not None:
                        self.engine.abort_request([arg])
            if not self.engine.has_unfinished_requests():
                continue
            import torch

            if torch.get_num_threads() != self._threads:
                torch.set_num_threads(self._threads)
            try:
                outputs = self.engine.step()
            except Exception as exc:  # the engine is broken: every waiting call fails, none hangs
                log.exception("vLLM engine step failed")
                for request_id in list(self._streams):
                    self._deliver(request_id, BackendError(f"vLLM engine failed: {exc}"))
                self._streams.clear()
                continue
            for output in outputs:
                if isinstance(output, RequestOutput):
                    self._deliver(output.request_id, output)
                else:  # a pooling model's answer (step() returns either kind): this engine only generates
                    self._deliver(output.request_id, BackendError(f"vLLM answered {output.request_id} without tokens"))
                if output.finished:
                    self._streams.pop(output.request_id, None)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, out = target
            try:
                loop.call_soon_threadsafe(out.put_nowait, item)
            except RuntimeError:  # that event loop is closed: nobody waits for this call any more
                self._commands.put(("abort", request_id))


class VllmBackend:
    """``GenerationBackend`` over a shared in-process :class:`VllmEngine`."""

    resumes_constrained = False
    logprob_mode = LOGPROB_PROCESSED

    def __init__(self, engine: VllmEngine) -> None:
        self.engine = engine
        self.tokenizer = ChatTokenizer.from_folder(engine.model_dir)
        self.policy_version = policy_version_of(engine.model_dir)
        # vLLM on CPU: the same request gives the same bits, alone or batched (measured); on a GPU,
        # batch composition changes the kernels, so a redone turn may sample another action.
        self.deterministic = engine.on_cpu

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[TokenChunk, None]:
        from vllm.sampling_params import RequestOutputKind

        params = sampling_params(request, RequestOutputKind.DELTA)
        request_id = self.engine.request_id(request.request_id or "call")
        out: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.engine.submit(
            request_id,
            [int(t) for t in request.prompt_ids] + [int(t) for t in request.prefix_ids],
            params,
            out,
            cache_salt=cache_salt(self.policy_version),
        )
        finished = False
        ids: list[int] = []
        logprobs: list[float] = []
        try:
            while not finished:
                item = await out.get()
                if isinstance(item, BaseException):
                    raise item
                completion = item.outputs[0]
                ids.extend(completion.token_ids)
                logprobs.extend(sampled_logprobs(completion.token_ids, completion.logprobs, request_id))
                finished = item.finished
                if finished or (request.chunk_tokens and len(ids) >= request.chunk_tokens):
                    reason = finish_reason(completion.finish_reason, request_id) if finished else None
                    yield TokenChunk(np.asarray(ids, dtype=np.int32), np.asarray(logprobs, dtype=np.float32), reason)
                    ids, logprobs = [], []
        finally:
            if not finished:
                self.engine.abort(request_id)

    def set_policy_version(self, version: str) -> None:
        """Name the weights from the next call on (after a sync; see ``ModelParticipant.sync_weights``)."""
        self.policy_version = version

    def reload_swap(self, folder: str | Path) -> Callable[[], Awaitable[None]]:
        """A weight swap for ``ModelParticipant.sync_weights``: load ``folder``'s checkpoint into the
        engine in place and drop its prefix cache. Every backend on this shared engine sees the new
        weights; swap the original folder back before another run uses the engine."""
        path = str(Path(folder).resolve())

        def reload(engine: Any) -> None:
            engine.collective_rpc("reload_weights", kwargs={"weights_path": path})
            engine.reset_prefix_cache()

        async def swap() -> None:
            await asyncio.wrap_future(self.engine.call(reload))

        return swap

    async def aclose(self) -> None:
        """The engine is shared by the process: it stays up for the next run."""


def sampling_params(request: GenerationRequest, output_kind: Any) -> Any:
    """vLLM's ``SamplingParams`` for a request: the sampled token's logprob (``logprobs=0``),
    the remaining tokens, top-k (off: 0, vLLM's spelling), the action list as a structured-output choice."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    structured = None
    if request.constraint is not None:
        choices = getattr(request.constraint, "choices", None)
        if not choices:
            raise BackendError(
                f"call {request.request_id}: vLLM enforces a constraint as a list of choices; this "
                f"{type(request.constraint).__name__} names none"
            )
        structured = StructuredOutputsParams(choice=list(choices))
    p = request.params
    return SamplingParams(
        temperature=float(np.float32(p.temperature)),
        top_p=float(np.float32(p.top_p)),
        top_k=p.top_k if p.top_k > 0 else 0,
        seed=p.seed,
        max_tokens=request.remaining_tokens,
        logprobs=0,
        output_kind=output_kind,
        structured_outputs=structured,
    )


def sampled_logprobs(token_ids: Any, logprobs: Any, request_id: str) -> list[float]:
    if logprobs is None or len(logprobs) != len(token_ids):
        raise BackendError(f"vLLM request {request_id}: no logprob for every sampled token")
    return [float(step[token].logprob) for step, token in zip(logprobs, token_ids)]


def finish_reason(reason: str | None, request_id: str) -> str:
    if reason == "length":
        return FINISH_LENGTH
    if reason == "stop":
        return FINISH_STOP
    raise BackendError(f"vLLM request {request_id} ended with finish reason {reason!r}")
