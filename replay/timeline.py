"""``replay show``: one rollout turn by turn, as data.

:func:`build_timeline` reads a rollout's events once, applies each to a
``RolloutState`` (the one fold restore uses) and records what happened around
it: every attempt and fence, every committed turn with its messages, model
calls and mutations, and the fate of each turn across attempts:

- reused: a later attempt resumed after it and kept it (a crash cost nothing);
- discarded / redone: a later attempt started over (a restart-only resource) and
  ran it again;
- copied: a fork's first attempt took it from the fork's origin.

The crash points (where a superseded attempt stopped) and the turn map (attempt
x turn) come from those. :class:`Timeline` is what the text view
(:meth:`Timeline.text`), ``--json`` and the HTML report render.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollout_journal.journal.errors import CorruptRecordError
from rollout_journal.journal.events import (
    AttemptFenced,
    AttemptStarted,
    HeadCheckpoint,
    Message,
    ModelCall,
    ResourceMutation,
    RolloutAcknowledged,
    RolloutFailed,
    RolloutFinished,
    TurnCompleted,
)
from rollout_journal.journal.journal import JournaledEvent, ReadReport
from rollout_journal.journal.progress import WORK_EVENTS
from rollout_journal.journal.whole_numbers import whole_number
from rollout_journal.participants.rollout.state import RolloutState, StateFoldError
from rollout_journal.replay.errors import NoSuchTurnError
from rollout_journal.replay.lineage import TokenSegment
from rollout_journal.replay.progress import Progress
from rollout_journal.replay.rollout_status import DAMAGED, FAILED, GIVEN_UP, RUNNING, rollout_status
from rollout_journal.replay.source import ReplaySource
from rollout_journal.replay.tokenizers import TokenizerCatalog, TokenizerIdentity

# Cells of the turn map (attempt x turn).
COMMITTED, FINISHED, REUSED, DISCARDED, REDONE, COPIED, CRASH = "C", "F", "=", "x", "R", "f", "!"
MAP_LEGEND = (
    f"{COMMITTED} committed, {FINISHED} finished there, {REUSED} reused, {CRASH} crashed during it, "
    f"{DISCARDED} discarded by a restart, {REDONE} redone, {COPIED} copied by a fork"
)


@dataclass
class CallView:
    """One model call: lineage, tokens, decoded text and who made each token."""

    call_id: str
    parent_call_id: str | None
    attempt: int
    epoch: int
    turn: int
    seq: int
    policy_version: str
    sampling: dict[str, Any]
    prefix_len: int
    prompt_delta: np.ndarray
    output_ids: np.ndarray
    logprobs: np.ndarray
    finish_reason: str
    latency_ms: float
    segments: list[TokenSegment]  # of the call's prompt + output
    location: str
    tokenizer: TokenizerIdentity | None = None
    decoded_delta: str | None = None
    decoded_output: str | None = None
    continuation: str = "unknown"  # first | extend | eos_splice | new_sequence (unknown: before ModelCall.v3)
    inserted_tokens: int = 0
    template_check: dict[str, Any] | None = None
    logprob_mode: str = "unknown"
    constrained: bool = False

    @property
    def prompt_len(self) -> int:
        return self.prefix_len + len(self.prompt_delta)

    @property
    def logprob_sum(self) -> float:
        return float(self.logprobs.sum()) if len(self.logprobs) else 0.0

    def as_json(self) -> dict[str, Any]:
        return {
            "call_id": self.call_id,
            "parent_call_id": self.parent_call_id,
            "attempt": self.attempt,
            "epoch": self.epoch,
            "turn": self.turn,
            "seq": self.seq,
            "policy_version": self.policy_version,
            "sampling": self.sampling,
            "prefix_len": self.prefix_len,
            "prompt_len": self.prompt_len,
            "prompt_delta": self.prompt_delta.tolist(),
            "output_ids": self.output_ids.tolist(),
            "logprobs": [float(x) for x in self.logprobs],
            "finish_reason": self.finish_reason,
            "latency_ms": self.latency_ms,
            "segments": [s.as_json() for s in self.segments],
            "tokenizer": self.tokenizer.as_json() if self.tokenizer else None,
            "decoded_prompt_delta": self.decoded_delta,
            "decoded_output": self.decoded_output,
            "continuation": self.continuation,
            "inserted_tokens": self.inserted_tokens,
            "template_check": self.template_check,
            "logprob_mode": self.logprob_mode,
            "constrained": self.constrained,
            "location": self.location,
        }

    def how_continued(self) -> str:
        """``extend; template: 1 sampled turn re-rendered otherwise`` (what ``show`` prints)."""
        check = self.template_check
        if check is None or check["agrees"]:
            said = "template agrees" if check is not None else "not checked"
        else:
            parts = []
            if check["sampled_turns_differing"]:
                parts.append(f"{check['sampled_turns_differing']} sampled turn(s) a re-render tokenizes otherwise")
            if check["rendered_turns_differing"]:
                parts.append(f"{check['rendered_turns_differing']} turn(s) the template rewrites")
            if check["structure_differs"]:
                parts.append("another number of turns")
            said = "template: " + ", ".join(parts or ["differs"])
        return f"{self.continuation}; {said}"


@dataclass
class MutationView:
    resource_id: str
    kind: str
    op: str
    args: dict[str, Any]
    result: dict[str, Any]
    prev_revision: int
    revision: int
    idempotency_key: str
    state_digest: str
    chain_hash: str
    attempt: int
    epoch: int
    turn: int
    seq: int
    location: str

    def as_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class TurnView:
    """One committed turn (one version of it, if a restart redid it)."""

    turn: int
    attempt: int
    epoch: int
    seq: int  # of its TurnCompleted, the commit point
    location: str
    ts_ms: int
    life: int  # the rollout's starts over before it (0 until a restart-only environment restarts it)
    messages: list[Message]
    actions: list[str]
    reward: float | None
    calls: list[CallView] = field(default_factory=list)
    mutations: list[MutationView] = field(default_factory=list)
    resource_revisions: dict[str, int] = field(default_factory=dict)
    reused_by: list[int] = field(default_factory=list)  # later attempts that resumed after it and kept it
    discarded_by: int | None = None  # the attempt that started over and ran it again
    redo_of: int | None = None  # the attempt whose version of this turn was discarded
    copied_from: str | None = None  # a fork's first attempt copied it from "<origin>@<turn>"
    finished: bool = False  # the rollout finished with it
    signed: bool = False  # its commit carried a signed checkpoint of the chain heads (HeadCheckpoint)

    @property
    def fate(self) -> str:
        if self.discarded_by is not None:
            return f"discarded: attempt {self.discarded_by} started over"
        parts = ["committed"] if self.copied_from is None else [f"copied from {self.copied_from.split('@')[0]}"]
        if self.redo_of is not None:
            parts.append(f"redo of attempt {self.redo_of}'s")
        if self.reused_by:
            parts.append("reused by attempt " + ", ".join(map(str, self.reused_by)))
        if self.finished:
            parts.append("finished")
        return "; ".join(parts)

    def as_json(self) -> dict[str, Any]:
        return {
            "turn": self.turn,
            "attempt": self.attempt,
            "epoch": self.epoch,
            "seq": self.seq,
            "location": self.location,
            "ts_ms": self.ts_ms,
            "life": self.life,
            "signed": self.signed,
            "fate": self.fate,
            "reused_by": self.reused_by,
            "discarded_by": self.discarded_by,
            "redo_of": self.redo_of,
            "copied_from": self.copied_from,
            "finished": self.finished,
            "reward": self.reward,
            "actions": self.actions,
            "messages": [{"role": m.role, "content": m.content} for m in self.messages],
            "resource_revisions": self.resource_revisions,
            "calls": [c.as_json() for c in self.calls],
            "mutations": [m.as_json() for m in self.mutations],
        }


@dataclass
class AttemptView:
    attempt: int
    epoch: int
    resumed_from_turn: int
    reason: str
    topology: str
    started_seq: int
    location: str
    ts_ms: int
    life: int  # the rollout's life it belongs to (a start over begins the next)
    messages: list[Message]  # the conversation it started with (a start from turn 0)
    override: str | None = None
    forked_from: str | None = None
    starts_over: bool = False  # began the conversation again although turns were committed
    superseded_by: int | None = None
    fence_reason: str | None = None  # from the AttemptFenced its successor wrote
    fences: str | None = None  # the attempt (and epoch) its AttemptFenced superseded
    turns: list[int] = field(default_factory=list)  # turns it committed
    finished: bool = False
    reused: list[int] = field(default_factory=list)  # earlier attempts' turns it resumed after
    ran: bool = False  # it journaled work of its own (``rollout_status.WORK_EVENTS``): it got to run
    failed: str | None = None  # it stopped on an infrastructure failure (RolloutFailed: error, reason)

    @property
    def crashed(self) -> bool:
        """Superseded after it started running and before it finished or failed: a crash (or a kill)
        stopped it. One superseded before it ran (queued behind the concurrency limit) lost nothing;
        a fork's first attempt, which only copies its origin's turns, stops there by design. The rule
        ``list`` counts by (``rollout_status.CrashCount``)."""
        return (
            self.superseded_by is not None
            and self.ran
            and not self.finished
            and self.failed is None
            and self.forked_from is None
        )

    @property
    def stopped_at(self) -> int:
        """The turn it was working on when it stopped: the first it did not commit."""
        return (max(self.turns) + 1) if self.turns else self.resumed_from_turn

    def as_json(self) -> dict[str, Any]:
        return {
            "attempt": self.attempt,
            "epoch": self.epoch,
            "resumed_from_turn": self.resumed_from_turn,
            "reason": self.reason,
            "topology": self.topology,
            "override": self.override,
            "forked_from": self.forked_from,
            "starts_over": self.starts_over,
            "started_seq": self.started_seq,
            "ts_ms": self.ts_ms,
            "life": self.life,
            "location": self.location,
            "superseded_by": self.superseded_by,
            "fence_reason": self.fence_reason,
            "fences": self.fences,
            "turns": self.turns,
            "reused_turns": self.reused,
            "finished": self.finished,
            "ran": self.ran,
            "failed": self.failed,
            "crashed": self.crashed,
            "stopped_at_turn": self.stopped_at if self.crashed else None,
            "messages": [{"role": m.role, "content": m.content} for m in self.messages],
        }


@dataclass
class Timeline:
    """A rollout, turn by turn across its attempts."""

    rollout_id: str
    group_id: str
    location: str
    attempts: list[AttemptView] = field(default_factory=list)
    turns: list[TurnView] = field(default_factory=list)  # in log order; a redone turn appears once per version
    finished: bool = False
    reward: float | None = None
    acknowledged: bool = False
    outcome: dict[str, Any] | None = None
    tokenizers: dict[str, TokenizerIdentity] = field(default_factory=dict)  # by policy version
    report: ReadReport = field(default_factory=ReadReport)
    selected_turn: int | None = None  # show only this turn (its every version)
    damaged: str | None = None  # why the events stop applying (a record lost): the timeline ends there
    final: RolloutState | None = None  # the rollout's state after every event read (the fold's)

    @property
    def crashes(self) -> list[AttemptView]:
        return [a for a in self.attempts if a.crashed]

    @property
    def crashed(self) -> bool:
        """A crash hit it, as ``list --crashed`` says: an attempt crashed, or its newest attempt ran and
        stopped unfinished (crashed and not resumed yet, or running now), or it is damaged."""
        last = self.attempts[-1] if self.attempts else None
        stopped = (
            last is not None and last.ran and not last.finished and last.failed is None and last.forked_from is None
        )
        return bool(self.crashes) or stopped or self.damaged is not None

    @property
    def status(self) -> str:
        """See :func:`rollout_journal.replay.rollout_status.rollout_status`."""
        if self.final is None:
            return DAMAGED if self.damaged else RUNNING
        return rollout_status(self.final, damaged=self.damaged is not None)

    @property
    def forked_from(self) -> str | None:
        """``<origin>@<turn>`` for a fork (its first attempt names it)."""
        return self.attempts[0].forked_from if self.attempts else None

    @property
    def policy_versions(self) -> list[str]:
        return list(self.final.policy_versions) if self.final is not None else []

    @property
    def committed_turns(self) -> int:
        return len({t.turn for t in self.turns if t.discarded_by is None})

    def shown_turns(self) -> list[TurnView]:
        return [t for t in self.turns if self.selected_turn is None or t.turn == self.selected_turn]

    def turn_map(self) -> list[tuple[int, list[str]]]:
        """(attempt, cells) per attempt; cell t tells what the attempt did with turn t (see ``MAP_LEGEND``)."""
        width = max([t.turn + 1 for t in self.turns] + [a.stopped_at + 1 for a in self.crashes] + [0])
        rows = []
        for a in self.attempts:
            cells = [" "] * width
            for t in a.reused:
                cells[t] = REUSED
            for view in self.turns:
                if view.attempt != a.attempt:
                    continue
                if view.discarded_by is not None:
                    mark = DISCARDED
                elif view.copied_from is not None:
                    mark = COPIED
                elif view.finished:
                    mark = FINISHED
                else:
                    mark = REDONE if view.redo_of is not None else COMMITTED
                cells[view.turn] = mark
            if a.crashed:
                cells[a.stopped_at] = CRASH
            rows.append((a.attempt, cells))
        return rows

    # -- rendering ---------------------------------------------------------------------
    def summary(self) -> str:
        status = {
            RUNNING: "running (unfinished: running now, or crashed and not resumed)",
            FAILED: f"failed ({self.final.failure if self.final else '?'}; resume retries it)",
            GIVEN_UP: f"given up after {self.final.failures if self.final else '?'} infrastructure failures "
            f"(the last: {self.final.failure if self.final else '?'})",
        }.get(self.status, self.status)
        reward = "" if self.reward is None else f", reward {self.reward:.4f}"
        crashes = self.crashes
        crash = f" ({len(crashes)} crash{'es' if len(crashes) != 1 else ''})" if crashes else ""
        return (
            f"status {status}{reward}; {self.committed_turns} turns, {len(self.attempts)} "
            f"attempt{'s' if len(self.attempts) != 1 else ''}{crash}"
        )

    def text(self, *, tokens: bool = False) -> Iterator[str]:
        """The human view: summary, turn map, then attempts, crash points and turns in log order.
        With ``tokens`` (and always for a selected turn) every call's ids, logprobs and segments."""
        yield f"rollout {self.rollout_id}  group {self.group_id}  journal {self.location}"
        yield self.summary()
        for identity in self.tokenizers.values():
            how = "verified against the policy" if identity.verified else "given, NOT verified against the policy"
            yield (
                f"tokenizer {identity.fingerprint[:16]} ({identity.source}, {how}) decodes calls of "
                f"{identity.policy_version}"
            )
        yield ""
        yield from self._map_lines()
        yield ""
        detail = tokens or self.selected_turn is not None
        shown = self.shown_turns()
        if self.selected_turn is not None and not shown:
            return
        for kind, item in self._story():
            if isinstance(item, TurnView):
                if self.selected_turn is None or item.turn == self.selected_turn:
                    yield from _turn_lines(item, detail)
            elif kind == "attempt":
                yield from _attempt_lines(item)
            elif kind == "failure":
                yield (
                    f"!! FAILED: attempt {item.attempt} (epoch {item.epoch}) failed on its infrastructure during "
                    f"turn {item.stopped_at} ({item.failed}); attempt {item.superseded_by} retried it"
                )
            else:
                yield (
                    f"!! CRASH: attempt {item.attempt} (epoch {item.epoch}) stopped during turn {item.stopped_at}"
                    f" after committing {len(item.turns)} turn{'s' if len(item.turns) != 1 else ''} of its own; "
                    f"attempt {item.superseded_by} took over"
                )
        if self.finished and self.selected_turn is None:
            yield f"== finished: reward {self.reward:.4f}" + (
                "; acknowledged by the trainer" if self.acknowledged else ""
            )
        elif self.final is not None and self.final.given_up and self.selected_turn is None:
            yield f"== given up after {self.final.failures} infrastructure failures, the last: {self.final.failure}"
        if self.damaged:
            yield f"!! DAMAGED: {self.damaged}; the timeline stops there"

    def _map_lines(self) -> Iterator[str]:
        rows = self.turn_map()
        if not rows:
            return
        width = len(rows[0][1])
        yield "turn map    " + "".join(f"{t:>3}" for t in range(width))
        for attempt, cells in rows:
            yield f"attempt {attempt:<3} " + "".join(f"{c:>3}" for c in cells)
        yield "  " + MAP_LEGEND

    def _story(self) -> Iterator[tuple[str, AttemptView | TurnView]]:
        """Attempts, crash points and turns, in the order they happened."""
        by_attempt = {a.attempt: a for a in self.attempts}
        turns = iter(self.turns)
        pending = next(turns, None)
        for a in self.attempts:
            while pending is not None and pending.attempt < a.attempt:
                yield "turn", pending
                pending = next(turns, None)
            previous = by_attempt.get(a.attempt - 1)
            if previous is not None and previous.crashed:
                yield "crash", previous
            elif previous is not None and previous.failed is not None:
                yield "failure", previous
            yield "attempt", a
        while pending is not None:
            yield "turn", pending
            pending = next(turns, None)

    def as_json(self) -> dict[str, Any]:
        return {
            "rollout_id": self.rollout_id,
            "group_id": self.group_id,
            "journal": self.location,
            "status": self.status,
            "finished": self.finished,
            "reward": self.reward,
            "acknowledged": self.acknowledged,
            "outcome": self.outcome,
            "committed_turns": self.committed_turns,
            "selected_turn": self.selected_turn,
            "damaged": self.damaged,
            "attempts": [a.as_json() for a in self.attempts],
            "crashes": [
                {
                    "attempt": a.attempt,
                    "epoch": a.epoch,
                    "stopped_at_turn": a.stopped_at,
                    "superseded_by": a.superseded_by,
                }
                for a in self.crashes
            ],
            "turn_map": {
                "legend": MAP_LEGEND,
                "rows": [{"attempt": a, "cells": "".join(c)} for a, c in self.turn_map()],
            },
            "turns": [t.as_json() for t in self.shown_turns()],
            "tokenizers": {v: i.as_json() for v, i in self.tokenizers.items()},
        }


