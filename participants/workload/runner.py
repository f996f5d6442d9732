"""Runs a workload of rollouts (groups x siblings) to the end, fresh or resumed.

Resuming is attempt N+1 for every unfinished rollout: fold its journal
(snapshot + events since), rebuild its environment (import exported resource
states, re-apply the mutations since), write the fence (``AttemptStarted``
with a higher epoch) and continue from the next turn. Rollouts whose
environment is ``restart_only`` start again from turn 0; finished rollouts
are offered again from the journal, never recomputed.

Taking each rollout over from the journal is :mod:`~rollout_journal.participants.workload.restore`'s
job; this module drives them: a task per rollout under the workload's concurrency, retries and
give-ups after infrastructure failures, replacement groups, coordinated checkpoints, a fleet's
releases and drops, the trainer's acknowledgements. The report types live in
:mod:`~rollout_journal.participants.workload.reports` (importable from here too).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from rollout_journal.journal.anchoring import HeadSigner
from rollout_journal.journal.errors import (
    ConfigurationError,
    FencedWriteError,
    JournalClosedError,
    PartitionFencedError,
)
from rollout_journal.journal.events import WorkloadRegistered
from rollout_journal.journal.journal import Journal
from rollout_journal.journal.restore import RestorePlan, load_rollouts
from rollout_journal.participants.cancelling import cancel_and_wait
from rollout_journal.participants.environments import Environment
from rollout_journal.participants.model.gate import ModelParticipant
from rollout_journal.participants.model.generation import GenerationBackend
from rollout_journal.participants.model.tokenizer import ChatTokenizer
from rollout_journal.participants.remote.client import EnvironmentFactory
from rollout_journal.participants.resources import ResourceError, StaleEpochError
from rollout_journal.participants.rollout import RolloutState, StateFoldError
from rollout_journal.participants.session.sinks import JournalSink, NullSink, durable
from rollout_journal.participants.workload.agent import Agent, LiveRollout, fails_the_rollout_alone
from rollout_journal.participants.workload.checkpoint import CoordinatedCheckpointer
from rollout_journal.participants.workload.config import WorkloadConfig
from rollout_journal.participants.workload.reports import RestoreTiming, RolloutReport, RunReport
from rollout_journal.participants.workload.restore import Restorer, acknowledged_in, rebuild_environment, set_aside
from rollout_journal.participants.workload.specs import (
    RolloutSpec,
    fork_specs,
    group_generation,
    registration_of,
    replacement_group,
    workload_specs,
)

__all__ = [
    "ProgressCallback",
    "RestoreTiming",
    "RolloutReport",
    "RunReport",
    "Runner",
    "taken_over",
    "workload_specs",
]

log = logging.getLogger(__name__)


ProgressCallback = Callable[[str, int], None]  # (rollout_id, turn) once that turn is durable
ResultCallback = Callable[[str], None]  # (rollout_id) once its training record is on the results stream


def taken_over(exc: BaseException) -> bool:
    """Whether a rollout's failure says another worker took it over: its partition's writer was
    fenced, the journal knows a newer epoch, or a resource refused a stale one."""
    return isinstance(exc, (PartitionFencedError, FencedWriteError, StaleEpochError))


class Runner:
    def __init__(
        self,
        config: WorkloadConfig,
        journal: Journal | None,
        backend: GenerationBackend,
        tokenizer: ChatTokenizer,
        *,
        progress: ProgressCallback | None = None,
        on_result: ResultCallback | None = None,
        hold_until_acknowledged: bool = False,
        signer: HeadSigner | None = None,
        topology_override: str | None = None,
        fleet: bool = False,
    ) -> None:
        """``hold_until_acknowledged`` keeps a finished rollout waiting for the trainer's
        acknowledgement (``acknowledge``) before the run may end, as a GRPO trainer holds a
        prompt group until every sibling is in. ``signer`` anchors the resources' chain heads
        (``HeadSigner.from_environment()`` is what ``run_workload`` passes). ``topology_override``
        (why) lets a resume go on with another topology than the journal's; it is recorded in
        each resumed attempt. ``fleet`` (a fleet's worker, which admits and releases rollouts as
        partitions come and go): a rollout whose partition another worker took over (its appends
        refused as fenced) is dropped alone, where a single process stops, since its whole slot
        was taken; and a rollout that is done is let go at once (its environment closed).
        ``on_result(rollout_id)``: on the event loop, once the rollout's training record (finished or
        given up) is durable on the results stream: its final turn committed, or its give-up
        journaled, here; or found so in the journal by :meth:`admit` (a fork publishes none)."""
        self.config = config
        self.topology_override = topology_override
        self.journal = journal
        self.model = ModelParticipant(backend, max_in_flight=config.model.max_concurrent_calls)
        sink = JournalSink(journal) if journal is not None and config.journaling else NullSink()
        self.progress = progress or (lambda rollout_id, turn: None)
        self.on_result = on_result or (lambda rollout_id: None)
        self.agent = Agent(
            config, self.model, tokenizer, sink, writer=config.writer, on_durable=self.progress, signer=signer
        )
        self.live: dict[str, LiveRollout] = {}
        self.states: dict[str, RolloutState] = {}
        self.hold_until_acknowledged = hold_until_acknowledged
        self.fleet = fleet
        self.report = RunReport()  # of the current run (a fleet's worker: of its whole life)
        self.dropped: dict[str, str] = {}  # rollouts another worker took over while this one drove them (why)
        self.failure: BaseException | None = None  # the first rollout task that failed (the run stops)
        self.registration: WorkloadRegistered | None = None  # the workload's, as the journal held it at the start
        self.redispatched: dict[str, int] = {}  # replacement groups launched per prompt group (see specs)
        self.failed = asyncio.Event()
        self._drives: dict[str, asyncio.Task[None]] = {}
        self._driving: set[str] = set()  # holding a concurrency slot: running turns
        self._stopping: set[str] = set()  # asked to stop at the next turn boundary
        self._semaphore: asyncio.Semaphore | None = None
        self._checkpoints: asyncio.Task[None] | None = None
        self._checkpoint_lock = asyncio.Lock()
        self._tally: dict[str, tuple[int, int]] = {}  # turns and tokens run here in earlier admissions
        self.restore = self.report.restore  # restoring adds its folding and rebuilding (a fleet's: all its admits)
        self.environments = EnvironmentFactory.for_workload(config)  # in process, or at a resource server
        self.checkpointer: CoordinatedCheckpointer | None = None
        if config.checkpoint_mode == "coordinated" and journal is not None and config.journaling:
            self.checkpointer = CoordinatedCheckpointer(
                journal, self.agent, self.model, prepare_timeout_s=config.prepare_timeout_s
            )
        # the hooks by name: a subclass's ``_new_environment`` and ``_rebuild`` serve the restore too
        self.restorer = Restorer(
            config,
            journal,
            self.agent,
            self.states,
            self._new_environment,
            topology_override=topology_override,
            rebuild=self._rebuild,
        )

    async def run(self, *, resume: bool, stop_after: dict[str, int] | None = None) -> RunReport:
        """Drive every rollout to its end. ``stop_after`` leaves the named rollouts
        once they have that many committed turns (a crash at a turn boundary, for
        tests and for forking)."""
        report = self.report = RunReport()
        self.restore = report.restore
        started = time.perf_counter()
        plan: RestorePlan | None = None
        registration: WorkloadRegistered | None = None
        if self.journal is not None:
            plan = load_rollouts(self.journal)
            if plan.orphans:  # blocks and blob chunks a writer that did not know them left behind
                await durable(self.journal.discard(plan.orphans))
            registration = self.registration = plan.workloads.get(self.config.name)
            self.redispatched = dict(registration.redispatched) if registration is not None else {}
        specs = workload_specs(self.config, self.redispatched)
        if plan is not None:
            report.restore.read_s, report.events_replayed = plan.seconds, plan.events_replayed
            report.read_errors = [str(e) for e in plan.report.errors]
            if not resume and (
                registration is not None
                or {s.rollout_id for s in specs} & (plan.rollouts.keys() | plan.acknowledged.keys())
            ):
                raise ConfigurationError(
                    f"journal {self.config.journal} already holds workload {self.config.name!r}; "
                    "use `rollout-journal resume` to continue it, or point --journal at a fresh location"
                )
        own_ids = {s.rollout_id for s in specs}
        if resume and plan is not None:  # forks of this workload's rollouts continue too (see specs.fork_specs)
            forks = [f for f in fork_specs(specs, plan.workloads) if f.rollout_id in plan.rollouts]
            if forks and registration is None and not own_ids & plan.rollouts.keys():
                # A journal of forks only (`fork --journal-out`): the workload's own rollouts live elsewhere.
                specs, own_ids = [], set()
            specs += forks
        admitted = await self.admit(specs, plan, registration)
        own = workload_specs(self.config, self.redispatched) if own_ids else []  # admitting may have redispatched
        registered = set(registration.rollout_ids) if registration is not None else set()
        stale_registration = registration is not None and registration.topology != self.config.topology()
        if (
            self.journal is not None
            and self.config.journaling
            and (registered != {s.rollout_id for s in own} or stale_registration)
        ):
            # after the first commits: each has a fence (forks are registered by `fork`, not here)
            await self._register_workload(self.journal, own, registration)
        try:
            for live in admitted:
                self.launch(live, (stop_after or {}).get(live.spec.rollout_id))
            await self._start_replacements()
            await self._drive_all()
        finally:
            await self.stop_tasks()  # a launch or replacement that failed leaves them running
            for live in self.live.values():
                live.env.close()
            await self.environments.aclose()
        for rid in self.live:
            self._note_progress(rid)
        if self.journal is not None:
            self.journal.flush()
        report.run_seconds = time.perf_counter() - started
        return report

    async def admit(
        self, specs: list[RolloutSpec], plan: RestorePlan | None, registration: WorkloadRegistered | None
    ) -> list[LiveRollout]:
        """Take over ``specs`` from what ``plan`` restored: each unfinished rollout as attempt N+1
        (fenced), each one the journal lacks as attempt 1; a finished one is offered again, an
        acknowledged one reported. Returns once their fences are durable; the rollouts to drive
        (see :meth:`launch`). A rollout whose journal does not fold is set aside alone.

        The single-process ``run`` admits the whole workload from a restore of the whole
        journal; a fleet's worker admits the rollouts of each partition it is assigned."""
        report = self.report
        histories = plan.rollouts if plan is not None else {}
        acknowledged = acknowledged_in(plan, registration, specs)
        restored = self.restorer.fold(specs, histories, report, self.restore)
        override = self.restorer.topology_check(registration, [state for _, state in restored.values()])
        first_commits: list[tuple[str, Awaitable[None]]] = []
        admitted: list[LiveRollout] = []
        published: list[RolloutSpec] = []  # finished or given up before: their records are on the stream
        for spec in specs:
            history = histories.get(spec.rollout_id)
            if spec.rollout_id in report.rollouts and report.rollouts[spec.rollout_id].set_aside:
                continue  # set aside above (or before: it stays aside until a resume by hand)
            if spec.rollout_id in acknowledged:  # the trainer took it: nothing to run or offer
                report.rollouts[spec.rollout_id] = RolloutReport(
                    spec.rollout_id, 0, 0, 0, False, False, acknowledged=True
                )
                continue
            live: LiveRollout | None
            commit: Awaitable[None] | None
            try:
                if history is None:
                    live, rollout_report, commit = self.restorer.first_attempt(spec)
                else:
                    admission = self.restorer.resume(spec, *restored[spec.rollout_id], override, report, self.restore)
                    live, rollout_report, commit = admission.live, admission.report, admission.commit
                    if admission.give_up is not None:
                        commit = self._give_up(spec, admission.give_up)  # told once durable, there
                    elif live is None and (rollout_report.reused_result or rollout_report.given_up is not None):
                        published.append(spec)
            except (StateFoldError, ResourceError) as exc:  # this rollout's journal is damaged: it alone waits
                set_aside(report, spec, exc)
                continue
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
            self._note_taken_over(rollout_id, error, "before its first commit")
            self._forget(rollout_id)
        for spec in published:
            self._published(spec)
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
                while True:
                    while (
                        not live.state.finished
                        and live.state.failure is None
                        and (limit is None or live.state.next_turn < limit)
                        and rollout_id not in self._stopping
                    ):
                        await self.agent.run_turn(live)
                    await self.agent.settle(live)
                    if live.state.failure is None or rollout_id in self._stopping or not await self._retry(live):
                        break
            except BaseException as exc:
                if not (self.fleet and taken_over(exc)):
                    raise
                # Another worker owns it now (this one missed its session): nothing more of it is written here.
                self._note_taken_over(rollout_id, exc, "while driven")
                self._done_here(rollout_id)
                return
            finally:
                self._driving.discard(rollout_id)
        if live.state.finished:  # settled: its final turn, and the training record with it, durable
            self._published(live.spec)
        if live.state.finished and self.hold_until_acknowledged and rollout_id not in self._stopping:
            await live.acknowledged.wait()
        if rollout_id not in self._stopping:
            self._done_here(rollout_id)

    async def _retry(self, live: LiveRollout) -> bool:
        """After an infrastructure failure: the next attempt at once (its environment rebuilt, its fence
        durable), or, once the rollout's failures reach ``failure_policy.max_failures``, give it up.
        A rebuild that fails is the rollout's next failure. Returns whether to drive it on."""
        state = live.state
        while state.failure is not None:
            while not self.agent.turn_boundary.is_set():  # a coordinated checkpoint parks agents: so this too
                await self.agent.turn_boundary.wait()
            if state.failures >= self.config.failure_policy.max_failures:
                await self._give_up(live.spec, state)
                await self._start_replacements()
                return False
            live.env.close()
            try:
                live.env, resumed_from, reason = self.restorer.next_attempt(live.spec, None, state, self.report)
            except Exception as exc:
                if not fails_the_rollout_alone(exc):
                    raise
                await self.agent.fail(live, exc)
                continue
            live.exports.clear()
            live.turns_since_snapshot = live.bytes_since_snapshot = live.resource_restores = 0
            restarts = state.restarts
            await self.agent.commit(self.agent.start_attempt(live, resumed_from_turn=resumed_from, reason=reason))
            if state.restarts > restarts and live.spec.rollout_id in self.report.rollouts:
                self.report.rollouts[live.spec.rollout_id].restarted_from_zero = True
        return True

    async def _give_up(self, spec: RolloutSpec, state: RolloutState) -> None:
        """Journal the rollout given up (see ``Agent.give_up``). With ``failure_policy.group:
        redispatch``, the replacement of its group is registered first, so a crash between the two
        leaves a journal that knows both."""
        policy = self._group_policy(spec)
        if policy == "redispatch":
            await self._redispatch(spec.group_id)
        await durable(self.agent.give_up(spec, state, policy))
        self._published(spec)

    def _group_policy(self, spec: RolloutSpec) -> str:
        """What the trainer's side does with the group of ``spec`` given up: the workload's
        ``failure_policy.group``, or drop for a fork, a group past ``max_redispatches`` and a fleet
        (whose workers register no replacements: see ``submit_workload``)."""
        policy = self.config.failure_policy
        if policy.group == "drop" or spec.forked_from is not None or self.fleet:
            return "drop"
        return "redispatch" if group_generation(spec.group_id)[1] < policy.max_redispatches else "drop"

    def _published(self, spec: RolloutSpec) -> None:
        """The rollout's training record is durable on the results stream: tell ``on_result`` (a
        fork publishes none, nor does a run that journals nothing)."""
        if spec.forked_from is None and self.journal is not None and self.config.journaling:
            self.on_result(spec.rollout_id)

    async def _redispatch(self, group_id: str) -> None:
        """Record the replacement of ``group_id`` (the next generation of its prompt group) in the
        workload's registration; :meth:`_start_replacements` runs it."""
        group, generation = group_generation(group_id)
        if self.redispatched.get(group, 0) > generation:
            return  # a sibling given up before asked for it already
        self.redispatched[group] = generation + 1
        log.warning("group %s: redispatched as %s", group_id, replacement_group(group, generation + 1))
        if self.journal is not None and self.config.journaling:
            await self._register_workload(
                self.journal, workload_specs(self.config, self.redispatched), self.registration
            )

    async def _start_replacements(self) -> None:
        """Start and drive every replacement rollout the registration names that this run has not met."""
        new = [
            s
            for s in workload_specs(self.config, self.redispatched)
            if group_generation(s.group_id)[1] and s.rollout_id not in self.report.rollouts
        ]
        commits = []
        for spec in new:
            live, self.report.rollouts[spec.rollout_id], commit = self.restorer.first_attempt(spec)
            self.live[spec.rollout_id], self.states[spec.rollout_id] = live, live.state
            commits.append(commit)
        await asyncio.gather(*commits)  # their fences (and first snapshots) durable, as admission's are
        for spec in new:
            self.launch(self.live[spec.rollout_id])

    def _note_taken_over(self, rollout_id: str, exc: BaseException, when: str) -> None:
        """Record a rollout dropped because its writes were refused as another worker's. Normally its
        partition has left this worker already (INFO). If this worker still owns the partition,
        nothing drives the rollout here until the partition moves: a WARNING naming it, so a fleet
        that stops short of its last turns says where (seen once in ``bench/fleet_scale.py`` after
        a broker's loss, not yet understood)."""
        self.dropped[rollout_id] = str(exc)
        journal = self.journal
        partition = journal.partition_of(rollout_id) if journal is not None else None
        if journal is not None and partition is not None and journal.backend.owner_token(partition) is not None:
            log.warning(
                "rollout %s: dropped %s as taken over (%s), but this worker still holds its partition %d: "
                "unless the group moves it (a move not heard of yet), nothing drives the rollout until it does",
                rollout_id,
                when,
                exc,
                partition,
            )
        else:
            log.info("rollout %s: taken over by another worker %s, dropped here: %s", rollout_id, when, exc)

    def _done_here(self, rollout_id: str) -> None:
        """A fleet's worker lets a rollout go once it is done (the single-process run keeps its
        rollouts until the end: its report and callers read them)."""
        if self.fleet:
            asyncio.get_running_loop().call_soon(self._forget, rollout_id)

    def _drive_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        if self.failure is None:
            self.failure = task.exception()
            self.failed.set()
        elif not isinstance(task.exception(), JournalClosedError):  # a journal's fatal stop fails every rollout alike
            log.error("rollout task also failed: %r", task.exception())

    async def _drive_all(self) -> None:
        """Wait until every launched rollout is done. The first failure is raised as itself (the
        caller's :meth:`stop_tasks` cancels the rest); the others are logged."""
        while self._drives and self.failure is None:
            pending = [t for t in self._drives.values() if not t.done()]
            if not pending:
                break
            failed = asyncio.ensure_future(self.failed.wait())
            try:
                await asyncio.wait([*pending, failed], return_when=asyncio.FIRST_COMPLETED)
            finally:
                await cancel_and_wait(failed)
        if self.failure is not None:
            raise self.failure

    async def stop_tasks(self) -> None:
        """Cancel every rollout's drive and the coordinated checkpoints, and wait until they are
        done: whoever ends the runner (``run``; a fleet's worker, which drives through ``launch``)
        leaves nothing of it running in an event loop that may live on."""
        await self.stop_checkpoints()
        await cancel_and_wait(*self._drives.values())

    async def stop_checkpoints(self) -> None:
        """Cancel the coordinated checkpoints and wait until they are done (a worker that leaves
        stops them before it gives its partitions up: no checkpoint runs beside a hand-off)."""
        task, self._checkpoints = self._checkpoints, None
        if task is not None:
            await cancel_and_wait(task)

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

    async def drop(self, rollout_ids: list[str], why: str | None = "its partition was lost") -> None:
        """Let these rollouts go at once, mid-turn, without another write: another worker owns them
        now (``why``, recorded in ``dropped``; None: a planned hand-off, or the end of the run). Their
        environments are closed; their next owner continues them from the last committed turn."""
        waiting = []
        for rollout_id in rollout_ids:
            self._stopping.add(rollout_id)
            task = self._drives.get(rollout_id)
            if task is not None:
                task.cancel()
                waiting.append(task)
            if why is not None and rollout_id in self.live:
                self.dropped.setdefault(rollout_id, why)
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
        state = live.state
        r.outcome = state.outcome
        r.failed, r.given_up = (None, state.failure) if state.given_up else (state.failure, None)

    async def _register_workload(
        self, journal: Journal, specs: list[RolloutSpec], previous: WorkloadRegistered | None
    ) -> None:
        """Record the workload and every rollout id it holds (see :func:`registration_of`)."""
        registration = registration_of(self.config, [s.rollout_id for s in specs], previous, self.redispatched)
        await durable(journal.register_workload(registration))

    def _new_environment(self, spec: RolloutSpec, *, fresh: bool = False) -> Environment:
        """The rollout's environment, in process or at its resource server: ``fresh`` at the task's
        initial state, else attached to what the server holds (restore reconciles or imports)."""
        return self.environments.build(spec.environment, spec.rollout_id, spec.environment_task(), fresh=fresh)

    @staticmethod
    def _rebuild(spec: RolloutSpec, state: RolloutState, env: Environment) -> None:
        """Bring the environment to the rollout's committed state (see :func:`rebuild_environment`)."""
        rebuild_environment(spec, state, env)

    async def acknowledge(self, rollout_ids: list[str], by: str = "trainer") -> None:
        """The trainer took these results: journal it and tombstone their snapshots."""
        if self.journal is None:
            for rid in rollout_ids:
                self.live[rid].acknowledged.set()
            return
        futures = []
        for rid in rollout_ids:
            state = self.states[rid]
            event = state.acknowledgement(self.config.writer, by)
            state.apply(event)
            futures.append(self.journal.acknowledge(event))
        for f in futures:
            await durable(f)
        for rid in rollout_ids:
            if rid in self.live:
                self.live[rid].acknowledged.set()
