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
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from journal.anchoring import HeadSigner
from journal.errors import (
    ConfigurationError,
    FencedWriteError,
    JournalClosedError,
    PartitionFencedError,
    RecordLocation,
)
from journal.events import Header, RolloutAcknowledged, WorkloadRegistered
from journal.journal import Journal
from journal.restore import RestorePlan, RolloutHistory, history_from_first_event, load_rollouts, reload_rollout

from .agent import Agent, JournalSink, LiveRollout, NullSink, durable
from .checkpoint import CoordinatedCheckpointer
from .config import TopologyChangedError, WorkloadConfig
from .environments import Environment
from .generation import GenerationBackend
from .model import ModelParticipant
from .resource_client import EnvironmentFactory
from .resources import Recovery, ResourceError, StaleEpochError
from .rollout_state import RolloutSpec, RolloutState, StateFoldError, restore_state
from .specs import fork_specs, workload_specs
from .tokenizer import ChatTokenizer

log = logging.getLogger(__name__)


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
    set_aside: str | None = None  # its journal could not be restored (why); the other rollouts ran
    failed: str | None = None  # it stopped on an infrastructure failure (why), journaled; the others ran


@dataclass
class RestoreTiming:
    """Where a run's restore went, in seconds, before any rollout ran a new turn.

    Reading the journal is rarely the bulk: a restart-only sandbox starts a new
    interpreter per rollout, and an exported state is imported and its mutations
    re-applied, so each phase is reported on its own."""

    read_s: float = 0.0  # the snapshot stream and the events since each snapshot
    fold_s: float = 0.0  # applying those events to every rollout's aggregate
    rebuild_s: float = 0.0  # resumed rollouts' environments: started, exports imported, mutations re-applied
    fence_s: float = 0.0  # the resumed attempts' AttemptStarted made durable (a fresh run: 0)

    @property
    def total_s(self) -> float:
        return self.read_s + self.fold_s + self.rebuild_s + self.fence_s

    def as_ms(self) -> dict[str, float]:
        phases = {"read": self.read_s, "fold": self.fold_s, "rebuild": self.rebuild_s, "fence": self.fence_s,
                  "total": self.total_s}
        return {name: round(seconds * 1000, 2) for name, seconds in phases.items()}


@dataclass
class RunReport:
    rollouts: dict[str, RolloutReport] = field(default_factory=dict)
    restore: RestoreTiming = field(default_factory=RestoreTiming)
    events_replayed: int = 0
    run_seconds: float = 0.0
    read_errors: list[str] = field(default_factory=list)

    @property
    def restore_seconds(self) -> float:
        """The whole restore: reading, folding, rebuilding environments and writing the fences."""
        return self.restore.total_s

    @property
    def turns_run(self) -> int:
        return sum(r.turns_run_here for r in self.rollouts.values())

    def outcomes(self) -> dict[str, dict | None]:
        """Outcome per rollout this run produced or offered again (acknowledged, set-aside and
        failed ones have none)."""
        return {rid: r.outcome for rid, r in sorted(self.rollouts.items())
                if not r.acknowledged and not r.set_aside and not r.failed}

    @property
    def set_aside(self) -> dict[str, str]:
        """Rollouts whose journal could not be restored, and why."""
        return {rid: r.set_aside for rid, r in sorted(self.rollouts.items()) if r.set_aside}

    @property
    def failed(self) -> dict[str, str]:
        """Rollouts that stopped on an infrastructure failure (journaled as ``RolloutFailed``), and why."""
        return {rid: r.failed for rid, r in sorted(self.rollouts.items()) if r.failed}


ProgressCallback = Callable[[str, int], None]  # (rollout_id, turn) once that turn is durable


def taken_over(exc: BaseException) -> bool:
    """Whether a rollout's failure says another worker took it over: its partition's writer was
    fenced, the journal knows a newer epoch, or a resource refused a stale one."""
    return isinstance(exc, (PartitionFencedError, FencedWriteError, StaleEpochError))