def _attempt_lines(a: AttemptView) -> Iterator[str]:
    head = f"== attempt {a.attempt} (epoch {a.epoch}) starts at turn {a.resumed_from_turn}: {a.reason}"
    if a.forked_from:
        head += f" [forked_from {a.forked_from}]"
    if a.override:
        head += f" [override {a.override}]"
    yield head
    if a.fences:
        yield f"   fences {a.fences}: its writes and mutations are refused from here on"
    if a.reused:
        yield f"   reuses turns {_spans(a.reused)} committed by earlier attempts (not run again)"
    if a.starts_over:
        yield "   starts the conversation over: the turns committed before are discarded and redone"
    for m in a.messages:
        yield _message(m)


def _turn_lines(t: TurnView, detail: bool) -> Iterator[str]:
    yield f"-- turn {t.turn}  [attempt {t.attempt}, epoch {t.epoch}: {t.fate}]"
    for c in t.calls:
        delta = len(c.prompt_delta)
        yield (
            f"   call {c.call_id}  parent {c.parent_call_id or '-'}  {c.policy_version}  prompt {c.prompt_len} "
            f"tokens ({c.prefix_len} from parent + {c.inserted_tokens} inserted + {delta - c.inserted_tokens} new, "
            f"{c.how_continued()}) -> {len(c.output_ids)} tokens, logprob {c.logprob_sum:.3f} ({c.logprob_mode}"
            f"{', constrained' if c.constrained else ''}), {c.finish_reason}, {c.latency_ms:.1f} ms, "
            f"seed {c.sampling.get('seed')}"
        )
        if c.decoded_delta is not None:
            yield f"      prompt delta: {c.decoded_delta!r}"
            yield f"      output:       {c.decoded_output!r}"
        if detail:
            yield "      tokens of prompt+output, by who made them:"
            for s in c.segments:
                kind = "generated" if s.generated else "prompt   "
                yield (f"        [{s.start:>5}, {s.end:>5})  {kind}  attempt {s.attempt}  turn {s.turn}  {s.call_id}")
            yield f"      prompt delta ids {c.prompt_delta.tolist()}"
            yield f"      output ids       {c.output_ids.tolist()}"
            yield f"      logprobs         {[round(float(x), 4) for x in c.logprobs]}"
    for mutation in t.mutations:
        yield (
            f"   mutation {mutation.resource_id} r{mutation.prev_revision}->r{mutation.revision} {mutation.op}"
            f"({json.dumps(mutation.args)}) = {json.dumps(mutation.result)}  digest {mutation.state_digest[:12]}  "
            f"chain {mutation.chain_hash[:12]}"
        )
    for message in t.messages:
        yield _message(message)
    if t.reward is not None:
        yield f"   reward {t.reward:.4f}"


