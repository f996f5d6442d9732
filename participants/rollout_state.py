"""A rollout's state as an event-sourced aggregate: ``apply(event)`` is the only code
that changes it.

The live path builds an event, applies it, and hands it to the journal; restore,
replay, audit and export apply the events they read. So what attempt N+1 continues
from, and what an offline reader shows, cannot drift from what ran: the epoch, the
lineage head, the resource revisions and the restart of a conversation are each
derived here, once.

Two layers:

- :class:`RolloutProgress`: the bounded bookkeeping every reader needs (attempt,
  epoch, turns, status, counts). ``replay list`` and ``status`` keep one per rollout.
- :class:`RolloutState`: adds the continuation an agent needs to run the next turn
  (conversation, lineage head, resource mutations since their last export).

A snapshot's bytes are a ``RolloutState`` serialised (:meth:`RolloutState.to_bytes`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from journal.errors import RecordLocation, RolloutJournalError
from journal.events import (
    AttemptFenced,
    AttemptStarted,
    HeadCheckpoint,
    Header,
    Message,
    ModelCall,
    ModelCallProgress,
    OutputSegment,
    ResourceMutation,
    RolloutAcknowledged,
    RolloutEvent,
    RolloutFailed,
    RolloutFinished,
    TrainingRecord,
    TurnCompleted,
)
from journal.restore import RolloutHistory

from .environments.tasks import Task
from .resources import MutationRecord
from .token_lineage import LineageMismatch, TokenLineage, TokenSegment

SNAPSHOT_FORMAT = "rollout-journal/rollout-state/3"
_SNAPSHOT_FORMAT_V2 = "rollout-journal/rollout-state/2"  # before the token lineage was kept
_SNAPSHOT_FORMAT_V1 = "rollout-journal/rollout-state/1"  # 0.1.0: exports only, no counters
# The byte layout around the document (to_bytes); older states are zlib'd JSON, which never
# starts with these bytes (a zlib stream starts with 0x78 here).
STATE_MAGIC = b"RJS\x01"
_STATE_LENGTHS = struct.Struct("<III")  # the JSON document's, the token ids', the logprobs' byte lengths


class StateFoldError(RolloutJournalError):
    """A rollout's events cannot be applied in order (a gap or a duplicate in its
    sequence numbers, a fence whose attempt is missing, or two attempts that claimed
    the same epoch): that rollout's journal is damaged, was read incompletely, or was
    written by two workers at once. The rollout alone is set aside."""


@dataclass(frozen=True)
class RolloutSpec:
    """Who a rollout is and what it works on; fixed by the workload, so restore never
    needs a snapshot to know it."""

    rollout_id: str
    group_id: str
    sibling: int
    task_seed: int
    environment: str
    seed: int | None = None  # sampling seed instead of the workload's (a fork run with another seed)
    seed_rollout: str | None = None  # whose turn seeds it draws (a fork: its origin's, so it re-runs what that did)
    forked_from: str | None = None  # "<rollout_id>@<turn>" for a fork (see participants.forks)
    task: Task | None = None  # the dataset row, when the workload reads tasks from a file (else the seed is all)

    def turn_seed_source(self, workload_seed: int) -> tuple[int, str]:
        """(seed, rollout id) the turn seeds of this rollout derive from."""
        return (workload_seed if self.seed is None else self.seed), (self.seed_rollout or self.rollout_id)

    def environment_task(self) -> Task:
        """What its environment is built from."""
        return self.task if self.task is not None else Task(self.task_seed)


def full_prompt(head_tokens: np.ndarray, call: ModelCall) -> np.ndarray:
    """A call's whole prompt: its parent's prompt+output up to ``prefix_len``, then the delta."""
    return np.concatenate([head_tokens[: call.prefix_len], call.prompt_delta]).astype(np.int32)


def mutation_record(event: ResourceMutation) -> MutationRecord:
    """The resource-side record of a journaled mutation (what ``Resource.replay`` takes)."""
    h = event.header
    return MutationRecord(
        resource_id=event.resource_id, kind=event.kind, op=event.op, args=json.loads(event.args_json),
        idempotency_key=event.idempotency_key, prev_revision=event.prev_revision, revision=event.revision,
        result=json.loads(event.result_json), state_digest=event.state_digest, chain_hash=event.chain_hash,
        rollout_id=h.rollout_id, attempt=h.attempt, epoch=h.epoch,
    )


def prompt_digest(prompt: np.ndarray) -> str:
    """What a ``ModelCallProgress`` names a call's prompt by."""
    return hashlib.sha256(np.ascontiguousarray(prompt, dtype="<i4").tobytes()).hexdigest()


