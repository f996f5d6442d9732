"""Snapshot records: building them (with large states chunked into blobs) and
loading the newest valid one per rollout.

A snapshot only bounds restore time; the recovery point is the last committed
turn. So a snapshot that proves corrupt is not fatal: the loader falls back to
the previous retained snapshot of that rollout (inline snapshots; a superseded
blob's chunks are tombstoned), or to none (a full replay).

The stream also holds each rollout's fence: ``<rollout>/fence`` is the
``AttemptStarted`` of its newest attempt, written in the same commit. A
snapshot of an older epoch counts only if it precedes the fence in the stream;
one written after it comes from a zombie attempt and is ignored.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from .backend import OutRecord, StoredRecord, Stream, compacted
from .codec import Codec
from .errors import CorruptRecordError, JournalError, RecordLocation
from .events import AttemptStarted, BlobChunk, BlobRef, Header, Snapshot, WorkloadRegistered

BLOB_MARK = "/blob/"
FENCE_SUFFIX = "/fence"
WORKLOAD_SUFFIX = "/workload"
LEGACY_WORKLOAD_PREFIX = "workload:"  # 0.1.0 kept a workload's registration as a pseudo-rollout snapshot


def fence_key(rollout_id: str) -> str:
    return rollout_id + FENCE_SUFFIX


def workload_key(name: str) -> str:
    return name + WORKLOAD_SUFFIX


def blob_chunk_key(rollout_id: str, sha256: str, index: int) -> str:
    return f"{rollout_id}{BLOB_MARK}{sha256}/{index}"


@dataclass(frozen=True)
class SnapshotDraft:
    """What a participant hands the journal; the journal adds where replay starts."""

    header: Header
    status: str  # "running" | "finished"
    covers_seq: int
    state: bytes


@dataclass(frozen=True)
class LoadedSnapshot:
    snapshot: Snapshot
    state: bytes  # blob chunks already joined and verified
    location: RecordLocation


@dataclass(frozen=True)
class Fence:
    """A rollout's newest attempt: events of older epochs from ``seq`` on are superseded."""

    epoch: int
    attempt: int
    seq: int
    location: RecordLocation


@dataclass
class SnapshotIndex:
    """Newest valid snapshot per rollout, its fence, and what was wrong with newer ones."""

    snapshots: dict[str, LoadedSnapshot | None] = field(default_factory=dict)  # None: known rollout, no valid snapshot
    fences: dict[str, Fence] = field(default_factory=dict)
    workloads: dict[str, WorkloadRegistered] = field(default_factory=dict)
    errors: list[JournalError] = field(default_factory=list)


