"""Every effect of a rollout's current life, by position: what a re-driven agent is answered from.

An effect is one model call (``ModelCall``) or one tool call made through the session API
(``ResourceMutation`` whose idempotency key ends ``/t<turn>/s<step>``). Its position is
``(turn, step)``: ``step`` counts the effects of that turn in program order, whatever their
kind (the shape of DBOS's step table). Each keeps the digest of the request that made it, so a
re-driven agent whose request differs at a position is caught (a nondeterminism error), and
enough of the answer to give it back without calling the model or the tool again.

The log is part of the aggregate: ``RolloutState.apply`` feeds it, a restart from turn 0
(a new life) empties it, and a snapshot keeps it (optional keys, read with defaults: a snapshot
written before the log was kept leaves it unknown, and the session replays the rollout from
its first event). A model answer's ids and logprobs are a span of the lineage head while the
head still holds them (the common case: every call extends its parent), else held as arrays.
"""

from __future__ import annotations

import base64
import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollout_journal.journal.events import ModelCall, OutputSegment, ResourceMutation, SamplingParams
from rollout_journal.participants.resources.canonical import canonical_json

__all__ = ["Effect", "EffectLog", "model_digest", "tool_digest", "TOOL_KEY"]

# A tool call made through the session API: its idempotency key names its position.
TOOL_KEY = re.compile(r"/t(\d+)/s(\d+)$")
MODEL = "model"
TOOL = "tool"


def sampling_json(params: SamplingParams) -> str:
    """The sampling parameters as the digest spells them (float32-rounded, as a backend sends them);
    ``top_k`` only when it is on, so a digest taken before it existed still matches."""
    spelled: dict[str, Any] = {
        "temperature": float(np.float32(params.temperature)),
        "top_p": float(np.float32(params.top_p)),
        "max_tokens": int(params.max_tokens),
        "seed": None if params.seed is None else int(params.seed),
    }
    if params.top_k > 0:
        spelled["top_k"] = int(params.top_k)
    return canonical_json(spelled)


def model_digest(prompt_ids: np.ndarray, params: SamplingParams, extra: str = "") -> str:
    """sha256 over the prompt ids (little-endian int32), the sampling parameters and ``extra``
    (what else decides the answer: a constraint's choices). The session journals it with the call
    as ``ModelCall.request_sha256``, which the effect log then reads back."""
    digest = hashlib.sha256(np.ascontiguousarray(prompt_ids, dtype="<i4").tobytes())
    digest.update(b"\0" + sampling_json(params).encode())
    if extra:
        digest.update(b"\0" + extra.encode())
    return digest.hexdigest()


def tool_digest(resource: str, op: str, args_json: str) -> str:
    """sha256 over ``[resource, op, args]`` in canonical JSON (``args_json`` already canonical)."""
    return hashlib.sha256(f'["{resource}","{op}",{args_json}]'.encode()).hexdigest()


@dataclass
class Effect:
    """One journaled effect at ``(turn, step)``."""

    turn: int
    step: int
    kind: str  # MODEL or TOOL
    digest: str
    ref: str  # a model call's call_id, a tool call's idempotency key
    attempt: int  # the attempt that made it
    ts_ms: int = 0  # when it was journaled (a replayed answer carries the same)
    # model calls
    prompt_len: int = 0
    out_start: int = -1  # where the head held the output when it was made (a snapshot stores the span)
    output_ids: np.ndarray | None = None
    logprobs: np.ndarray | None = None
    finish_reason: str = ""
    policy_version: str = ""
    segments: list[OutputSegment] = field(default_factory=list)
    sampling: str = ""  # sampling_json of the call (for error messages)
    # tool calls
    resource_id: str = ""
    op: str = ""
    args_json: str = ""
    result_json: str = ""
    revision: int = 0

    @property
    def answer(self) -> tuple[np.ndarray, np.ndarray]:
        """A model call's output ids and logprobs."""
        assert self.output_ids is not None and self.logprobs is not None, f"{self.ref} is no model call"
        return self.output_ids, self.logprobs


