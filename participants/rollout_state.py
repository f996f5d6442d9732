"""A rollout's continuation, derived from the journal and never saved on the side.

``RolloutState`` is what an agent needs to run the next turn. It is built by
folding journal events (``fold``) over the newest snapshot, and a snapshot's
bytes are just this state (plus exported resource states) serialised.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import zlib
from dataclasses import dataclass, field

import numpy as np

from journal.errors import RecordLocation, RolloutJournalError
from journal.events import (
    AttemptStarted, Header, Message, ModelCall, ResourceMutation, RolloutFinished, TurnCompleted,
)
from journal.restore import RolloutHistory

from .resources import MutationRecord

SNAPSHOT_FORMAT = "rollout-journal/rollout-state/1"


class StateFoldError(RolloutJournalError):
    """The journal of a rollout cannot be folded (a gap in its sequence numbers)."""


@dataclass(frozen=True)
class RolloutSpec:
    """Who a rollout is; fixed by the workload, so restore never needs a snapshot to know it."""

    rollout_id: str
    group_id: str
    sibling: int
    task_seed: int
    environment: str


@dataclass
class RolloutState:
    spec: RolloutSpec
    attempt: int = 0
    epoch: int = 0
    next_turn: int = 0
    next_seq: int = 0
    messages: list[Message] = field(default_factory=list)
    head_call_id: str | None = None
    head_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))  # prompt+output of the head call
    finished: bool = False
    reward: float | None = None
    actions: list[str] = field(default_factory=list)
    output_tokens: int = 0  # generated tokens so far (work accounting)
    resource_states: dict[str, bytes] = field(default_factory=dict)  # exported at the snapshot, per resource
    outcome: dict | None = None  # what the finished rollout produced (see agent.outcome_of)
    writer: str = field(default="", compare=False)  # this process's worker slot; not persisted

    def header(self, turn: int | None = None) -> Header:
        """A header for the next event; takes a sequence number."""
        h = Header(self.spec.rollout_id, self.spec.group_id, self.attempt, self.epoch,
                   self.next_turn if turn is None else turn, self.next_seq, Header.now_ms(), self.writer)
        self.next_seq += 1
        return h

    def snapshot_header(self) -> Header:
        """The header of a snapshot of this state: it covers every seq taken so far."""
        return Header(self.spec.rollout_id, self.spec.group_id, self.attempt, self.epoch,
                      self.next_turn, self.next_seq - 1, Header.now_ms(), self.writer)

    # -- snapshot bytes ------------------------------------------------------
    def to_bytes(self) -> bytes:
        doc = {
            "format": SNAPSHOT_FORMAT,
            "spec": dataclasses.asdict(self.spec),
            "attempt": self.attempt, "epoch": self.epoch,
            "next_turn": self.next_turn, "next_seq": self.next_seq,
            "messages": [[m.role, m.content] for m in self.messages],
            "head_call_id": self.head_call_id,
            "head_tokens": base64.b64encode(self.head_tokens.astype("<i4").tobytes()).decode(),
            "finished": self.finished, "reward": self.reward, "actions": self.actions,
            "output_tokens": self.output_tokens, "outcome": self.outcome,
            "resources": {k: base64.b64encode(v).decode() for k, v in self.resource_states.items()},
        }
        return zlib.compress(json.dumps(doc, separators=(",", ":")).encode(), 1)

    @classmethod
    def from_bytes(cls, data: bytes, where: RecordLocation | None = None) -> "RolloutState":
        try:
            doc = json.loads(zlib.decompress(data))
        except (zlib.error, ValueError) as exc:
            raise StateFoldError(f"snapshot at {where} is not a rollout state: {exc}") from exc
        if doc.get("format") != SNAPSHOT_FORMAT:
            raise StateFoldError(f"snapshot at {where} has format {doc.get('format')!r}, expected {SNAPSHOT_FORMAT!r}")
        try:
            return cls._from_doc(doc)
        except (KeyError, TypeError, ValueError) as exc:
            raise StateFoldError(f"snapshot at {where} lacks or mangles field {exc}; written by another version?") from exc

    @classmethod
    def _from_doc(cls, doc: dict) -> "RolloutState":
        return cls(
            spec=RolloutSpec(**doc["spec"]), attempt=doc["attempt"], epoch=doc["epoch"],
            next_turn=doc["next_turn"], next_seq=doc["next_seq"],
            messages=[Message(r, c) for r, c in doc["messages"]], head_call_id=doc["head_call_id"],
            head_tokens=np.frombuffer(base64.b64decode(doc["head_tokens"]), dtype="<i4").copy(),
            finished=doc["finished"], reward=doc["reward"], actions=list(doc["actions"]),
            output_tokens=doc["output_tokens"], outcome=doc["outcome"],
            resource_states={k: base64.b64decode(v) for k, v in doc["resources"].items()},
        )


def mutation_record(event: ResourceMutation) -> MutationRecord:
    h = event.header
    return MutationRecord(
        resource_id=event.resource_id, kind=event.kind, op=event.op, args=json.loads(event.args_json),
        idempotency_key=event.idempotency_key, prev_revision=event.prev_revision, revision=event.revision,
        result=json.loads(event.result_json), state_digest=event.state_digest, chain_hash=event.chain_hash,
        rollout_id=h.rollout_id, attempt=h.attempt, epoch=h.epoch,
    )


@dataclass
class FoldedRollout:
    state: RolloutState
    mutations: list[MutationRecord]  # to re-apply on top of state.resource_states, in order
    restarted_from_zero: bool  # an attempt restarted it from turn 0 after the snapshot


def full_prompt(head_tokens: np.ndarray, call: ModelCall) -> np.ndarray:
    """A call's whole prompt: its parent's prompt+output up to ``prefix_len``, then the delta."""
    return np.concatenate([head_tokens[: call.prefix_len], call.prompt_delta]).astype(np.int32)


def fold(spec: RolloutSpec, history: RolloutHistory) -> FoldedRollout:
    """The state after every committed, unfenced event of the rollout."""
    if history.snapshot is not None:
        state = RolloutState.from_bytes(history.snapshot.state, history.snapshot.location)
        state.attempt, state.epoch = history.snapshot.snapshot.header.attempt, history.snapshot.snapshot.header.epoch
    else:
        state = RolloutState(spec)
    mutations: list[MutationRecord] = []
    restarted = False
    for item in history.events:
        event = item.event
        h = event.header
        if h.seq != state.next_seq and not isinstance(event, AttemptStarted):
            raise StateFoldError(
                f"rollout {spec.rollout_id}: expected seq {state.next_seq}, found {h.seq} at {item.location}; "
                "a record is missing (see the read report)"
            )
        state.next_seq = max(state.next_seq, h.seq + 1)
        if isinstance(event, AttemptStarted):
            state.attempt, state.epoch = h.attempt, h.epoch
            if event.resumed_from_turn == 0 and state.next_turn > 0:
                state = dataclasses.replace(RolloutState(spec), attempt=h.attempt, epoch=h.epoch, next_seq=state.next_seq)
                mutations.clear()
                restarted = True
        elif isinstance(event, ModelCall):
            prompt = full_prompt(state.head_tokens, event)
            state.head_tokens = np.concatenate([prompt, event.output_ids]).astype(np.int32)
            state.head_call_id = event.call_id
            state.output_tokens += len(event.output_ids)
        elif isinstance(event, ResourceMutation):
            mutations.append(mutation_record(event))
        elif isinstance(event, TurnCompleted):
            state.messages.extend(event.messages)
            state.actions.extend(event.actions)
            state.next_turn = h.turn + 1
        elif isinstance(event, RolloutFinished):
            state.finished, state.reward = True, event.reward
            state.outcome = json.loads(event.result_json)
    return FoldedRollout(state, mutations, restarted)
