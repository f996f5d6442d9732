"""The agent: one rollout's multi-turn loop.

A turn = (optionally) a free-form reasoning call, one constrained model call
choosing a tool call, the tool call on the environment's resources, then
``TurnCompleted``; all of it (plus the rollout's snapshot when one is due, and
``RolloutFinished`` and the rollout's ``TrainingRecord`` for the trainer on the
last turn) is appended to the journal atomically. Every prompt is built from token ids
by the token-in-token-out rule (:mod:`rollout_journal.participants.model.chat`): the
previous prompt, the ids the model sampled (never decoded and encoded again), what the
model's chat template adds to close that turn, and the tokenized new messages; each
assistant message names the call it came from.

The agent is a client of the session API (:mod:`rollout_journal.participants.session`), as any
agent loop is: its model calls are the session's effects, so a redone turn's calls are answered
from the journal by position (whatever it would sample now: a difference is logged), a call cut
short continues from its durable prefix, and its progress marks are the session's. What the
session does not do for it is its environment: an in-process environment's mutations are
replayed into the rebuilt environment by restore
(:mod:`~rollout_journal.participants.workload.restore`), not answered from the journal.

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
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from rollout_journal.journal.anchoring import HeadSigner
from rollout_journal.journal.errors import JournalError, RolloutJournalError
from rollout_journal.journal.events import (
    ChatMessage,
    RolloutEvent,
    RolloutFailed,
    RolloutFinished,
    RolloutGivenUp,
    SamplingParams,
    ToolCallRef,
    TurnCompleted,
)
from rollout_journal.journal.snapshots import SnapshotDraft
from rollout_journal.participants.environments.base import SUBMIT, Environment, Observation, StepContext
from rollout_journal.participants.environments.tool_calls import ToolCallError, looks_like_tool_call, parse_tool_call
from rollout_journal.participants.model.chat import Prompt, PromptBuilder
from rollout_journal.participants.model.constraints import ActionTrie
from rollout_journal.participants.model.gate import ModelParticipant
from rollout_journal.participants.model.tokenizer import ChatTokenizer
from rollout_journal.participants.remote.protocol import ResourceSessionLostError
from rollout_journal.participants.resources import MutationRecord, Recovery, Resource, StaleEpochError
from rollout_journal.participants.rollout import (
    RolloutState,
    head_checkpoint,
    mutation_event,
    outcome_of,
    snapshot_of,
)
from rollout_journal.participants.session.api import (
    ModelAnswer,
    RolloutRef,
    RolloutSession,
    SessionFactory,
    StateRequest,
)
from rollout_journal.participants.session.ownership import Unrouted
from rollout_journal.participants.session.sinks import JournalSink, TurnSink, durable
from rollout_journal.participants.workload.config import WorkloadConfig
from rollout_journal.participants.workload.specs import RolloutSpec

log = logging.getLogger(__name__)

T = TypeVar("T")
_MAX_RESOURCE_RESTORES = 3  # a server that loses the rollout again right after a restore is broken


class RestartFromZero(RolloutJournalError):
    """The rollout's restart-only resources are gone (their server restarted): a new attempt
    begins from turn 0, as after a worker crash."""


SYSTEM_PROMPT = "You are an assistant that acts only through tool calls. Reply with exactly one tool call."


def turn_seed(workload_seed: int, rollout_id: str, turn: int, call_index: int = 0) -> int:
    """The sampling seed of a turn's call: never the attempt's, so a redone turn samples what the lost one did."""
    name = f"{workload_seed}/{rollout_id}/{turn}" + (f"/c{call_index}" if call_index else "")
    digest = hashlib.sha256(name.encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def action_messages(action: str, call_id: str, observation: str) -> list[ChatMessage]:
    """The assistant message of a turn's action (naming the call whose sampled ids it stands for)
    and the tool's answer. A free-form answer that is a JSON tool call is kept structured, so the
    chat template renders it in its own tool-call format when it re-renders the conversation."""
    if looks_like_tool_call(action):
        try:
            parsed = parse_tool_call(action)
        except ToolCallError:
            pass
        else:
            ref = ToolCallRef(f"{call_id}#0", parsed.name, json.dumps(dict(parsed.arguments), ensure_ascii=False))
            return [
                ChatMessage("assistant", "", [ref], call_id=call_id),
                ChatMessage("tool", observation, tool_call_id=ref.id, name=parsed.name),
            ]
    return [ChatMessage("assistant", action, call_id=call_id), ChatMessage("tool", observation)]


def _dataset_message(row: dict[str, Any]) -> ChatMessage:
    """A dataset row's message (OpenAI's shape) as the journal keeps it."""
    calls = [
        ToolCallRef(
            str(c.get("id", f"call-{i}")),
            str(c.get("function", c).get("name", "")),
            a if isinstance(a := c.get("function", c).get("arguments", {}), str) else json.dumps(a, ensure_ascii=False),
        )
        for i, c in enumerate(row.get("tool_calls") or [])
    ]
    return ChatMessage(str(row["role"]), str(row.get("content") or ""), calls, row.get("tool_call_id"), row.get("name"))


def fails_the_rollout_alone(exc: BaseException) -> bool:
    """Whether ``exc``, raised by a rollout's turn, is that rollout's own failure (journaled as
    ``RolloutFailed``; the others run on) rather than the journal's or the attempt's: a journal
    that cannot commit, or a resource that says a newer attempt took over, stops the worker."""
    return isinstance(exc, Exception) and not isinstance(exc, (JournalError, StaleEpochError))


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
    # Its current attempt's session (see Agent.session_of): the turn's held events, its appends not yet durable
    session: RolloutSession | None = None
    acknowledged: asyncio.Event = field(default_factory=asyncio.Event)  # the trainer took its result
    resource_restores: int = 0  # times its resources were brought back on a restarted resource server

    def __post_init__(self) -> None:
        self.at_boundary.set()


class Agent:
    def __init__(
        self,
        config: WorkloadConfig,
        model: ModelParticipant,
        tokenizer: ChatTokenizer,
        sink: TurnSink,
        *,
        writer: str,
        on_durable: Callable[[str, int], None] = lambda rollout_id, turn: None,
        signer: HeadSigner | None = None,
    ) -> None:
        """``on_durable(rollout_id, turn)`` is called once each turn is durable. With a ``signer``,
        every turn that mutates a resource also journals a signed checkpoint of the chain heads."""
        self.config = config
        self.signer = signer if sink.journals else None
        self.model = model
        self.tokenizer = tokenizer
        self.prompts = PromptBuilder(tokenizer, history_policy=config.model.history_policy)
        self.sink = sink
        self.on_durable = on_durable
        self.writer = writer
        self.topology = config.topology()  # hashes a tasks file: once, not per rollout
        self._tries: dict[tuple[str, ...], ActionTrie] = {}
        self.turn_boundary = asyncio.Event()  # cleared by a coordinated checkpoint to park agents
        self.turn_boundary.set()
        # A call made durable before its tool call is replayed by a redone turn, never sampled again:
        # on a server that is not bit-deterministic, sampling again could pick another action under
        # the same idempotency keys, which a resource that remembers them refuses.
        mode = config.durable_model_calls
        self.durable_calls = sink.journals and (
            mode == "always" or (mode == "auto" and not model.backend.deterministic)
        )
        # The session API's effects, with the runner's restore and ownership: sessions are adopted
        # (the runner fences and restores its rollouts itself), and a live call's answer is held for
        # the turn's one append (made durable before its tool call only with ``durable_calls``).
        self.sessions = SessionFactory(
            sink.journal if isinstance(sink, JournalSink) else None,
            model,
            writer=writer,
            ownership=Unrouted(),
            sink=sink,
            durable_answers=False,
            progress_every_tokens=config.progress_every_tokens if sink.journals else 0,
            progress_min_interval_ms=config.progress_min_interval_ms,
        )

    def session_of(self, live: LiveRollout) -> RolloutSession:
        """The session of the rollout's current attempt, at the turn under way. A new attempt of the
        rollout in this process (a retry, a restart from turn 0) takes over what the session of the
        previous one held and had not yet seen durable."""
        session, state = live.session, live.state
        if session is None or session.state is not state or session.epoch != state.epoch:
            spec = live.spec
            ref = RolloutRef(spec.rollout_id, spec.group_id, spec.sibling, self.config.siblings, self.topology)
            fresh = self.sessions.adopt(ref, state)
            if session is not None:
                fresh.carry_over(session)
            session = live.session = fresh
        elif session.turn != state.next_turn:
            session.fast_forward()
        return session

    # -- conversation --------------------------------------------------------
    def initial_messages(self, env: Environment) -> list[ChatMessage]:
        """The conversation's start: the dataset row's own messages (system and multi-message
        prompts), else the agent's system prompt and the task's instruction."""
        task = env.task
        if task.messages:
            return [_dataset_message(m) for m in task.messages]
        return [ChatMessage("system", SYSTEM_PROMPT), ChatMessage("user", env.task_prompt())]

    @staticmethod
    def tools_of(env: Environment) -> list[dict[str, Any]] | None:
        """The JSON-schema functions the chat template shows the model: the dataset row's, else
        the environment's (None: the template shows none)."""
        return list(env.task.tools) if env.task.tools else env.tools()

    def prompt_of(self, live: LiveRollout, extra: list[ChatMessage] | None = None) -> Prompt:
        """The next call's prompt: the lineage head (the previous prompt and the ids it sampled),
        the chat template's end-of-turn tokens, and the tokenized messages after the head's own
        (``extra``: those of the turn under way), ending in the generation prompt."""
        state = live.state
        sampled = state.lineage.loss_mask() if state.lineage is not None else None
        return self.prompts.prompt(state, extra or [], tools=self.tools_of(live.env), sampled=sampled)

    def _trie(self, actions: list[str]) -> ActionTrie:
        key = tuple(actions)
        trie = self._tries.get(key)
        if trie is None:
            if len(self._tries) > 4096:
                self._tries.clear()
            trie = self._tries[key] = ActionTrie.from_strings(self.tokenizer, actions)
        return trie

    # -- lifecycle -------------------------------------------------------------
    def start_attempt(
        self, live: LiveRollout, *, resumed_from_turn: int, reason: str, override: str | None = None
    ) -> list[RolloutEvent]:
        """The fence: attempt N+1 with the next epoch (``RolloutState.start_attempt`` builds and
        applies its events), then the environment's resources refuse older epochs from now on.

        ``resumed_from_turn=0`` on a rollout with committed turns starts its conversation
        over (a restart-only environment lost its state); applying the event does that.
        ``override`` records what the user changed on purpose (another topology)."""
        events = live.state.start_attempt(
            self.writer,
            resumed_from_turn=resumed_from_turn,
            topology=self.topology,
            reason=reason,
            messages=self.initial_messages(live.env) if resumed_from_turn == 0 else (),
            override=override,
        )
        live.env.fence(live.spec.rollout_id, live.state.epoch)
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
        unless ``resource_states`` (exported by a coordinated checkpoint) is given. The live
        state records the exports as the snapshot holds them (``RolloutState.record_exports``)."""
        if resource_states is None:
            resource_states = {rid: self._export(live, r) for rid, r in live.env.resources.items() if r.supports_export}
        draft = snapshot_of(live.state, resource_states, self.writer, self.sink.snapshot_block_bytes)
        live.state.record_exports(resource_states)
        return draft

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
        try:
            try:
                await self._turn(live)
            except RestartFromZero as lost:  # its restart-only resources are gone (their server restarted)
                await self._restart_from_zero(live, lost)
        except Exception as exc:
            if not fails_the_rollout_alone(exc):
                raise
            await self.fail(live, exc)
        finally:
            live.at_boundary.set()
        # Take turns: a rollout whose previous commit is already done would otherwise run to
        # its end before its siblings start, since nothing else in its turn has to wait.
        await asyncio.sleep(0)

    async def fail(self, live: LiveRollout, exc: Exception) -> None:
        """Journal the failed turn's events so far (those its session holds: the model call and
        mutations did happen) and ``RolloutFailed`` after them, once the turns before are durable."""
        state = live.state
        reason = " ".join(str(exc).split()) or type(exc).__name__
        log.error(
            "rollout %s failed at turn %d (attempt %d), the others run on: %s: %s",
            live.spec.rollout_id,
            state.next_turn,
            state.attempt,
            type(exc).__name__,
            reason,
        )
        if not isinstance(exc, RolloutJournalError):  # an environment's or a backend's bug: where, with -v
            log.debug("rollout %s failed here", live.spec.rollout_id, exc_info=exc)
        session = self.session_of(live)
        await session.settle(keep=0, on_durable=self._on_durable(live))
        session.hold(RolloutFailed(state.header(self.writer), type(exc).__name__, reason))
        session.commit()
        await session.settle(keep=0)

    def give_up(self, spec: RolloutSpec, state: RolloutState, group_policy: str) -> Future[Any]:
        """Give the rollout up after its last failure: ``RolloutGivenUp``, a final snapshot, and (for
        a rollout of a prompt group, not a fork) its given-up training record, in one commit, so a
        trainer learns of it exactly when it is durable. ``group_policy``: what the trainer's side
        does with its group (``failure_policy.group``, or drop past the redispatch budget)."""
        error, _, reason = (state.failure or "").partition(": ")
        event = RolloutGivenUp(state.header(self.writer), state.failures, error, reason)
        state.apply(event)
        log.error(
            "rollout %s given up after %d infrastructure failures (the last: %s); its group: %s",
            spec.rollout_id,
            state.failures,
            state.failure,
            group_policy,
        )
        if not self.sink.journals:
            return self.sink.submit([event], None)
        record = None
        if spec.forked_from is None:  # a fork is a what-if, not a group's sample
            record = state.given_up_record(event.header, self.config.siblings, group_policy)
        return self.sink.submit([event], snapshot_of(state, {}, self.writer, self.sink.snapshot_block_bytes), record)

    # -- the model calls of a turn ------------------------------------------------------
    async def model_call(
        self,
        live: LiveRollout,
        extra: list[ChatMessage],
        params: SamplingParams,
        constraint: ActionTrie | None,
        describe: str,
    ) -> ModelAnswer:
        """The turn's next call after the conversation and ``extra`` (messages of the turn so far),
        made through the rollout's session: answered from the journal if it holds the call at this
        position (nothing generated, nothing journaled again), else generated, applied to the state
        and held for the turn's append. Its progress (a free-form call) is journaled every
        ``progress_every_tokens`` as it streams, no sooner than ``progress_min_interval_ms`` after the
        call's last mark. With ``durable_calls``, the call is made durable (with the turn's events so
        far) before it returns, i.e. before its tool call."""
        session = self.session_of(live)
        # Unchecked: the journal is the truth of what this rollout sampled (a resume that changed the
        # sampling on purpose, or an upgrade that derives seeds otherwise, keeps what the turn under way
        # already sampled and the resources saw; a difference is logged, never a failure).
        asked = StateRequest(params, lambda: self.prompt_of(live, extra), constraint, describe, checked=False)
        answer = await session.model_call(asked)
        if answer.replayed:
            return answer
        live.tokens_run_here += answer.new_tokens
        if self.durable_calls:
            session.commit()
            await session.settle(keep=0, on_durable=self._on_durable(live))
        return answer

    async def reasoning(self, live: LiveRollout) -> tuple[list[ChatMessage], list[str]]:
        """The turn's free-form reasoning segment (``model.reasoning_tokens``), as the messages
        it adds to the conversation and the call ids; none when the workload has no segment. The
        message's text is for readers; its tokens are the call's sampled ids (it names the call)."""
        model = self.config.model
        if not model.reasoning_tokens:
            return [], []
        state = live.state
        seed, seed_rollout = live.spec.turn_seed_source(self.config.seed)
        params = SamplingParams(
            model.temperature,
            model.top_p,
            model.reasoning_tokens,
            turn_seed(seed, seed_rollout, state.next_turn, 1),
            model.top_k,
        )
        call = await self.model_call(live, [], params, None, "reasoning")
        text = self.tokenizer.decode(call.output_ids)
        return [ChatMessage("assistant", text, call_id=call.call_id)], [call.call_id]

    async def choose_action(
        self, live: LiveRollout, thoughts: list[ChatMessage], actions: list[str]
    ) -> tuple[str, ModelAnswer]:
        """The constrained call that picks one of ``actions`` (after the turn's ``thoughts``)."""
        state, model = live.state, self.config.model
        trie = self.constraint_for(actions)
        seed, seed_rollout = live.spec.turn_seed_source(self.config.seed)
        params = SamplingParams(
            model.temperature,
            model.top_p,
            model.max_tokens,
            turn_seed(seed, seed_rollout, state.next_turn),
            model.top_k,
        )
        call = await self.model_call(live, thoughts, params, trie, "action")
        return self.action_of(trie, call.output_ids), call

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
            live, lambda: live.env.astep(action, StepContext(live.spec.rollout_id, state.attempt, state.epoch, prefix))
        )

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
                log.warning(
                    "rollout %s: %s; restoring its resources from its last snapshot and %d mutations since",
                    live.spec.rollout_id,
                    lost,
                    len(state.mutations_since_export),
                )
                await live.env.arestore(state.resource_states, state.mutations_since_export, fence_epoch=state.epoch)
                live.resource_restores += 1
        raise AssertionError("unreachable")

    async def _restart_from_zero(self, live: LiveRollout, lost: RestartFromZero) -> None:
        """A new attempt from turn 0 on fresh resources, journaled after what this turn applied."""
        state = live.state
        log.warning("rollout %s restarts from turn 0 (attempt %d): %s", live.spec.rollout_id, state.next_attempt, lost)
        await self.settle(live)
        await live.env.arestore({}, [], fence_epoch=state.next_epoch)  # a fresh session; the old epoch is fenced
        started = self.start_attempt(live, resumed_from_turn=0, reason=f"restart from turn 0: {lost}")
        session = self.session_of(live)  # the new attempt's: it takes over what the turn held
        session.hold_applied(started)
        live.exports.clear()
        live.turns_since_snapshot = live.bytes_since_snapshot = 0
        session.commit()
        await session.settle(keep=0)

    async def _exports(self, live: LiveRollout) -> dict[str, bytes]:
        """The rollout's exported resource states for a snapshot. An export is reused while its
        resource's revision and fence stand still (most turns touch one resource, and every
        snapshot exports them all); a restart-only environment has none worth keeping."""
        env = live.env
        if env.recovery is Recovery.RESTART_ONLY:
            return {}
        versions = {
            rid: (r.revision, r.fenced_epoch(live.spec.rollout_id))
            for rid, r in env.resources.items()
            if r.supports_export
        }
        stale = [rid for rid, version in versions.items() if rid not in live.exports or live.exports[rid][0] != version]
        if stale:
            fresh = await self._with_resources(live, lambda: env.aexport(stale))
            for rid in stale:
                live.exports[rid] = (versions[rid], fresh[rid])
        return {rid: live.exports[rid][1] for rid in versions}

    async def _turn(self, live: LiveRollout) -> None:
        state, env = live.state, live.env
        session = self.session_of(live)
        turn = state.next_turn
        actions = env.action_space()
        if not self.config.allow_early_submit and turn + 1 < self.config.max_turns and len(actions) > 1:
            actions = [a for a in actions if a != SUBMIT]
        thoughts, call_ids = await self.reasoning(live)
        action, call = await self.choose_action(live, thoughts, actions)
        call_ids.append(call.call_id)
        observation, records = await self.run_tool_call(live, action)
        if self.config.turn_delay_ms:
            await asyncio.sleep(self.config.turn_delay_ms / 1000.0)
        for record in records:
            session.hold(mutation_event(state.header(self.writer), record))
        if records and self.signer is not None:  # anchored in the same append as the mutations it covers
            session.hold(self.head_checkpoint(live, turn))
        messages = [*thoughts, *action_messages(action, call.call_id, observation.text)]
        last = observation.done or turn + 1 >= self.config.max_turns
        reward = await self._with_resources(live, env.averify) if last else None
        if last and reward is None:  # a user environment's verify() without a return: this rollout fails
            raise TypeError(
                f"environment {live.spec.environment!r} of rollout {live.spec.rollout_id}: "
                "verify() returned None; it must return the rollout's reward (a float)"
            )
        session.end_turn_with(
            TurnCompleted(state.header(self.writer), messages, call_ids, env.revisions(), reward, [action])
        )
        result = None
        if reward is not None:  # the last turn (only its reward is verified; None there was refused above)
            outcome = outcome_of(state, env.state_digests())
            finished = session.hold(
                RolloutFinished(state.header(self.writer), reward, state.next_turn, json.dumps(outcome))
            )
            if self.sink.journals and live.spec.forked_from is None:  # a fork is a what-if, not a group's sample
                result = state.training_record(finished.header, self.config.siblings)
        live.turns_run_here += 1
        live.turns_since_snapshot += 1
        live.bytes_since_snapshot += int(call.prompt_ids.nbytes) + int(call.output_ids.nbytes) * 2
        snapshot = None
        periodic = self.config.checkpoint_mode == "snapshot" and (
            live.turns_since_snapshot >= self.config.snapshot_every_turns
            or live.bytes_since_snapshot >= self.config.snapshot_max_bytes
        )
        if self.sink.journals and (last or periodic):
            snapshot = self.snapshot_draft(live, await self._exports(live))
            live.turns_since_snapshot = live.bytes_since_snapshot = 0
        session.commit(snapshot, result, turn=turn)
        await session.settle(keep=self.config.turns_in_flight - 1, on_durable=self._on_durable(live))

    def head_checkpoint(self, live: LiveRollout, turn: int) -> RolloutEvent:
        """The signed heads of every resource of the rollout, in this life of it."""
        if self.signer is None:
            raise ValueError(
                f"rollout {live.state.rollout_id}: writer {self.writer} has no head signer (none was "
                "given, or its sink journals nothing); sign heads only with one"
            )
        return head_checkpoint(self.signer, live.state, live.env.resources, self.writer, turn)

    def _on_durable(self, live: LiveRollout) -> Callable[[int], None]:
        rollout_id = live.spec.rollout_id
        return lambda turn: self.on_durable(rollout_id, turn)

    async def settle(self, live: LiveRollout) -> None:
        """Wait until every append of the rollout (its last turn's included) is durable."""
        if live.session is not None:
            await live.session.settle(keep=0, on_durable=self._on_durable(live))