@dataclass
class PartialCall:
    """A model call the journal holds progress of, not yet finished: what a later attempt
    continues from (the prompt it must have, the tokens so far, who generated them)."""

    turn: int
    call_index: int
    prompt_sha256: str
    output_ids: np.ndarray
    logprobs: np.ndarray
    segments: list[OutputSegment]

    def matches(self, turn: int, call_index: int, prompt_sha256: str) -> bool:
        return (self.turn, self.call_index, self.prompt_sha256) == (turn, call_index, prompt_sha256)


@dataclass
class RolloutProgress:
    """Where a rollout stands; bounded in size whatever its length."""

    # What ``apply`` reads of the frequent events, and all a bookkeeping scan (``replay list``) decodes
    # of them (``Journal.scan(fields=...)``): the other fields are None in what it is handed. A
    # subclass that reads more (RolloutState) is fed full events. Other event types come whole.
    READS: ClassVar[dict[type, tuple[str, ...]]] = {
        ModelCall: ("header", "policy_version", "output_ids"),
        ModelCallProgress: ("header", "output_ids"),
        ResourceMutation: ("header",),
        TurnCompleted: ("header", "reward"),
    }

    rollout_id: str
    group_id: str
    attempt: int = 0
    epoch: int = 0
    next_turn: int = 0
    next_seq: int = 0
    finished: bool = False
    reward: float | None = None
    acknowledged: bool = False
    restarts: int = 0  # attempts that started the conversation over (restart-only resources)
    model_calls: int = 0
    output_tokens: int = 0  # generated by the model calls of the current conversation (work accounting)
    mutation_count: int = 0
    policy_versions: list[str] = field(default_factory=list)  # in order of first use
    topology: str = ""  # fingerprint of the config its newest attempt runs with ("" unknown)
    failure: str | None = None  # its newest attempt stopped on an infrastructure failure (why); not a result
    progress_tokens: int = 0  # tokens journaled as progress of calls still generating (ModelCallProgress)
    calls_this_turn: int = 0  # model calls journaled in the turn under way (made durable before its tool call)

    def apply(self, event: RolloutEvent) -> None:
        """Advance by one committed (or just built) event of this rollout, in seq order."""
        h = event.header
        if h.rollout_id != self.rollout_id:
            raise StateFoldError(f"rollout {self.rollout_id}: was handed an event of rollout {h.rollout_id}")
        if h.seq != self.next_seq and not isinstance(event, AttemptStarted):
            problem = "a record is missing" if h.seq > self.next_seq else "a record appears twice"
            raise StateFoldError(f"rollout {self.rollout_id}: expected seq {self.next_seq}, found {h.seq} "
                                 f"({type(event).__name__}); {problem}")
        if isinstance(event, AttemptStarted) and self.attempt and h.epoch <= self.epoch:
            raise StateFoldError(f"rollout {self.rollout_id}: attempt {h.attempt} (written by {h.writer}) claims epoch "
                                 f"{h.epoch}, which attempt {self.attempt} already holds (epoch {self.epoch}): two "
                                 "writers resumed this rollout at once; its journal needs a look before it runs on")
        self.next_seq = max(self.next_seq, h.seq + 1)
        if isinstance(event, AttemptStarted):
            self._on_attempt(event)
        elif isinstance(event, ModelCall):
            self._on_model_call(event)
        elif isinstance(event, ModelCallProgress):
            self._on_call_progress(event)
        elif isinstance(event, ResourceMutation):
            self._on_mutation(event)
        elif isinstance(event, TurnCompleted):
            self._on_turn(event)
        elif isinstance(event, RolloutFinished):
            self._on_finished(event)
        elif isinstance(event, RolloutFailed):
            self._on_failed(event)
        elif isinstance(event, RolloutAcknowledged):
            self.acknowledged = True
        elif not isinstance(event, (AttemptFenced, HeadCheckpoint)):
            # Audit only: AttemptStarted moved the epoch; a HeadCheckpoint vouches for heads the mutations set
            raise StateFoldError(f"rollout {self.rollout_id}: no rule to apply a {type(event).__name__}")

    def starts_over(self, event: AttemptStarted) -> bool:
        """Whether ``event`` begins the conversation again from turn 0 (the restart decision's record)."""
        return event.resumed_from_turn == 0 and (self.next_turn > 0 or self.model_calls > self.calls_this_turn)

    # -- one rule per event type; subclasses extend them ------------------------------
    def _on_attempt(self, event: AttemptStarted) -> None:
        if self.starts_over(event):
            self.restarts += 1
            self.next_turn, self.finished, self.reward, self.output_tokens = 0, False, None, 0
            self.calls_this_turn = 0
        self.attempt, self.epoch = event.header.attempt, event.header.epoch
        self.topology, self.failure = event.topology, None  # a new attempt: the failure was the old one's

    def _on_model_call(self, event: ModelCall) -> None:
        self.model_calls += 1
        if event.header.turn == self.next_turn:
            self.calls_this_turn += 1
        self.output_tokens += len(event.output_ids)
        if event.policy_version not in self.policy_versions:
            self.policy_versions.append(event.policy_version)

    def _on_call_progress(self, event: ModelCallProgress) -> None:
        self.progress_tokens += len(event.output_ids)

    def _on_mutation(self, event: ResourceMutation) -> None:
        self.mutation_count += 1

    def _on_turn(self, event: TurnCompleted) -> None:
        self.next_turn, self.calls_this_turn = event.header.turn + 1, 0
        if event.reward is not None:
            self.reward = event.reward

    def _on_finished(self, event: RolloutFinished) -> None:
        self.finished, self.reward = True, event.reward

    def _on_failed(self, event: RolloutFailed) -> None:
        self.failure = f"{event.error}: {event.reason}"

    def header(self, writer: str, *, turn: int | None = None, attempt: int | None = None,
               epoch: int | None = None) -> Header:
        """The header of the next event (it takes seq ``next_seq``; applying the event moves on)."""
        return Header(self.rollout_id, self.group_id, self.attempt if attempt is None else attempt,
                      self.epoch if epoch is None else epoch, self.next_turn if turn is None else turn,
                      self.next_seq, Header.now_ms(), writer)


