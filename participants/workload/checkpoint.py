"""Coordinated checkpoints, for resources whose state lives outside the journal.

The event-sourced path never pauses anything: a snapshot rides along with a
turn's commit. When a resource's state can only be exported (a remote server,
an opaque store), a consistent cut needs a pause:

1. close model admission (new calls wait; admitted calls finish, and any still
   running after ``prepare_timeout_s`` is aborted: it leaves the gate at once
   and continues from the tokens it had once admission reopens);
2. park every agent at a turn boundary, each within ``prepare_timeout_s`` -
   a rollout that does not get there in time is skipped this round, it does
   not fail the checkpoint;
3. prepare each parked rollout: its environment exports its opaque resource
   state (a resource server also holds the rollout's session still), every
   rollout at once and all of them within one more ``prepare_timeout_s``
   (transient control errors such as an HTTP 500 or a refused connection are
   retried with backoff and jitter); each export is checked before it is used
   (an error page served with HTTP 200 is no state), and a rollout whose
   exports fail, or are not done in time, is skipped this round;
4. commit one snapshot per rollout exported (group-committed together);
5. resume the prepared rollouts whose snapshot was committed and abort the
   others' (their servers let go of the sessions), then reopen admission and
   the turn boundary.

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

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_attempt,
    wait_random_exponential,
)

from rollout_journal.journal.journal import Journal
from rollout_journal.participants.model.gate import ModelParticipant
from rollout_journal.participants.remote.protocol import ControlError, TransientControlError
from rollout_journal.participants.resources import ResourceError
from rollout_journal.participants.session.sinks import durable
from rollout_journal.participants.workload.agent import Agent, LiveRollout

log = logging.getLogger(__name__)


@dataclass
class CheckpointReport:
    pause_ms: float = 0.0
    included: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # rollout -> why
    retries: int = 0
    aborted_calls: int = 0  # model calls aborted because they were still running after the prepare timeout


class CoordinatedCheckpointer:
    def __init__(
        self,
        journal: Journal,
        agent: Agent,
        model: ModelParticipant,
        *,
        prepare_timeout_s: float = 2.0,
        max_retries: int = 5,
        retry_backoff_s: float = 0.02,
    ) -> None:
        self.journal = journal
        self.agent = agent
        self.model = model
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
            try:  # admitted calls finish; a slow or hung one must not hold every rollout
                async with asyncio.timeout(self.prepare_timeout_s):  # never wait_for: see _park
                    await self.model.gate.drained()
            except TimeoutError:
                report.aborted_calls = self.model.gate.abort_in_flight()
                log.warning(
                    "%d model calls still in flight after %.1fs were aborted (they continue after the "
                    "checkpoint); their rollouts are skipped this round",
                    report.aborted_calls,
                    self.prepare_timeout_s,
                )
            # An acknowledged rollout left the snapshot stream: a new snapshot would bring it back.
            # A failed one stopped mid-turn: its resources may hold what the journal does not.
            candidates = [r for r in rollouts if not r.acknowledged.is_set() and r.state.failure is None]
            parked = await self._park(candidates, report)
            epochs = {live.spec.rollout_id: live.state.epoch for live in parked}
            exported = await self._export_all(parked, report)
            committed: set[str] = set()
            try:
                drafts = []
                for live in parked:
                    states = exported.get(live.spec.rollout_id)
                    if states is not None:
                        drafts.append(self.agent.snapshot_draft(live, states))
                        report.included.append(live.spec.rollout_id)
                futures = [self.journal.append([], draft) for draft in drafts]
                for future in futures:
                    await durable(future)
                committed = set(report.included)
            finally:
                await self._end_all(parked, epochs, committed)
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
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the result when it is
            # cancelled just as the wait completed, and a checkpoint that swallowed the run's
            # cancellation went on to the next one while the run's end waited for it for ever.
            try:
                async with asyncio.timeout(self.prepare_timeout_s):
                    await live.at_boundary.wait()
                return True
            except TimeoutError:
                report.skipped[live.spec.rollout_id] = f"not at a turn boundary within {self.prepare_timeout_s}s"
                return False

        results = await asyncio.gather(*(parked(live) for live in rollouts))
        return [live for live, ok in zip(rollouts, results) if ok]

    async def _export_all(self, parked: list[LiveRollout], report: CheckpointReport) -> dict[str, dict[str, bytes]]:
        """Every parked rollout's exports, all prepared at once; the whole phase is bounded by
        the prepare timeout. A rollout whose exports fail or are late is skipped this round."""
        tasks = {asyncio.create_task(self._prepare(live, report)): live.spec.rollout_id for live in parked}
        if not tasks:
            return {}
        try:
            done, late = await asyncio.wait(tasks, timeout=self.prepare_timeout_s)
        except asyncio.CancelledError:  # the run is ending: no prepare may outlive it (its clients close)
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
            raise
        for task in late:
            task.cancel()  # a blocked export thread runs on, but nothing waits for it
            report.skipped[tasks[task]] = f"exports not done within {self.prepare_timeout_s}s"
        exported = {}
        for task in done:
            rollout_id = tasks[task]
            try:
                exported[rollout_id] = task.result()
            except (ControlError, ResourceError) as exc:  # an unusable export (check_export) included
                report.skipped[rollout_id] = f"export failed: {exc}"
        if late:
            await asyncio.wait(late)  # let the cancellations land before the turn boundary reopens
        return exported

    async def _prepare(self, live: LiveRollout, report: CheckpointReport) -> dict[str, bytes]:
        """One rollout's exports, prepared by its environment (at its resource server for a remote
        one), retried on transient errors and each checked before it is used."""

        def counted(state: RetryCallState) -> None:
            report.retries += 1
            log.warning(
                "rollout %s: transient control error, retrying: %s",
                live.spec.rollout_id,
                state.outcome.exception() if state.outcome else "?",
            )

        retrying = AsyncRetrying(
            retry=retry_if_exception_type(TransientControlError),
            reraise=True,
            stop=stop_after_attempt(self.max_retries + 1),
            before_sleep=counted,
            wait=wait_random_exponential(multiplier=self.retry_backoff_s, max=1.0),
        )
        try:
            async for attempt in retrying:
                with attempt:
                    states = await live.env.aprepare_checkpoint(live.state.epoch)
        except TransientControlError as exc:
            raise ControlError(f"{exc} (gave up after {self.max_retries + 1} tries)") from exc
        for resource_id, data in states.items():
            live.env.resources[resource_id].check_export(data)
        return states

    async def _end_all(self, parked: list[LiveRollout], epochs: dict[str, int], committed: set[str]) -> None:
        """Resume the rollouts whose snapshot is durable and abort the others' preparation, within
        one prepare timeout; a server that does not answer lets go of its session by itself."""

        async def end(live: LiveRollout) -> None:
            rollout_id = live.spec.rollout_id
            try:
                await live.env.aend_checkpoint(epochs[rollout_id], rollout_id in committed)
            except (ControlError, ResourceError) as exc:
                log.warning("rollout %s: ending the checkpoint at its resource server failed: %s", rollout_id, exc)

        if parked:
            ends = [asyncio.create_task(end(live)) for live in parked]
            try:
                await asyncio.wait(ends, timeout=self.prepare_timeout_s)
            finally:
                for task in ends:
                    task.cancel()
