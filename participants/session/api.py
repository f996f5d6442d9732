"""The session API: any agent loop makes its effects through a rollout session.

An agent opens a session for one rollout (``SessionFactory.open``), makes model calls and tool
calls through it, marks turn boundaries and finishes with a reward. Every effect is an event of
today's journal: a ``ModelCall`` (token ids, logprobs, lineage), a ``ResourceMutation``
(revision, idempotency key, chain hash), a ``TurnCompleted`` (the commit point of a turn).

Record and replay (Temporal's and DBOS's shape): each effect has a position ``(turn, step)``
(``step`` counts the turn's effects in program order, whatever their kind). On a resumed
attempt the same agent code runs again from its start, and at each position

- an effect the journal holds is answered from it at once, without calling the model or the
  tool, once its request's digest matches the journaled one; another request there is a
  :class:`NondeterminismError` naming the position and both requests;
- a model call cut short by the crash (its ``ModelCallProgress`` marks) continues from its
  durable prefix;
- the first effect past the journal goes live, and its answer is durable before the agent sees
  it (``durable_answers``): a crash never leaves an agent holding an answer the journal lacks.

Opening attempt N+1 fences attempt N: N's session refuses every further effect
(:class:`StaleAttemptError`), the journal's writer refuses its appends, and resources refuse its
epoch. A session writes its rollout only while the ownership routes it here.

Effects of one rollout are made one at a time (a per-session lock): positions are program order,
so concurrent calls of one rollout are serialized rather than raced for positions.

The project's own workload agent is a client too, of a lower layer of the same class: its runner
restores and fences rollouts itself (``SessionFactory.adopt``), asks with :class:`StateRequest`
(a prompt built from the state), and appends each turn whole (``durable_answers=False``:
``hold``, ``end_turn_with``, ``commit``, ``settle``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from rollout_journal.journal.errors import FencedWriteError, JournalError, writer_fenced
from rollout_journal.journal.events import (
    CONTINUATION_EXTEND,
    CONTINUATION_FIRST,
    CONTINUATION_NEW_SEQUENCE,
    Message,
    ModelCall,
    ModelCallProgress,
    RolloutEvent,
    RolloutFailed,
    RolloutFinished,
    RolloutGivenUp,
    SamplingParams,
    TrainingRecord,
    TurnCompleted,
)
from rollout_journal.journal.group_commit import CommitFuture
from rollout_journal.journal.journal import Journal
from rollout_journal.journal.restore import RestorePlan, RolloutHistory, load_rollouts
from rollout_journal.journal.snapshots import SnapshotDraft
from rollout_journal.participants.model.chat import Prompt
from rollout_journal.participants.model.constraints import TokenConstraint
from rollout_journal.participants.model.gate import ModelParticipant, TokenSink
from rollout_journal.participants.model.generation import TokenChunk
from rollout_journal.participants.resources.canonical import canonical_json, sha256_hex
from rollout_journal.participants.resources.records import MutationRecord, genesis_hash, link_hash
from rollout_journal.participants.rollout.effects import MODEL, TOOL, Effect, model_digest, sampling_json, tool_digest
from rollout_journal.participants.rollout.mutations import mutation_event
from rollout_journal.participants.rollout.restore import trusted_restore
from rollout_journal.participants.rollout.snapshot import snapshot_of
from rollout_journal.participants.rollout.state import RolloutState, StateFoldError, full_prompt, run_digest
from rollout_journal.participants.session.errors import (
    EffectNotDurableError,
    NondeterminismError,
    NotOwnerError,
    OwnerMovingError,
    RequestSummary,
    RolloutFinishedError,
    StaleAttemptError,
)
from rollout_journal.participants.session.ownership import Local, Moving, RolloutOwnership, SingleWriter
from rollout_journal.participants.session.sinks import JournalSink, TurnSink, durable

__all__ = [
    "ModelAnswer",
    "ModelRequest",
    "RolloutRef",
    "RolloutSession",
    "SessionFactory",
    "StateRequest",
    "TokenChunk",
    "ToolAnswer",
    "ToolContext",
    "ToolOutcome",
    "ToolRequest",
]

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class RolloutRef:
    """Who a rollout is; fixed by the framework and stable across restarts (README, "stable
    rollout ids"): the same job re-driven asks for the same ids."""

    rollout_id: str
    group_id: str = ""  # default: the rollout id
    sibling: int = 0
    group_size: int = 1  # siblings in its prompt group (the training record's group_size)
    topology: str = ""  # fingerprint of the agent/model/tools config it runs with

    @property
    def group(self) -> str:
        return self.group_id or self.rollout_id


@dataclass(frozen=True)
class ModelRequest:
    """One model call, token ids in. ``prompt_ids`` is the whole prompt (the journal keeps its delta
    against the parent call): the parent's prompt and sampled ids, then the new tokens, or else it
    starts a new sequence (:func:`session_prompt`); ``describe`` a short summary for error messages.
    ``layout``: the same ids as a :class:`Prompt` that says how they continue the head, for a caller
    whose prompt builder knows more than the ids show (a chat template's end-of-turn splice, a new
    sequence on purpose); None: :func:`session_prompt` reads it from the ids."""

    prompt_ids: np.ndarray
    params: SamplingParams
    constraint: TokenConstraint | None = None
    describe: str = ""
    layout: Prompt | None = None

    @classmethod
    def of(
        cls, prompt: Prompt, params: SamplingParams, constraint: TokenConstraint | None, describe: str = ""
    ) -> ModelRequest:
        """A request for ``prompt`` as its builder laid it out."""
        return cls(prompt.ids, params, constraint, describe, prompt)

    def digest(self) -> str:
        choices = getattr(self.constraint, "choices", None)
        return model_digest(self.prompt_ids, self.params, canonical_json(list(choices)) if choices else "")

    def summary(self) -> RequestSummary:
        what = self.describe or "call"
        return RequestSummary(
            MODEL, self.digest(), f"{what}, prompt {len(self.prompt_ids)} tokens, {sampling_json(self.params)}"
        )


@dataclass(frozen=True)
class StateRequest:
    """A model call whose prompt its caller derives from the rollout's state (the project's Agent:
    the conversation and the lineage head as the journal folded them). The prompt is built only when
    the call goes live: a call the journal holds at the cursor has already moved the state's head past
    its own prompt, so there it cannot be asked again, and the journaled call is checked by its
    sampling parameters alone (the prompt is the journal's by construction); ``checked=False``
    takes it as is, logging a difference (an agent for which the journal is the truth of what was
    sampled: a resume that changed the sampling on purpose keeps what its turn under way sampled)."""

    params: SamplingParams
    prompt: Callable[[], Prompt]
    constraint: TokenConstraint | None = None
    describe: str = ""
    checked: bool = True

    def request(self) -> ModelRequest:
        return ModelRequest.of(self.prompt(), self.params, self.constraint, self.describe)

    def summary(self) -> RequestSummary:
        return RequestSummary(MODEL, "", f"{self.describe or 'call'}, {sampling_json(self.params)}")


@dataclass(frozen=True)
class ModelAnswer:
    """What a model call answered: the sampled ids and their logprobs, durable in the journal."""

    call_id: str
    output_ids: np.ndarray
    logprobs: np.ndarray
    finish_reason: str
    prompt_ids: np.ndarray
    position: tuple[int, int]
    replayed: bool  # answered from the journal: nothing was generated
    continued_from: int = 0  # tokens taken from a journaled prefix of a call cut short
    new_tokens: int = 0  # tokens generated for this answer here
    ts_ms: int = 0  # when it was journaled


@dataclass(frozen=True)
class ToolRequest:
    """One tool call on a resource: ``resource`` names it within the rollout (the journal's
    resource id is ``<rollout>/<resource>``), ``op`` the tool, ``args`` its JSON arguments."""

    resource: str
    op: str
    args: Mapping[str, Any]
    kind: str = "tool"

    def args_json(self) -> str:
        return canonical_json(dict(self.args))


@dataclass(frozen=True)
class ToolContext:
    """What a live tool call's runner gets: the fence and the key to send along, and the tool calls
    this life already journaled on the same resource (to re-apply them on a server that lost them)."""

    rollout_id: str
    attempt: int
    epoch: int
    idempotency_key: str
    prev_revision: int
    journaled: list[Effect]


@dataclass(frozen=True)
class ToolOutcome:
    """What a live tool call's runner returns: its JSON-clean result (and a digest of the state
    after it, when the resource exposes one; else the result's)."""

    result: dict[str, Any]
    state_digest: str = ""


@dataclass(frozen=True)
class ToolAnswer:
    result: dict[str, Any]
    revision: int
    idempotency_key: str
    position: tuple[int, int]
    replayed: bool


ToolRunner = Callable[[ToolContext], Awaitable[ToolOutcome]]


def session_prompt(state: RolloutState, prompt_ids: np.ndarray) -> Prompt:
    """How an agent's whole prompt continues the rollout's head (token-in-token-out, issue 16): the
    first prompt, or one that starts with the whole head (what was sampled, never re-tokenized), or
    else a new sequence (an agent that re-renders its history: the training record closes the
    head's sequence there rather than splicing the two)."""
    ids = np.ascontiguousarray(prompt_ids, dtype=np.int32)
    if state.head_call_id is None:
        return Prompt(ids, 0, CONTINUATION_FIRST)
    head = state.head_tokens
    if len(ids) >= len(head) and np.array_equal(ids[: len(head)], head):
        return Prompt(ids, len(head), CONTINUATION_EXTEND)
    return Prompt(ids, 0, CONTINUATION_NEW_SEQUENCE)


def snapshot_draft(state: RolloutState, writer: str, block_bytes: int) -> SnapshotDraft:
    """A snapshot of ``state`` covering every event applied to it (no resource exports: a session's
    resources live behind their own servers, their calls in the journal), by the aggregate's one
    rule, as the agent's are: a given-up rollout's last snapshot is final too (``block_bytes``: the
    journal's ``snapshot_block_bytes``)."""
    draft = snapshot_of(state, {}, writer, block_bytes)
    state.record_exports({})
    return draft


class RolloutSession:
    """One attempt of one rollout. Every effect goes through it, in program order."""

    def __init__(self, factory: SessionFactory, ref: RolloutRef, state: RolloutState, *, writes: bool) -> None:
        self.factory = factory
        self.ref = ref
        self.state = state
        self.attempt, self.epoch = state.attempt, state.epoch
        self.writes = writes  # False: a finished rollout re-driven: replay only
        self.turn = 0
        self.step = 0
        self.model_index = 0  # model calls so far in the cursor's turn (the call id's c<i>)
        self.replayed_calls = 0
        self.live_calls = 0
        self.regenerated_tokens = 0  # tokens generated here for a position the journal held (never, by design)
        self._lock = asyncio.Lock()
        self._stale: StaleAttemptError | None = None
        self._broken: BaseException | None = None
        # appends not yet known durable, oldest first, each with the turn it ends (None: none ends there)
        self._pending: deque[tuple[Future[Any], int | None]] = deque()
        self.held: list[RolloutEvent] = []  # applied to the state, not yet handed to the journal
        self._turns_since_snapshot = 0
        self._effect: asyncio.Task[Any] | None = None  # the task making an effect now (cancelled when fenced)
        self._fence_cancelled: asyncio.Task[Any] | None = None  # the effect a fence cancelled (see _one_effect)
        self.first_replay_s: float | None = None  # monotonic times: the first effect answered from the journal,
        self.first_live_s: float | None = None  # and the first one made live (how fast a re-drive catches up)

    # -- where the cursor stands ------------------------------------------------------
    @property
    def rollout_id(self) -> str:
        return self.ref.rollout_id

    @property
    def position(self) -> tuple[int, int]:
        return self.turn, self.step

    @property
    def committed_turns(self) -> int:
        return self.state.next_turn

    @property
    def replaying(self) -> bool:
        """Whether the cursor is still inside what the journal holds."""
        return self.turn < self.state.next_turn or self.state.effects.at(self.turn, self.step) is not None

    def fast_forward(self) -> int:
        """Skip the committed turns (an agent that restores its own continuation from the state, as the
        project's Agent does); the effects journaled in the turn under way still replay. Returns the turn."""
        self.turn, self.step, self.model_index = self.state.next_turn, 0, 0
        return self.turn

    def skip_journaled(self) -> None:
        """Step the cursor past every effect the journal holds in its turn (an agent that outlived
        the process serving it asks for what follows them)."""
        effects = self.state.effects.in_turn(self.turn)
        self.step, self.model_index = len(effects), sum(1 for e in effects if e.kind == MODEL)

    def skip_to_end(self) -> Effect | None:
        """Step the cursor past everything the journal holds (an agent that outlived the process serving
        it goes on where it was); returns the last journaled effect, which the agent may be retrying."""
        state = self.state
        effects = state.effects.all()
        if not effects:
            return None
        last = effects[-1]
        if last.turn >= state.next_turn:  # the turn under way: past its journaled effects
            self.turn = last.turn
            self.skip_journaled()
        else:
            self.fast_forward()
        return last

    @property
    def fresh(self) -> bool:
        """Nothing made or replayed through this session yet."""
        return self.replayed_calls == 0 and self.live_calls == 0 and self.position == (0, 0)

    def status(self) -> dict[str, Any]:
        s = self.state
        return {
            "rollout": self.rollout_id,
            "group": self.ref.group,
            "attempt": self.attempt,
            "epoch": self.epoch,
            "committed_turns": s.next_turn,
            "cursor": [self.turn, self.step],
            "replaying": self.replaying,
            "finished": s.finished,
            "given_up": s.given_up,
            "reward": s.reward,
            "effects": len(s.effects),
            "replayed_calls": self.replayed_calls,
            "live_calls": self.live_calls,
            "stale": self._stale is not None,
        }

    # -- effects ----------------------------------------------------------------------
    async def model_call(
        self, request: ModelRequest | StateRequest, *, on_tokens: TokenSink | None = None
    ) -> ModelAnswer:
        """The model call at the cursor: from the journal if it holds it (digest checked), else live;
        the answer is durable before this returns."""
        return await self._one_effect(self._model_call(request, on_tokens))

    async def tool_call(self, request: ToolRequest, run: ToolRunner) -> ToolAnswer:
        """The tool call at the cursor: from the journal if it holds it (digest checked), else ``run``
        (live) and journaled as a ``ResourceMutation`` before this returns."""
        return await self._one_effect(self._tool_call(request, run))

    async def _one_effect(self, effect: Awaitable[T]) -> T:
        """Run one effect under the session's lock; a fence while it runs cancels it (nothing of it
        that was not yet handed to the journal is applied)."""
        async with self._lock:
            task = self._effect = asyncio.current_task()
            try:
                return await effect
            except asyncio.CancelledError:
                # Only the fence's own cancellation becomes the stale-attempt error, taken back so none
                # stays pending on the task; one from outside as well (a shutdown) stays a cancellation.
                stale = self._stale
                if stale is not None and task is not None and self._fence_cancelled is task and task.uncancel() == 0:
                    raise stale from None
                raise
            finally:
                self._effect = self._fence_cancelled = None

    async def _model_call(self, asked: ModelRequest | StateRequest, on_tokens: TokenSink | None) -> ModelAnswer:
        self._check_usable()
        state, (turn, step) = self.state, self.position
        entry = state.effects.at(turn, step)
        if entry is not None:
            if isinstance(asked, StateRequest):
                self._check_sampling(entry, asked)
                prompt_ids = _held_prompt(state.head_tokens, entry)  # the journal's (see StateRequest)
            else:
                self._check_same(entry, MODEL, asked.summary(), lambda: self._first_model_difference(entry, asked))
                prompt_ids = asked.prompt_ids
            ids, logprobs = entry.answer
            self._advance(model=True, replayed=True)
            self.replayed_calls += 1
            answer = ModelAnswer(
                entry.ref, ids, logprobs, entry.finish_reason, prompt_ids, (turn, step), True, ts_ms=entry.ts_ms
            )
            if on_tokens is not None and len(ids):
                await on_tokens(TokenChunk(ids, logprobs))
            return answer
        unlogged = None if state.effects.known else state.journaled_call(self.model_index)
        if unlogged is not None:  # a state restored from a snapshot older than the effect log: the journal's, unchecked
            self._advance(model=True, replayed=True)
            self.replayed_calls += 1
            return _answer_of(unlogged, np.zeros(0, dtype=np.int32), (turn, step), replayed=True)
        request = asked.request() if isinstance(asked, StateRequest) else asked
        summary = request.summary()  # its digest is journaled with the call: hashed once
        self._check_live(summary)
        call_index = self.model_index
        call_id = f"{self.rollout_id}/a{self.attempt}/t{turn}/c{call_index}"
        config = self.factory
        progress = self._progress if config.progress_every_tokens > 0 else None
        partial = state.partial_call(call_index, request.prompt_ids, request.params)
        continued = len(partial.output_ids) if partial is not None else 0
        result = await config.model.call(
            state,
            request.layout if request.layout is not None else session_prompt(state, request.prompt_ids),
            request.params,
            request.constraint,
            call_id,
            writer=config.writer,
            call_index=call_index,
            on_progress=progress,
            progress_every=config.progress_every_tokens,
            progress_interval_s=config.progress_min_interval_ms / 1000.0,
            on_tokens=on_tokens,
            request_sha256=summary.digest,
        )
        self._check_usable()  # fenced while it generated: nothing of it is applied or written
        if result.replayed:  # the gate found it in the turn under way (the log was not told): same answer
            raise StateFoldError(
                f"rollout {self.rollout_id}: call {call_id} is journaled but not in the effect log; reopen the rollout"
            )
        event = result.event
        if config.durable_answers:
            self._apply_and_send([event], what=f"model call {call_id}")
            await self._settle(f"model call {call_id}")
        else:  # the caller makes it durable with its turn (see ``commit``)
            self.hold(event)
        self._advance(model=True)
        self.live_calls += 1
        return _answer_of(
            event,
            request.prompt_ids,
            (turn, step),
            replayed=False,
            continued_from=continued,
            new_tokens=result.new_tokens,
        )

    async def _tool_call(self, request: ToolRequest, run: ToolRunner) -> ToolAnswer:
        self._check_usable()
        state, (turn, step) = self.state, self.position
        resource_id = f"{self.rollout_id}/{request.resource}"
        args_json = request.args_json()
        summary = RequestSummary(
            TOOL, tool_digest(resource_id, request.op, args_json), f"{request.resource}.{request.op}({args_json[:200]})"
        )
        entry = state.effects.at(turn, step)
        if entry is not None:
            self._check_same(entry, TOOL, summary, lambda: _tool_difference(entry, request.op, args_json))
            self._advance(model=False, replayed=True)
            self.replayed_calls += 1
            return ToolAnswer(json.loads(entry.result_json), entry.revision, entry.ref, (turn, step), replayed=True)
        self._check_live(summary)
        key = f"{self.rollout_id}/t{turn}/s{step}"
        journaled = [e for e in state.effects.all() if e.kind == TOOL and e.resource_id == resource_id]
        prev = journaled[-1].revision if journaled else 0
        prev_hash = self._chain_head(resource_id)
        outcome = await run(ToolContext(self.rollout_id, self.attempt, self.epoch, key, prev, journaled))
        self._check_usable()
        result = outcome.result
        payload: dict[str, Any] = {
            "resource_id": resource_id,
            "kind": request.kind,
            "op": request.op,
            "args": json.loads(args_json),
            "idempotency_key": key,
            "prev_revision": prev,
            "revision": prev + 1,
            "result": result,
            "state_digest": outcome.state_digest or sha256_hex(canonical_json(result)),
            "rollout_id": self.rollout_id,
            "attempt": self.attempt,
            "epoch": self.epoch,
        }
        record = MutationRecord(chain_hash=link_hash(prev_hash, payload), **payload)
        event = mutation_event(state.header(self.factory.writer), record)
        self._apply_and_send([event], what=f"tool call {key}")
        await self._settle(f"tool call {key}")
        self._advance(model=False)
        self.live_calls += 1
        return ToolAnswer(result, prev + 1, key, (turn, step), replayed=False)

    async def end_turn(
        self, messages: Sequence[Message], *, actions: Sequence[str] = (), reward: float | None = None
    ) -> None:
        """The turn at the cursor is over: ``TurnCompleted`` (its commit point) with the messages it
        added. A turn the journal already holds is only stepped over."""
        async with self._lock:
            self._check_usable()
            self._end_turn(messages, actions, reward)

    def end_turn_with(self, event: TurnCompleted) -> TurnCompleted:
        """End the turn at the cursor with the caller's own ``TurnCompleted`` (its environment's
        revisions, its actions), held for the next :meth:`commit`; the same checks as :meth:`end_turn`."""
        self._check_usable()
        self._check_turn_over()
        self.hold(event)
        self.turn, self.step, self.model_index = self.turn + 1, 0, 0
        return event

    def _check_turn_over(self) -> None:
        """The turn at the cursor may end: the journal holds no more of its effects, and it is not committed."""
        state, turn = self.state, self.turn
        leftover = state.effects.at(turn, self.step)
        if leftover is not None:
            raise NondeterminismError(
                self.rollout_id,
                self.attempt,
                self.epoch,
                (turn, self.step),
                RequestSummary(leftover.kind, leftover.digest, leftover.ref),
                RequestSummary("turn end", "", f"end of turn {turn}"),
                f"the journal holds {len(state.effects.in_turn(turn)) - self.step} more effect(s) in turn {turn}",
                leftover.ref,
                leftover.attempt,
            )
        self._check_live(RequestSummary("turn end", "", f"end of turn {turn}"))

    def _end_turn(
        self, messages: Sequence[Message], actions: Sequence[str], reward: float | None, *, final: bool = False
    ) -> list[RolloutEvent]:
        state, turn = self.state, self.turn
        if turn < state.next_turn:  # committed: a re-driven agent passing it again
            self.turn, self.step, self.model_index = turn + 1, 0, 0
            return []
        self._check_turn_over()
        effects = state.effects.in_turn(turn)
        call_ids = [e.ref for e in effects if e.kind == MODEL]
        event = TurnCompleted(
            state.header(self.factory.writer), list(messages), call_ids, self._revisions(), reward, list(actions)
        )
        self._turns_since_snapshot += 1
        self.turn, self.step, self.model_index = turn + 1, 0, 0
        if final:
            return [event]
        due = self._turns_since_snapshot >= self.factory.snapshot_every_turns
        self._apply_and_send([event], what=f"the end of turn {turn}", snapshot=due)
        return [event]

    async def finish(
        self, reward: float, *, messages: Sequence[Message] = (), outcome: Mapping[str, Any] | None = None
    ) -> TrainingRecord | None:
        """The rollout is done: the turn at the cursor ends (with ``messages``) unless the agent ended it,
        then ``RolloutFinished`` and the training record, in one commit. Finishing a finished rollout
        again (a re-driven agent) returns at once."""
        async with self._lock:
            self._check_usable()
            state = self.state
            if state.finished:
                return None
            self._check_live(RequestSummary("finish", "", f"finish with reward {reward}"))
            if state.effects.in_turn(self.turn) or messages:  # the turn under way ends with the rollout
                for event in self._end_turn(messages, (), reward, final=True):
                    self.hold(event)
            header = state.header(self.factory.writer)
            done = {"reward": reward, "turns": state.next_turn, **dict(outcome or {})}
            finished = self.hold(RolloutFinished(header, float(reward), state.next_turn, json.dumps(done)))
            result = state.training_record(finished.header, self.ref.group_size) if state.lineage is not None else None
            self._send(what="the rollout's finish", snapshot=True, result=result)
            await self._settle("the rollout's finish")
            self.factory.finished(self.rollout_id)
            return result

    async def fail(self, error: str, reason: str) -> None:
        """The attempt stops on an infrastructure failure (not a result): ``RolloutFailed``; a later
        attempt retries it."""
        async with self._lock:
            self._check_usable()
            event = RolloutFailed(self.state.header(self.factory.writer), error, reason)
            self._apply_and_send([event], what="the rollout's failure")
            await self._settle("the rollout's failure")

    async def give_up(self, error: str, reason: str, *, group_policy: str = "drop") -> TrainingRecord | None:
        """The rollout ends for good without a result (the agent's retry budget is spent):
        ``RolloutGivenUp``, a final snapshot and its given-up training record in one commit, so the
        trainer feed resolves its group by ``group_policy`` (``drop``; ``redispatch``: the caller
        runs a replacement group) instead of waiting for it forever. Returns the record; giving up
        a finished or given-up rollout again returns None at once."""
        if group_policy not in ("drop", "redispatch"):
            raise ValueError(f"group_policy {group_policy!r}: expected 'drop' or 'redispatch'")
        async with self._lock:
            self._check_usable()
            state = self.state
            if state.terminal:
                return None
            event = self.hold(RolloutGivenUp(state.header(self.factory.writer), state.failures, error, reason))
            result = state.given_up_record(event.header, self.ref.group_size, group_policy)
            self._send(what="the rollout's give-up", snapshot=True, result=result)
            await self._settle("the rollout's give-up")
            self.factory.finished(self.rollout_id)
            return result

    async def close(self) -> None:
        """Wait until every append of this session is durable."""
        async with self._lock:
            if self._broken is None and self._stale is None:
                await self._settle("the session's last appends")

    # -- inside ------------------------------------------------------------------------
    def _advance(self, *, model: bool, replayed: bool = False) -> None:
        now = time.monotonic()
        if replayed and self.first_replay_s is None:
            self.first_replay_s = now
        if not replayed and self.first_live_s is None:
            self.first_live_s = now
        self.step += 1
        if model:
            self.model_index += 1

    def _check_usable(self) -> None:
        if self._stale is not None:
            raise self._stale
        if self._broken is not None:
            raise EffectNotDurableError(self.rollout_id, "an earlier effect of this session", self._broken)
        current = self.factory.sessions.get(self.rollout_id)
        if current is not self and current is not None:
            self.fence(current.epoch, by=f"attempt {current.attempt}")
            raise self._stale  # type: ignore[misc]
        route = self.factory.ownership.route(self.rollout_id)
        if isinstance(route, Moving):
            raise OwnerMovingError(self.rollout_id, route.retry_after_s)
        if not isinstance(route, Local):
            raise NotOwnerError(self.rollout_id, route.base_url, route.member)

    def _check_live(self, now: RequestSummary) -> None:
        """The cursor is past the journal: an effect here goes live, if the rollout takes one."""
        state, (turn, step) = self.state, self.position
        if state.terminal or not self.writes:  # finished or given up: nothing more runs of it
            raise RolloutFinishedError(self.rollout_id, state.next_turn, state.reward)
        if turn < state.next_turn:
            raise NondeterminismError(
                self.rollout_id, self.attempt, self.epoch, (turn, step), None, now,
                f"committed turn {turn} holds {len(state.effects.in_turn(turn))} effect(s)",
            )  # fmt: skip

    def _check_same(self, entry: Effect, kind: str, now: RequestSummary, difference: Callable[[], str]) -> None:
        if entry.kind == kind and entry.digest == now.digest:
            return
        journaled = RequestSummary(entry.kind, entry.digest, _describe(entry))
        what = f"journaled a {entry.kind} call, now a {kind} call" if entry.kind != kind else difference()
        raise NondeterminismError(
            self.rollout_id, self.attempt, self.epoch, self.position, journaled, now, what, entry.ref, entry.attempt
        )

    def _check_sampling(self, entry: Effect, asked: StateRequest) -> None:
        sampling = sampling_json(asked.params)
        if entry.kind == MODEL and entry.sampling == sampling:
            return
        if entry.kind == MODEL and not asked.checked:
            log.warning(
                "rollout %s: journaled call %s sampled with %s; this attempt would sample with %s: the journal's is kept",
                self.rollout_id, entry.ref, entry.sampling, sampling,
            )  # fmt: skip
            return
        journaled = RequestSummary(entry.kind, entry.digest, _describe(entry))
        what = (
            f"journaled a {entry.kind} call, now a {MODEL} call"
            if entry.kind != MODEL
            else f"sampling (journaled {entry.sampling}, now {sampling})"
        )
        raise NondeterminismError(
            self.rollout_id, self.attempt, self.epoch, self.position, journaled, asked.summary(), what, entry.ref,
            entry.attempt,
        )  # fmt: skip

    def _first_model_difference(self, entry: Effect, request: ModelRequest) -> str:
        now = np.asarray(request.prompt_ids)
        then = self._journaled_prompt(entry)
        if then is not None:
            n = min(len(then), len(now))
            diff = np.flatnonzero(then[:n] != now[:n])
            if diff.size:
                i = int(diff[0])
                return f"prompt token {i} (journaled {int(then[i])}, now {int(now[i])})"
            if len(then) != len(now):
                return f"prompt length (journaled {len(then)} tokens, now {len(now)})"
        if entry.sampling != sampling_json(request.params):
            return f"sampling (journaled {entry.sampling}, now {sampling_json(request.params)})"
        return "the constraint or another part of the request"

    def _journaled_prompt(self, entry: Effect) -> np.ndarray | None:
        """The whole prompt of a journaled call, read back from the journal (an error's detail only:
        the effect log keeps its digest, not its ids)."""
        folded = RolloutState(self.rollout_id, self.ref.group)
        journal = self.factory.journal
        if journal is None:
            return None
        try:
            for item in journal.read_rollout(self.rollout_id):
                event = item.event
                if isinstance(event, ModelCall) and event.call_id == entry.ref:
                    return full_prompt(folded.head_tokens, event)
                folded.apply(event)
        except (JournalError, StateFoldError) as exc:
            log.warning("rollout %s: could not read call %s back: %s", self.rollout_id, entry.ref, exc)
        return None

    # -- a client that builds its turns' events itself (the project's Agent) ---------------
    def hold(self, event: RolloutEvent) -> RolloutEvent:
        """Apply ``event`` to the rollout's state and hold it for the next :meth:`commit`."""
        self.state.apply(event)
        self.held.append(event)
        return event

    def hold_applied(self, events: Sequence[RolloutEvent]) -> None:
        """Hold events the state has applied already (an attempt's start builds and applies its own)."""
        self.held.extend(events)

    def commit(
        self, snapshot: SnapshotDraft | None = None, result: TrainingRecord | None = None, *, turn: int | None = None
    ) -> Future[Any]:
        """Hand every held event (with ``snapshot`` and ``result``) to the journal in one append, without
        waiting (:meth:`settle` waits; the journal commits appends in order, so a later one is never
        durable without an earlier one); ``turn``: the turn this append ends. Errors are the journal's own."""
        future = self.factory.sink.submit(self.held, snapshot, result)
        self.held = []  # handed to the journal: a failure from here on journals nothing of it twice
        self._pending.append((future, turn))
        return future

    async def settle(self, keep: int = 0, on_durable: Callable[[int], None] | None = None) -> None:
        """Wait (oldest first) until at most ``keep`` appends are not yet durable, calling
        ``on_durable(turn)`` for each durable one that ended a turn. Errors are the journal's own."""
        while len(self._pending) > keep:
            future, turn = self._pending[0]
            await durable(future)
            self._pending.popleft()
            if turn is not None and on_durable is not None:
                on_durable(turn)

    def carry_over(self, older: RolloutSession) -> None:
        """Take over what ``older`` (this rollout's previous attempt in this process) held and had
        not yet seen durable: its appends are this one's to wait for."""
        self.held, older.held = [*older.held, *self.held], []
        self._pending.extendleft(reversed(older._pending))
        older._pending.clear()

    # -- inside: appends ---------------------------------------------------------------
    def _progress(self, event: ModelCallProgress) -> None:
        self._check_usable()  # a fenced attempt's mark is refused before it touches the state
        self.hold(event)
        # The turn's held events go first (their seqs come first): a reasoning call before a
        # free-form action is still held when the action marks progress.
        future = self.commit()
        if isinstance(future, CommitFuture):
            future.hasten()  # a mark still lingering when the process dies is lost: commit it now

    def _apply_and_send(self, events: list[RolloutEvent], *, what: str, snapshot: bool = False) -> None:
        for event in events:
            self.hold(event)
        self._send(what=what, snapshot=snapshot)

    def _send(self, *, what: str, snapshot: bool = False, result: TrainingRecord | None = None) -> None:
        """Hand the held events to the journal; any failure breaks the session (its state is ahead of
        the journal now: the factory reloads the rollout from the journal on the next open)."""
        draft = None
        if snapshot:
            draft = snapshot_draft(self.state, self.factory.writer, self.factory.sink.snapshot_block_bytes)
            self._turns_since_snapshot = 0
        try:
            self.commit(draft, result)
        except BaseException as exc:
            raise self._failed(what, exc) from exc

    async def _settle(self, what: str) -> None:
        """Wait until every append of this session is durable; a failed one breaks the session."""
        try:
            await self.settle(0)
        except BaseException as exc:
            raise self._failed(what, exc) from exc

    def _failed(self, what: str, exc: BaseException) -> BaseException:
        if isinstance(exc, asyncio.CancelledError):
            if self._stale is None:  # not a fence: what it appended may or may not be durable
                self._broken = exc
                self.factory.forget(self.rollout_id, self)
            return exc
        if isinstance(exc, FencedWriteError):
            self.fence(exc.current_epoch, by="a newer attempt in this journal")
            return self._stale  # type: ignore[return-value]
        self._broken = exc
        self.factory.forget(self.rollout_id, self)
        if writer_fenced(exc) and isinstance(self.factory.ownership, SingleWriter):
            self.factory.ownership.fenced(f"another writer took the namespace over: {exc}")
            return NotOwnerError(self.rollout_id, None)
        return EffectNotDurableError(self.rollout_id, what, exc)

    def fence(self, current_epoch: int, *, by: str = "") -> None:
        """This attempt was superseded: refuse every further effect, and cancel the one under way."""
        if self._stale is None:
            self._stale = StaleAttemptError(self.rollout_id, self.attempt, self.epoch, current_epoch, by)
            if self._effect is not None and self._effect is not asyncio.current_task():
                self._fence_cancelled = self._effect
                self._effect.cancel()

    def _revisions(self) -> dict[str, int]:
        revisions: dict[str, int] = {}
        for e in self.state.effects.all():
            if e.kind == TOOL:
                revisions[e.resource_id] = e.revision
        return revisions

    def _chain_head(self, resource_id: str) -> str:
        head = genesis_hash(resource_id)
        for m in self.state.mutations_since_export:
            if m.resource_id == resource_id:
                head = m.chain_hash
        return head


def _answer_of(
    event: ModelCall,
    prompt_ids: np.ndarray,
    position: tuple[int, int],
    *,
    replayed: bool,
    continued_from: int = 0,
    new_tokens: int = 0,
) -> ModelAnswer:
    """A journaled (or just made) call as its answer."""
    return ModelAnswer(
        event.call_id,
        np.asarray(event.output_ids, dtype=np.int32),
        np.asarray(event.logprobs, dtype=np.float32),
        event.finish_reason,
        prompt_ids,
        position,
        replayed,
        continued_from,
        new_tokens,
        event.header.ts_ms,
    )


def _held_prompt(head: np.ndarray, entry: Effect) -> np.ndarray:
    """A journaled call's whole prompt, a view of the head where the head still holds the call right
    after its prompt (the common case: the call extends its parent, or started the head's sequence);
    else empty (a later call of the conversation started a new sequence)."""
    ids, start = entry.answer[0], entry.prompt_len
    if (
        entry.out_start == start
        and start + len(ids) <= len(head)
        and np.array_equal(head[start : start + len(ids)], ids)
    ):
        return head[:start]
    return np.zeros(0, dtype=np.int32)


def _describe(entry: Effect) -> str:
    if entry.kind == MODEL:
        return f"call, prompt {entry.prompt_len} tokens, {entry.sampling}"
    return f"{entry.resource_id.rsplit('/', 1)[-1]}.{entry.op}({entry.args_json[:200]})"


def _tool_difference(entry: Effect, op: str, args_json: str) -> str:
    if entry.op != op:
        return f"tool (journaled {entry.op}, now {op})"
    return f"arguments (journaled {entry.args_json[:200]}, now {args_json[:200]})"


@dataclass
class _Known:
    """A rollout this process may write: its history (folded on first open) or its state; neither
    (``reload``) when a failed write left what this process held ahead of the journal."""

    history: RolloutHistory | None = None
    state: RolloutState | None = None
    reload: bool = False


class SessionFactory:
    """Opens rollout sessions over one journal, one model participant and one ownership.

    ``start()`` reads what the journal holds (the snapshot stream to its end, the events since each
    snapshot) once; after that this process is the only writer of the rollouts it owns, so its
    states are the journal's. ``open`` begins a new attempt (the fence) unless the rollout is
    finished (a re-driven agent is then answered from the journal alone).

    A client that restores and fences its rollouts itself (the project's runner) takes sessions
    over states it started with :meth:`adopt` instead, and may run with no journal at all (its
    overhead baseline: ``sink`` a :class:`NullSink`)."""

    def __init__(
        self,
        journal: Journal | None,
        model: ModelParticipant,
        *,
        writer: str,
        ownership: RolloutOwnership | None = None,
        sink: TurnSink | None = None,
        durable_answers: bool = True,
        snapshot_every_turns: int = 4,
        progress_every_tokens: int = 0,
        progress_min_interval_ms: float = 0.0,
        keep_finished: int = 1024,
    ) -> None:
        """``keep_finished``: finished rollouts whose state stays in memory (the oldest beyond are
        read back from the journal if a re-driven agent asks for them again). ``sink``: where appends
        go (default: the journal). ``durable_answers``: a live model call's answer is durable before the
        agent sees it; False leaves it held for the agent's own :meth:`RolloutSession.commit` (an
        agent whose redone turn asks the same calls again, and gets the same answers: the project's
        Agent on a bit-deterministic backend)."""
        if journal is None and (sink is None or ownership is None):
            raise ValueError("a session factory without a journal needs a sink and an ownership")
        self.journal = journal
        self.sink: TurnSink = sink if sink is not None else JournalSink(self._journal_of(journal))
        self.durable_answers = durable_answers
        self.model = model
        self.writer = writer
        self.ownership: RolloutOwnership = (
            ownership if ownership is not None else SingleWriter(self._journal_of(journal))
        )
        self.snapshot_every_turns = max(1, snapshot_every_turns)
        self.progress_every_tokens = progress_every_tokens
        self.progress_min_interval_ms = progress_min_interval_ms
        self.sessions: dict[str, RolloutSession] = {}
        self._known: dict[str, _Known] = {}
        self._acknowledged: set[str] = set()
        self._finished: OrderedDict[str, None] = OrderedDict()
        self.keep_finished = keep_finished
        self._started = False
        self.ownership.on_lost(self._lost)
        self.ownership.on_taken(self._taken)

    @staticmethod
    def _journal_of(journal: Journal | None) -> Journal:
        if journal is None:
            raise ValueError("this session factory has no journal (its sessions are adopted; none is opened)")
        return journal

    @property
    def journaled(self) -> Journal:
        """The journal (a factory without one opens no session and reads nothing back)."""
        return self._journal_of(self.journal)

    def adopt(self, ref: RolloutRef, state: RolloutState) -> RolloutSession:
        """A session over ``state``, whose current attempt the caller restored, started and journaled
        itself (the project's runner: its restore rebuilds environments too). The session is not this
        factory's to route or fence (the caller's ownership decides); its cursor stands at the turn
        under way, and the effects journaled there replay."""
        session = RolloutSession(self, ref, state, writes=not state.terminal)
        session.fast_forward()
        return session

    def start(self) -> None:
        """Read the rollouts the journal holds (blocking: call it before serving). Under an ownership
        of some partitions only, nothing: each partition's rollouts arrive as it is taken."""
        if self.ownership.whole_namespace:
            plan = load_rollouts(self.journaled)
            for rollout_id, history in plan.rollouts.items():
                self._known[rollout_id] = _Known(history=history)
            self._acknowledged = set(plan.acknowledged)
        self._started = True

    def known(self, rollout_id: str) -> bool:
        return rollout_id in self._known or rollout_id in self._acknowledged

    def state_of(self, rollout_id: str) -> RolloutState | None:
        """The rollout's state as this process knows it (folded on first use); None if unknown."""
        if not self._started:
            self.start()
        known = self._known.get(rollout_id)
        if known is None:
            return None
        if known.reload:
            history = reload_one(self.journaled, rollout_id)
            if history is None:
                del self._known[rollout_id]
                return None
            known.history, known.reload = history, False
        if known.state is None:
            assert known.history is not None
            known.state = self._fold(known.history)
            known.history = None
        return known.state

    def _fold(self, history: RolloutHistory) -> RolloutState:
        # a snapshot an older version wrote keeps no effect log: then from the rollout's first event
        return trusted_restore(self.journaled, history, needs_effects=True)[1]

    async def open(
        self,
        ref: RolloutRef,
        *,
        reason: str = "",
        restart_from_zero: bool = False,
        messages: Sequence[Message] = (),
        run_key: str | None = None,
    ) -> RolloutSession:
        """A session for ``ref``: attempt 1 of a new rollout, attempt N+1 (fencing N) of an unfinished
        one, or a replay-only session of a finished (or given-up) one. Returns once the new attempt
        is durable.
        ``restart_from_zero`` begins a new life (its earlier effects are never replayed);
        ``messages``: the conversation a new life starts with; ``run_key``: the agent run the
        attempt serves, journaled as its digest (``RolloutState.run_standing`` reads it back)."""
        rollout_id = ref.rollout_id
        route = self.ownership.route(rollout_id)
        if isinstance(route, Moving):
            raise OwnerMovingError(rollout_id, route.retry_after_s)
        if not isinstance(route, Local):
            raise NotOwnerError(rollout_id, route.base_url, route.member)
        if rollout_id in self._acknowledged:
            raise RolloutFinishedError(rollout_id, 0, None)
        state = self.state_of(rollout_id)
        old = self.sessions.get(rollout_id)
        if state is not None and state.terminal:  # finished or given up: its calls replay, none runs
            session = RolloutSession(self, ref, state, writes=False)
            self._install(session, old)
            return session
        if old is not None:  # its in-flight effect must not touch the state the new attempt builds on
            old.fence(state.next_epoch if state is not None else 1, by="a newer attempt opened here")
            async with old._lock:
                pass
            state = self.state_of(rollout_id)  # a broken old session was forgotten: reloaded from the journal
        new = state is None
        if state is None:
            state = RolloutState(rollout_id, ref.group)
        run = run_digest(run_key) if run_key is not None else None
        events = self._start_attempt(ref, state, reason, restart_from_zero or new, messages, run)
        session = RolloutSession(self, ref, state, writes=True)
        draft = (
            snapshot_draft(state, self.writer, self.sink.snapshot_block_bytes) if new else None
        )  # registers it in the compacted stream
        try:
            await durable(self.sink.submit(events, draft))
        except BaseException as exc:
            self.forget(rollout_id, None)
            if writer_fenced(exc) and isinstance(self.ownership, SingleWriter):
                self.ownership.fenced(f"another writer took the namespace over: {exc}")
                raise NotOwnerError(rollout_id, None) from exc
            if isinstance(exc, JournalError):
                raise EffectNotDurableError(rollout_id, f"attempt {state.attempt}'s start", exc) from exc
            raise
        self._known[rollout_id] = _Known(state=state)
        self._install(session, old)
        return session

    def _install(self, session: RolloutSession, old: RolloutSession | None) -> None:
        if old is not None:
            old.fence(session.epoch, by=f"attempt {session.attempt}")
        self.sessions[session.rollout_id] = session

    def _start_attempt(
        self,
        ref: RolloutRef,
        state: RolloutState,
        reason: str,
        from_zero: bool,
        messages: Sequence[Message],
        run: str | None = None,
    ) -> list[RolloutEvent]:
        resumed = 0 if from_zero else state.next_turn
        why = reason or ("new rollout" if not state.attempt else f"resume at turn {resumed}")
        return state.start_attempt(
            self.writer,
            resumed_from_turn=resumed,
            topology=ref.topology,
            reason=why,
            messages=messages if from_zero else (),
            run=run,
        )

    def finished(self, rollout_id: str) -> None:
        """A rollout finished: beyond ``keep_finished``, the oldest finished state leaves memory."""
        self._finished[rollout_id] = None
        self._finished.move_to_end(rollout_id)
        while len(self._finished) > self.keep_finished:
            old, _ = self._finished.popitem(last=False)
            self.sessions.pop(old, None)
            self._known[old] = _Known(reload=True)

    def forget(self, rollout_id: str, session: RolloutSession | None) -> None:
        """Drop what this process holds of a rollout (a failed append left it ahead of the journal):
        the next open reads it from the journal again."""
        if session is None or self.sessions.get(rollout_id) is session:
            self.sessions.pop(rollout_id, None)
        self._known[rollout_id] = _Known(reload=True)

    def _lost(self, partitions: set[int]) -> None:
        """This process may no longer write ``partitions``: their sessions are closed (fenced, an
        effect under way cancelled) and what it knew of their rollouts forgotten; the next owner
        restores them from the journal."""
        for rollout_id, session in list(self.sessions.items()):
            if self.journaled.partition_of(rollout_id) in partitions:
                session.fence(session.state.next_epoch, by="the owner that took its partition")
                del self.sessions[rollout_id]
        for rollout_id in [r for r in self._known if self.journaled.partition_of(r) in partitions]:
            del self._known[rollout_id]
        self._acknowledged = {r for r in self._acknowledged if self.journaled.partition_of(r) not in partitions}

    def _taken(self, partition: int, plan: RestorePlan) -> None:
        """This process took ``partition``: its rollouts are what ``plan`` read from the journal."""
        self._lost({partition})  # whatever was known of it from an earlier time here is stale
        for rollout_id, history in plan.rollouts.items():
            self._known[rollout_id] = _Known(history=history)
        self._acknowledged |= set(plan.acknowledged)


def reload_one(journal: Journal, rollout_id: str) -> RolloutHistory | None:
    """One rollout's history as restore finds it (None: the journal holds none)."""
    from rollout_journal.journal.restore import reload_rollout

    history = reload_rollout(journal, rollout_id, ())
    if history.snapshot is None and not history.events:
        return None
    return history