@dataclass
class RolloutState(RolloutProgress):
    """Everything an agent needs to run a rollout's next turn."""

    messages: list[Message] = field(default_factory=list)
    head_call_id: str | None = None
    head_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))  # prompt+output of the head
    actions: list[str] = field(default_factory=list)
    outcome: dict | None = None  # what the finished rollout produced (see agent.outcome_of)
    resource_states: dict[str, bytes] = field(default_factory=dict)  # exports at the last snapshot, per resource
    mutations_since_export: list[MutationRecord] = field(default_factory=list)  # to re-apply over those exports
    # The turn under way (not yet completed): its calls journaled so far, in order (a call made
    # durable before its tool call), and a call of it still generating whose progress is journaled.
    # Both are empty at every turn boundary, where snapshots are taken.
    turn_calls: list[ModelCall] = field(default_factory=list)
    partial: PartialCall | None = None
    # Who made each token of the head and the logprob of each sampled one (the training record);
    # None when restored from a snapshot written before it was kept (a replay from the first event rebuilds it).
    lineage: TokenLineage | None = field(default_factory=TokenLineage)

    def journaled_call(self, call_index: int) -> ModelCall | None:
        """The call at ``call_index`` of the turn under way, if the journal holds it: a redone
        turn replays it instead of calling the model again."""
        return self.turn_calls[call_index] if call_index < len(self.turn_calls) else None

    def partial_call(self, call_index: int, prompt: np.ndarray) -> PartialCall | None:
        """The journaled progress of the call at ``call_index`` of the turn under way, if it was
        made with this very prompt."""
        partial = self.partial
        if partial is None or not partial.matches(self.next_turn, call_index, prompt_digest(prompt)):
            return None
        return partial

    def _on_attempt(self, event: AttemptStarted) -> None:
        if self.starts_over(event):
            self.turn_calls, self.partial = [], None
            self.head_call_id, self.head_tokens = None, np.zeros(0, dtype=np.int32)
            self.lineage = TokenLineage()
            self.actions, self.outcome = [], None
            self.resource_states, self.mutations_since_export = {}, []
            self.messages = list(event.messages)
        elif event.resumed_from_turn == 0 and event.messages:  # a fresh start: the conversation begins here
            self.messages = list(event.messages)
        super()._on_attempt(event)

    def _on_model_call(self, event: ModelCall) -> None:
        super()._on_model_call(event)
        self.head_tokens = np.concatenate(
            [self.head_tokens[: event.prefix_len], event.prompt_delta, event.output_ids]).astype(np.int32)
        self.head_call_id = event.call_id
        if self.lineage is not None:
            try:
                self.lineage.follow(self.rollout_id, len(self.head_tokens), event)
            except LineageMismatch as exc:
                raise StateFoldError(str(exc)) from None
        if event.header.turn == self.next_turn:
            self.turn_calls.append(event)
            if self.partial is not None and self.partial.matches(event.header.turn, len(self.turn_calls) - 1,
                                                                 self.partial.prompt_sha256):
                self.partial = None  # the call finished: its ModelCall holds every token

    def _on_call_progress(self, event: ModelCallProgress) -> None:
        super()._on_call_progress(event)
        h, partial = event.header, self.partial
        if partial is not None and not partial.matches(h.turn, event.call_index, event.prompt_sha256):
            partial = None  # another call's: this one has no tokens held yet
        if event.start == 0 and partial is None:
            partial = self.partial = PartialCall(h.turn, event.call_index, event.prompt_sha256,
                                                 np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.float32), [])
        elif partial is None or event.start != len(partial.output_ids):
            held = 0 if partial is None else len(partial.output_ids)
            raise StateFoldError(
                f"rollout {self.rollout_id}: progress of call {event.call_id} starts at token {event.start}, but "
                f"the journal holds {held} tokens of that call before it; a progress record is missing")
        partial.output_ids = np.concatenate([partial.output_ids, event.output_ids]).astype(np.int32)
        partial.logprobs = np.concatenate([partial.logprobs, event.logprobs]).astype(np.float32)
        last = partial.segments[-1] if partial.segments else None
        if last is not None and (last.attempt, last.policy_version) == (h.attempt, event.policy_version):
            partial.segments[-1] = OutputSegment(last.attempt, last.policy_version, last.tokens + len(event.output_ids))
        else:
            partial.segments.append(OutputSegment(h.attempt, event.policy_version, len(event.output_ids)))

    def _on_mutation(self, event: ResourceMutation) -> None:
        super()._on_mutation(event)
        self.mutations_since_export.append(mutation_record(event))

    def _on_turn(self, event: TurnCompleted) -> None:
        super()._on_turn(event)
        self.turn_calls, self.partial = [], None
        self.messages.extend(event.messages)
        self.actions.extend(event.actions)

    def _on_finished(self, event: RolloutFinished) -> None:
        super()._on_finished(event)
        self.outcome = json.loads(event.result_json)

    def training_record(self, header: Header, group_size: int) -> TrainingRecord:
        """What a trainer takes of this rollout as it stands (``header``: its ``RolloutFinished``'s).
        Raises :class:`StateFoldError` when the lineage is unknown (restored from an older snapshot)."""
        if self.lineage is None:
            raise StateFoldError(f"rollout {self.rollout_id}: its token lineage is unknown (restored from a snapshot "
                                 "written before lineage was kept); replay it from its first event")
        return TrainingRecord(header, group_size, self.reward, self.finished, self.head_tokens.astype(np.int32),
                              self.lineage.logprobs.astype(np.float32), self.lineage.loss_mask(),
                              list(self.lineage.segments))

    def record_exports(self, exports: dict[str, bytes]) -> None:
        """A snapshot exported these resources: their earlier mutations are inside the
        exports now, so restore imports the exports and re-applies only what follows."""
        self.resource_states = dict(exports)
        self.mutations_since_export = [m for m in self.mutations_since_export if m.resource_id not in exports]

    # -- snapshot bytes --------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """The state as a snapshot holds it: ``STATE_MAGIC``, then zlib of the lengths, a JSON
        document of everything but the token arrays, and the head's token ids and logprobs as
        raw little-endian arrays. (The arrays were base64 strings inside zlib'd JSON until 2026-12-01:
        a 41-turn state took twice as long to read back, see :meth:`from_bytes`.)"""
        doc = {
            "format": SNAPSHOT_FORMAT,
            "rollout_id": self.rollout_id, "group_id": self.group_id,
            "attempt": self.attempt, "epoch": self.epoch,
            "next_turn": self.next_turn, "next_seq": self.next_seq,
            "finished": self.finished, "reward": self.reward, "acknowledged": self.acknowledged,
            "restarts": self.restarts, "model_calls": self.model_calls, "mutation_count": self.mutation_count,
            "policy_versions": self.policy_versions, "topology": self.topology, "failure": self.failure,
            "messages": [[m.role, m.content] for m in self.messages],
            "head_call_id": self.head_call_id,
            "actions": self.actions, "output_tokens": self.output_tokens, "outcome": self.outcome,
            "resources": {k: base64.b64encode(v).decode() for k, v in self.resource_states.items()},
            "mutations": [m.to_dict() for m in self.mutations_since_export],
        }
        logprobs = b""
        if self.lineage is not None:
            doc["lineage"] = [[g.start, g.end, g.generated, g.attempt, g.turn, g.call_id, g.policy_version]
                              for g in self.lineage.segments]
            logprobs = self.lineage.logprobs.astype("<f4").tobytes()
        else:
            doc["format"] = _SNAPSHOT_FORMAT_V2  # what it knows is what an older version wrote
        text = json.dumps(doc, separators=(",", ":")).encode()
        tokens = self.head_tokens.astype("<i4").tobytes()
        return STATE_MAGIC + zlib.compress(_STATE_LENGTHS.pack(len(text), len(tokens), len(logprobs))
                                           + text + tokens + logprobs, 1)

    @classmethod
    def from_bytes(cls, data: bytes, where: RecordLocation | None = None) -> RolloutState:
        """A state :meth:`to_bytes` wrote, or one an earlier version wrote (zlib'd JSON, the
        arrays base64 inside it)."""
        tokens: bytes | None = None  # None: the earlier layout, which holds the arrays inside the document
        logprobs = b""
        try:
            if data[:len(STATE_MAGIC)] == STATE_MAGIC:
                doc, tokens, logprobs = _unpacked(zlib.decompress(data[len(STATE_MAGIC):]))
            else:
                doc = _document(zlib.decompress(data))
        except (zlib.error, ValueError) as exc:
            raise StateFoldError(f"snapshot at {where} is not a rollout state: {exc!r}") from exc
        if doc.get("format") not in (SNAPSHOT_FORMAT, _SNAPSHOT_FORMAT_V2, _SNAPSHOT_FORMAT_V1):
            raise StateFoldError(f"snapshot at {where} has format {doc.get('format')!r}, expected {SNAPSHOT_FORMAT!r}")
        try:
            if tokens is None:  # base64 strings; a state's logprobs are there exactly when its lineage is
                tokens = base64.b64decode(doc["head_tokens"])
                logprobs = base64.b64decode(doc["logprobs"]) if "lineage" in doc else b""
            return cls._from_doc(doc, np.frombuffer(tokens, dtype="<i4").copy(),
                                 np.frombuffer(logprobs, dtype="<f4").copy())
        except (KeyError, TypeError, ValueError) as exc:
            raise StateFoldError(f"snapshot at {where} lacks or mangles field {exc}; written by another version?") from exc

    @classmethod
    def _from_doc(cls, doc: dict[str, Any], head_tokens: np.ndarray, logprobs: np.ndarray) -> RolloutState:
        ids = doc["spec"] if doc["format"] == _SNAPSHOT_FORMAT_V1 else doc
        messages = [Message(r, c) for r, c in doc["messages"]]
        lineage = None
        if "lineage" in doc:
            lineage = TokenLineage([TokenSegment(*g) for g in doc["lineage"]], logprobs)
        return cls(
            rollout_id=ids["rollout_id"], group_id=ids["group_id"], attempt=doc["attempt"], epoch=doc["epoch"],
            next_turn=doc["next_turn"], next_seq=doc["next_seq"], finished=doc["finished"], reward=doc["reward"],
            acknowledged=doc.get("acknowledged", False), restarts=doc.get("restarts", 0),
            # 0.1.0 kept no counters: one call and (at most) one mutation per committed turn is its shape
            model_calls=doc.get("model_calls", doc["next_turn"]), mutation_count=doc.get("mutation_count", 0),
            policy_versions=list(doc.get("policy_versions", [])),
            topology=doc.get("topology", ""), failure=doc.get("failure"),
            messages=messages, head_call_id=doc["head_call_id"], head_tokens=head_tokens,
            actions=list(doc["actions"]), output_tokens=doc["output_tokens"], outcome=doc["outcome"],
            resource_states={k: base64.b64decode(v) for k, v in doc["resources"].items()},
            mutations_since_export=[MutationRecord.from_dict(m) for m in doc.get("mutations", [])],
            lineage=lineage,
        )


def _unpacked(payload: bytes) -> tuple[dict[str, Any], bytes, bytes]:
    """The JSON document, token ids and logprobs of a decompressed :meth:`RolloutState.to_bytes`;
    ValueError if the lengths it starts with do not add up to the payload."""
    if len(payload) < _STATE_LENGTHS.size:
        raise ValueError(f"{len(payload)} bytes, shorter than the lengths that lead a state")
    text, tokens, logprobs = _STATE_LENGTHS.unpack_from(payload)
    start = _STATE_LENGTHS.size
    if start + text + tokens + logprobs != len(payload) or tokens % 4 or logprobs % 4:
        raise ValueError(f"lengths {text}+{tokens}+{logprobs} do not match the {len(payload) - start} bytes after them")
    doc = _document(payload[start:start + text])
    start += text
    return doc, payload[start:start + tokens], payload[start + tokens:]


def _document(text: bytes) -> dict[str, Any]:
    """A state's JSON document; ValueError unless it is an object."""
    doc = json.loads(text)
    if not isinstance(doc, dict):
        raise ValueError(f"the document is a {type(doc).__name__}, not an object")
    return doc


def restore_state(history: RolloutHistory, group_id: str = "") -> RolloutState:
    """A rollout's state after every committed, unfenced event the journal holds:
    its newest snapshot, then the events after it, applied in order.

    Raises :class:`StateFoldError` (naming the record) when the events do not apply
    in order, or when the snapshot stream knows a newer attempt than the events read:
    a prefix was read, and continuing from it would reuse an epoch.
    """
    if history.snapshot is not None:
        state = RolloutState.from_bytes(history.snapshot.state, history.snapshot.location)
    else:
        first = history.events[0].event.header if history.events else None
        state = RolloutState(history.rollout_id, first.group_id if first else group_id)
    for item in history.events:
        try:
            state.apply(item.event)
        except StateFoldError as exc:
            raise StateFoldError(f"{exc} at {item.location}") from None
    fence = history.fence
    if fence is not None and fence.epoch > state.epoch:
        raise StateFoldError(
            f"rollout {history.rollout_id}: the snapshot stream holds attempt {fence.attempt} (epoch {fence.epoch}) "
            f"at {fence.location}, but the events read reach epoch {state.epoch} only; the event log was read "
            "incompletely (an open transaction holding it back?) or the attempt's record is lost")
    return state
