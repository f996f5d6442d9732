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
import dataclasses
import hashlib
import json
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from rollout_journal.journal.errors import RecordLocation
from rollout_journal.journal.events import (
    CONTINUATION_EOS_SPLICE,
    CONTINUATION_NEW_SEQUENCE,
    RECORD_FINISHED,
    RECORD_GIVEN_UP,
    RECORD_UNFINISHED,
    AttemptStarted,
    ChatMessage,
    FenceEntry,
    Header,
    ModelCall,
    ModelCallProgress,
    OutputSegment,
    ResourceMutation,
    RolloutFinished,
    SamplingParams,
    ToolCallRef,
    TrainingRecord,
    TurnCompleted,
)

# Re-exported: the aggregate's base and its error, which live below the participants for the
# journal's writer (its per-rollout summaries fold them too)
from rollout_journal.journal.progress import RolloutProgress as RolloutProgress
from rollout_journal.journal.progress import StateFoldError as StateFoldError
from rollout_journal.journal.restore import RolloutHistory
from rollout_journal.participants.resources import MutationRecord
from rollout_journal.participants.rollout.effects import EffectLog
from rollout_journal.participants.rollout.lineage import LineageMismatch, TokenLineage, TokenSegment, extended_segments
from rollout_journal.participants.rollout.mutations import mutation_record

SNAPSHOT_FORMAT = "rollout-journal/rollout-state/4"
_SNAPSHOT_FORMAT_V3 = "rollout-journal/rollout-state/3"  # before messages were ChatMessages and runs had labels
_SNAPSHOT_FORMAT_V2 = "rollout-journal/rollout-state/2"  # before the token lineage was kept
_SNAPSHOT_FORMAT_V1 = "rollout-journal/rollout-state/1"  # 0.1.0: exports only, no counters
# The byte layout around the document (to_bytes); older states are zlib'd JSON, which never
# starts with these bytes (a zlib stream starts with 0x78 here).
STATE_MAGIC = b"RJS\x01"
_STATE_LENGTHS = struct.Struct("<III")  # the JSON document's, the token ids', the logprobs' byte lengths
# The layout for snapshots written in blocks (to_sections) ends with its lengths and this magic:
# its growing sections come first, so that their blocks stay the same from one snapshot to the next.
SECTIONS_MAGIC = b"RJS\x02"
# The lengths of the token ids, logprobs, messages, closed sequences' ids and logprobs, compressed document.
_SECTIONS_TRAILER = struct.Struct("<IIIIII4s")


def full_prompt(head_tokens: np.ndarray, call: ModelCall) -> np.ndarray:
    """A call's whole prompt: its parent's prompt+output up to ``prefix_len``, then the delta."""
    prompt: np.ndarray = np.concatenate([head_tokens[: call.prefix_len], call.prompt_delta]).astype(np.int32)
    return prompt


def outcome_of(state: RolloutState, resource_digests: Mapping[str, str]) -> dict[str, Any]:
    """What a finished rollout produced, enough to compare two runs (``resource_digests``: its
    resources' state digests at the end): written into ``RolloutFinished`` so a result is offered
    again without recomputing it; applying that event makes it the state's ``outcome``."""
    return {
        "reward": state.reward,
        "turns": state.next_turn,
        "actions": state.actions,
        "tokens_sha256": hashlib.sha256(state.head_tokens.astype("<i4").tobytes()).hexdigest(),
        "output_tokens": state.output_tokens,
        "resource_digests": dict(resource_digests),
    }


def prompt_digest(prompt: np.ndarray, params: SamplingParams | None = None) -> str:
    """What a ``ModelCallProgress`` names a call by: its prompt, and with ``params`` the
    distribution it samples from (temperature, top_p, top_k, float32-rounded as a backend gets
    them), so a call asked again with other sampling never continues tokens drawn from another
    distribution (their runs would be labelled with the new parameters)."""
    digest = hashlib.sha256(np.ascontiguousarray(prompt, dtype="<i4").tobytes())
    if params is not None:
        spelled = (float(np.float32(params.temperature)), float(np.float32(params.top_p)), max(int(params.top_k), -1))
        digest.update(json.dumps(spelled).encode())
    return digest.hexdigest()


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