class Runner:
    def __init__(self, config: WorkloadConfig, journal: Journal | None, backend: GenerationBackend,
                 tokenizer: ChatTokenizer, *, progress: ProgressCallback | None = None,
                 hold_until_acknowledged: bool = False,
                 signer: HeadSigner | None = None, topology_override: str | None = None,
                 fleet: bool = False) -> None:
        """``hold_until_acknowledged`` keeps a finished rollout waiting for the trainer's
        acknowledgement (``acknowledge``) before the run may end, as a GRPO trainer holds a
        prompt group until every sibling is in. ``signer`` anchors the resources' chain heads
        (``HeadSigner.from_environment()`` is what ``run_workload`` passes). ``topology_override``
        (why) lets a resume go on with another topology than the journal's; it is recorded in
        each resumed attempt. ``fleet`` (a fleet's worker, which admits and releases rollouts as
        partitions come and go): a rollout whose partition another worker took over (its appends
        refused as fenced) is dropped alone, where a single process stops, since its whole slot
        was taken; and a rollout that is done is let go at once (its environment closed)."""
        self.config = config
        self.topology_override = topology_override
        self.journal = journal
        self.model = ModelParticipant(backend, max_in_flight=config.model.max_concurrent_calls)
        sink = JournalSink(journal) if journal is not None and config.journaling else NullSink()
        self.progress = progress or (lambda rollout_id, turn: None)
        self.agent = Agent(config, self.model, tokenizer, sink, writer=config.writer, on_durable=self.progress,
                           signer=signer)
        self.live: dict[str, LiveRollout] = {}
        self.states: dict[str, RolloutState] = {}
        self.hold_until_acknowledged = hold_until_acknowledged
        self.fleet = fleet
        self.report = RunReport()  # of the current run (a fleet's worker: of its whole life)
        self.dropped: dict[str, str] = {}  # rollouts another worker took over while this one drove them (why)
        self.failure: BaseException | None = None  # the first rollout task that failed (the run stops)
        self.failed = asyncio.Event()
        self._drives: dict[str, asyncio.Task] = {}
        self._driving: set[str] = set()  # holding a concurrency slot: running turns
        self._stopping: set[str] = set()  # asked to stop at the next turn boundary
        self._semaphore: asyncio.Semaphore | None = None
        self._checkpoints: asyncio.Task | None = None
        self._checkpoint_lock = asyncio.Lock()
        self._tally: dict[str, tuple[int, int]] = {}  # turns and tokens run here in earlier admissions
        self.restore = RestoreTiming()  # of the current run; restoring adds its folding and rebuilding
        self.environments = EnvironmentFactory.for_workload(config)  # in process, or at a resource server
        self.checkpointer: CoordinatedCheckpointer | None = None
        if config.checkpoint_mode == "coordinated" and journal is not None and config.journaling:
            self.checkpointer = CoordinatedCheckpointer(journal, self.agent, self.model,
                                                        prepare_timeout_s=config.prepare_timeout_s)

    async def run(self, *, resume: bool, stop_after: dict[str, int] | None = None) -> RunReport:
        """Drive every rollout to its end. ``stop_after`` leaves the named rollouts
        once they have that many committed turns (a crash at a turn boundary, for
        tests and for forking)."""
        report = self.report = RunReport()
        self.restore = report.restore
        started = time.perf_counter()
        specs = workload_specs(self.config)
        plan: RestorePlan | None = None
        registration: WorkloadRegistered | None = None
        if self.journal is not None:
            plan = load_rollouts(self.journal)
            registration = plan.workloads.get(self.config.name)
            report.restore.read_s, report.events_replayed = plan.seconds, plan.events_replayed
            report.read_errors = [str(e) for e in plan.report.errors]
            if not resume and (registration is not None or {s.rollout_id for s in specs}
                               & (plan.rollouts.keys() | plan.acknowledged.keys())):
                raise ConfigurationError(
                    f"journal {self.config.journal} already holds workload {self.config.name!r}; "
                    "use `rollout-journal resume` to continue it, or point --journal at a fresh location"
                )
        own_ids = {s.rollout_id for s in specs}
        if resume and plan is not None:  # forks of this workload's rollouts continue too (see participants.specs)
            forks = [f for f in fork_specs(specs, plan.workloads) if f.rollout_id in plan.rollouts]
            if forks and registration is None and not own_ids & plan.rollouts.keys():
                # A journal of forks only (`fork --journal-out`): the workload's own rollouts live elsewhere.
                specs, own_ids = [], set()
            specs += forks
        admitted = await self.admit(specs, plan, registration)
        registered = set(registration.rollout_ids) if registration is not None else set()
        stale_registration = registration is not None and registration.topology != self.config.topology()
        if self.journal is not None and self.config.journaling and (registered != own_ids or stale_registration):
            # after the first commits: each has a fence (forks are registered by `fork`, not here)
            await self._register_workload(self.journal, [s for s in specs if s.rollout_id in own_ids], registration)
        for live in admitted:
            self.launch(live, (stop_after or {}).get(live.spec.rollout_id))
        try:
            await self._drive_all()
        finally:
            for live in self.live.values():
                live.env.close()
            await self.environments.aclose()
        for rid in self.live:
            self._note_progress(rid)
        if self.journal is not None:
            self.journal.flush()
        report.run_seconds = time.perf_counter() - started
        return report

    async def admit(self, specs: list[RolloutSpec], plan: RestorePlan | None,
                    registration: WorkloadRegistered | None) -> list[LiveRollout]:
        """Take over ``specs`` from what ``plan`` restored: each unfinished rollout as attempt N+1
        (fenced), each one the journal lacks as attempt 1; a finished one is offered again, an
        acknowledged one reported. Returns once their fences are durable; the rollouts to drive
        (see :meth:`launch`). A rollout whose journal does not fold is set aside alone.

        The single-process ``run`` admits the whole workload from a restore of the whole
        journal; a fleet's worker admits the rollouts of each partition it is assigned."""
        report = self.report
        histories = plan.rollouts if plan is not None else {}
        acknowledged = set(plan.acknowledged) if plan is not None else set()
        if registration is not None and not registration.acknowledgement_markers:
            # Registered before acknowledgement kept a marker: a registered rollout gone from the
            # snapshot stream was acknowledged (the registration followed its first commit).
            acknowledged |= {s.rollout_id for s in specs if s.rollout_id in registration.rollout_ids
                             and s.rollout_id not in histories}
        restored: dict[str, tuple[RolloutHistory, RolloutState]] = {}
        folding = time.perf_counter()
        for spec in specs:  # every state first: nothing starts before the topology is checked
            history = histories.get(spec.rollout_id)
            if history is None:
                continue
            try:
                state = restore_state(history, spec.group_id)
                if state.lineage is None and not state.finished and self.journal is not None:
                    # An older version's snapshot: its training record needs every call's tokens.
                    history = histories[spec.rollout_id] = history_from_first_event(self.journal, history)
                    state = restore_state(history, spec.group_id)
                restored[spec.rollout_id] = history, state
            except StateFoldError as exc:  # this rollout's journal is damaged: it alone waits
                self._set_aside(report, spec, exc)
        if histories:  # a fresh run folds nothing
            self.restore.fold_s += time.perf_counter() - folding
        override = self._topology_check(registration, [state for _, state in restored.values()])
        first_commits: list[tuple[str, Awaitable[None]]] = []
        admitted: list[LiveRollout] = []
        for spec in specs:
            history = histories.get(spec.rollout_id)
            if spec.rollout_id in report.rollouts and report.rollouts[spec.rollout_id].set_aside:
                continue  # set aside above (or before: it stays aside until a resume by hand)
            if spec.rollout_id in acknowledged:  # the trainer took it: nothing to run or offer
                report.rollouts[spec.rollout_id] = RolloutReport(spec.rollout_id, 0, 0, 0, False, False,
                                                                 acknowledged=True)
                continue
            prepared: tuple[LiveRollout | None, RolloutReport, Awaitable[None] | None]
            try:
                prepared = self._start(spec) if history is None else \
                    self._resume(spec, *restored[spec.rollout_id], override, report)
            except (StateFoldError, ResourceError) as exc:  # this rollout's journal is damaged: it alone waits
                self._set_aside(report, spec, exc)
                continue
            live, rollout_report, commit = prepared
            previous = report.rollouts.get(spec.rollout_id)
            if previous is not None:  # driven here before (a partition that came back): keep the tally
                self._tally[spec.rollout_id] = (previous.turns_run_here, previous.tokens_run_here)
            report.rollouts[spec.rollout_id] = rollout_report
            if live is not None:
                self.live[spec.rollout_id] = live
                self.states[spec.rollout_id] = live.state
                admitted.append(live)
            if commit is not None:
                first_commits.append((spec.rollout_id, commit))
        fencing = time.perf_counter()
        results = await asyncio.gather(*(commit for _, commit in first_commits), return_exceptions=True)
        if histories:  # the resumed attempts' fences (a new rollout's first commit rides along, one group commit)
            report.restore.fence_s += time.perf_counter() - fencing
        failed = {rid: r for (rid, _), r in zip(first_commits, results) if isinstance(r, BaseException)}
        stopping = [r for r in failed.values() if not (self.fleet and taken_over(r))]
        if stopping:
            for live in admitted:
                self._forget(live.spec.rollout_id)
            raise stopping[0]
        for rollout_id, error in failed.items():  # a fleet's partition taken over meanwhile: those rollouts alone go
            log.info("rollout %s: taken over by another worker before its first commit: %s", rollout_id, error)
            self.dropped[rollout_id] = str(error)
            self._forget(rollout_id)
        return [live for live in admitted if live.spec.rollout_id not in failed]

    def launch(self, live: LiveRollout, limit: int | None = None) -> None:
        """Drive ``live`` to its end in the background (``limit``: leave it after that many committed
        turns); :meth:`release` stops it at a turn boundary."""
        rollout_id = live.spec.rollout_id
        if self._semaphore is None:
            self._semaphore = asyncio.Semaphore(self.config.concurrency)
        task = asyncio.create_task(self._drive(live, limit, self._semaphore), name=f"drive {rollout_id}")
        self._drives[rollout_id] = task
        task.add_done_callback(self._drive_done)
        if self.checkpointer is not None and self._checkpoints is None:
            self._checkpoints = asyncio.create_task(self._checkpoint_periodically(), name="checkpoints")
            self._checkpoints.add_done_callback(self._drive_done)  # a failed checkpoint stops the run too

    async def _drive(self, live: LiveRollout, limit: int | None, semaphore: asyncio.Semaphore) -> None:
        rollout_id = live.spec.rollout_id
        async with semaphore:
            self._driving.add(rollout_id)
            try:
                while not live.state.finished and live.state.failure is None \
                        and (limit is None or live.state.next_turn < limit) and rollout_id not in self._stopping:
                    await self.agent.run_turn(live)
                await self.agent.settle(live)
            except BaseException as exc:
                if not (self.fleet and taken_over(exc)):
                    raise
                # Another worker owns it now (this one missed its session): nothing more of it is written here.
                log.info("rollout %s: taken over by another worker, dropped here: %s", rollout_id, exc)
                self.dropped[rollout_id] = str(exc)
                self._done_here(rollout_id)
                return
            finally:
                self._driving.discard(rollout_id)
        if live.state.finished and self.hold_until_acknowledged and rollout_id not in self._stopping:
            await live.acknowledged.wait()
        if rollout_id not in self._stopping:
            self._done_here(rollout_id)

    def _done_here(self, rollout_id: str) -> None:
        """A fleet's worker lets a rollout go once it is done (the single-process run keeps its
        rollouts until the end: its report and callers read them)."""
        if self.fleet:
            asyncio.get_running_loop().call_soon(self._forget, rollout_id)

    def _drive_done(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:
            return
        if self.failure is None:
            self.failure = task.exception()
            self.failed.set()
        elif not isinstance(task.exception(), JournalClosedError):  # a journal's fatal stop fails every rollout alike
            log.error("rollout task also failed: %r", task.exception())

    async def _drive_all(self) -> None:
        """Wait until every launched rollout is done. The first failure cancels the rest and is
        raised as itself; the others are logged."""
        try:
            while self._drives and self.failure is None:
                pending = [t for t in self._drives.values() if not t.done()]
                if not pending:
                    break
                failed = asyncio.ensure_future(self.failed.wait())
                await asyncio.wait([*pending, failed], return_when=asyncio.FIRST_COMPLETED)
                failed.cancel()
            if self.failure is not None:
                raise self.failure
        finally:
            running = [t for t in self._drives.values() if not t.done()]
            if self._checkpoints is not None:
                running.append(self._checkpoints)
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            self._checkpoints = None

    async def _checkpoint_periodically(self) -> None:
        assert self.checkpointer is not None
        while True:
            await asyncio.sleep(self.config.coordinated_every_s)
            async with self._checkpoint_lock:  # a rollout is let go only between checkpoints
                await self.checkpointer.checkpoint(list(self.live.values()))

    async def release(self, rollout_ids: list[str]) -> None:
        """Stop these rollouts at a turn boundary, wait until every turn they appended is durable,
        and let them go (their environments closed): a worker that hands a partition on has
        written everything it ran, so the next owner redoes nothing."""
        waiting = []
        for rollout_id in rollout_ids:
            task = self._drives.get(rollout_id)
            if task is None:
                continue
            self._stopping.add(rollout_id)
            if rollout_id not in self._driving:
                task.cancel()  # still waiting for a slot: it ran nothing
            waiting.append(task)
        for task, outcome in zip(waiting, await asyncio.gather(*waiting, return_exceptions=True)):
            if isinstance(outcome, BaseException) and not isinstance(outcome, asyncio.CancelledError):
                log.warning("%s ended with %r while being released", task.get_name(), outcome)
        async with self._checkpoint_lock:
            for rollout_id in rollout_ids:
                self._forget(rollout_id)

    async def drop(self, rollout_ids: list[str]) -> None:
        """Let these rollouts go at once, without another write: another worker owns them now."""
        waiting = []
        for rollout_id in rollout_ids:
            task = self._drives.get(rollout_id)
            if task is not None:
                self._stopping.add(rollout_id)
                task.cancel()
                waiting.append(task)
                self.dropped.setdefault(rollout_id, "its partition was lost")
        await asyncio.gather(*waiting, return_exceptions=True)
        async with self._checkpoint_lock:
            for rollout_id in rollout_ids:
                self._forget(rollout_id)

    def _forget(self, rollout_id: str) -> None:
        """Record what this worker did for the rollout, close its environment, and drop it."""
        if rollout_id in self.live:
            self._note_progress(rollout_id)
            self.live.pop(rollout_id).env.close()
        self.states.pop(rollout_id, None)
        self._drives.pop(rollout_id, None)
        self._stopping.discard(rollout_id)

    def _note_progress(self, rollout_id: str) -> None:
        live, r = self.live[rollout_id], self.report.rollouts.get(rollout_id)
        if r is None:
            return
        turns, tokens = self._tally.get(rollout_id, (0, 0))
        r.turns_run_here, r.tokens_run_here = turns + live.turns_run_here, tokens + live.tokens_run_here
        r.outcome, r.failed = live.state.outcome, live.state.failure

    async def _register_workload(self, journal: Journal, specs: list[RolloutSpec],
                                 previous: WorkloadRegistered | None) -> None:
        """Record the workload and every rollout id it holds. An acknowledged rollout keeps its fence,
        marked, in the snapshot stream, so a registered rollout missing from it has never started;
        a journal registered before that (``previous`` without ``acknowledgement_markers``) keeps
        reading a missing registered rollout as acknowledged."""
        markers = previous is None or previous.acknowledgement_markers
        registration = WorkloadRegistered(
            self.config.name, self.config.model_dump_json(), [s.rollout_id for s in specs],
            self.config.topology(), Header.now_ms(), self.config.writer, markers)
        await durable(journal.register_workload(registration))

    def _new_environment(self, spec: RolloutSpec, *, fresh: bool = False) -> Environment:
        """The rollout's environment, in process or at its resource server: ``fresh`` at the task's
        initial state, else attached to what the server holds (restore reconciles or imports)."""
        return self.environments.build(spec.environment, spec.rollout_id, spec.environment_task(), fresh=fresh)

    @staticmethod
    def _set_aside(report: RunReport, spec: RolloutSpec, exc: Exception) -> None:
        log.error("rollout %s set aside: %s", spec.rollout_id, exc)
        report.rollouts[spec.rollout_id] = RolloutReport(spec.rollout_id, 0, 0, 0, False, False, set_aside=str(exc))

    def _topology_check(self, registration: WorkloadRegistered | None, states: list[RolloutState]) -> str | None:
        """What to record as the resumed attempts' override: None when the journal's unfinished
        rollouts (and the workload's registration) ran with this config's topology. A change
        without ``topology_override`` raises :class:`TopologyChangedError` with the diff."""
        current = self.config.topology()
        unfinished = [s for s in states if not s.finished and not s.acknowledged]
        recorded = {s.topology for s in unfinished} | ({registration.topology} if registration else set())
        changed = sorted(recorded - {current, ""})  # "": a 0.1.0 registration kept no fingerprint
        if not changed or not unfinished:  # nothing to resume: no rollout would mix two policies
            return None
        diff = self.config.topology_diff(registration.spec_json) if registration is not None else []
        what = ", ".join(diff) if diff else (
            f"fingerprint {', '.join(changed)} -> {current} (the journal keeps no readable copy of the old settings)")
        if self.topology_override is None:
            raise TopologyChangedError(
                f"resume refused: workload {self.config.name!r} in journal {self.config.journal} ran with other "
                f"settings: {what}; continuing would mix two policies inside its {len(unfinished)} unfinished "
                "rollouts. Resume with the journal's settings, or pass --allow-topology-change WHY "
                "(topology_override) to continue anyway; WHY is recorded in the journal")
        log.warning("resuming workload %s with another topology (%s), as asked: %s",
                    self.config.name, what, self.topology_override)
        return f"{self.topology_override} (changed: {what})"

    def _start(self, spec: RolloutSpec) -> tuple[LiveRollout, RolloutReport, Awaitable[None]]:
        """A rollout the journal does not hold: attempt 1 from turn 0."""
        state = RolloutState(spec.rollout_id, spec.group_id)
        live = LiveRollout(spec, state, self._new_environment(spec, fresh=True))
        events = self.agent.start_attempt(live, resumed_from_turn=0, reason="new rollout")
        return live, RolloutReport(spec.rollout_id, 0, 0, 0, False, False), self.agent.begin(live, events)

    def _resume(self, spec: RolloutSpec, history: RolloutHistory, state: RolloutState, override: str | None,
                report: RunReport) -> tuple[LiveRollout | None, RolloutReport, Awaitable[None] | None]:
        """The live rollout to drive (None if finished), its report entry, and its first commit."""
        self.states[spec.rollout_id] = state  # a finished result may still be acknowledged
        committed = state.next_turn
        if state.acknowledged:  # the trainer took it (its snapshot tombstone may be lost; the event is not)
            return None, RolloutReport(spec.rollout_id, committed, 0, 0, False, False, acknowledged=True), None
        if state.finished:
            return None, RolloutReport(spec.rollout_id, committed, 0, 0, False, True, state.outcome), None
        rebuilding = time.perf_counter()  # a restart-only environment's cost is starting it again
        env = self._new_environment(spec)
        restart = env.recovery is Recovery.RESTART_ONLY and committed > 0
        if restart:
            env.restore({}, [])  # what a resource server still holds of it is the lost attempt's
            reason = f"restart from turn 0: environment {spec.environment!r} is restart_only"
        else:
            state, env = self._rebuilt(spec, history, state, env, report)
            self.states[spec.rollout_id] = state
            committed = state.next_turn
            if spec.forked_from and state.attempt == 1:
                reason = f"continue fork of {spec.forked_from} from turn {committed}"
            elif state.failure is not None:
                reason = f"resume at turn {committed} after attempt {state.attempt} failed: {state.failure}"
            else:
                reason = f"resume after crash at turn {committed}"
        self.restore.rebuild_s += time.perf_counter() - rebuilding
        live = LiveRollout(spec, state, env)
        events = self.agent.start_attempt(live, resumed_from_turn=0 if restart else committed, reason=reason,
                                          override=override)
        return live, RolloutReport(spec.rollout_id, committed, 0, 0, restart, False), self.agent.commit(events)

    def _rebuilt(self, spec: RolloutSpec, history: RolloutHistory, state: RolloutState, env: Environment,
                 report: RunReport) -> tuple[RolloutState, Environment]:
        """The rollout's state and a fresh environment brought to it. A snapshot whose exported
        resource states do not import (or do not take its mutations) is left out: the previous
        snapshot and a longer replay take its place, down to a replay from the first event.
        Raises (the rollout alone is set aside) when nothing works."""
        unusable: set[RecordLocation] = set()
        while True:
            try:
                self._rebuild(spec, state, env)
                return state, env
            except BaseException as exc:
                env.close()
                if not isinstance(exc, ResourceError) or history.snapshot is None or self.journal is None:
                    raise
                bad, why = history.snapshot.location, exc
            unusable.add(bad)
            note = (f"rollout {spec.rollout_id}: the snapshot at {bad} does not restore its resources ({why}); "
                    "falling back to the previous snapshot and a longer replay")
            log.warning("%s", note)
            report.read_errors.append(note)
            history = reload_rollout(self.journal, spec.rollout_id, unusable)
            state = restore_state(history, spec.group_id)
            env = self._new_environment(spec)

    @staticmethod
    def _rebuild(spec: RolloutSpec, state: RolloutState, env: Environment) -> None:
        """Bring the environment to the rollout's committed state: the exports of its last snapshot,
        then the mutations journaled since, fenced at the next attempt's epoch. A resource server
        reconciles by revision when it already holds that state, else imports it."""
        env.restore(state.resource_states, state.mutations_since_export, fence_epoch=state.epoch + 1)

    async def acknowledge(self, rollout_ids: list[str], by: str = "trainer") -> None:
        """The trainer took these results: journal it and tombstone their snapshots."""
        if self.journal is None:
            for rid in rollout_ids:
                self.live[rid].acknowledged.set()
            return
        futures = []
        for rid in rollout_ids:
            state = self.states[rid]
            header = state.header(self.config.writer)
            state.apply(RolloutAcknowledged(header, by))
            futures.append(self.journal.acknowledge(header, by))
        for f in futures:
            await durable(f)
        for rid in rollout_ids:
            if rid in self.live:
                self.live[rid].acknowledged.set()
