"""Typed journal events, one dataclass per Avro record in ``schemas/``.

Field names match the current reader schema. Token ids and logprobs are numpy
arrays that the codec packs to little-endian bytes without copying element by
element, and unpacks as read-only views over the record's bytes.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import ClassVar, Union

import numpy as np

@dataclass(frozen=True)
class Header:
    rollout_id: str
    group_id: str
    attempt: int
    epoch: int
    turn: int
    seq: int
    ts_ms: int
    writer: str

    @staticmethod
    def now_ms() -> int:
        return time.time_ns() // 1_000_000


@dataclass(frozen=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 32
    seed: int | None = None


@dataclass(frozen=True)
class BlobRef:
    sha256: str
    size: int
    chunks: int


@dataclass(frozen=True)
class AttemptStarted:
    RECORD: ClassVar[str] = "AttemptStarted"
    header: Header
    resumed_from_turn: int
    topology: str
    reason: str
    messages: list[Message] = field(default_factory=list)  # the initial conversation of a start from turn 0
    override: str | None = None  # what the user changed on purpose (a resume with another topology)
    forked_from: str | None = None  # "<rollout_id>@<turn>" for a forked lineage


@dataclass(frozen=True)
class AttemptFenced:
    RECORD: ClassVar[str] = "AttemptFenced"
    header: Header
    fenced_attempt: int
    fenced_epoch: int
    reason: str


@dataclass(frozen=True, eq=False)
class ModelCall:
    """One model call. ``prompt = parent.prompt + parent.output`` (its first
    ``prefix_len`` tokens) followed by ``prompt_delta``."""

    RECORD: ClassVar[str] = "ModelCall"
    header: Header
    call_id: str
    parent_call_id: str | None
    policy_version: str
    sampling: SamplingParams
    prefix_len: int
    prompt_delta: np.ndarray = field(metadata={"dtype": "<i4"})
    output_ids: np.ndarray = field(metadata={"dtype": "<i4"})
    logprobs: np.ndarray = field(metadata={"dtype": "<f4"})
    finish_reason: str = "stop"
    latency_ms: float = 0.0

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ModelCall):
            return NotImplemented
        return all(
            np.array_equal(getattr(self, f.name), getattr(other, f.name))
            if "dtype" in f.metadata
            else getattr(self, f.name) == getattr(other, f.name)
            for f in dataclasses.fields(self)
        )


@dataclass(frozen=True)
class ResourceMutation:
    RECORD: ClassVar[str] = "ResourceMutation"
    header: Header
    resource_id: str
    kind: str
    op: str
    args_json: str
    idempotency_key: str
    prev_revision: int
    revision: int
    result_json: str
    state_digest: str
    chain_hash: str


@dataclass(frozen=True)
class TurnCompleted:
    RECORD: ClassVar[str] = "TurnCompleted"
    header: Header
    messages: list[Message]
    call_ids: list[str]
    resource_revisions: dict[str, int]
    reward: float | None = None
    actions: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class RolloutFinished:
    RECORD: ClassVar[str] = "RolloutFinished"
    header: Header
    reward: float
    turns: int
    result_json: str


@dataclass(frozen=True)
class RolloutFailed:
    """An attempt stopped on an infrastructure failure (never a reward): the rollout alone
    stops, the others run on, and a resume retries it as a new attempt."""

    RECORD: ClassVar[str] = "RolloutFailed"
    header: Header
    error: str
    reason: str


@dataclass(frozen=True)
class RolloutAcknowledged:
    RECORD: ClassVar[str] = "RolloutAcknowledged"
    header: Header
    acknowledged_by: str


@dataclass(frozen=True)
class Snapshot:
    RECORD: ClassVar[str] = "Snapshot"
    header: Header
    status: str
    covers_seq: int
    replay_partition: int
    replay_offset: int
    state: bytes
    state_sha256: str
    blob: BlobRef | None = None


@dataclass(frozen=True)
class BlobChunk:
    RECORD: ClassVar[str] = "BlobChunk"
    sha256: str
    index: int
    count: int
    data: bytes


@dataclass(frozen=True)
class ChainHead:
    """A resource's hash-chain head: its revision and the chain hash at that revision."""

    resource_id: str
    revision: int
    chain_hash: str


