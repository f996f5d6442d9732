"""The embedded default generation backend: a tiny deterministic torch policy.

A two-layer decoder-only transformer on CPU float32 whose weights come from a
local ``torch.Generator`` seeded with ``weights_seed``: every process builds
bit-identical weights without touching torch's global RNG or thread settings.
It is untrained (its outputs are arbitrary but reproducible), which is all a
rollout-recovery test bed needs: real sampling, real logprobs, real cost.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from participants.constraints import ConstraintViolation, TokenConstraint
from participants.generation import FINISH_LENGTH, FINISH_STOP, Generation, SamplingParams
from participants.tokenizer import ChatTokenizer, default_tokenizer

ARCH_VERSION = "tiny-torch-v1"


@dataclass(frozen=True)
class TinyPolicyConfig:
    vocab_size: int
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    d_mlp: int = 256
    max_context: int = 2048
    # Embedding scale: with the tied head this gives logits of std ~1.6, so
    # next-token distributions are neither uniform nor one-hot.
    embed_std: float = 0.2

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} must be divisible by n_heads {self.n_heads}")


class _KVCache:
    """Per-layer key/value buffers for one sequence, preallocated to its final length."""

    def __init__(self, config: TinyPolicyConfig, length: int) -> None:
        head_dim = config.d_model // config.n_heads
        shape = (config.n_layers, config.n_heads, length, head_dim)
        self.k = torch.empty(shape, dtype=torch.float32)
        self.v = torch.empty(shape, dtype=torch.float32)


class _Block(nn.Module):
    def __init__(self, c: TinyPolicyConfig) -> None:
        super().__init__()
        d = c.d_model
        # torch.empty draws nothing from the global RNG; _init fills every tensor.
        self.ln1_w, self.ln1_b = nn.Parameter(torch.empty(d)), nn.Parameter(torch.empty(d))
        self.qkv_w, self.qkv_b = nn.Parameter(torch.empty(3 * d, d)), nn.Parameter(torch.empty(3 * d))
        self.out_w, self.out_b = nn.Parameter(torch.empty(d, d)), nn.Parameter(torch.empty(d))
        self.ln2_w, self.ln2_b = nn.Parameter(torch.empty(d)), nn.Parameter(torch.empty(d))
        self.fc1_w, self.fc1_b = nn.Parameter(torch.empty(c.d_mlp, d)), nn.Parameter(torch.empty(c.d_mlp))
        self.fc2_w, self.fc2_b = nn.Parameter(torch.empty(d, c.d_mlp)), nn.Parameter(torch.empty(d))
        self.n_heads = c.n_heads

    def forward(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int) -> torch.Tensor:
        """``x``: [T, d] at positions ``start..start+T-1``; caches: [H, L, dh]."""
        t, d = x.shape
        h = F.layer_norm(x, (d,), self.ln1_w, self.ln1_b)
        q, k, v = F.linear(h, self.qkv_w, self.qkv_b).view(t, 3, self.n_heads, -1).permute(1, 2, 0, 3)
        end = start + t
        k_cache[:, start:end] = k
        v_cache[:, start:end] = v
        keys, values = k_cache[:, :end], v_cache[:, :end]
        if t == 1 or start == 0:
            # One new token sees everything; a prefill from 0 is plain causal.
            attn = F.scaled_dot_product_attention(q, keys, values, is_causal=t > 1)  # [H, T, dh]
        else:
            visible = torch.ones(t, end, dtype=torch.bool).tril(start)
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible)
        x = x + F.linear(attn.transpose(0, 1).reshape(t, d), self.out_w, self.out_b)
        h = F.layer_norm(x, (d,), self.ln2_w, self.ln2_b)
        return x + F.linear(F.gelu(F.linear(h, self.fc1_w, self.fc1_b)), self.fc2_w, self.fc2_b)


class _TinyTransformer(nn.Module):
    def __init__(self, c: TinyPolicyConfig) -> None:
        super().__init__()
        self.config = c
        self.tok_emb = nn.Parameter(torch.empty(c.vocab_size, c.d_model))
        self.pos_emb = nn.Parameter(torch.empty(c.max_context, c.d_model))
        self.blocks = nn.ModuleList(_Block(c) for _ in range(c.n_layers))
        self.lnf_w, self.lnf_b = nn.Parameter(torch.empty(c.d_model)), nn.Parameter(torch.empty(c.d_model))

    def init_weights(self, generator: torch.Generator) -> None:
        """Fill every parameter in registration order from ``generator``."""
        c = self.config
        with torch.no_grad():
            for name, p in self.named_parameters():
                leaf = name.rsplit(".", 1)[-1]
                if leaf.startswith("ln") and leaf.endswith("_w"):
                    p.fill_(1.0)
                elif leaf.endswith("_b"):
                    p.zero_()
                elif leaf == "tok_emb":
                    p.normal_(0.0, c.embed_std, generator=generator)
                elif leaf == "pos_emb":
                    p.normal_(0.0, 0.02, generator=generator)
                else:
                    std = 1.0 / math.sqrt(p.shape[1])
                    if leaf in ("out_w", "fc2_w"):  # keep the residual stream's scale across layers
                        std /= math.sqrt(2 * c.n_layers)
                    p.normal_(0.0, std, generator=generator)

    def forward(self, ids: torch.Tensor, cache: _KVCache, start: int, all_logits: bool = False) -> torch.Tensor:
        """Logits for the last position ([V]), or for every position ([T, V])."""
        t = ids.shape[0]
        x = self.tok_emb[ids] + self.pos_emb[start : start + t]
        for i, block in enumerate(self.blocks):
            x = block(x, cache.k[i], cache.v[i], start)
        if not all_logits:
            x = x[-1:]
        x = F.layer_norm(x, (self.config.d_model,), self.lnf_w, self.lnf_b)
        logits = F.linear(x, self.tok_emb)  # tied head
        return logits if all_logits else logits[0]


class TinyTorchPolicy:
    """Deterministic CPU ``GenerationBackend``: same inputs, same ids and logprobs, bit for bit.

    Sampling per step: logits -> constraint mask (disallowed = -inf) ->
    divide by temperature -> top-p nucleus -> inverse-CDF draw with a
    ``torch.Generator`` seeded from ``params.seed``; ``temperature == 0`` is greedy.
    A call with ``seed=None`` takes its seed from a per-instance stream started
    at ``sampler_seed``, so it is reproducible only for the same sequence of calls.

    Logprobs: each sampled token's log-probability under the masked,
    temperature-scaled distribution, *before* top-p truncation (with
    ``top_p == 1`` that is exactly the distribution sampled from). That is what a
    trainer can recompute from logits alone (``score`` does), without replaying
    the nucleus cut. Greedy calls report logprobs at temperature 1.

    Prompts longer than ``max_context - max_tokens`` keep their last
    ``max_context - max_tokens`` tokens, so the whole generation fits the
    positional table. ``generate_batch`` loops over ``generate``: each result is
    bit-identical to the single call, which real batching (other matmul shapes)
    would not guarantee. Not thread-safe; use one instance per thread.
    """

    def __init__(
        self,
        tokenizer: ChatTokenizer | None = None,
        weights_seed: int = 0,
        sampler_seed: int = 0,
        config: TinyPolicyConfig | None = None,
    ) -> None:
        self.tokenizer = tokenizer if tokenizer is not None else default_tokenizer()
        self.config = config if config is not None else TinyPolicyConfig(vocab_size=self.tokenizer.vocab_size)
        if self.config.vocab_size != self.tokenizer.vocab_size:
            raise ValueError(
                f"policy vocab_size {self.config.vocab_size} != tokenizer vocab_size {self.tokenizer.vocab_size}"
            )
        self.eos_id = self.tokenizer.eos_id
        self.weights_seed = weights_seed
        self.model = _TinyTransformer(self.config)
        self.model.init_weights(torch.Generator().manual_seed(weights_seed))
        self.model.requires_grad_(False).eval()
        self.weights_digest = self._digest()
        self.policy_version = f"{ARCH_VERSION}-seed{weights_seed}-{self.weights_digest[:12]}"
        self._seed_stream = np.random.default_rng(sampler_seed)

    @torch.inference_mode()
    def generate(
        self, prompt_ids: np.ndarray, params: SamplingParams, constraint: TokenConstraint | None = None
    ) -> Generation:
        temperature, top_p = self._check_params(params)
        prompt = self._prompt_tensor(prompt_ids, params.max_tokens)
        seed = params.seed if params.seed is not None else int(self._seed_stream.integers(2**63))
        generator = torch.Generator().manual_seed(seed)
        cache = _KVCache(self.config, prompt.shape[0] + params.max_tokens)
        logits = self.model(prompt, cache, 0)
        pos = prompt.shape[0]
        out: list[int] = []
        logprobs: list[float] = []
        finish = FINISH_LENGTH
        for step in range(params.max_tokens):
            logp = self._logprobs(logits, self._allowed(constraint, out), temperature)
            if temperature == 0.0:
                token = int(torch.argmax(logp))
            else:
                token = _sample(logp, top_p, generator)
            out.append(token)
            logprobs.append(float(logp[token]))
            if token == self.eos_id or (constraint is not None and constraint.is_complete(out)):
                finish = FINISH_STOP
                break
            if step + 1 < params.max_tokens:
                logits = self.model(torch.tensor([token]), cache, pos)
                pos += 1
        return Generation(
            output_ids=np.asarray(out, dtype=np.int32),
            logprobs=np.asarray(logprobs, dtype=np.float32),
            finish_reason=finish,
        )

    def generate_batch(
        self, requests: Sequence[tuple[np.ndarray, SamplingParams, TokenConstraint | None]]
    ) -> list[Generation]:
        """Sequential ``generate`` per request (see the class docstring for why)."""
        return [self.generate(prompt, params, constraint) for prompt, params, constraint in requests]

    @torch.inference_mode()
    def score(
        self,
        prompt_ids: np.ndarray,
        output_ids: np.ndarray,
        params: SamplingParams,
        constraint: TokenConstraint | None = None,
    ) -> np.ndarray:
        """Logprobs of ``output_ids`` after ``prompt_ids`` from one full forward pass.

        Same masking and temperature as ``generate`` and no KV cache, so it
        independently checks (to float rounding) what ``generate`` reported.
        """
        temperature, _ = self._check_params(params)
        prompt = self._prompt_tensor(prompt_ids, params.max_tokens)
        output = torch.from_numpy(np.asarray(output_ids, dtype=np.int64))
        ids = torch.cat([prompt, output])
        cache = _KVCache(self.config, ids.shape[0])
        logits = self.model(ids, cache, 0, all_logits=True)[prompt.shape[0] - 1 : -1]
        out: list[int] = []
        scores = np.empty(len(output), dtype=np.float32)
        for i, token in enumerate(output.tolist()):
            scores[i] = float(self._logprobs(logits[i], self._allowed(constraint, out), temperature)[token])
            out.append(token)
        return scores

    def _logprobs(self, logits: torch.Tensor, allowed: np.ndarray | None, temperature: float) -> torch.Tensor:
        if allowed is not None:
            mask = np.full(self.config.vocab_size, -np.inf, dtype=np.float32)
            mask[allowed] = 0.0
            logits = logits + torch.from_numpy(mask)
        if temperature > 0.0:
            logits = logits / torch.tensor(temperature, dtype=torch.float32)
        return torch.log_softmax(logits, dim=-1)

    def _allowed(self, constraint: TokenConstraint | None, out: list[int]) -> np.ndarray | None:
        if constraint is None:
            return None
        allowed = constraint.allowed(out)
        if allowed is None:
            return None
        if allowed.size == 0:
            raise ConstraintViolation(f"constraint allows no next token after {out} and is not complete")
        if allowed.min() < 0 or allowed.max() >= self.config.vocab_size:
            raise ConstraintViolation(f"constraint allowed ids outside [0, {self.config.vocab_size})")
        return allowed

    def _prompt_tensor(self, prompt_ids: np.ndarray, max_tokens: int) -> torch.Tensor:
        prompt = np.asarray(prompt_ids)
        if prompt.ndim != 1 or prompt.size == 0:
            raise ValueError(f"prompt_ids must be a non-empty 1-D id array, got shape {prompt.shape}")
        if prompt.min() < 0 or prompt.max() >= self.config.vocab_size:
            raise ValueError(f"prompt_ids must lie in [0, {self.config.vocab_size}) for {self.policy_version}")
        keep = self.config.max_context - max_tokens
        return torch.from_numpy(prompt[-keep:].astype(np.int64))

    def _check_params(self, params: SamplingParams) -> tuple[float, float]:
        # Round to float32 as the journal's Avro record does, so a restored
        # call computes exactly what the original one did.
        temperature, top_p = float(np.float32(params.temperature)), float(np.float32(params.top_p))
        if not temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {params.temperature}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
        if not 1 <= params.max_tokens < self.config.max_context:
            raise ValueError(f"max_tokens must be in [1, {self.config.max_context}), got {params.max_tokens}")
        return temperature, top_p

    def _digest(self) -> str:
        h = hashlib.sha256()
        h.update(json.dumps(asdict(self.config), sort_keys=True).encode())
        h.update(self.tokenizer.fingerprint.encode())
        for name, p in self.model.named_parameters():
            h.update(name.encode())
            h.update(p.detach().numpy().tobytes())
        return h.hexdigest()


def _sample(logp: torch.Tensor, top_p: float, generator: torch.Generator) -> int:
    """Inverse-CDF draw (float64) from ``exp(logp)``, restricted to the top-p nucleus."""
    probs = logp.double().exp()
    order: torch.Tensor | None = None
    if top_p < 1.0:
        probs, order = torch.sort(probs, descending=True, stable=True)
        before = torch.cumsum(probs, 0) - probs
        probs = probs[before < top_p]  # the highest-probability token is always kept
    cdf = torch.cumsum(probs, 0)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    # right=True: the first index whose cdf exceeds u, which skips zero-probability tokens
    index = int(torch.searchsorted(cdf, u, right=True))
    if index >= cdf.shape[0] or probs[index] == 0.0:  # u rounded up to the total
        index = int(torch.nonzero(probs)[-1])
    return int(order[index]) if order is not None else index
