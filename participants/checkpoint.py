"""Coordinated checkpoints, for resources whose state lives outside the journal.

The event-sourced path never pauses anything: a snapshot rides along with a
turn's commit. When a resource's state can only be exported (a remote server,
an opaque store), a consistent cut needs a pause:

1. close model admission (new calls wait; admitted calls finish);
2. park every agent at a turn boundary, each within ``prepare_timeout_s`` -
   a rollout that does not get there in time is skipped this round, it does
   not fail the checkpoint;
3. export each parked rollout's opaque resource state (transient control
   errors such as an HTTP 500 are retried with backoff);
4. commit one snapshot per parked rollout (group-committed together);
5. reopen admission and the turn boundary.

A finished rollout that waits for its acknowledgement is already at a
boundary, so it never blocks a prepare (no deadlock in a prompt group whose
finished sibling waits for the trainer). The pause is measured.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from journal.journal import Journal

from .agent import Agent, LiveRollout, durable
from .model import ModelParticipant
from .resource_server import ControlError, TransientControlError
from .resources import Resource

log = logging.getLogger(__name__)


class StateExporter(Protocol):
    def export(self, resource: Resource) -> bytes: ...


@dataclass
class CheckpointReport:
    pause_ms: float = 0.0
    included: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # rollout -> why
    retries: int = 0


class CoordinatedCheckpointer:
    def __init__(self, journal: Journal, agent: Agent, model: ModelParticipant, exporter: StateExporter, *,
                 prepare_timeout_s: float = 2.0, max_retries: int = 5, retry_backoff_s: float = 0.02) -> None:
        self.journal = journal
        self.agent = agent
        self.model = model
        self.exporter = exporter
        self.prepare_timeout_s = prepare_timeout_s
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.history: list[CheckpointReport] = []

    async def checkpoint(self, rollouts: Iterable[LiveRollout]) -> CheckpointReport:
        report = CheckpointReport()
        started = time.perf_counter()
        self.model.gate.close()
        self.agent.turn_boundary.clear()
        try:
            try:  # admitted calls finish; a hung one must not hold every rollout
                await asyncio.wait_for(self.model.gate.drained(), self.prepare_timeout_s)
            except asyncio.TimeoutError:
                log.warning("model calls still in flight after %.1fs; their rollouts are skipped this round",
                            self.prepare_timeout_s)
            # An acknowledged rollout left the snapshot stream: a new snapshot would bring it back.
            parked = await self._park([r for r in rollouts if not r.acknowledged.is_set()], report)
            drafts = []
            for live in parked:
                try:
                    states = {rid: await self._export(r, report) for rid, r in live.env.resources.items()
                              if r.supports_export}
                except ControlError as exc:
                    report.skipped[live.spec.rollout_id] = f"export failed: {exc}"
                    continue
                drafts.append(self.agent.snapshot_draft(live, states))
                report.included.append(live.spec.rollout_id)
            futures = [self.journal.append([], draft) for draft in drafts]
            for future in futures:
                await durable(future)
        finally:
            self.agent.turn_boundary.set()
            self.model.gate.open()
            report.pause_ms = (time.perf_counter() - started) * 1000.0
            self.history.append(report)
        if report.skipped:
            log.info("coordinated checkpoint skipped %d rollouts: %s", len(report.skipped), report.skipped)
        return report

    async def _park(self, rollouts: list[LiveRollout], report: CheckpointReport) -> list[LiveRollout]:
        async def parked(live: LiveRollout) -> bool:
            try:
                await asyncio.wait_for(live.at_boundary.wait(), self.prepare_timeout_s)
                return True
            except asyncio.TimeoutError:
                report.skipped[live.spec.rollout_id] = f"not at a turn boundary within {self.prepare_timeout_s}s"
                return False

        results = await asyncio.gather(*(parked(live) for live in rollouts))
        return [live for live, ok in zip(rollouts, results) if ok]

    async def _export(self, resource: Resource, report: CheckpointReport) -> bytes:
        for attempt in range(self.max_retries + 1):
            try:
                return await asyncio.to_thread(self.exporter.export, resource)
            except TransientControlError as exc:
                if attempt == self.max_retries:
                    raise ControlError(f"{exc} (gave up after {attempt + 1} tries)") from exc
                report.retries += 1
                log.warning("transient control error, retrying: %s", exc)
                await asyncio.sleep(self.retry_backoff_s * (2 ** attempt))
        raise AssertionError("unreachable")
