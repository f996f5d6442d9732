"""The model participant: an admission gate in front of a generation backend
that turns every call into a ``ModelCall`` lineage event.

Lineage: each call names its parent (the rollout's previous call) and journals
only the prompt tokens after the parent's prompt+output (``prefix_len`` +
``prompt_delta``), so a 30-turn conversation does not re-journal its whole
prompt every turn. The gate can be closed (coordinated checkpoints): new
calls wait, calls already admitted finish.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np

from journal.events import ModelCall, SamplingParams

from .constraints import TokenConstraint
from .generation import Generation, GenerationBackend
from .rollout_state import RolloutState


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


@dataclass(frozen=True)
class ModelCallResult:
    event: ModelCall
    generation: Generation
    prompt: np.ndarray


class AdmissionGate:
    """Bounds calls in flight and can close admission while a checkpoint is prepared."""

    def __init__(self, max_in_flight: int) -> None:
        self._slots = asyncio.Semaphore(max_in_flight)
        self._open = asyncio.Event()
        self._open.set()
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def __aenter__(self) -> None:
        await self._open.wait()
        await self._slots.acquire()
        self._in_flight += 1
        self._idle.clear()

    async def __aexit__(self, *exc: object) -> None:
        self._slots.release()
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.set()

    def close(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    async def drained(self) -> None:
        """Wait until every admitted call has finished."""
        await self._idle.wait()

    @property
    def in_flight(self) -> int:
        return self._in_flight


class ModelParticipant:
    def __init__(self, backend: GenerationBackend, *, max_in_flight: int = 8) -> None:
        self.backend = backend
        self.gate = AdmissionGate(max_in_flight)

    async def call(self, state: RolloutState, prompt: np.ndarray, params: SamplingParams,
                   constraint: TokenConstraint | None, call_id: str, *, writer: str) -> ModelCallResult:
        """Generate, and describe the call as a lineage event whose parent is the state's head.

        The state is only read: applying the returned event moves its head.
        """
        async with self.gate:
            started = time.perf_counter()
            generation = self.backend.generate(prompt, params, constraint)
            latency_ms = (time.perf_counter() - started) * 1000.0
        prefix = common_prefix_len(state.head_tokens, prompt) if state.head_call_id else 0
        event = ModelCall(
            header=state.header(writer), call_id=call_id, parent_call_id=state.head_call_id,
            policy_version=self.backend.policy_version, sampling=params, prefix_len=prefix,
            prompt_delta=np.ascontiguousarray(prompt[prefix:], dtype="<i4"),
            output_ids=generation.output_ids, logprobs=generation.logprobs,
            finish_reason=generation.finish_reason, latency_ms=latency_ms,
        )
        return ModelCallResult(event, generation, prompt)
