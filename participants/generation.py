"""Backend-neutral generation types shared by every model backend.

The embedded torch policy, vLLM in process and vLLM's OpenAI-compatible server
all take token ids plus ``SamplingParams`` (and optionally a ``TokenConstraint``)
and return a ``Generation`` whose arrays go into a ``ModelCall`` record as is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

# One sampling-parameters type from the journal record to the backend call, so a
# restored ModelCall's params can be passed straight back to a backend.
from journal.events import SamplingParams
from participants.constraints import TokenConstraint

__all__ = ["FINISH_LENGTH", "FINISH_STOP", "Generation", "GenerationBackend", "SamplingParams", "TokenConstraint"]

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclass(frozen=True)
class Generation:
    """One completion: sampled ids, their logprobs, and why it stopped.

    ``finish_reason`` is ``"stop"`` (an eos/stop token was sampled, or the
    constraint completed) or ``"length"`` (``max_tokens`` ran out first).
    """

    output_ids: np.ndarray  # int32, 1-D
    logprobs: np.ndarray  # float32, 1-D, same length: logprob of each sampled token
    finish_reason: str

    def __post_init__(self) -> None:
        if self.output_ids.ndim != 1 or self.output_ids.shape != self.logprobs.shape:
            raise ValueError(
                f"Generation arrays must be 1-D and equal length, got output_ids {self.output_ids.shape} "
                f"and logprobs {self.logprobs.shape}"
            )
        if self.finish_reason not in (FINISH_STOP, FINISH_LENGTH):
            raise ValueError(f"finish_reason must be 'stop' or 'length', got {self.finish_reason!r}")


@runtime_checkable
class GenerationBackend(Protocol):
    """What the model gate calls; ``policy_version`` names the exact weights."""

    policy_version: str

    def generate(
        self, prompt_ids: np.ndarray, params: SamplingParams, constraint: TokenConstraint | None = None
    ) -> Generation: ...

    def generate_batch(
        self, requests: Sequence[tuple[np.ndarray, SamplingParams, TokenConstraint | None]]
    ) -> list[Generation]: ...
