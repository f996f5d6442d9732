"""The distribution a token is sampled from, as vLLM's sampler builds it, on one row of logits.

Order (vLLM v1's ``Sampler``): the decoding constraint's mask (a grammar bitmask or an action
trie: disallowed ids at -inf), then temperature, then top-k (keep every logit at least the k-th
largest), then top-p (sorted ascending, drop the tokens whose cumulative probability stays at or
below ``1 - top_p``, always keep the most likely). ``temperature == 0`` is greedy: the scores are
log_softmax of the masked logits, without temperature or filters (vLLM's all-greedy branch).

*Processed* logprobs are log_softmax of that filtered row: the probability the token was
sampled with, renormalized over the tokens top-k/top-p kept. This is what every backend journals
(``ModelCall.logprob_mode == "processed"``); a trainer that applies only the temperature gets other
numbers wherever top_p < 1 or 0 < top_k < vocab (the record marks those runs ``renormalized``).
"""

from __future__ import annotations

import numpy as np
import torch

from rollout_journal.journal.events import SamplingParams

__all__ = ["filter_top_k_top_p", "processed_logprobs"]


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """vLLM's ``apply_top_k_top_p_pytorch`` on one row (already divided by the temperature):
    the dropped tokens at -inf. ``top_k`` <= 0 or >= the row's size and ``top_p`` >= 1 are off."""
    size = logits.shape[-1]
    use_k = 0 < top_k < size
    use_p = top_p < 1.0
    if not (use_k or use_p):
        return logits
    ordered, order = logits.sort(dim=-1, descending=False)
    if use_k:
        ordered = ordered.masked_fill(ordered < ordered[size - top_k], -float("inf"))
    if use_p:
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        dropped = cumulative <= 1 - top_p
        dropped[-1] = False  # the most likely token always stays
        ordered = ordered.masked_fill(dropped, -float("inf"))
    return logits.scatter(-1, order, ordered)


def processed_logprobs(
    logits: torch.Tensor, params: SamplingParams, allowed: np.ndarray | torch.Tensor | None = None
) -> torch.Tensor:
    """Log-probabilities (float32) of the distribution ``params`` sample one row of ``logits`` from;
    ``allowed``: the ids (or a boolean mask) a decoding constraint allows, None for all."""
    row = logits.to(torch.float32)
    if allowed is not None:
        allowed_t = torch.as_tensor(np.array(allowed))
        keep = allowed_t if allowed_t.dtype == torch.bool else torch.zeros(row.shape[-1], dtype=torch.bool)
        if allowed_t.dtype != torch.bool:
            keep[allowed_t.long()] = True
        row = row.masked_fill(~keep, -float("inf"))
    temperature = float(np.float32(params.temperature))  # as the journal's Avro double from a float32 setting
    if temperature == 0.0:
        return torch.log_softmax(row, dim=-1)
    row = row / torch.tensor(temperature, dtype=torch.float32)
    row = filter_top_k_top_p(row, params.top_k, float(np.float32(params.top_p)))
    return torch.log_softmax(row, dim=-1)
