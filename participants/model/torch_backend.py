"""The embedded generation backend: a Hugging Face causal LM run with torch on CPU.

It loads a model folder in the standard layout with ``transformers``
(``AutoModelForCausalLM``: the embedded tiny Llama of ``rollout_journal.participants.model.tiny_model``,
or a user's own folder) in float32, and decodes token by token with its own
sampler, which the project needs and ``transformers.generate`` does not give:

* constrained decoding (an action trie masks the logits at every step);
* seeded sampling that is *seeded per position*: the draw for output position i comes
  from a generator seeded with ``(seed, i)``, so a call continued from a journaled
  prefix samples exactly what the uninterrupted call would have;
* bit-for-bit determinism on CPU: the same request gives the same ids and logprobs in
  any process, alone or beside other calls.

A continued call rebuilds the key/value cache the way the uninterrupted call built it:
the prompt in one forward pass, then the prefix one token at a time. A single pass over
prompt + prefix would be cheaper but differs in the last bits (other matrix shapes;
measured: 2e-5 in the logits), and a greedy continuation must equal the uninterrupted
call logprob for logprob. The prefix is read, never sampled again.

Compute runs on a worker thread (``workers``, default one: the model is small and
latency-bound), so the event loop keeps journaling and serving other rollouts meanwhile.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from rollout_journal.journal.events import LOGPROB_PROCESSED
from rollout_journal.participants.model.constraints import ConstraintViolation, TokenConstraint
from rollout_journal.participants.model.folders import policy_version_of
from rollout_journal.participants.model.generation import (
    FINISH_LENGTH,
    FINISH_STOP,
    Generation,
    GenerationRequest,
    SamplingParams,
    TokenChunk,
)
from rollout_journal.participants.model.sampling import filter_top_k_top_p
from rollout_journal.participants.model.tokenizer import ChatTokenizer

if TYPE_CHECKING:
    from transformers import DynamicCache

_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """The sampler seed of output position ``position`` of a call seeded ``seed`` (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1  # below 2**63: any torch.Generator takes it


class TorchPolicy:
    """Deterministic CPU ``GenerationBackend`` over a Hugging Face model folder.

    Sampling per step, in vLLM's order (:mod:`rollout_journal.participants.model.sampling`):
    logits -> constraint mask (disallowed = -inf) -> divide by temperature -> top-k -> top-p
    -> inverse-CDF draw from a generator seeded with ``position_seed(params.seed, position)``;
    ``temperature == 0`` is greedy. A call with ``seed=None`` takes its seed from a
    per-instance stream started at ``sampler_seed``.

    Logprobs are *processed* (``logprob_mode``): each sampled token's log-probability under
    the distribution it was drawn from (masked, temperature-scaled, top-k/top-p filtered and
    renormalized over what they kept), as vLLM's ``processed_logprobs`` mode reports them;
    ``score`` recomputes them from one forward pass. Greedy calls report log_softmax of the
    masked logits (temperature 1).

    Prompts longer than ``max_context - max_tokens`` keep their last tokens, so the
    whole generation fits the model's positions.
    """

    deterministic = True
    resumes_constrained = True
    logprob_mode = LOGPROB_PROCESSED

    def __init__(self, model_dir: str | Path, *, sampler_seed: int = 0, workers: int = 1) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # library code never prints
        self.model_dir = Path(model_dir)
        self.tokenizer = ChatTokenizer.from_folder(self.model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(
            self.model_dir, dtype=torch.float32, attn_implementation="sdpa"
        )
        self.model.requires_grad_(False).eval()
        config = self.model.config
        self.vocab_size = int(config.vocab_size)
        self.max_context = int(getattr(config, "max_position_embeddings", 2048))
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        eos_ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
        self.eos_ids = frozenset(int(i) for i in eos_ids) | {self.tokenizer.eos_id}
        self.policy_version = policy_version_of(self.model_dir)
        self._seed_stream = np.random.default_rng(sampler_seed)
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="torch-policy")

    # -- the async interface --------------------------------------------------------
    async def stream(self, request: GenerationRequest) -> AsyncGenerator[TokenChunk, None]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenChunk | BaseException] = asyncio.Queue()
        stop = threading.Event()

        def emit(item: TokenChunk | BaseException) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        def work() -> None:
            try:
                self.generate_sync(request, emit, stop)
            except BaseException as exc:  # handed to the awaiting call, raised there
                emit(exc)

        seed = request.params.seed if request.params.seed is not None else int(self._seed_stream.integers(2**63))
        if request.params.seed is None:
            request = dataclasses.replace(request, params=dataclasses.replace(request.params, seed=seed))
        loop.run_in_executor(self._executor, work)
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            stop.set()  # an abandoned call stops at its next token

    async def aclose(self) -> None:
        """Nothing to release per run: the worker thread idles until the next call."""

    # -- the compute ----------------------------------------------------------------
    @torch.inference_mode()
    def generate_sync(
        self,
        request: GenerationRequest,
        emit: Callable[[TokenChunk], None] | None = None,
        stop: threading.Event | None = None,
    ) -> Generation:
        """The whole output (prefix included); ``emit`` gets the new tokens in chunks."""
        params, constraint = request.params, request.constraint
        temperature, top_p, top_k = self._check_params(params)
        seed = params.seed if params.seed is not None else int(self._seed_stream.integers(2**63))
        prompt = self._prompt_tensor(request.prompt_ids, params.max_tokens)
        cache = self._new_cache()
        logits = self._forward(prompt, cache)
        out = [int(t) for t in request.prefix_ids]
        for token in out:
            logits = self._forward(torch.tensor([token]), cache)
        new_ids: list[int] = []
        new_logprobs: list[float] = []
        sent = 0
        finish = FINISH_LENGTH
        for position in range(len(out), params.max_tokens):
            if stop is not None and stop.is_set():
                break
            logp = self._logprobs(logits, self._allowed(constraint, out), temperature, top_k, top_p)
            if temperature == 0.0:
                token = int(torch.argmax(logp))
            else:
                token = _sample(logp, torch.Generator().manual_seed(position_seed(seed, position)))
            out.append(token)
            new_ids.append(token)
            new_logprobs.append(float(logp[token]))
            if token in self.eos_ids or (constraint is not None and constraint.is_complete(out)):
                finish = FINISH_STOP
                break
            if emit is not None and request.chunk_tokens and len(new_ids) - sent >= request.chunk_tokens:
                emit(
                    TokenChunk(
                        np.asarray(new_ids[sent:], dtype=np.int32), np.asarray(new_logprobs[sent:], dtype=np.float32)
                    )
                )
                sent = len(new_ids)
            if position + 1 < params.max_tokens:
                logits = self._forward(torch.tensor([token]), cache)
        if emit is not None:
            emit(
                TokenChunk(
                    np.asarray(new_ids[sent:], dtype=np.int32),
                    np.asarray(new_logprobs[sent:], dtype=np.float32),
                    finish,
                )
            )
        return Generation(
            np.concatenate([request.prefix_ids, np.asarray(new_ids, dtype=np.int32)]).astype(np.int32),
            np.concatenate([request.prefix_logprobs, np.asarray(new_logprobs, dtype=np.float32)]).astype(np.float32),
            finish,
        )

    @torch.inference_mode()
    def score(
        self,
        prompt_ids: np.ndarray,
        output_ids: np.ndarray,
        params: SamplingParams,
        constraint: TokenConstraint | None = None,
    ) -> np.ndarray:
        """Logprobs of ``output_ids`` after ``prompt_ids`` from one full forward pass.

        Same masking and temperature as generation and no key/value cache, so it
        independently checks (to float rounding) what a call reported."""
        temperature, top_p, top_k = self._check_params(params)
        prompt = self._prompt_tensor(prompt_ids, params.max_tokens)
        output = torch.from_numpy(np.asarray(output_ids, dtype=np.int64))
        ids = torch.cat([prompt, output])
        logits = self.model(input_ids=ids[None]).logits[0, prompt.shape[0] - 1 : -1]
        out: list[int] = []
        scores = np.empty(len(output), dtype=np.float32)
        for i, token in enumerate(output.tolist()):
            scores[i] = float(
                self._logprobs(logits[i], self._allowed(constraint, out), temperature, top_k, top_p)[token]
            )
            out.append(token)
        return scores

    def _new_cache(self) -> DynamicCache:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def _forward(self, ids: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        """Logits of the last position after feeding ``ids`` (1-D) on top of ``cache``."""
        out = self.model(input_ids=ids[None], past_key_values=cache, use_cache=True, logits_to_keep=1)
        logits: torch.Tensor = out.logits[0, -1]  # transformers' model output: logits as a tensor
        return logits

    def set_policy_version(self, version: str) -> None:
        """Name the weights from the next call on (the model gate calls it while no stream is open,
        after a weight sync: see ``ModelParticipant.sync_weights``)."""
        self.policy_version = version

    def load_weights(self, folder: str | Path) -> None:
        """Load another folder's weights into the model in place (same architecture), between calls."""
        from transformers import AutoModelForCausalLM

        other = AutoModelForCausalLM.from_pretrained(Path(folder), dtype=torch.float32, attn_implementation="sdpa")
        self.model.load_state_dict(other.state_dict())

    def _logprobs(
        self, logits: torch.Tensor, allowed: np.ndarray | None, temperature: float, top_k: int = -1, top_p: float = 1.0
    ) -> torch.Tensor:
        """The log-probabilities of the distribution a token is drawn from (see the class docstring)."""
        if allowed is not None:
            mask = np.full(logits.shape[-1], -np.inf, dtype=np.float32)
            mask[allowed] = 0.0
            logits = logits + torch.from_numpy(mask)
        if temperature > 0.0:
            logits = logits / torch.tensor(temperature, dtype=torch.float32)
            logits = filter_top_k_top_p(logits, top_k, top_p)
        return torch.log_softmax(logits, dim=-1)

    def _allowed(self, constraint: TokenConstraint | None, out: list[int]) -> np.ndarray | None:
        if constraint is None:
            return None
        allowed = constraint.allowed(out)
        if allowed is None:
            return None
        if allowed.size == 0:
            raise ConstraintViolation(f"constraint allows no next token after {out} and is not complete")
        if allowed.min() < 0 or allowed.max() >= self.vocab_size:
            raise ConstraintViolation(f"constraint allowed ids outside [0, {self.vocab_size})")
        return allowed

    def _prompt_tensor(self, prompt_ids: np.ndarray, max_tokens: int) -> torch.Tensor:
        prompt = np.asarray(prompt_ids)
        if prompt.ndim != 1 or prompt.size == 0:
            raise ValueError(f"prompt_ids must be a non-empty 1-D id array, got shape {prompt.shape}")
        if prompt.min() < 0 or prompt.max() >= self.vocab_size:
            raise ValueError(f"prompt_ids must lie in [0, {self.vocab_size}) for {self.policy_version}")
        keep = self.max_context - max_tokens
        return torch.from_numpy(prompt[-keep:].astype(np.int64))

    def _check_params(self, params: SamplingParams) -> tuple[float, float, int]:
        # Round to float32 as the journal's Avro record does, so a restored
        # call computes exactly what the original one did.
        temperature, top_p = float(np.float32(params.temperature)), float(np.float32(params.top_p))
        if not temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {params.temperature}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
        if not 1 <= params.max_tokens < self.max_context:
            raise ValueError(f"max_tokens must be in [1, {self.max_context}), got {params.max_tokens}")
        if params.top_k < -1 or params.top_k == 0:
            raise ValueError(f"top_k must be -1 (off) or at least 1, got {params.top_k}")
        return temperature, top_p, params.top_k


def _sample(logp: torch.Tensor, generator: torch.Generator) -> int:
    """Inverse-CDF draw (float64) from ``exp(logp)`` (top-k/top-p already applied: the tokens they
    dropped have probability 0 and are never drawn)."""
    probs = logp.double().exp()
    cdf = torch.cumsum(probs, 0)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    # right=True: the first index whose cdf exceeds u, which skips zero-probability tokens
    index = int(torch.searchsorted(cdf, u, right=True))
    if index >= cdf.shape[0] or probs[index] == 0.0:  # u rounded up to the total
        index = int(torch.nonzero(probs)[-1])
    return index