def _message(m: Message) -> str:
    """A message, its later lines indented under its first (tool calls after its text)."""
    indent = "\n" + " " * (5 + len(m.role))
    text = m.content + "".join(f"\n[tool call {c.id}] {c.name}({c.arguments_json})" for c in m.tool_calls)
    if m.tool_call_id is not None:
        text = f"[answers {m.tool_call_id}] " + text
    return f"   {m.role}: {text.replace(chr(10), indent)}"


def _spans(turns: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    runs: list[list[int]] = []
    for t in sorted(turns):
        if runs and t == runs[-1][1] + 1:
            runs[-1][1] = t
        else:
            runs.append([t, t])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs)


class TimelineBuilder:
    """Applies a rollout's events to its state and records the timeline around them (``add`` each
    event of the rollout, in log order)."""

    def __init__(self, timeline: Timeline, catalog: TokenizerCatalog | None) -> None:
        self.t = timeline
        self.catalog = catalog
        self.state: RolloutState | None = None
        self.calls: list[CallView] = []  # of the turn in progress
        self.mutations: list[MutationView] = []
        self.signed = False  # a HeadCheckpoint came with the turn in progress
        self.life: list[TurnView] = []  # turns of the conversation as it stands (since the last start over)
        self.discarded: dict[int, int] = {}  # turn -> attempt whose version a restart discarded

    def add(self, item: JournaledEvent) -> None:
        event, where = item.event, str(item.location)
        h = event.header
        if self.state is None:
            self.state = self.t.final = RolloutState(h.rollout_id, h.group_id)
            self.t.group_id = h.group_id
        state = self.state
        starts_over = isinstance(event, AttemptStarted) and state.starts_over(event)
        try:
            state.apply(event)  # its lineage labels the head's tokens too
        except StateFoldError as exc:
            raise StateFoldError(f"{exc} at {where}") from None
        if isinstance(event, WORK_EVENTS) and self.t.attempts and self.t.attempts[-1].attempt == h.attempt:
            self.t.attempts[-1].ran = True
        if isinstance(event, AttemptStarted):
            self._attempt(state, event, where, starts_over)
        elif isinstance(event, RolloutFailed):
            if self.t.attempts:
                self.t.attempts[-1].failed = f"{event.error}: {event.reason}"
        elif isinstance(event, AttemptFenced):
            for a in self.t.attempts:
                if a.attempt == event.fenced_attempt:
                    a.fence_reason = event.reason
            if self.t.attempts:
                self.t.attempts[-1].fences = f"attempt {event.fenced_attempt} (epoch {event.fenced_epoch})"
        elif isinstance(event, ModelCall):
            self._call(state, event, where)
        elif isinstance(event, ResourceMutation):
            self.mutations.append(
                MutationView(
                    event.resource_id,
                    event.kind,
                    event.op,
                    json.loads(event.args_json),
                    json.loads(event.result_json),
                    event.prev_revision,
                    event.revision,
                    event.idempotency_key,
                    event.state_digest,
                    event.chain_hash,
                    h.attempt,
                    h.epoch,
                    h.turn,
                    h.seq,
                    where,
                )
            )
        elif isinstance(event, TurnCompleted):
            self._turn(state, event, where)
        elif isinstance(event, HeadCheckpoint):  # audit only: the turn's chain heads are signed
            self.signed = True
        elif isinstance(event, RolloutFinished):
            self.t.finished, self.t.reward, self.t.outcome = True, event.reward, state.outcome
            if self.t.attempts:
                self.t.attempts[-1].finished = True
            if self.life:
                self.life[-1].finished = True
        elif isinstance(event, RolloutAcknowledged):
            self.t.acknowledged = True

    def _attempt(self, state: RolloutState, event: AttemptStarted, where: str, starts_over: bool) -> None:
        h = event.header
        if self.t.attempts:
            self.t.attempts[-1].superseded_by = h.attempt
        view = AttemptView(
            h.attempt,
            h.epoch,
            event.resumed_from_turn,
            event.reason,
            event.topology,
            h.seq,
            where,
            h.ts_ms,
            state.restarts,
            list(event.messages),
            event.override,
            event.forked_from,
            starts_over,
        )
        if starts_over:
            for turn in self.life:
                turn.discarded_by = h.attempt
                self.discarded[turn.turn] = turn.attempt
            self.life = []
        else:
            for turn in self.life:
                if turn.turn < event.resumed_from_turn:
                    turn.reused_by.append(h.attempt)
                    view.reused.append(turn.turn)
        self.calls, self.mutations, self.signed = [], [], False  # uncommitted work never reaches the journal
        self.t.attempts.append(view)

    def _call(self, state: RolloutState, event: ModelCall, where: str) -> None:
        h = event.header
        if (
            state.lineage is None
        ):  # only a state restored from an old snapshot lacks it; this one is folded from the start
            raise StateFoldError(f"rollout {state.rollout_id}: no token lineage at {where}")
        identity = decoded_delta = decoded_output = None
        if self.catalog is not None:
            identity = self.t.tokenizers[event.policy_version] = self.catalog.identify(event.policy_version)
            decoded_delta = identity.tokenizer.decode(event.prompt_delta, skip_special_tokens=False)
            decoded_output = identity.tokenizer.decode(event.output_ids, skip_special_tokens=False)
        s = event.sampling
        self.calls.append(
            CallView(
                event.call_id,
                event.parent_call_id,
                h.attempt,
                h.epoch,
                h.turn,
                h.seq,
                event.policy_version,
                {
                    "temperature": s.temperature,
                    "top_p": s.top_p,
                    "top_k": s.top_k,
                    "max_tokens": s.max_tokens,
                    "seed": s.seed,
                },
                event.prefix_len,
                event.prompt_delta,
                event.output_ids,
                event.logprobs,
                event.finish_reason,
                event.latency_ms,
                list(state.lineage.segments),
                where,
                identity,
                decoded_delta,
                decoded_output,
                event.continuation,
                event.inserted_tokens,
                None if event.template_check is None else dataclasses.asdict(event.template_check),
                event.logprob_mode,
                event.constrained,
            )
        )

    def _turn(self, state: RolloutState, event: TurnCompleted, where: str) -> None:
        h = event.header
        attempt = self.t.attempts[-1] if self.t.attempts else None
        copied = None
        if attempt is not None and attempt.forked_from is not None:
            origin, _, at_turn = attempt.forked_from.rpartition("@")
            at = whole_number(at_turn)
            if at is not None and h.turn <= at:
                copied = f"{origin}@{h.turn}"
        view = TurnView(
            h.turn,
            h.attempt,
            h.epoch,
            h.seq,
            where,
            h.ts_ms,
            state.restarts,
            list(event.messages),
            list(event.actions),
            event.reward,
            self.calls,
            self.mutations,
            dict(event.resource_revisions),
            redo_of=self.discarded.pop(h.turn, None),
            copied_from=copied,
            signed=self.signed,
        )
        self.calls, self.mutations, self.signed = [], [], False
        if attempt is not None:
            attempt.turns.append(h.turn)
        self.life.append(view)
        self.t.turns.append(view)