@dataclass(frozen=True)
class HeadCheckpoint:
    """Signed heads of every resource of a rollout, committed with the mutations they cover.

    Audit only: it changes no rollout state. Built and signed by ``journal.anchoring.HeadSigner``;
    an auditor holding the public key checks it with ``HeadVerifier``.
    """

    RECORD: ClassVar[str] = "HeadCheckpoint"
    header: Header
    life: int  # 0, then +1 each time the rollout starts over from turn 0
    heads: list[ChainHead]
    algorithm: str
    key_id: str
    signature: bytes


@dataclass(frozen=True)
class WorkloadRegistered:
    """A workload recorded in the journal (not a rollout event: it has no header)."""

    RECORD: ClassVar[str] = "WorkloadRegistered"
    name: str
    spec_json: str
    rollout_ids: list[str]
    topology: str
    ts_ms: int
    writer: str
    # True: acknowledgement keeps a marker, so a registered rollout missing from the snapshot stream
    # has not started; False (journals before 0.3): such a rollout was acknowledged.
    acknowledgement_markers: bool = False


@dataclass(frozen=True)
class FenceEntry:
    """One attempt of a rollout as its fence history keeps it."""

    attempt: int
    epoch: int
    seq: int  # of its AttemptStarted: older epochs' events from this seq on are superseded
    writer: str
    ts_ms: int


@dataclass(frozen=True)
class FenceHistory:
    """Every attempt of a rollout, oldest first, and whether the trainer took its result (not a
    rollout event: the value of the compacted key ``<rollout>/fence``)."""

    RECORD: ClassVar[str] = "FenceHistory"
    rollout_id: str
    attempts: list[FenceEntry]
    acknowledged_epoch: int | None = None


@dataclass(frozen=True)
class EventChunk:
    """One piece of a rollout event too large for one record; the journal splits and joins them."""

    RECORD: ClassVar[str] = "EventChunk"
    header: Header  # the chunked event's own
    record: str
    sha256: str
    index: int
    count: int
    size: int
    data: bytes


RolloutEvent = Union[
    AttemptStarted, AttemptFenced, ModelCall, ResourceMutation, TurnCompleted, RolloutFinished, RolloutFailed,
    RolloutAcknowledged, HeadCheckpoint,
]
Record = Union[RolloutEvent, Snapshot, BlobChunk, EventChunk, WorkloadRegistered, FenceHistory]

ROLLOUT_EVENT_TYPES: tuple[type, ...] = (
    AttemptStarted, AttemptFenced, ModelCall, ResourceMutation, TurnCompleted, RolloutFinished, RolloutFailed,
    RolloutAcknowledged, HeadCheckpoint,
)
"""What the events stream holds (besides the EventChunk pieces of a large one); a Snapshot,
BlobChunk, WorkloadRegistered or FenceHistory found there is a foreign record."""

EVENT_TYPES: tuple[type, ...] = (
    AttemptStarted, AttemptFenced, ModelCall, ResourceMutation, TurnCompleted,
    RolloutFinished, RolloutFailed, RolloutAcknowledged, Snapshot, BlobChunk, EventChunk, WorkloadRegistered,
    HeadCheckpoint, FenceHistory,
)
NESTED_TYPES: dict[str, type] = {
    "header": Header, "sampling": SamplingParams, "blob": BlobRef, "messages": Message, "heads": ChainHead,
    "attempts": FenceEntry,
}
NESTED_LISTS = frozenset({"messages", "heads", "attempts"})  # fields of NESTED_TYPES that hold an array of them
