"""Taking a workload's rollouts over from the journal: each one's next attempt, ready to drive.

The journal reads the histories (``rollout_journal.journal.restore``) and the aggregate picks the
snapshot it trusts (``rollout_journal.participants.rollout.restore``); this is the live path's
part: fold each rollout (one that does not fold is set aside alone), refuse a changed topology,
decide what each rollout is (acknowledged, finished, given up, to resume or to start), bring a
resumed rollout's environment to its committed state (exports imported, mutations re-applied, a
restart-only one started over from turn 0) and build the fence of its next attempt. Driving the
rollouts from there is :mod:`rollout_journal.participants.workload.runner`'s job.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from rollout_journal.journal.errors import RecordLocation
from rollout_journal.journal.events import WorkloadRegistered
from rollout_journal.journal.journal import Journal
from rollout_journal.journal.restore import RestorePlan, RolloutHistory
from rollout_journal.participants.environments import Environment
from rollout_journal.participants.resources import Recovery, ResourceError
from rollout_journal.participants.rollout import RolloutState, StateFoldError, trusted_restore
from rollout_journal.participants.workload.agent import Agent, LiveRollout
from rollout_journal.participants.workload.config import TopologyChangedError, WorkloadConfig
from rollout_journal.participants.workload.reports import RestoreTiming, RolloutReport, RunReport
from rollout_journal.participants.workload.specs import RolloutSpec, group_generation

log = logging.getLogger(__name__)

# The rollout's environment: ``fresh`` at the task's initial state, else attached to what a resource
# server holds of it (the runner's ``_new_environment``, which tests wrap).
EnvironmentBuilder = Callable[..., Environment]
# Bringing an environment to the rollout's committed state (the runner's ``_rebuild``, which tests
# replace: :func:`rebuild_environment`).
Rebuild = Callable[[RolloutSpec, RolloutState, Environment], None]


@dataclass
class Admission:
    """What restoring decided for one rollout the journal holds."""

    report: RolloutReport  # its row in the run's report
    live: LiveRollout | None = None  # to drive; None: finished, acknowledged or given up
    commit: Awaitable[None] | None = None  # its next attempt's fence, durable before it runs
    give_up: RolloutState | None = None  # it failed for the last time, then a crash: give it up now


def acknowledged_in(
    plan: RestorePlan | None, registration: WorkloadRegistered | None, specs: list[RolloutSpec]
) -> set[str]:
    """The rollouts of ``specs`` the trainer took: nothing to run or offer for them."""
    acknowledged = set(plan.acknowledged) if plan is not None else set()
    histories = plan.rollouts if plan is not None else {}
    if registration is not None and not registration.acknowledgement_markers:
        # Registered before acknowledgement kept a marker: a registered rollout gone from the
        # snapshot stream was acknowledged (the registration followed its first commit). A
        # replacement group is registered before it starts, by a version that keeps markers.
        acknowledged |= {
            s.rollout_id
            for s in specs
            if s.rollout_id in registration.rollout_ids
            and s.rollout_id not in histories
            and not group_generation(s.group_id)[1]
        }
    return acknowledged


def set_aside(report: RunReport, spec: RolloutSpec, exc: Exception) -> None:
    """Record that the rollout's journal could not be restored: it alone waits (the others run)."""
    log.error("rollout %s set aside: %s", spec.rollout_id, exc)
    report.rollouts[spec.rollout_id] = RolloutReport(spec.rollout_id, 0, 0, 0, False, False, set_aside=str(exc))


def rebuild_environment(spec: RolloutSpec, state: RolloutState, env: Environment) -> None:
    """Bring the environment to the rollout's committed state: the exports of its last snapshot,
    then the mutations journaled since, fenced at the next attempt's epoch. A resource server
    reconciles by revision when it already holds that state, else imports it."""
    env.restore(state.resource_states, state.mutations_since_export, fence_epoch=state.next_epoch)