def snapshot_records(
    codec: Codec,
    draft: SnapshotDraft,
    replay_partition: int,
    replay_offset: int,
    inline_limit: int,
    previous_blob: BlobRef | None,
) -> tuple[list[OutRecord], BlobRef | None]:
    """The records that write ``draft``: blob chunks (if large), tombstones for the
    previous blob's chunks, then the snapshot itself."""
    rollout_id = draft.header.rollout_id
    digest = hashlib.sha256(draft.state).hexdigest()
    records: list[OutRecord] = []
    blob: BlobRef | None = None
    inline = draft.state
    if len(draft.state) > inline_limit:
        count = -(-len(draft.state) // inline_limit)
        blob = BlobRef(digest, len(draft.state), count)
        inline = b""
        if previous_blob is None or previous_blob.sha256 != digest:
            for i in range(count):
                chunk = BlobChunk(digest, i, count, draft.state[i * inline_limit:(i + 1) * inline_limit])
                records.append(OutRecord(Stream.SNAPSHOTS, blob_chunk_key(rollout_id, digest, i),
                                         codec.encode(chunk), rollout_id))
    if previous_blob is not None and (blob is None or previous_blob.sha256 != blob.sha256):
        records.extend(blob_tombstones(rollout_id, previous_blob))
    snapshot = Snapshot(draft.header, draft.status, draft.covers_seq, replay_partition, replay_offset,
                        inline, digest, blob)
    records.append(OutRecord(Stream.SNAPSHOTS, rollout_id, codec.encode(snapshot), rollout_id))
    return records, blob


def blob_tombstones(rollout_id: str, blob: BlobRef) -> list[OutRecord]:
    return [OutRecord(Stream.SNAPSHOTS, blob_chunk_key(rollout_id, blob.sha256, i), None, rollout_id)
            for i in range(blob.chunks)]


def load_snapshots(codec: Codec, stored: Iterable[StoredRecord], keep: int = 2) -> SnapshotIndex:
    """Read a snapshot stream to its end and pick each rollout's newest valid snapshot."""
    index = SnapshotIndex()
    latest = compacted(stored, keep, lambda r: index.errors.append(CorruptRecordError(r.location, r.error)))
    chunks = {key: records[-1] for key, records in latest.items() if BLOB_MARK in key}
    for key, records in latest.items():
        try:
            if key.endswith(FENCE_SUFFIX):
                index.fences[key[: -len(FENCE_SUFFIX)]] = _fence(codec, records[-1])
            elif key.endswith(WORKLOAD_SUFFIX):
                index.workloads[key[: -len(WORKLOAD_SUFFIX)]] = _workload(codec, records[-1])
            elif key.startswith(LEGACY_WORKLOAD_PREFIX):
                index.workloads[key[len(LEGACY_WORKLOAD_PREFIX):]] = _legacy_workload(codec, records[-1])
        except JournalError as exc:
            index.errors.append(exc)
    candidates = {key: records for key, records in latest.items()
                  if "/" not in key and not key.startswith(LEGACY_WORKLOAD_PREFIX)}
    for rollout_id, records in candidates.items():
        index.snapshots[rollout_id] = None
        fence = index.fences.get(rollout_id)
        for record in reversed(records):
            try:
                loaded = _verified(codec, record, chunks)
            except JournalError as exc:
                index.errors.append(exc)
                continue
            if fence is not None and loaded.snapshot.header.epoch < fence.epoch \
                    and record.location.offset > fence.location.offset:
                index.errors.append(CorruptRecordError(
                    record.location, f"snapshot of rollout {rollout_id} from epoch {loaded.snapshot.header.epoch} "
                                     f"was written after the fence of epoch {fence.epoch}: a zombie attempt's; ignored"))
                continue
            index.snapshots[rollout_id] = loaded
            break
    return index


def _fence(codec: Codec, record: StoredRecord) -> Fence:
    event = codec.decode(record.value, record.location)
    if not isinstance(event, AttemptStarted):
        raise CorruptRecordError(record.location, f"fence of {record.key} holds a {type(event).__name__}")
    h = event.header
    return Fence(h.epoch, h.attempt, h.seq, record.location)


def _workload(codec: Codec, record: StoredRecord) -> WorkloadRegistered:
    registered = codec.decode(record.value, record.location)
    if not isinstance(registered, WorkloadRegistered):
        raise CorruptRecordError(record.location, f"{record.key} holds a {type(registered).__name__}")
    return registered


def _legacy_workload(codec: Codec, record: StoredRecord) -> WorkloadRegistered:
    """Upcast 0.1.0's registration (a snapshot of pseudo-rollout ``workload:<name>`` listing
    the rollout ids) to the record type that replaced it."""
    marker = codec.decode(record.value, record.location)
    try:
        if not isinstance(marker, Snapshot):
            raise TypeError(type(marker).__name__)
        ids = json.loads(marker.state)["rollouts"]
    except (TypeError, ValueError, KeyError) as exc:
        raise CorruptRecordError(record.location, f"0.1.0 workload registration {record.key} is unreadable: {exc!r}") from exc
    h = marker.header
    return WorkloadRegistered(record.key[len(LEGACY_WORKLOAD_PREFIX):], "{}", list(ids), "", h.ts_ms, h.writer)


def _verified(codec: Codec, record: StoredRecord, chunks: dict[str, StoredRecord]) -> LoadedSnapshot:
    snapshot = codec.decode(record.value, record.location)
    if not isinstance(snapshot, Snapshot):
        raise CorruptRecordError(record.location, f"expected a Snapshot, found {type(snapshot).__name__}")
    state = snapshot.state if snapshot.blob is None else b"".join(_blob_parts(codec, record, snapshot, chunks))
    if hashlib.sha256(state).hexdigest() != snapshot.state_sha256:
        raise CorruptRecordError(record.location, f"snapshot of rollout {record.key} fails its SHA-256 check")
    return LoadedSnapshot(snapshot, state, record.location)


def _blob_parts(codec: Codec, record: StoredRecord, snapshot: Snapshot,
                chunks: dict[str, StoredRecord]) -> Iterator[bytes]:
    blob = snapshot.blob
    for i in range(blob.chunks):
        stored = chunks.get(blob_chunk_key(record.key, blob.sha256, i))
        if stored is None:
            raise CorruptRecordError(record.location, f"snapshot blob {blob.sha256[:12]} lacks chunk {i}/{blob.chunks}")
        chunk = codec.decode(stored.value, stored.location)
        if not isinstance(chunk, BlobChunk):
            raise CorruptRecordError(stored.location, f"expected a BlobChunk, found {type(chunk).__name__}")
        yield chunk.data
