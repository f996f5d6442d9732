"""Trainer lag as a worker sees it: the results on its partitions the trainer has not acknowledged.

A fleet worker counts each rollout whose training record became durable on the results stream
(finished or given up, here or found so at a take) until the trainer's acknowledgement of it is
applied and durable; its metrics endpoint reads the count and the oldest one's age
(``rj_results_awaiting_trainer``, ``rj_oldest_result_awaiting_trainer_seconds``; docs/scaling.md).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

__all__ = ["AwaitingTrainer"]


class AwaitingTrainer:
    """Rollouts on a worker's owned partitions whose training record is on the results stream
    (finished, or given up) and whose acknowledgement by the trainer is not yet applied and durable:
    rollout id -> (partition, since), ``since`` (monotonic) when this worker learned of it (its
    finish or give-up here, or the take that restored it so). Changed on the event loop (and by an
    acknowledgement's commit callback), read by the metrics endpoint's thread: under a lock."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._waiting: dict[str, tuple[int, float]] = {}
        # acknowledged before this worker counted them (a take's admission still under way while its
        # partition's acknowledgements apply): not counted when they come (rollout id -> partition)
        self._early: dict[str, int] = {}

    def add(self, rollout_id: str, partition: int) -> None:
        with self._lock:
            if self._early.pop(rollout_id, None) is None:
                self._waiting.setdefault(rollout_id, (partition, self._clock()))

    def acknowledged(self, rollout_id: str, partition: int) -> None:
        """The trainer's acknowledgement of it is applied and durable."""
        with self._lock:
            if self._waiting.pop(rollout_id, None) is None:
                self._early[rollout_id] = partition

    def let_go(self, partitions: Iterable[int]) -> None:
        """Revoked or lost: their next owner counts them."""
        gone = set(partitions)
        with self._lock:
            self._waiting = {rid: entry for rid, entry in self._waiting.items() if entry[0] not in gone}
            self._early = {rid: p for rid, p in self._early.items() if p not in gone}

    def count(self) -> int:
        with self._lock:
            return len(self._waiting)

    def oldest_seconds(self) -> float:
        """How long the oldest has waited; 0 when none waits."""
        with self._lock:
            oldest = min((since for _, since in self._waiting.values()), default=None)
        return 0.0 if oldest is None else max(0.0, self._clock() - oldest)