class ModelCallView(Protocol):
    """What a model call reads of its rollout, and all it may: the lineage head it continues, the
    turn's calls the journal holds, the progress of a call cut short, and the next event's header
    (read when the event is built: the call's progress marks take sequence numbers meanwhile).
    :class:`RolloutState` provides it; the model gate (``ModelParticipant.call``) takes nothing more."""

    @property
    def rollout_id(self) -> str:
        """The rollout (errors name it)."""
        ...

    @property
    def attempt(self) -> int:
        """The attempt making the call (its output runs name it)."""
        ...

    @property
    def head_call_id(self) -> str | None:
        """The rollout's last call, the new call's parent (None: this is its first)."""
        ...

    @property
    def head_tokens(self) -> np.ndarray:
        """The head's prompt+output, which the new call's prompt extends."""
        ...

    def journaled_call(self, call_index: int) -> ModelCall | None: ...

    def partial_call(
        self, call_index: int, prompt: np.ndarray, params: SamplingParams | None = None
    ) -> PartialCall | None: ...

    def header(self, writer: str) -> Header: ...


@dataclass
class RolloutState(RolloutProgress):
    """Everything an agent needs to run a rollout's next turn."""

    messages: list[ChatMessage] = field(default_factory=list)
    head_call_id: str | None = None
    head_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))  # prompt+output of the head
    actions: list[str] = field(default_factory=list)
    outcome: dict[str, Any] | None = None  # what the finished rollout produced (see outcome_of)
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
    # Every effect of the current life by position (turn, step): what a re-driven agent is answered from
    # (see rollout_journal.participants.rollout.effects and the session API).
    effects: EffectLog = field(default_factory=EffectLog)
    # Every attempt of the rollout, oldest first, as its fence history keeps them (what its training
    # record carries): one entry per AttemptStarted applied, restarts included. None when read from a
    # snapshot written before it was kept (restore_state takes them from the fence record then).
    attempts: list[FenceEntry] | None = field(default_factory=list)
    # The agent runs the rollout served, oldest first, by the digest of their key (run_digest; an
    # AttemptStarted names the run it serves): how a gateway that lost its memory (a restart, the
    # rollout's partition gone and back) still tells the current run from an older one.
    runs: list[str] = field(default_factory=list)
    # How the calls of the current conversation continued their parents (the training record's counters)
    calls: int = 0
    calls_drifted: int = 0  # prefix_len short of the parent's prompt+output (not a new sequence): tokens lost
    eos_splices: int = 0
    new_sequences: int = 0
    template_mismatch_calls: int = 0

    # -- what a model call reads (ModelCallView) ----------------------------------------
    def journaled_call(self, call_index: int) -> ModelCall | None:
        """The call at ``call_index`` of the turn under way, if the journal holds it: a redone
        turn replays it instead of calling the model again."""
        return self.turn_calls[call_index] if call_index < len(self.turn_calls) else None

    def partial_call(
        self, call_index: int, prompt: np.ndarray, params: SamplingParams | None = None
    ) -> PartialCall | None:
        """The journaled progress of the call at ``call_index`` of the turn under way, if it was
        made with this very prompt (and, with ``params``, sampled from the same distribution)."""
        partial = self.partial
        if partial is None or not partial.matches(self.next_turn, call_index, prompt_digest(prompt, params)):
            return None
        return partial

    def _on_attempt(self, event: AttemptStarted) -> None:
        if self.starts_over(event):
            self.turn_calls, self.partial = [], None
            self.head_call_id, self.head_tokens = None, np.zeros(0, dtype=np.int32)
            self.lineage = TokenLineage()
            self.calls = self.calls_drifted = self.eos_splices = self.new_sequences = self.template_mismatch_calls = 0
            self.actions, self.outcome = [], None
            self.resource_states, self.mutations_since_export = {}, []
            self.messages = list(event.messages)
            self.effects = EffectLog()
        elif event.resumed_from_turn == 0 and event.messages:  # a fresh start: the conversation begins here
            self.messages = list(event.messages)
        if self.attempts is not None:
            self.attempts.append(FenceEntry.of(event.header))
        if event.run is not None and self.runs[-1:] != [event.run]:  # the run it names is the current one
            self.runs = [r for r in self.runs if r != event.run] + [event.run]
        super()._on_attempt(event)

    def run_standing(self, key: str) -> RunStanding | None:
        """Where the agent run ``key`` names stands among the runs the journal holds: ``current``
        (the newest attempt's), ``older`` (one a newer run fenced) or ``unknown``; None when no
        attempt named a run (a rollout no keyed agent drove, or journaled before runs were kept)."""
        if not self.runs:
            return None
        digest = run_digest(key)
        if digest == self.runs[-1]:
            return "current"
        return "older" if digest in self.runs else "unknown"

    def _on_model_call(self, event: ModelCall) -> None:
        super()._on_model_call(event)
        prompt = full_prompt(self.head_tokens, event)
        new_sequence = event.continuation == CONTINUATION_NEW_SEQUENCE
        self.calls += 1
        self.calls_drifted += (
            self.head_call_id is not None and not new_sequence and event.prefix_len != len(self.head_tokens)
        )
        self.eos_splices += event.continuation == CONTINUATION_EOS_SPLICE
        self.new_sequences += new_sequence
        self.template_mismatch_calls += event.template_check is not None and not event.template_check.agrees
        if new_sequence and self.head_call_id is not None and self.lineage is not None:
            self.lineage.close_sequence(self.head_tokens)
        self.head_tokens = np.concatenate(
            [self.head_tokens[: event.prefix_len], event.prompt_delta, event.output_ids]
        ).astype(np.int32)
        self.head_call_id = event.call_id
        self.effects.on_model_call(event, prompt, len(self.head_tokens))
        if self.lineage is not None:
            try:
                self.lineage.follow(self.rollout_id, len(self.head_tokens), event)
            except LineageMismatch as exc:
                raise StateFoldError(str(exc)) from None
        if event.header.turn == self.next_turn:
            self.turn_calls.append(event)
            if self.partial is not None and self.partial.matches(
                event.header.turn, len(self.turn_calls) - 1, self.partial.prompt_sha256
            ):
                self.partial = None  # the call finished: its ModelCall holds every token

    def _on_call_progress(self, event: ModelCallProgress) -> None:
        super()._on_call_progress(event)
        h, partial = event.header, self.partial
        if partial is not None and not partial.matches(h.turn, event.call_index, event.prompt_sha256):
            partial = None  # another call's: this one has no tokens held yet
        if event.start == 0 and partial is None:
            partial = self.partial = PartialCall(
                h.turn,
                event.call_index,
                event.prompt_sha256,
                np.zeros(0, dtype=np.int32),
                np.zeros(0, dtype=np.float32),
                [],
            )
        elif partial is None or event.start != len(partial.output_ids):
            held = 0 if partial is None else len(partial.output_ids)
            raise StateFoldError(
                f"rollout {self.rollout_id}: progress of call {event.call_id} starts at token {event.start}, but "
                f"the journal holds {held} tokens of that call before it; a progress record is missing"
            )
        partial.output_ids = np.concatenate([partial.output_ids, event.output_ids]).astype(np.int32)
        partial.logprobs = np.concatenate([partial.logprobs, event.logprobs]).astype(np.float32)
        partial.segments = extended_segments(
            partial.segments, h.attempt, event.policy_version, len(event.output_ids), event.logprob_mode
        )

    def _on_mutation(self, event: ResourceMutation) -> None:
        super()._on_mutation(event)
        self.mutations_since_export.append(mutation_record(event))
        self.effects.on_mutation(event)

    def _on_turn(self, event: TurnCompleted) -> None:
        super()._on_turn(event)
        self.turn_calls, self.partial = [], None
        self.messages.extend(event.messages)
        self.actions.extend(event.actions)

    def _on_finished(self, event: RolloutFinished) -> None:
        super()._on_finished(event)
        self.outcome = json.loads(event.result_json)

    def training_record(self, header: Header, group_size: int, group_policy: str = "wait") -> TrainingRecord:
        """What a trainer takes of this rollout as it stands (``header``: its ``RolloutFinished``'s),
        complete: every sequence of its conversation (the closed ones, then the head's), the logprob
        of each sampled token, the loss mask, the labelled runs, how its calls continued their
        parents, its fence history (``attempts``). Raises :class:`StateFoldError` when the lineage
        is unknown (restored from an older snapshot)."""
        lineage = self.lineage
        if lineage is None:
            raise StateFoldError(
                f"rollout {self.rollout_id}: its token lineage is unknown (restored from a snapshot "
                "written before lineage was kept); replay it from its first event"
            )
        return TrainingRecord(
            header,
            group_size,
            self.reward,
            self.finished,
            lineage.record_ids(self.head_tokens).astype(np.int32),
            lineage.record_logprobs().astype(np.float32),
            lineage.record_loss_mask(),
            lineage.record_segments(),
            list(self.attempts or []),
            status=RECORD_FINISHED if self.finished else RECORD_GIVEN_UP if self.given_up else RECORD_UNFINISHED,
            group_policy=group_policy,
            sequence_starts=np.asarray(lineage.sequence_starts, dtype="<i4"),
            calls=self.calls,
            calls_drifted=self.calls_drifted,
            eos_splices=self.eos_splices,
            new_sequences=self.new_sequences,
            template_mismatch_calls=self.template_mismatch_calls,
        )

    def given_up_record(self, header: Header, group_size: int, group_policy: str) -> TrainingRecord:
        """What a trainer gets of this rollout given up (``header``: its ``RolloutGivenUp``'s): no
        tokens, no reward, its fence history, and the workload's ``failure_policy.group``
        (``group_policy``), so the feed resolves its group instead of waiting for it. The only place
        such a record is built."""
        empty = np.zeros(0, dtype=np.int32)
        return TrainingRecord(
            header,
            group_size,
            None,
            False,
            empty,
            empty.astype(np.float32),
            empty.astype(bool),
            [],
            list(self.attempts or []),
            status=RECORD_GIVEN_UP,
            group_policy=group_policy,
        )

    def with_exports(self, exports: Mapping[str, bytes]) -> RolloutState:
        """This state as a snapshot taken now with these resource exports holds it (this state is
        not changed): the exports, and of the mutations since the last export only those of other
        resources (an export holds every earlier mutation of its resource), so restore imports the
        exports and re-applies only what follows them. The one rule for what a snapshot keeps of
        the resources: the draft is written from it, and the live state records it."""
        return dataclasses.replace(
            self,
            resource_states=dict(exports),
            mutations_since_export=[m for m in self.mutations_since_export if m.resource_id not in exports],
        )

    def record_exports(self, exports: Mapping[str, bytes]) -> None:
        """A snapshot was drafted with these exports: the live state keeps the resources as the
        snapshot holds them (:meth:`with_exports`), as a restore from it would read them back, so a
        resource server that lost the rollout is brought back from the same exports and mutations."""
        exported = self.with_exports(exports)
        self.resource_states, self.mutations_since_export = exported.resource_states, exported.mutations_since_export

    # -- snapshot bytes --------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """The state as a snapshot holds it: ``STATE_MAGIC``, then zlib of the lengths, a JSON
        document of everything but the token arrays, and the head's token ids and logprobs as
        raw little-endian arrays. (The arrays were base64 strings inside zlib'd JSON until 2026-12-01:
        a 41-turn state took twice as long to read back, see :meth:`from_bytes`.)"""
        doc, tokens, logprobs = self._document()
        doc["messages"] = [_message_doc(m) for m in self.messages]
        text = json.dumps(doc, separators=(",", ":")).encode()
        return STATE_MAGIC + zlib.compress(
            _STATE_LENGTHS.pack(len(text), len(tokens), len(logprobs)) + text + tokens + logprobs, 1
        )

    def to_sections(self) -> tuple[bytes, tuple[int, ...]]:
        """The state laid out for a snapshot written in blocks (``SnapshotDraft.stable``): the head's
        token ids, its logprobs (raw little-endian arrays), the conversation (a JSON line per
        message) and the closed sequences' ids and logprobs (``history_policy: new_sequence``), the
        five sections that only grow from one turn to the next, then zlib of the rest of the
        document, then ``_SECTIONS_TRAILER`` (the six lengths and ``SECTIONS_MAGIC``). The bytes,
        and the lengths of the five growing sections."""
        doc, tokens, logprobs = self._document()
        messages = b"".join(json.dumps(_message_doc(m), separators=(",", ":")).encode() + b"\n" for m in self.messages)
        closed_ids = closed_logprobs = b""
        closed = doc.get("closed")
        if closed is not None and self.lineage is not None:  # raw, in sections, instead of inside the document
            del closed["ids"], closed["logprobs"]
            closed_ids = self.lineage.closed_ids.astype("<i4").tobytes()
            closed_logprobs = self.lineage.closed_logprobs.astype("<f4").tobytes()
        rest = zlib.compress(json.dumps(doc, separators=(",", ":")).encode(), 1)
        stable = (len(tokens), len(logprobs), len(messages), len(closed_ids), len(closed_logprobs))
        trailer = _SECTIONS_TRAILER.pack(*stable, len(rest), SECTIONS_MAGIC)
        return tokens + logprobs + messages + closed_ids + closed_logprobs + rest + trailer, stable

    def _document(self) -> tuple[dict[str, Any], bytes, bytes]:
        """The snapshot's document without its messages, the head's token ids and its logprobs."""
        doc = {
            "format": SNAPSHOT_FORMAT,
            "rollout_id": self.rollout_id,
            "group_id": self.group_id,
            "attempt": self.attempt,
            "epoch": self.epoch,
            "next_turn": self.next_turn,
            "next_seq": self.next_seq,
            "finished": self.finished,
            "reward": self.reward,
            "acknowledged": self.acknowledged,
            "restarts": self.restarts,
            "model_calls": self.model_calls,
            "mutation_count": self.mutation_count,
            "policy_versions": self.policy_versions,
            "topology": self.topology,
            "failure": self.failure,
            "failures": self.failures,
            "given_up": self.given_up,
            "head_call_id": self.head_call_id,
            "actions": self.actions,
            "output_tokens": self.output_tokens,
            "progress_tokens": self.progress_tokens,  # a reader of an earlier version skips the key
            "outcome": self.outcome,
            "resources": {k: base64.b64encode(v).decode() for k, v in self.resource_states.items()},
            "mutations": [m.to_dict() for m in self.mutations_since_export],
        }
        if self.attempts is not None:  # a reader of an earlier version skips the key
            doc["attempts"] = [[a.attempt, a.epoch, a.seq, a.writer, a.ts_ms] for a in self.attempts]
        if self.runs:  # a reader of an earlier version skips the key
            doc["runs"] = self.runs
        if self.effects.known:  # an optional key: a reader that lacks it replays the rollout from its first event
            doc["effects"] = self.effects.to_doc(
                self.head_tokens, self.lineage.logprobs if self.lineage is not None else None
            )
        logprobs = b""
        lineage = self.lineage
        doc["counts"] = [  # a reader of an earlier version skips the key
            self.calls,
            self.calls_drifted,
            self.eos_splices,
            self.new_sequences,
            self.template_mismatch_calls,
        ]
        if lineage is not None:
            doc["lineage"] = [_segment_row(g) for g in lineage.segments]
            if lineage.sequence_starts:  # rare (history_policy new_sequence): plain lists are fine
                doc["closed"] = {
                    "ids": lineage.closed_ids.tolist(),
                    "logprobs": base64.b64encode(lineage.closed_logprobs.astype("<f4").tobytes()).decode(),
                    "segments": [_segment_row(g) for g in lineage.closed_segments],
                    "starts": lineage.sequence_starts,
                }
            logprobs = lineage.logprobs.astype("<f4").tobytes()
        else:
            doc["format"] = _SNAPSHOT_FORMAT_V2  # what it knows is what an older version wrote
        return doc, self.head_tokens.astype("<i4").tobytes(), logprobs

    @classmethod
    def from_bytes(cls, data: bytes, where: RecordLocation | None = None) -> RolloutState:
        """A state :meth:`to_bytes` wrote, or one an earlier version wrote (zlib'd JSON, the
        arrays base64 inside it)."""
        tokens: bytes | None = None  # None: the earlier layout, which holds the arrays inside the document
        logprobs = b""
        try:
            sections = _sections(data)
            if sections is not None:
                doc, tokens, logprobs = sections
            elif data[: len(STATE_MAGIC)] == STATE_MAGIC:
                doc, tokens, logprobs = _unpacked(zlib.decompress(data[len(STATE_MAGIC) :]))
            else:
                doc = _document(zlib.decompress(data))
        except (zlib.error, ValueError) as exc:
            raise StateFoldError(f"snapshot at {where} is not a rollout state: {exc!r}") from exc
        if doc.get("format") not in (SNAPSHOT_FORMAT, _SNAPSHOT_FORMAT_V3, _SNAPSHOT_FORMAT_V2, _SNAPSHOT_FORMAT_V1):
            raise StateFoldError(f"snapshot at {where} has format {doc.get('format')!r}, expected {SNAPSHOT_FORMAT!r}")
        try:
            if tokens is None:  # base64 strings; a state's logprobs are there exactly when its lineage is
                tokens = base64.b64decode(doc["head_tokens"])
                logprobs = base64.b64decode(doc["logprobs"]) if "lineage" in doc else b""
            return cls._from_doc(
                doc, np.frombuffer(tokens, dtype="<i4").copy(), np.frombuffer(logprobs, dtype="<f4").copy()
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise StateFoldError(
                f"snapshot at {where} lacks or mangles field {exc}; written by another version?"
            ) from exc

    @classmethod
    def _from_doc(cls, doc: dict[str, Any], head_tokens: np.ndarray, logprobs: np.ndarray) -> RolloutState:
        ids = doc["spec"] if doc["format"] == _SNAPSHOT_FORMAT_V1 else doc
        messages = [_message_of(m) for m in doc["messages"]]  # [role, content] before format 4
        lineage = None
        if "lineage" in doc:  # rows of 7 fields before format 4: the sampling labels take their defaults
            closed = doc.get("closed")
            lineage = TokenLineage(
                [TokenSegment(*g) for g in doc["lineage"]],
                logprobs,
                np.asarray(closed["ids"], dtype=np.int32) if closed else None,
                np.frombuffer(_raw(closed["logprobs"]), dtype="<f4").copy() if closed else None,
                [TokenSegment(*g) for g in closed["segments"]] if closed else None,
                closed["starts"] if closed else None,
            )
        counts = doc.get("counts", [0, 0, 0, 0, 0])
        attempts = [FenceEntry(*a) for a in doc["attempts"]] if "attempts" in doc else None
        return cls(
            rollout_id=ids["rollout_id"],
            group_id=ids["group_id"],
            attempt=doc["attempt"],
            epoch=doc["epoch"],
            next_turn=doc["next_turn"],
            next_seq=doc["next_seq"],
            finished=doc["finished"],
            reward=doc["reward"],
            acknowledged=doc.get("acknowledged", False),
            restarts=doc.get("restarts", 0),
            # 0.1.0 kept no counters: one call and (at most) one mutation per committed turn is its shape
            model_calls=doc.get("model_calls", doc["next_turn"]),
            mutation_count=doc.get("mutation_count", 0),
            policy_versions=list(doc.get("policy_versions", [])),
            topology=doc.get("topology", ""),
            failure=doc.get("failure"),
            failures=doc.get("failures", 0),  # keys added without a format change: older states had none
            given_up=doc.get("given_up", False),
            messages=messages,
            head_call_id=doc["head_call_id"],
            head_tokens=head_tokens,
            actions=list(doc["actions"]),
            output_tokens=doc["output_tokens"],
            progress_tokens=doc.get("progress_tokens", 0),  # an earlier version's snapshot dropped them
            outcome=doc["outcome"],
            resource_states={k: base64.b64decode(v) for k, v in doc["resources"].items()},
            mutations_since_export=[MutationRecord.from_dict(m) for m in doc.get("mutations", [])],
            lineage=lineage,
            attempts=attempts,
            runs=list(doc.get("runs", [])),
            calls=counts[0],
            calls_drifted=counts[1],
            eos_splices=counts[2],
            new_sequences=counts[3],
            template_mismatch_calls=counts[4],
            effects=EffectLog.from_doc(doc.get("effects"), head_tokens, logprobs if lineage is not None else None),
        )


RunStanding = Literal["current", "older", "unknown"]


def run_digest(key: str) -> str:
    """What the journal keeps of an agent run's key (``AttemptStarted.run``): enough to recognise
    it, nothing a reader of the journal could present as the key."""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def _segment_row(g: TokenSegment) -> list[Any]:
    return [
        g.start,
        g.end,
        g.generated,
        g.attempt,
        g.turn,
        g.call_id,
        g.policy_version,
        g.temperature,
        g.top_p,
        g.top_k,
        g.logprob_mode,
        g.renormalized,
        g.constrained,
    ]


def _message_doc(m: ChatMessage) -> dict[str, Any]:
    """A message in a snapshot's document: role and content, and the other fields when set."""
    doc: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        doc["tool_calls"] = [[c.id, c.name, c.arguments_json] for c in m.tool_calls]
    for key in ("tool_call_id", "name", "call_id"):
        if getattr(m, key) is not None:
            doc[key] = getattr(m, key)
    return doc