@dataclass
class Restorer:
    """Brings rollouts back from what the journal holds, for one runner: ``states`` is the runner's
    table of aggregates (a rollout's restored state goes there as soon as it is known, so a finished
    result may still be acknowledged), ``new_environment`` builds a rollout's environment and
    ``rebuild`` brings it to the committed state."""

    config: WorkloadConfig
    journal: Journal | None
    agent: Agent
    states: dict[str, RolloutState]
    new_environment: EnvironmentBuilder
    topology_override: str | None = None
    rebuild: Rebuild = rebuild_environment

    def fold(
        self,
        specs: list[RolloutSpec],
        histories: dict[str, RolloutHistory],
        report: RunReport,
        timing: RestoreTiming,
    ) -> dict[str, tuple[RolloutHistory, RolloutState]]:
        """Every rollout of ``specs`` that ``histories`` holds, folded from the snapshot it trusts
        (``histories`` takes the history that was used); one that does not fold is set aside."""
        restored: dict[str, tuple[RolloutHistory, RolloutState]] = {}
        folding = time.perf_counter()
        for spec in specs:  # every state first: nothing starts before the topology is checked
            history = histories.get(spec.rollout_id)
            if history is None:
                continue
            assert self.journal is not None  # the plan was read from it
            try:
                history, state = trusted_restore(self.journal, history, spec.group_id)
                histories[spec.rollout_id] = history
                restored[spec.rollout_id] = history, state
            except StateFoldError as exc:  # this rollout's journal is damaged: it alone waits
                set_aside(report, spec, exc)
        if histories:  # a fresh run folds nothing
            timing.fold_s += time.perf_counter() - folding
        return restored

    def topology_check(self, registration: WorkloadRegistered | None, states: list[RolloutState]) -> str | None:
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
        what = (
            ", ".join(diff)
            if diff
            else (
                f"fingerprint {', '.join(changed)} -> {current} (the journal keeps no readable copy of the old settings)"
            )
        )
        if self.topology_override is None:
            raise TopologyChangedError(
                f"resume refused: workload {self.config.name!r} in journal {self.config.journal} ran with other "
                f"settings: {what}; continuing would mix two policies inside its {len(unfinished)} unfinished "
                "rollouts. Resume with the journal's settings, or pass --allow-topology-change WHY "
                "(topology_override) to continue anyway; WHY is recorded in the journal"
            )
        log.warning(
            "resuming workload %s with another topology (%s), as asked: %s",
            self.config.name,
            what,
            self.topology_override,
        )
        return f"{self.topology_override} (changed: {what})"

    def first_attempt(self, spec: RolloutSpec) -> tuple[LiveRollout, RolloutReport, Awaitable[None]]:
        """A rollout the journal does not hold: attempt 1 from turn 0, and its first commit."""
        state = RolloutState(spec.rollout_id, spec.group_id)
        live = LiveRollout(spec, state, self.new_environment(spec, fresh=True))
        events = self.agent.start_attempt(live, resumed_from_turn=0, reason="new rollout")
        return live, RolloutReport(spec.rollout_id, 0, 0, 0, False, False), self.agent.begin(live, events)

    def resume(
        self,
        spec: RolloutSpec,
        history: RolloutHistory,
        state: RolloutState,
        override: str | None,
        report: RunReport,
        timing: RestoreTiming,
    ) -> Admission:
        """What the restored rollout is: the live rollout to drive and its fence, or nothing to run."""
        self.states[spec.rollout_id] = state  # a finished result may still be acknowledged
        committed = state.next_turn
        if state.acknowledged:  # the trainer took it (its snapshot tombstone may be lost; the event is not)
            return Admission(RolloutReport(spec.rollout_id, committed, 0, 0, False, False, acknowledged=True))
        if state.finished:
            return Admission(RolloutReport(spec.rollout_id, committed, 0, 0, False, True, state.outcome))
        given_up = RolloutReport(spec.rollout_id, committed, 0, 0, False, False, given_up=state.failure)
        if state.given_up:  # terminal: its given-up record is on the results stream already
            return Admission(given_up)
        if state.failure is not None and state.failures >= self.config.failure_policy.max_failures:
            return Admission(given_up, give_up=state)  # it failed for the last time, then a crash
        rebuilding = time.perf_counter()  # a restart-only environment's cost is starting it again
        env, resumed_from, reason = self.next_attempt(spec, history, self.states[spec.rollout_id], report)
        state = self.states[spec.rollout_id]  # a snapshot that did not restore may have been replaced
        timing.rebuild_s += time.perf_counter() - rebuilding
        live = LiveRollout(spec, state, env)
        events = self.agent.start_attempt(live, resumed_from_turn=resumed_from, reason=reason, override=override)
        restart = resumed_from == 0 and committed > 0
        committed = committed if restart else resumed_from
        row = RolloutReport(spec.rollout_id, committed, 0, 0, restart, False)
        return Admission(row, live, self.agent.commit(events))

    def next_attempt(
        self, spec: RolloutSpec, history: RolloutHistory | None, state: RolloutState, report: RunReport
    ) -> tuple[Environment, int, str]:
        """A fresh environment for the rollout's next attempt, the turn it resumes from and why:
        turn 0 for a restart-only environment that lost committed turns, else the next turn, the
        environment brought to the committed state (``history``: what a restore read, so a snapshot
        that does not restore falls back to an older one, whose state replaces the rollout's in
        ``states``; None: the live state, no fallback)."""
        committed = state.next_turn
        env = self.new_environment(spec)
        retry = (
            f"retry after infrastructure failure {state.failures} of {self.config.failure_policy.max_failures}"
            f" ({state.failure})"
            if state.failure is not None
            else None
        )
        if env.recovery is Recovery.RESTART_ONLY and committed > 0:
            env.restore({}, [])  # what a resource server still holds of it is the lost attempt's
            restart = f"restart from turn 0: environment {spec.environment!r} is restart_only"
            return env, 0, restart if retry is None else f"{retry}; {restart}"
        if history is None:
            try:
                self.rebuild(spec, state, env)
            except BaseException:
                env.close()
                raise
        else:
            state, env = self._rebuilt(spec, history, state, env, report)
            self.states[spec.rollout_id] = state
        committed = state.next_turn
        if retry is not None:
            return env, committed, f"{retry}: resume at turn {committed}"
        if spec.forked_from and state.attempt == 1:
            return env, committed, f"continue fork of {spec.forked_from} from turn {committed}"
        return env, committed, f"resume after crash at turn {committed}"

    def _rebuilt(
        self, spec: RolloutSpec, history: RolloutHistory, state: RolloutState, env: Environment, report: RunReport
    ) -> tuple[RolloutState, Environment]:
        """The rollout's state and a fresh environment brought to it. A snapshot whose exported
        resource states do not import (or do not take its mutations) is distrusted: the snapshot
        ``trusted_restore`` picks instead and a longer replay take its place, down to a replay from
        the first event. Raises (the rollout alone is set aside) when nothing works."""
        unusable: set[RecordLocation] = set()
        while True:
            try:
                self.rebuild(spec, state, env)
                return state, env
            except BaseException as exc:
                env.close()
                if not isinstance(exc, ResourceError) or history.snapshot is None or self.journal is None:
                    raise
                bad, why = history.snapshot.location, exc
            unusable.add(bad)
            note = (
                f"rollout {spec.rollout_id}: the snapshot at {bad} does not restore its resources ({why}); "
                "falling back to the previous snapshot and a longer replay"
            )
            log.warning("%s", note)
            report.read_errors.append(note)
            history, state = trusted_restore(self.journal, history, spec.group_id, distrusted=unusable)
            env = self.new_environment(spec)
