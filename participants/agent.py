"""The agent: one rollout's multi-turn loop.

A turn = (optionally) a free-form reasoning call, one constrained model call
choosing a tool call, the tool call on the environment's resources, then
``TurnCompleted``; all of it (plus the rollout's snapshot when one is due, and
``RolloutFinished`` and the rollout's ``TrainingRecord`` for the trainer on the
last turn) is appended to the journal atomically.
Two things are journaled earlier, on their own: the progress of a long free-form
call (``ModelCallProgress`` every ``progress_every_tokens``, no sooner than
``progress_min_interval_ms`` after the last), and, with a backend
that is not bit-deterministic, each model call before its tool call (see
``Agent.model_call``), so that a redone turn replays the call the resources saw.

Commits are pipelined: with ``turns_in_flight=2`` (the default) turn t+1
generates and is appended while turn t commits, and turn t+2 starts only once
turn t is durable, so the journal's commit latency hides behind the next model
call. The journal commits appends in order, so t+1 is never durable without t.
That is safe at any depth because
everything a turn does before it is durable is redone identically after a
crash: sampling seeds derive from (workload seed, rollout, turn), never from
the attempt, and resource mutations carry idempotency keys derived from
(rollout, turn, index).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import numpy as np

from journal.anchoring import HeadSigner
from journal.errors import JournalError, RolloutJournalError
from journal.events import (
    AttemptFenced,
    AttemptStarted,
    ChainHead,
    Header,
    Message,
    ModelCallProgress,
    ResourceMutation,
    RolloutEvent,
    RolloutFailed,
    RolloutFinished,
    SamplingParams,
    TrainingRecord,
    TurnCompleted,
)
from journal.group_commit import CommitFuture
from journal.journal import Journal
from journal.snapshots import SnapshotDraft

from .config import WorkloadConfig
from .constraints import ActionTrie
from .environments.base import SUBMIT, Environment, Observation, StepContext
from .model import ModelCallResult, ModelParticipant
from .resource_protocol import ResourceSessionLostError
from .resources import (
    MutationRecord,
    Recovery,
    Resource,
    StaleEpochError,
    canonical_json,
)
from .rollout_state import RolloutSpec, RolloutState
from .tokenizer import ChatTokenizer

log = logging.getLogger(__name__)

T = TypeVar("T")
_MAX_RESOURCE_RESTORES = 3  # a server that loses the rollout again right after a restore is broken


class RestartFromZero(RolloutJournalError):
    """The rollout's restart-only resources are gone (their server restarted): a new attempt
    begins from turn 0, as after a worker crash."""


SYSTEM_PROMPT = "You are an assistant that acts only through tool calls. Reply with exactly one tool call."


class TurnSink(Protocol):
    """Where a finished turn goes: the journal, or nowhere (overhead baseline)."""

    journals: bool  # turns are made durable: snapshots are worth building

    def submit(self, events: list[RolloutEvent], snapshot: SnapshotDraft | None,
               result: TrainingRecord | None = None) -> Future:
        """Start making the turn durable (with a final turn's training record, in the same commit);
        the future resolves once it is."""
        ...


class JournalSink:
    journals = True

    def __init__(self, journal: Journal) -> None:
        self.journal = journal

    def submit(self, events: list[RolloutEvent], snapshot: SnapshotDraft | None,
               result: TrainingRecord | None = None) -> Future:
        return self.journal.append(events, snapshot, result)


class NullSink:
    """Journaling off: the same rollout work with nothing made durable and no snapshots built."""

    journals = False

    def submit(self, events: list[RolloutEvent], snapshot: SnapshotDraft | None,
               result: TrainingRecord | None = None) -> Future:
        done: Future = Future()
        done.set_result(None)
        return done


async def durable(future: Future) -> object:
    """The result of a journal future, awaited without blocking the event loop.

    A turn's commit is usually done long before the agent asks (rollouts take turns,
    so a rollout's next turn comes after its siblings' turns): then the result is read
    at once, and the committer thread never has to wake the event loop for it.
    """
    if not future.done():
        await asyncio.wrap_future(future)
    return future.result()


def turn_seed(workload_seed: int, rollout_id: str, turn: int, call_index: int = 0) -> int:
    """The sampling seed of a turn's call: never the attempt's, so a redone turn samples what the lost one did."""
    name = f"{workload_seed}/{rollout_id}/{turn}" + (f"/c{call_index}" if call_index else "")
    digest = hashlib.sha256(name.encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def outcome_of(state: RolloutState, env: Environment) -> dict:
    """What a finished rollout produced, enough to compare two runs: written into
    ``RolloutFinished`` so a result is offered again without recomputing it."""
    return {
        "reward": state.reward,
        "turns": state.next_turn,
        "actions": state.actions,
        "tokens_sha256": hashlib.sha256(state.head_tokens.astype("<i4").tobytes()).hexdigest(),
        "output_tokens": state.output_tokens,
        "resource_digests": env.state_digests(),
    }


def fails_the_rollout_alone(exc: BaseException) -> bool:
    """Whether ``exc``, raised by a rollout's turn, is that rollout's own failure (journaled as
    ``RolloutFailed``; the others run on) rather than the journal's or the attempt's: a journal
    that cannot commit, or a resource that says a newer attempt took over, stops the worker."""
    return isinstance(exc, Exception) and not isinstance(exc, (JournalError, StaleEpochError))


def snapshot_of(state: RolloutState, resource_states: dict[str, bytes], writer: str) -> SnapshotDraft:
    """A snapshot of ``state`` covering every event applied to it, with these resource exports."""
    state.record_exports(resource_states)
    covers_seq = state.next_seq - 1  # every event applied so far
    return SnapshotDraft(state.header(writer), "finished" if state.finished else "running", covers_seq,
                         state.to_bytes())


def head_checkpoint(signer: HeadSigner, state: RolloutState, env: Environment, writer: str,
                    turn: int) -> RolloutEvent:
    """The signed chain heads of every resource of a rollout, in this life of it (the agent's
    after a turn's mutations; a fork's after each turn it copies)."""
    heads = [ChainHead(rid, r.revision, r.chain_hash) for rid, r in sorted(env.resources.items())]
    return signer.checkpoint(state.header(writer, turn=turn), state.restarts, heads)


def mutation_event(header: Header, record: MutationRecord) -> ResourceMutation:
    return ResourceMutation(
        header=header, resource_id=record.resource_id, kind=record.kind, op=record.op,
        args_json=canonical_json(record.args), idempotency_key=record.idempotency_key,
        prev_revision=record.prev_revision, revision=record.revision, result_json=canonical_json(record.result),
        state_digest=record.state_digest, chain_hash=record.chain_hash,
    )


@dataclass
class LiveRollout:
    """A rollout being driven in this process: who it is, its state, its environment."""

    spec: RolloutSpec
    state: RolloutState
    env: Environment
    bytes_since_snapshot: int = 0
    turns_since_snapshot: int = 0
    turns_run_here: int = 0  # turns this process executed (work accounting)
    tokens_run_here: int = 0
    at_boundary: asyncio.Event = field(default_factory=asyncio.Event)  # set between turns: safe to checkpoint
    exports: dict[str, tuple[tuple[int, int], bytes]] = field(default_factory=dict)  # resource -> (version, bytes)
    # (commit, turn) not yet known durable; turn None: an append inside a turn (a call's progress,
    # a call made durable before its tool call)
    in_flight: deque[tuple[Future, int | None]] = field(default_factory=deque)
    acknowledged: asyncio.Event = field(default_factory=asyncio.Event)  # the trainer took its result
    resource_restores: int = 0  # times its resources were brought back on a restarted resource server

    def __post_init__(self) -> None:
        self.at_boundary.set()


class Agent:
    def __init__(self, config: WorkloadConfig, model: ModelParticipant, tokenizer: ChatTokenizer,
                 sink: TurnSink, *, writer: str,
                 on_durable: Callable[[str, int], None] = lambda rollout_id, turn: None,
                 signer: HeadSigner | None = None) -> None:
        """``on_durable(rollout_id, turn)`` is called once each turn is durable. With a ``signer``,
        every turn that mutates a resource also journals a signed checkpoint of the chain heads."""
        self.config = config
        self.signer = signer if sink.journals else None
        self.model = model
        self.tokenizer = tokenizer
        self.sink = sink
        self.on_durable = on_durable
        self.writer = writer
        self._tries: dict[tuple[str, ...], ActionTrie] = {}
        self.turn_boundary = asyncio.Event()  # cleared by a coordinated checkpoint to park agents
        self.turn_boundary.set()
        # A call made durable before its tool call is replayed by a redone turn, never sampled again:
        # on a server that is not bit-deterministic, sampling again could pick another action under
        # the same idempotency keys, which a resource that remembers them refuses.
        mode = config.durable_model_calls
        self.durable_calls = sink.journals and (mode == "always" or (mode == "auto" and not model.backend.deterministic))

    # -- conversation --------------------------------------------------------
    def initial_messages(self, env: Environment) -> list[Message]:
        return [Message("system", SYSTEM_PROMPT), Message("user", env.task_prompt())]

    def prompt_of(self, state: RolloutState, extra: list[Message] | None = None) -> np.ndarray:
        """The conversation (and ``extra`` messages of the turn under way) rendered with the
        model's own chat template, ending in its generation prompt."""
        messages = [*state.messages, *(extra or [])]
        return self.tokenizer.chat_prompt((m.role, m.content) for m in messages)

    def _trie(self, actions: list[str]) -> ActionTrie:
        key = tuple(actions)
        trie = self._tries.get(key)
        if trie is None:
            if len(self._tries) > 4096:
                self._tries.clear()
            trie = self._tries[key] = ActionTrie.from_strings(self.tokenizer, actions)
        return trie

    # -- lifecycle -------------------------------------------------------------
    def _applied(self, state: RolloutState, event: RolloutEvent, events: list[RolloutEvent]) -> RolloutEvent:
        """Apply a just-built event to the rollout's state and collect it for the journal."""
        state.apply(event)
        events.append(event)
        return event

    def start_attempt(self, live: LiveRollout, *, resumed_from_turn: int, reason: str,
                      override: str | None = None) -> list[RolloutEvent]:
        """The fence: attempt N+1 with the next epoch. Resources refuse older epochs from now on.

        ``resumed_from_turn=0`` on a rollout with committed turns starts its conversation
        over (a restart-only environment lost its state); applying the event does that.
        ``override`` records what the user changed on purpose (another topology)."""
        state = live.state
        previous_attempt, previous_epoch = state.attempt, state.epoch
        attempt, epoch = previous_attempt + 1, previous_epoch + 1
        messages = self.initial_messages(live.env) if resumed_from_turn == 0 else []
        events: list[RolloutEvent] = []
        self._applied(state, AttemptStarted(state.header(self.writer, turn=resumed_from_turn, attempt=attempt, epoch=epoch),
                                            resumed_from_turn, self.config.topology(), reason, messages,
                                            override), events)
        live.env.fence(live.spec.rollout_id, state.epoch)
        if previous_attempt:  # the audit trail names what this attempt supersedes
            self._applied(state, AttemptFenced(state.header(self.writer, turn=resumed_from_turn), previous_attempt,
                                               previous_epoch, f"superseded by attempt {attempt}: {reason}"), events)
        return events

    async def commit(self, events: list[RolloutEvent], snapshot: SnapshotDraft | None = None) -> None:
        """Make events (and a snapshot) durable now, outside the turn pipeline."""
        await durable(self.sink.submit(events, snapshot))

    async def begin(self, live: LiveRollout, events: list[RolloutEvent]) -> None:
        """Commit a new rollout's fence with its first snapshot, which registers the
        rollout in the compacted stream: restore finds it there."""
        await self.commit(events, self.snapshot_draft(live, await self._exports(live)) if self.sink.journals else None)

    def snapshot_draft(self, live: LiveRollout, resource_states: dict[str, bytes] | None = None) -> SnapshotDraft:
        """The rollout's state as a snapshot; exportable resources export themselves
        unless ``resource_states`` (exported by a coordinated checkpoint) is given."""
        if resource_states is None:
            resource_states = {rid: self._export(live, r) for rid, r in live.env.resources.items() if r.supports_export}
        return snapshot_of(live.state, resource_states, self.writer)

    @staticmethod
    def _export(live: LiveRollout, resource: Resource) -> bytes:
        """A resource's exported state, reused while its revision and fence stand still
        (most turns touch one resource, and every snapshot exports them all)."""
        version = (resource.revision, resource.fenced_epoch(live.spec.rollout_id))
        cached = live.exports.get(resource.resource_id)
        if cached is None or cached[0] != version:
            cached = live.exports[resource.resource_id] = (version, resource.export_state())
        return cached[1]

    async def run_turn(self, live: LiveRollout) -> None:
        """Run the rollout's next turn. A failure of this rollout alone (see
        :func:`fails_the_rollout_alone`) is journaled as ``RolloutFailed`` and ends the rollout
        here (``state.failure``); the journal's or the attempt's own errors are raised."""
        while not self.turn_boundary.is_set():  # re-check: a checkpoint may close it again before we run
            await self.turn_boundary.wait()
        live.at_boundary.clear()
        unsent: list[RolloutEvent] = []  # applied to the state, not yet handed to the journal
        try:
            try:
                await self._turn(live, unsent)
            except RestartFromZero as lost:  # its restart-only resources are gone (their server restarted)
                await self._restart_from_zero(live, unsent, lost)
        except Exception as exc:
            if not fails_the_rollout_alone(exc):
                raise
            await self._fail(live, unsent, exc)
        finally:
            live.at_boundary.set()
        # Take turns: a rollout whose previous commit is already done would otherwise run to
        # its end before its siblings start, since nothing else in its turn has to wait.
        await asyncio.sleep(0)

    async def _fail(self, live: LiveRollout, unsent: list[RolloutEvent], exc: Exception) -> None:
        """Journal the failed turn's events so far (the model call and mutations did happen) and
        ``RolloutFailed`` after them, once the turns before are durable."""
        state = live.state
        reason = " ".join(str(exc).split()) or type(exc).__name__
        log.error("rollout %s failed at turn %d (attempt %d), the others run on: %s: %s",
                  live.spec.rollout_id, state.next_turn, state.attempt, type(exc).__name__, reason,
                  exc_info=not isinstance(exc, RolloutJournalError))
        await self._durable(live, keep=0)
        self._applied(state, RolloutFailed(state.header(self.writer), type(exc).__name__, reason), unsent)
        await self.commit(unsent)

    # -- the model calls of a turn ------------------------------------------------------
    async def model_call(self, live: LiveRollout, events: list[RolloutEvent], prompt: np.ndarray,
                         params: SamplingParams, constraint: ActionTrie | None, call_index: int) -> ModelCallResult:
        """The turn's call at ``call_index``, applied to the state and collected in ``events``.

        Its progress (a free-form call) is journaled every ``progress_every_tokens`` as it
        streams, no sooner than ``progress_min_interval_ms`` after the call's last mark. With ``durable_calls``, the call is made durable (with the turn's events so
        far) before it returns, i.e. before its tool call. A call the journal already holds
        for this turn is replayed from it: nothing is generated, nothing journaled again."""
        state = live.state
        rollout_id, turn = live.spec.rollout_id, state.next_turn

        def progress(event: ModelCallProgress) -> None:
            state.apply(event)
            future = self.sink.submit([event], None)
            if isinstance(future, CommitFuture):
                future.hasten()  # a mark still lingering when the process dies is lost: commit it now
            live.in_flight.append((future, None))

        journals_progress = self.sink.journals and self.config.progress_every_tokens > 0
        call = await self.model.call(state, prompt, params, constraint,
                                     f"{rollout_id}/a{state.attempt}/t{turn}/c{call_index}", writer=self.writer,
                                     call_index=call_index, on_progress=progress if journals_progress else None,
                                     progress_every=self.config.progress_every_tokens,
                                     progress_interval_s=self.config.progress_min_interval_ms / 1000.0)
        if call.replayed:
            return call
        self._applied(state, call.event, events)
        live.tokens_run_here += call.new_tokens
        if self.durable_calls:
            live.in_flight.append((self.sink.submit(list(events), None), None))
            events.clear()  # handed to the journal
            await self._durable(live, keep=0)
        return call

    async def reasoning(self, live: LiveRollout, events: list[RolloutEvent]) -> tuple[list[Message], list[str]]:
        """The turn's free-form reasoning segment (``model.reasoning_tokens``), as the messages
        it adds to the conversation and the call ids; none when the workload has no segment."""
        model = self.config.model
        if not model.reasoning_tokens:
            return [], []
        state = live.state
        seed, seed_rollout = live.spec.turn_seed_source(self.config.seed)
        params = SamplingParams(model.temperature, model.top_p, model.reasoning_tokens,
                                turn_seed(seed, seed_rollout, state.next_turn, 1))
        call = await self.model_call(live, events, self.prompt_of(state), params, None, 0)
        return [Message("assistant", self.tokenizer.decode(call.generation.output_ids))], [call.event.call_id]

    async def choose_action(self, live: LiveRollout, events: list[RolloutEvent], thoughts: list[Message],
                            actions: list[str]) -> tuple[str, ModelCallResult]:
        """The constrained call that picks one of ``actions`` (after the turn's ``thoughts``)."""
        state, model = live.state, self.config.model
        trie = self.constraint_for(actions)
        seed, seed_rollout = live.spec.turn_seed_source(self.config.seed)
        params = SamplingParams(model.temperature, model.top_p, model.max_tokens,
                                turn_seed(seed, seed_rollout, state.next_turn))
        call = await self.model_call(live, events, self.prompt_of(state, thoughts), params, trie, len(thoughts))
        return self.action_of(trie, call.generation.output_ids), call

    # -- the tool-call half of a turn: what the model chose, and running it on the resources ------
    def constraint_for(self, actions: list[str]) -> ActionTrie | None:
        """The decoding constraint of a turn: the trie of the actions valid now, or None when the
        workload lets the model answer freely (``constrained_actions: false``)."""
        return self._trie(actions) if self.config.constrained_actions else None

    def action_of(self, trie: ActionTrie | None, output_ids: np.ndarray) -> str:
        """The action a generation chose. A generation that is no listed action (cut short by
        ``max_tokens``, or free-form text) is passed on as its text: the environment parses a JSON
        tool call from it, or answers with an observation saying what is wrong: the policy's
        mistake, not the workload's."""
        action = trie.label_of(output_ids) if trie is not None else None
        return action if action is not None else self.tokenizer.decode(output_ids)

    async def run_tool_call(self, live: LiveRollout, action: str) -> tuple[Observation, list[MutationRecord]]:
        """Run the turn's tool call on the rollout's environment, with keys ``<rollout>/t<turn>/m<i>``
        (the same keys when a turn is re-executed after a crash)."""
        state = live.state
        prefix = f"{live.spec.rollout_id}/t{state.next_turn}"
        return await self._with_resources(
            live, lambda: live.env.astep(action, StepContext(live.spec.rollout_id, state.attempt, state.epoch, prefix)))

    async def _with_resources(self, live: LiveRollout, exchange: Callable[[], Awaitable[T]]) -> T:
        """Run ``exchange`` with the rollout's resources. When their server lost the rollout (it was
        restarted), bring the resources back to the rollout's state (the exports of its last
        snapshot and the mutations since) and run it again; a restart-only environment cannot be
        brought back: :class:`RestartFromZero`."""
        for tries in range(1, _MAX_RESOURCE_RESTORES + 1):
            try:
                return await exchange()
            except ResourceSessionLostError as lost:
                if live.env.recovery is Recovery.RESTART_ONLY:
                    raise RestartFromZero(str(lost)) from lost
                if tries == _MAX_RESOURCE_RESTORES:
                    raise
                state = live.state
                log.warning("rollout %s: %s; restoring its resources from its last snapshot and %d mutations since",
                            live.spec.rollout_id, lost, len(state.mutations_since_export))
                await live.env.arestore(state.resource_states, state.mutations_since_export, fence_epoch=state.epoch)
                live.resource_restores += 1
        raise AssertionError("unreachable")

    async def _restart_from_zero(self, live: LiveRollout, unsent: list[RolloutEvent], lost: RestartFromZero) -> None:
        """A new attempt from turn 0 on fresh resources, journaled after what this turn applied."""
        state = live.state
        log.warning("rollout %s restarts from turn 0 (attempt %d): %s", live.spec.rollout_id, state.attempt + 1, lost)
        await self._durable(live, keep=0)
        await live.env.arestore({}, [], fence_epoch=state.epoch + 1)  # a fresh session; the old epoch is fenced
        unsent.extend(self.start_attempt(live, resumed_from_turn=0, reason=f"restart from turn 0: {lost}"))
        live.exports.clear()
        live.turns_since_snapshot = live.bytes_since_snapshot = 0
        await self.commit(unsent)
        unsent.clear()

    async def _exports(self, live: LiveRollout) -> dict[str, bytes]:
        """The rollout's exported resource states for a snapshot. An export is reused while its
        resource's revision and fence stand still (most turns touch one resource, and every
        snapshot exports them all); a restart-only environment has none worth keeping."""
        env = live.env
        if env.recovery is Recovery.RESTART_ONLY:
            return {}
        versions = {rid: (r.revision, r.fenced_epoch(live.spec.rollout_id))
                    for rid, r in env.resources.items() if r.supports_export}
        stale = [rid for rid, version in versions.items()
                 if rid not in live.exports or live.exports[rid][0] != version]
        if stale:
            fresh = await self._with_resources(live, lambda: env.aexport(stale))
            for rid in stale:
                live.exports[rid] = (versions[rid], fresh[rid])
        return {rid: live.exports[rid][1] for rid in versions}

    async def _turn(self, live: LiveRollout, events: list[RolloutEvent]) -> None:
        state, env = live.state, live.env
        turn = state.next_turn
        actions = env.action_space()
        if not self.config.allow_early_submit and turn + 1 < self.config.max_turns and len(actions) > 1:
            actions = [a for a in actions if a != SUBMIT]
        thoughts, call_ids = await self.reasoning(live, events)
        action, call = await self.choose_action(live, events, thoughts, actions)
        call_ids.append(call.event.call_id)
        observation, records = await self.run_tool_call(live, action)
        if self.config.turn_delay_ms:
            await asyncio.sleep(self.config.turn_delay_ms / 1000.0)
        for record in records:
            self._applied(state, mutation_event(state.header(self.writer), record), events)
        if records and self.signer is not None:  # anchored in the same append as the mutations it covers
            self._applied(state, self.head_checkpoint(live, turn), events)
        messages = [*thoughts, Message("assistant", action), Message("tool", observation.text)]
        last = observation.done or turn + 1 >= self.config.max_turns
        reward = await self._with_resources(live, env.averify) if last else None
        if last and reward is None:  # a user environment's verify() without a return: this rollout fails
            raise TypeError(f"environment {live.spec.environment!r} of rollout {live.spec.rollout_id}: "
                            "verify() returned None; it must return the rollout's reward (a float)")
        self._applied(state, TurnCompleted(state.header(self.writer), messages, call_ids,
                                           env.revisions(), reward, [action]), events)
        result = None
        if reward is not None:  # the last turn (only its reward is verified; None there was refused above)
            outcome = outcome_of(state, env)
            finished = self._applied(state, RolloutFinished(state.header(self.writer), reward, state.next_turn,
                                                            json.dumps(outcome)), events)
            if self.sink.journals and live.spec.forked_from is None:  # a fork is a what-if, not a group's sample
                result = state.training_record(finished.header, self.config.siblings)
        live.turns_run_here += 1
        live.turns_since_snapshot += 1
        live.bytes_since_snapshot += int(call.prompt.nbytes) + int(call.generation.output_ids.nbytes) * 2
        snapshot = None
        periodic = self.config.checkpoint_mode == "snapshot" and (
            live.turns_since_snapshot >= self.config.snapshot_every_turns
            or live.bytes_since_snapshot >= self.config.snapshot_max_bytes)
        if self.sink.journals and (last or periodic):
            snapshot = self.snapshot_draft(live, await self._exports(live))
            live.turns_since_snapshot = live.bytes_since_snapshot = 0
        live.in_flight.append((self.sink.submit(list(events), snapshot, result), turn))
        events.clear()  # handed to the journal: a failure from here on journals nothing of this turn twice
        await self._durable(live, keep=self.config.turns_in_flight - 1)

    def head_checkpoint(self, live: LiveRollout, turn: int) -> RolloutEvent:
        """The signed heads of every resource of the rollout, in this life of it."""
        if self.signer is None:
            raise ValueError(f"rollout {live.state.rollout_id}: writer {self.writer} has no head signer (none was "
                             "given, or its sink journals nothing); sign heads only with one")
        return head_checkpoint(self.signer, live.state, live.env, self.writer, turn)

    async def _durable(self, live: LiveRollout, keep: int) -> None:
        """Wait (oldest first) until at most ``keep`` of the rollout's turns are not yet durable."""
        while len(live.in_flight) > keep:
            future, turn = live.in_flight[0]
            await durable(future)
            live.in_flight.popleft()
            if turn is not None:
                self.on_durable(live.spec.rollout_id, turn)

    async def settle(self, live: LiveRollout) -> None:
        """Wait until the rollout's last appended turn is durable."""
        await self._durable(live, keep=0)
