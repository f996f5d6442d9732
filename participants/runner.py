"""Runs a workload of rollouts (groups x siblings) to the end, fresh or resumed.

Resuming is attempt N+1 for every unfinished rollout: fold its journal
(snapshot + events since), rebuild its environment (import exported resource
states, re-apply the mutations since), write the fence (``AttemptStarted``
with a higher epoch) and continue from the next turn. Rollouts whose
environment is ``restart_only`` start again from turn 0; finished rollouts
are offered again from the journal, never recomputed.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from journal.errors import ConfigurationError, JournalClosedError
from journal.events import Header
from journal.journal import Journal
from journal.snapshots import SnapshotDraft
from journal.restore import RolloutHistory, load_rollouts

from .agent import Agent, JournalSink, LiveRollout, NullSink, durable
from .checkpoint import CoordinatedCheckpointer, StateExporter
from .resource_server import InProcessExporter
from .config import WorkloadConfig
from .environments import make_environment
from .generation import GenerationBackend
from .model import ModelParticipant
from .resources import Recovery
from .rollout_state import RolloutSpec, RolloutState, fold
from .tokenizer import ChatTokenizer

log = logging.getLogger(__name__)


def workload_specs(config: WorkloadConfig) -> list[RolloutSpec]:
    specs = []
    for g in range(config.groups):
        environment = config.environments[g % len(config.environments)]
        task_seed = int.from_bytes(hashlib.sha256(f"{config.seed}/task/{g}".encode()).digest()[:4], "little")
        for s in range(config.siblings):
            specs.append(RolloutSpec(f"{config.name}-g{g}-s{s}", f"{config.name}-g{g}", s, task_seed, environment))
    return specs


@dataclass
class RolloutReport:
    rollout_id: str
    turns_committed_before: int  # turns found committed in the journal when this run began
    turns_run_here: int  # turns this run executed
    tokens_run_here: int
    restarted_from_zero: bool
    reused_result: bool  # finished before; offered again from the journal
    outcome: dict | None = None
    acknowledged: bool = False  # the trainer took its result before this run: nothing to do


@dataclass
class RunReport:
    rollouts: dict[str, RolloutReport] = field(default_factory=dict)
    restore_seconds: float = 0.0
    events_replayed: int = 0
    run_seconds: float = 0.0
    read_errors: list[str] = field(default_factory=list)

    @property
    def turns_run(self) -> int:
        return sum(r.turns_run_here for r in self.rollouts.values())

    def outcomes(self) -> dict[str, dict]:
        """Outcome per rollout this run produced or offered again (acknowledged ones are gone)."""
        return {rid: r.outcome for rid, r in sorted(self.rollouts.items()) if not r.acknowledged}


ProgressCallback = Callable[[str, int], None]  # (rollout_id, turn) once that turn is durable


class Runner:
    def __init__(self, config: WorkloadConfig, journal: Journal | None, backend: GenerationBackend,
                 tokenizer: ChatTokenizer, *, progress: ProgressCallback | None = None,
                 exporter: StateExporter | None = None, hold_until_acknowledged: bool = False) -> None:
        """``hold_until_acknowledged`` keeps a finished rollout waiting for the trainer's
        acknowledgement (``acknowledge``) before the run may end, as a GRPO trainer holds a
        prompt group until every sibling is in."""
        self.config = config
        self.journal = journal
        self.model = ModelParticipant(backend, max_in_flight=config.model.max_concurrent_calls)
        sink = JournalSink(journal) if journal is not None and config.journaling else NullSink()
        self.progress = progress or (lambda rollout_id, turn: None)
        self.agent = Agent(config, self.model, tokenizer, sink, writer=config.writer, on_durable=self.progress)
        self.live: dict[str, LiveRollout] = {}
        self.states: dict[str, RolloutState] = {}
        self.hold_until_acknowledged = hold_until_acknowledged
        self.checkpointer: CoordinatedCheckpointer | None = None
        if config.checkpoint_mode == "coordinated" and journal is not None and config.journaling:
            self.checkpointer = CoordinatedCheckpointer(
                journal, self.agent, self.model, exporter or InProcessExporter(),
                prepare_timeout_s=config.prepare_timeout_s)

    async def run(self, *, resume: bool, stop_after: dict[str, int] | None = None) -> RunReport:
        """Drive every rollout to its end. ``stop_after`` leaves the named rollouts
        once they have that many committed turns (a crash at a turn boundary, for
        tests and for forking)."""
        report = RunReport()
        started = time.perf_counter()
        histories: dict[str, RolloutHistory] = {}
        registered = False
        if self.journal is not None:
            plan = load_rollouts(self.journal)
            histories = plan.rollouts
            report.restore_seconds, report.events_replayed = plan.seconds, plan.events_replayed
            report.read_errors = [str(e) for e in plan.report.errors]
            registered = self._marker_id in histories
            ours = {s.rollout_id for s in workload_specs(self.config)}
            if not resume and (registered or ours & set(histories)):
                raise ConfigurationError(
                    f"journal {self.config.journal} already holds workload {self.config.name!r}; "
                    "use `rollout-journal resume` to continue it, or point --journal at a fresh location"
                )
        first_commits = []
        for spec in workload_specs(self.config):
            history = histories.get(spec.rollout_id)
            if history is None and registered:
                # Registered, yet gone from the snapshot stream: the trainer acknowledged it.
                report.rollouts[spec.rollout_id] = RolloutReport(spec.rollout_id, 0, 0, 0, False, False,
                                                                 acknowledged=True)
                continue
            live, rollout_report, commit = self._prepare(spec, history)
            report.rollouts[spec.rollout_id] = rollout_report
            if live is not None:
                self.live[spec.rollout_id] = live
                self.states[spec.rollout_id] = live.state
            if commit is not None:
                first_commits.append(commit)
        await asyncio.gather(*first_commits)
        if self.journal is not None and self.config.journaling and not registered:
            await self._register_workload()
        semaphore = asyncio.Semaphore(self.config.concurrency)

        async def drive(live: LiveRollout) -> None:
            async with semaphore:
                limit = (stop_after or {}).get(live.state.spec.rollout_id)
                while not live.state.finished and (limit is None or live.state.next_turn < limit):
                    await self.agent.run_turn(live)
                await self.agent.settle(live)
            if live.state.finished and self.hold_until_acknowledged:
                await live.acknowledged.wait()

        async def checkpoints() -> None:
            while True:
                await asyncio.sleep(self.config.coordinated_every_s)
                await self.checkpointer.checkpoint(self.live.values())

        try:
            await self._drive_all(drive, checkpoints)
        finally:
            for live in self.live.values():
                live.env.close()
        for rid, live in self.live.items():
            r = report.rollouts[rid]
            r.turns_run_here, r.tokens_run_here = live.turns_run_here, live.tokens_run_here
            r.outcome = live.state.outcome
        if self.journal is not None:
            self.journal.flush()
        report.run_seconds = time.perf_counter() - started
        return report

    async def _drive_all(self, drive, checkpoints) -> None:
        """Drive every live rollout (and periodic checkpoints) until all are done. The first
        failure cancels the rest and is raised as itself; the others are logged."""
        try:
            async with asyncio.TaskGroup() as group:
                drives = [group.create_task(drive(live)) for live in self.live.values()]
                if self.checkpointer is not None:
                    periodic = group.create_task(checkpoints())

                    async def stop_checkpoints() -> None:
                        await asyncio.gather(*drives)
                        periodic.cancel()

                    group.create_task(stop_checkpoints())
        except BaseExceptionGroup as failures:
            first, *others = failures.exceptions
            for other in others:  # a journal's fatal error (or its stop) fails every waiting rollout alike
                if other is not first and not isinstance(other, JournalClosedError):
                    log.error("rollout task also failed: %r", other)
            raise first from None

    @property
    def _marker_id(self) -> str:
        return f"workload:{self.config.name}"

    async def _register_workload(self) -> None:
        """Record that every rollout of the workload has been registered in the snapshot
        stream. From then on a rollout missing from it was acknowledged, not unstarted."""
        ids = [spec.rollout_id for spec in workload_specs(self.config)]
        header = Header(self._marker_id, self._marker_id, 0, 0, 0, 0, Header.now_ms(), self.config.writer)
        draft = SnapshotDraft(header, "registered", -1, json.dumps({"rollouts": ids}).encode())
        await durable(self.journal.append([], draft))

    def _prepare(self, spec: RolloutSpec, history: RolloutHistory | None):
        """The live rollout to drive (None if finished), its report entry, and its first commit."""
        if history is None:
            live = LiveRollout(RolloutState(spec, writer=self.config.writer),
                               make_environment(spec.environment, spec.rollout_id, spec.task_seed))
            events = self.agent.start_attempt(live, resumed_from_turn=0, reason="new rollout")
            commit = self.agent.begin(live, events)
            return live, RolloutReport(spec.rollout_id, 0, 0, 0, False, False), commit
        folded = fold(spec, history)
        state = folded.state
        state.writer = self.config.writer
        state.epoch, state.attempt = max(state.epoch, history.epoch), max(state.attempt, history.attempt)
        committed = state.next_turn
        self.states[spec.rollout_id] = state
        if state.finished:
            return None, RolloutReport(spec.rollout_id, committed, 0, 0, folded.restarted_from_zero, True, state.outcome), None
        env = make_environment(spec.environment, spec.rollout_id, spec.task_seed)
        restart = env.recovery is Recovery.RESTART_ONLY and state.next_turn > 0
        if restart:
            state = RolloutState(spec, attempt=state.attempt, epoch=state.epoch, next_seq=state.next_seq,
                                 writer=self.config.writer)
            reason = f"restart from turn 0: environment {spec.environment!r} is restart_only"
        else:
            for resource_id, exported in state.resource_states.items():
                resource = env.resources.get(resource_id)
                if resource is None:
                    raise ConfigurationError(
                        f"rollout {spec.rollout_id}: its snapshot holds resource {resource_id!r}, which environment "
                        f"{spec.environment!r} does not have; was the workload's environment changed?")
                resource.import_state(exported)
            env.replay(folded.mutations)
            reason = f"resume after crash at turn {state.next_turn}"
        live = LiveRollout(state, env)
        events = self.agent.start_attempt(live, resumed_from_turn=state.next_turn, reason=reason)
        commit = self.agent.commit(events)
        return live, RolloutReport(spec.rollout_id, committed, 0, 0, restart, False), commit

    async def acknowledge(self, rollout_ids: list[str], by: str = "trainer") -> None:
        """The trainer took these results: journal it and tombstone their snapshots."""
        if self.journal is None:
            for rid in rollout_ids:
                self.live[rid].acknowledged.set()
            return
        futures = [self.journal.acknowledge(self.states[rid].header(), by) for rid in rollout_ids]
        for f in futures:
            await durable(f)
        for rid in rollout_ids:
            if rid in self.live:
                self.live[rid].acknowledged.set()
