"""The timeline a report draws: one rollout's attempts and turns, the crash points, the
turns each attempt reused and the ones a restart threw away.

(Interim: the replay-commands branch brings ``replay show``'s timeline structure; once it
lands the report draws that one and this module goes.)

Everything is derived by applying the rollout's events to its ``RolloutState``, the one
fold: where a new life begins is ``starts_over``, the conversation is the fold's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from journal.events import (
    AttemptStarted,
    HeadCheckpoint,
    Message,
    ModelCall,
    ResourceMutation,
    TurnCompleted,
)
from journal.journal import JournaledEvent
from participants.rollout_state import RolloutState

__all__ = ["AttemptView", "CallView", "MutationView", "RolloutTimeline", "TurnView", "build_timeline"]


@dataclass(frozen=True)
class CallView:
    call_id: str
    parent_call_id: str | None
    policy_version: str
    prompt_tokens: int
    output_tokens: int
    logprob: float


@dataclass(frozen=True)
class MutationView:
    resource_id: str
    op: str
    args_json: str
    prev_revision: int
    revision: int


@dataclass
class TurnView:
    """One committed turn."""

    turn: int
    attempt: int
    epoch: int
    life: int
    location: str
    ts_ms: int
    messages: list[Message]
    actions: list[str]
    reward: float | None
    calls: list[CallView] = field(default_factory=list)
    mutations: list[MutationView] = field(default_factory=list)
    signed: bool = False  # its commit carried a signed checkpoint of the chain heads
    thrown_away: bool = False  # an earlier life's: the rollout started over after it


@dataclass
class AttemptView:
    """One attempt: where it started, what it committed, how it ended."""

    attempt: int
    epoch: int
    life: int
    resumed_from_turn: int
    reason: str
    location: str
    ts_ms: int
    starts_over: bool  # began the conversation again from turn 0 (a restart-only environment)
    turns: list[int] = field(default_factory=list)  # turns this attempt committed
    reused: list[int] = field(default_factory=list)  # earlier attempts' turns it continued from
    superseded_by: int | None = None  # the attempt that fenced it: it crashed (or stalled) here

    @property
    def crashed_after(self) -> int | None:
        """The turn after which it crashed: its last committed turn (or the turn before it began)."""
        if self.superseded_by is None:
            return None
        return self.turns[-1] if self.turns else self.resumed_from_turn - 1


@dataclass
class RolloutTimeline:
    rollout_id: str
    group_id: str
    attempts: list[AttemptView]
    turns: list[TurnView]
    initial_messages: list[Message]  # the conversation's start, in the final life
    final: RolloutState

    @property
    def crashes(self) -> int:
        return sum(1 for a in self.attempts if a.superseded_by is not None)

    @property
    def turn_count(self) -> int:
        return max((t.turn for t in self.turns), default=-1) + 1


def build_timeline(rollout_id: str, events: Iterable[JournaledEvent]) -> RolloutTimeline:
    """The timeline of one rollout from its events in log order (fenced, as ``read_rollout`` yields)."""
    state: RolloutState | None = None
    attempts: list[AttemptView] = []
    turns: list[TurnView] = []
    calls: list[CallView] = []
    mutations: list[MutationView] = []
    signed = False
    initial: list[Message] = []
    for item in events:
        event = item.event
        h = event.header
        if state is None:
            state = RolloutState(h.rollout_id, h.group_id)
        if isinstance(event, AttemptStarted):
            over = state.starts_over(event)
            if over:
                for turn in turns:
                    turn.thrown_away = True
        state.apply(event)
        if isinstance(event, AttemptStarted):
            if attempts:
                attempts[-1].superseded_by = h.attempt
            reused = [] if over else sorted({t.turn for t in turns if not t.thrown_away
                                             and t.turn < event.resumed_from_turn})
            attempts.append(AttemptView(h.attempt, h.epoch, state.restarts, event.resumed_from_turn, event.reason,
                                        str(item.location), h.ts_ms, over, reused=reused))
            if event.messages:
                initial = list(event.messages)
        elif isinstance(event, ModelCall):
            logprob = float(event.logprobs.sum()) if len(event.logprobs) else 0.0
            calls.append(CallView(event.call_id, event.parent_call_id, event.policy_version,
                                  event.prefix_len + len(event.prompt_delta), len(event.output_ids), logprob))
        elif isinstance(event, ResourceMutation):
            mutations.append(MutationView(event.resource_id, event.op, event.args_json, event.prev_revision,
                                          event.revision))
        elif isinstance(event, HeadCheckpoint):
            signed = True
        elif isinstance(event, TurnCompleted):
            turns.append(TurnView(h.turn, h.attempt, h.epoch, state.restarts, str(item.location), h.ts_ms,
                                  list(event.messages), list(event.actions), event.reward, calls, mutations, signed))
            if attempts:
                attempts[-1].turns.append(h.turn)
            calls, mutations, signed = [], [], False
    if state is None:
        raise LookupError(rollout_id)
    return RolloutTimeline(rollout_id, state.group_id, attempts, turns, initial, state)