def _message_of(doc: Any) -> ChatMessage:
    if isinstance(doc, list):  # formats 1-3: [role, content]
        return ChatMessage(doc[0], doc[1])
    return ChatMessage(
        doc["role"],
        doc["content"],
        [ToolCallRef(*c) for c in doc.get("tool_calls", [])],
        doc.get("tool_call_id"),
        doc.get("name"),
        doc.get("call_id"),
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
    doc = _document(payload[start : start + text])
    start += text
    return doc, payload[start : start + tokens], payload[start + tokens :]


def _sections(data: bytes) -> tuple[dict[str, Any], bytes, bytes] | None:
    """The document (its messages and closed sequences back in it), token ids and logprobs of a
    :meth:`RolloutState.to_sections` state; None for another layout (an earlier one never ends
    with a trailer whose lengths add up); ValueError if its document does not read."""
    size = _SECTIONS_TRAILER.size
    if len(data) < size or data[-4:] != SECTIONS_MAGIC:
        return None
    *lengths, rest, _ = _SECTIONS_TRAILER.unpack_from(data, len(data) - size)
    if sum(lengths) + rest + size != len(data) or any(n % 4 for i, n in enumerate(lengths) if i != 2):
        return None
    starts = [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    tokens, logprobs, messages, closed_ids, closed_logprobs = (data[a:b] for a, b in zip(starts, starts[1:]))
    doc = _document(zlib.decompress(data[starts[-1] : starts[-1] + rest]))
    doc["messages"] = [json.loads(line) for line in messages.split(b"\n")[:-1]]
    if "closed" in doc:
        doc["closed"]["ids"] = np.frombuffer(closed_ids, dtype="<i4").copy()
        doc["closed"]["logprobs"] = closed_logprobs
    return doc, tokens, logprobs


def _raw(array: bytes | str) -> bytes:
    """A packed array as a document holds it: base64 text (``to_bytes``), or raw (``to_sections``)."""
    return array if isinstance(array, bytes) else base64.b64decode(array)


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
        if state.attempts is None:  # written before states kept them: the fence record's, through its attempt
            fence = history.fence
            state.attempts = [entry for entry in fence.history if entry.epoch <= state.epoch] if fence else []
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
            "incompletely (an open transaction holding it back?) or the attempt's record is lost"
        )
    return state