def build_timeline(
    source: ReplaySource,
    rollout_id: str,
    *,
    catalog: TokenizerCatalog | None,
    turn: int | None = None,
    progress: Progress | None = None,
) -> Timeline:
    """The timeline of ``rollout_id``. ``catalog`` decodes token ids (None: ids only);
    ``turn`` selects one turn to show (every version of it). Unreadable records go to
    ``Timeline.report``; raises ``NoSuchRolloutError``, or ``NoSuchTurnError`` for a turn
    the rollout never committed."""
    timeline = Timeline(rollout_id, "", source.location, selected_turn=turn)
    builder = TimelineBuilder(timeline, catalog)
    try:
        for item in source.rollout_events(rollout_id, timeline.report, progress):
            builder.add(item)
    except StateFoldError as exc:
        if not any(isinstance(e, CorruptRecordError) for e in timeline.report.errors):
            raise  # no record was lost on the way: the journal itself is inconsistent
        timeline.damaged = str(exc)  # a record was unreadable: show what came before it, and name it
    if turn is not None and not timeline.shown_turns():
        committed = sorted({t.turn for t in timeline.turns})
        raise NoSuchTurnError(
            f"rollout {rollout_id} never committed turn {turn} (committed: {_spans(committed) or 'none'})"
        )
    return timeline


def build_timelines(
    source: ReplaySource,
    *,
    catalog: TokenizerCatalog | None,
    report: ReadReport,
    progress: Progress | None = None,
    feed: Callable[[JournaledEvent], None] | None = None,
) -> dict[str, Timeline]:
    """The timeline of every rollout of the journal, in one scan, in order of first appearance
    (what the whole-journal report draws; it holds them all). A rollout whose events stop applying
    is ``damaged`` there, and the others go on. ``feed`` sees every event read, in order."""
    builders: dict[str, TimelineBuilder] = {}
    for item in source.scan(report, progress):
        if feed is not None:
            feed(item)
        rollout_id = item.event.header.rollout_id
        builder = builders.get(rollout_id)
        if builder is None:
            builder = builders[rollout_id] = TimelineBuilder(Timeline(rollout_id, "", source.location), catalog)
        if builder.t.damaged is not None:
            continue
        try:
            builder.add(item)
        except StateFoldError as exc:
            builder.t.damaged = str(exc)
    return {rollout_id: b.t for rollout_id, b in builders.items()}