class EffectLog:
    """The effects of the current life, by position. ``known`` is False for a state restored from
    a snapshot written before the log was kept (replay the rollout from its first event)."""

    def __init__(self, known: bool = True) -> None:
        self.known = known
        self._by_turn: dict[int, list[Effect]] = {}

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_turn.values())

    def at(self, turn: int, step: int) -> Effect | None:
        effects = self._by_turn.get(turn)
        return effects[step] if effects is not None and step < len(effects) else None

    def in_turn(self, turn: int) -> list[Effect]:
        return list(self._by_turn.get(turn, ()))

    def model_calls(self) -> list[Effect]:
        """Every model effect of the life, in order."""
        return [e for turn in sorted(self._by_turn) for e in self._by_turn[turn] if e.kind == MODEL]

    def all(self) -> list[Effect]:
        return [e for turn in sorted(self._by_turn) for e in self._by_turn[turn]]

    def clear(self) -> None:
        self._by_turn.clear()
        self.known = True

    # -- applied by RolloutState ------------------------------------------------------
    def on_model_call(self, event: ModelCall, prompt: np.ndarray, head_len: int) -> None:
        """``prompt``: the call's whole prompt; ``head_len``: the head's length after the call."""
        turn = event.header.turn
        effects = self._by_turn.setdefault(turn, [])
        effects.append(
            Effect(
                turn,
                len(effects),
                MODEL,
                # the digest the session journaled with the call (ModelCall.request_sha256); a call
                # journaled without one (before ModelCall.v3, or not through a session): its prompt and sampling
                event.request_sha256 or model_digest(prompt, event.sampling),
                event.call_id,
                event.header.attempt,
                event.header.ts_ms,
                prompt_len=len(prompt),
                out_start=head_len - len(event.output_ids),
                output_ids=np.asarray(event.output_ids, dtype=np.int32),
                logprobs=np.asarray(event.logprobs, dtype=np.float32),
                finish_reason=event.finish_reason,
                policy_version=event.policy_version,
                segments=event.output_segments(),
                sampling=sampling_json(event.sampling),
            )
        )

    def on_mutation(self, event: ResourceMutation) -> None:
        match = TOOL_KEY.search(event.idempotency_key)
        if match is None:
            return  # a mutation of an in-process environment's step (the project's agent), not a tool call
        turn = event.header.turn
        effects = self._by_turn.setdefault(turn, [])
        effects.append(
            Effect(
                turn,
                len(effects),
                TOOL,
                tool_digest(event.resource_id, event.op, event.args_json),
                event.idempotency_key,
                event.header.attempt,
                event.header.ts_ms,
                resource_id=event.resource_id,
                op=event.op,
                args_json=event.args_json,
                result_json=event.result_json,
                revision=event.revision,
            )
        )

    # -- snapshot keys ------------------------------------------------------------------
    def to_doc(self, head: np.ndarray, logprobs: np.ndarray | None) -> list[list[Any]]:
        """The log as the snapshot's ``effects`` key: model answers as spans of ``head`` and of the
        lineage's ``logprobs`` where both hold them (None: the state keeps no lineage), else base64 arrays."""
        doc: list[list[Any]] = []
        for e in self.all():
            if e.kind == MODEL:
                ids = e.output_ids if e.output_ids is not None else np.zeros(0, dtype=np.int32)
                end = e.out_start + len(ids)
                span_ok = (
                    logprobs is not None
                    and e.out_start >= 0
                    and end <= len(head)
                    and end <= len(logprobs)
                    and np.array_equal(head[e.out_start : end], ids)
                    and np.array_equal(logprobs[e.out_start : end].astype(np.float32), e.answer[1])
                )
                held: list[str] = []
                if not span_ok:
                    held = [
                        base64.b64encode(np.ascontiguousarray(ids, "<i4").tobytes()).decode(),
                        base64.b64encode(np.ascontiguousarray(e.logprobs, "<f4").tobytes()).decode(),
                    ]
                doc.append(
                    [
                        e.turn,
                        MODEL,
                        e.digest,
                        e.ref,
                        e.attempt,
                        e.prompt_len,
                        e.out_start,  # where it was made; its arrays are held when the spans do not hold it
                        len(ids),
                        e.finish_reason,
                        e.policy_version,
                        [[s.attempt, s.policy_version, s.tokens, s.logprob_mode] for s in e.segments],
                        e.sampling,
                        held,
                        e.ts_ms,
                    ]
                )
            else:
                doc.append(
                    [
                        e.turn,
                        TOOL,
                        e.digest,
                        e.ref,
                        e.attempt,
                        e.resource_id,
                        e.op,
                        e.args_json,
                        e.result_json,
                        e.revision,
                        e.ts_ms,
                    ]
                )
        return doc

    @classmethod
    def from_doc(cls, doc: list[list[Any]] | None, head: np.ndarray, logprobs: np.ndarray | None) -> EffectLog:
        if doc is None:
            return cls(known=False)
        log = cls()
        for row in doc:
            turn, kind = int(row[0]), row[1]
            effects = log._by_turn.setdefault(turn, [])
            if kind == MODEL:
                _, _, digest, ref, attempt, prompt_len, out_start, n, finish, version, segs, sampling, held, ts = row
                if held:
                    ids = np.frombuffer(base64.b64decode(held[0]), dtype="<i4").astype(np.int32)
                    lp = np.frombuffer(base64.b64decode(held[1]), dtype="<f4").astype(np.float32)
                elif logprobs is None or len(logprobs) < out_start + n:
                    # a span of logprobs the snapshot does not hold (an earlier version wrote it without
                    # its lineage): unknown, so the session replays the rollout from its first event
                    return cls(known=False)
                else:
                    ids = head[out_start : out_start + n].astype(np.int32)
                    lp = logprobs[out_start : out_start + n].astype(np.float32)
                effects.append(
                    Effect(
                        turn,
                        len(effects),
                        MODEL,
                        digest,
                        ref,
                        attempt,
                        ts,
                        prompt_len=prompt_len,
                        out_start=out_start,
                        output_ids=ids,
                        logprobs=lp,
                        finish_reason=finish,
                        policy_version=version,
                        segments=[OutputSegment(*seg) for seg in segs],  # [attempt, version, tokens, logprob_mode?]
                        sampling=sampling,
                    )
                )
            else:
                _, _, digest, ref, attempt, resource_id, op, args_json, result_json, revision, ts = row
                effects.append(
                    Effect(
                        turn,
                        len(effects),
                        TOOL,
                        digest,
                        ref,
                        attempt,
                        ts,
                        resource_id=resource_id,
                        op=op,
                        args_json=args_json,
                        result_json=result_json,
                        revision=revision,
                    )
                )
        return log
