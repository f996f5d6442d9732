"""Snapshot records: building them (with large states chunked into blobs) and
loading the newest valid one per rollout.

A snapshot only bounds restore time; the recovery point is the last committed
turn. So a snapshot that proves corrupt is not fatal: the loader falls back to
the previous snapshot of that rollout, or to none (a full replay).

That previous snapshot must survive log compaction, which keeps one value per
key: a rollout's snapshots alternate between two keys, ``<rollout>`` (slot 0,
the only key of journals written by 0.1.0, still read as such) and
``<rollout>/snapshot/1`` (slot 1). A new snapshot overwrites the slot that does
not hold the newest valid one, so after compaction the newest and the one
before it remain, each with its blob chunks (a blob is tombstoned only once no
slot refers to it). Acknowledgement tombstones both slots.

A state that begins with sections whose bytes only grow (a rollout's head of token ids and
logprobs, its conversation: ``SnapshotDraft.stable``) is written in blocks: each section cut into
``block_bytes`` pieces from its own start, each piece a ``BlobChunk`` under the content-addressed
key ``<rollout>/block/<sha256>``, named by the snapshot in order (``Snapshot.blocks``). A block
either slot names already is not written again, so a rollout's snapshots write the blocks its
turns added, not its whole head each time: the bytes a rollout puts on the stream grow with its
turns, not with their square. A block is tombstoned once neither slot names it, as a blob is.

The stream also holds each rollout's fence: ``<rollout>/fence`` is its
``FenceHistory``, every attempt it ever started with the seq it resumed from,
rewritten in the same commit as each ``AttemptStarted`` (journals before 0.3 kept
the newest ``AttemptStarted`` there; it reads as a history of one). A snapshot of
an older epoch counts only if it precedes the fence in the stream; one written
after it comes from a zombie attempt and is ignored. Acknowledgement tombstones
the snapshots and keeps the fence, marked acknowledged at the rollout's epoch, so
a zombie's snapshot written afterwards never brings the rollout back. A slot value
before that fence is moot, not a zombie's: its tombstone came with the fence, and a
read that outlasts the topic's ``delete.retention.ms`` may miss it (the cleaner
removes it while the read runs).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from itertools import repeat
from typing import cast

from rollout_journal.journal.backend import OutRecord, StoredRecord, Stream, compacted
from rollout_journal.journal.codec import Codec
from rollout_journal.journal.errors import CorruptRecordError, JournalError, RecordLocation
from rollout_journal.journal.events import (
    AcknowledgedRollouts,
    AttemptStarted,
    BlobChunk,
    BlobRef,
    FenceEntry,
    FenceHistory,
    Header,
    Record,
    Snapshot,
    WorkloadRegistered,
)
from rollout_journal.schemas import released_versions

RUNNING = "running"  # a snapshot status: events may follow it; any other status is final
BLOB_MARK = "/blob/"
BLOCK_MARK = "/block/"
# A block's size: a 32k-token turn adds 16 to a head of ids and logprobs. Each snapshot also rewrites
# the last, partial block of each growing section: larger blocks write more that way (64 KiB: 1.7x the
# bytes of 16 KiB over 32 turns of 2,560 tokens, bench/snapshot_blocks.py), smaller ones more keys.
BLOCK_BYTES = 16 * 1024
MIN_BLOCK_BYTES = 256  # smaller blocks cost more in keys and framing than they save
FENCE_SUFFIX = "/fence"
BUCKET_MARK = "/acknowledged/"
WORKLOAD_SUFFIX = "/workload"
LEGACY_WORKLOAD_PREFIX = "workload:"  # 0.1.0 kept a workload's registration as a pseudo-rollout snapshot
SLOT_ONE_SUFFIX = "/snapshot/1"
_SNAPSHOT_V1, _SNAPSHOT_V2 = released_versions()["Snapshot"][:2]
SLOTS = 2


def fence_key(rollout_id: str) -> str:
    return rollout_id + FENCE_SUFFIX


def workload_key(name: str) -> str:
    return name + WORKLOAD_SUFFIX


def snapshot_key(rollout_id: str, slot: int) -> str:
    """Slot 0 is the rollout id itself (the single key of the 0.1.0 layout)."""
    return rollout_id if slot == 0 else rollout_id + SLOT_ONE_SUFFIX


def _slot_of(key: str) -> tuple[str, int] | None:
    """(rollout, slot) of a snapshot key; None for a fence, a blob chunk or anything else."""
    if key.startswith(LEGACY_WORKLOAD_PREFIX):
        return None
    if "/" not in key:
        return key, 0
    rollout_id = key[: -len(SLOT_ONE_SUFFIX)]
    if key.endswith(SLOT_ONE_SUFFIX) and "/" not in rollout_id:
        return rollout_id, 1
    return None


def blob_chunk_key(rollout_id: str, sha256: str, index: int) -> str:
    return f"{rollout_id}{BLOB_MARK}{sha256}/{index}"


def block_key(rollout_id: str, sha256: str) -> str:
    return f"{rollout_id}{BLOCK_MARK}{sha256}"


def bucket_key(rollout_ids: Iterable[str]) -> str:
    """A bucket's own key: its first rollout and a digest of every id it names, so two writers
    folding different sets never overwrite each other's bucket."""
    ids = list(rollout_ids)
    digest = hashlib.sha256("\n".join(ids).encode()).hexdigest()[:32]
    return f"{ids[0]}{BUCKET_MARK}{digest}"


@dataclass(frozen=True)
class SnapshotDraft:
    """What a participant hands the journal; the journal adds where replay starts."""

    header: Header
    status: str  # RUNNING, or final: "finished" (or the runner's "registered" marker), no events follow
    covers_seq: int
    state: bytes
    summary: bytes | None = None  # the rollout's RolloutSummary through covers_seq (the journal adds it)
    # The lengths of the sections ``state`` begins with whose bytes only grow from one snapshot to the
    # next (a head of tokens, a conversation): each is written in blocks, once (see the module's doc).
    stable: tuple[int, ...] = ()


@dataclass(frozen=True)
class LoadedSnapshot:
    snapshot: Snapshot
    state: bytes  # blob chunks already joined and verified
    location: RecordLocation


@dataclass(frozen=True)
class Fence:
    """A rollout's attempts as its fence record keeps them: the newest one (``epoch``, ``attempt``,
    ``seq``: events of older epochs from ``seq`` on are superseded) and every one before it
    (``history``, oldest first, the newest included), and the epoch at which the trainer
    acknowledged the rollout (None: not acknowledged)."""

    epoch: int
    attempt: int
    seq: int
    location: RecordLocation
    history: tuple[FenceEntry, ...] = ()
    acknowledged_epoch: int | None = None

    @property
    def acknowledged(self) -> bool:
        return self.acknowledged_epoch is not None

    def starts(self) -> dict[int, int]:
        """Epoch -> seq of its ``AttemptStarted``, for every attempt the history holds."""
        return {entry.epoch: entry.seq for entry in self.history}


Folded = tuple[int, int, RecordLocation]
"""What a bucket says of a rollout: its acknowledged epoch, its newest attempt, and where the bucket lies."""


class Fences(MutableMapping[str, Fence]):
    """Fences by rollout id: each fence record's (``records``), and the acknowledged rollouts that
    buckets name (``folded``: rollout -> (acknowledged epoch, newest attempt, the bucket's location)), made a
    :class:`Fence` only when one is asked for. Why: a restore of a partition with a long history
    meets thousands of acknowledged rollouts and needs none of them as objects; readers that do ask
    (a trainer checking a rollout is acknowledged) get the same answer a fence record gives. A
    record wins over a bucket: it holds the attempts."""

    __slots__ = ("records", "folded")

    def __init__(
        self,
        records: Mapping[str, Fence] | None = None,
        folded: Mapping[str, Folded] | None = None,
    ) -> None:
        self.records: dict[str, Fence] = dict(records or {})
        self.folded: dict[str, Folded] = dict(folded or {})

    def __getitem__(self, rollout_id: str) -> Fence:
        fence = self.records.get(rollout_id)
        if fence is not None:
            return fence
        epoch, attempt, location = self.folded[rollout_id]
        return Fence(epoch, attempt, 0, location, (), epoch)

    def __contains__(self, rollout_id: object) -> bool:
        return rollout_id in self.records or rollout_id in self.folded

    def __setitem__(self, rollout_id: str, fence: Fence) -> None:
        self.records[rollout_id] = fence

    def __delitem__(self, rollout_id: str) -> None:
        found = self.records.pop(rollout_id, None) is not None
        found = self.folded.pop(rollout_id, None) is not None or found
        if not found:
            raise KeyError(rollout_id)

    def __iter__(self) -> Iterator[str]:
        yield from self.records
        yield from (rollout_id for rollout_id in self.folded if rollout_id not in self.records)

    def __len__(self) -> int:
        return len(self.folded) + sum(1 for rollout_id in self.records if rollout_id not in self.folded)

    def only_folded(self) -> dict[str, Folded]:
        """The rollouts a bucket names and no fence record does (a copy: one pass in C, then a step
        per fence record, of which a partition keeps few)."""
        folded = dict(self.folded)
        for rollout_id in self.records:
            folded.pop(rollout_id, None)
        return folded


@dataclass(frozen=True)
class SnapshotSlots:
    """What a writer must know of a rollout's two snapshot keys: the slot to keep (it holds the
    newest valid snapshot; None: neither does) and the blob each slot's snapshot refers to."""

    keep: int | None = None
    blobs: tuple[BlobRef | None, ...] = (None,) * SLOTS
    blocks: tuple[frozenset[str], ...] = (frozenset(),) * SLOTS  # the block digests each slot's snapshot names

    @property
    def next_slot(self) -> int:
        return 0 if self.keep is None else 1 - self.keep


@dataclass
class SnapshotIndex:
    """Newest valid snapshot per rollout, its fence, and what was wrong with newer ones."""

    snapshots: dict[str, LoadedSnapshot | None] = field(default_factory=dict)  # None: known rollout, no valid snapshot
    fences: Fences = field(default_factory=Fences)
    workloads: dict[str, WorkloadRegistered] = field(default_factory=dict)
    errors: list[JournalError] = field(default_factory=list)
    slots: dict[str, SnapshotSlots] = field(default_factory=dict)  # for the writer that continues these rollouts
    # Blocks and blob chunks of rollouts that have no snapshot to name them any more (acknowledged, or
    # tombstoned), by partition: left by a writer that did not know them (a trainer acknowledging from
    # its records, a zombie). Whoever takes the partition tombstones them (``Journal.discard``).
    orphans: dict[int, list[OutRecord]] = field(default_factory=dict)
    # Partitions with an unreadable record that may have been a bucket (one naming it so, or one whose
    # key is unreadable too): the rollouts it named have neither fence nor snapshot left, and only
    # their events say what became of them (restore reads their keys there).
    unaccounted: set[int] = field(default_factory=set)


def snapshot_records(
    codec: Codec,
    draft: SnapshotDraft,
    replay_partition: int,
    replay_offset: int,
    inline_limit: int,
    slots: SnapshotSlots,
    block_bytes: int = BLOCK_BYTES,
) -> tuple[list[OutRecord], SnapshotSlots]:
    """The records that write ``draft`` into the slot ``slots`` does not keep: its new blocks, blob
    chunks (if what follows the blocks is large and not stored already), tombstones for what only
    the overwritten slot named, then the snapshot."""
    rollout_id = draft.header.rollout_id
    slot = slots.next_slot
    digest = hashlib.sha256(draft.state).hexdigest()
    pieces, rest = (
        _blocks(draft.state, draft.stable, min(block_bytes, inline_limit)) if block_bytes else ([], draft.state)
    )
    named = [hashlib.sha256(piece).hexdigest() for piece in pieces]
    stored_blocks = frozenset().union(*slots.blocks)
    records: list[OutRecord] = []
    for sha, piece in dict(zip(named, pieces)).items():
        if sha not in stored_blocks:
            value = codec.encode(BlobChunk(sha, 0, 1, piece))
            records.append(OutRecord(Stream.SNAPSHOTS, block_key(rollout_id, sha), value, rollout_id))
    stored_blobs = {blob.sha256 for blob in slots.blobs if blob is not None}
    blob: BlobRef | None = None
    inline = rest
    # The summary shares the snapshot's record with an inline state: both must fit a record.
    if len(rest) + len(draft.summary or b"") > inline_limit:
        rest_digest = hashlib.sha256(rest).hexdigest() if pieces else digest
        count = -(-len(rest) // inline_limit)
        blob = BlobRef(rest_digest, len(rest), count)
        inline = b""
        if rest_digest not in stored_blobs:
            for i in range(count):
                chunk = BlobChunk(rest_digest, i, count, rest[i * inline_limit : (i + 1) * inline_limit])
                key = blob_chunk_key(rollout_id, rest_digest, i)
                records.append(OutRecord(Stream.SNAPSHOTS, key, codec.encode(chunk), rollout_id))
    blobs, blocks = list(slots.blobs), list(slots.blocks)
    overwritten, blobs[slot] = blobs[slot], blob
    if overwritten is not None and overwritten.sha256 not in {b.sha256 for b in blobs if b is not None}:
        records.extend(blob_tombstones(rollout_id, overwritten))
    dropped, blocks[slot] = blocks[slot], frozenset(named)
    records.extend(
        OutRecord(Stream.SNAPSHOTS, block_key(rollout_id, sha), None, rollout_id)
        for sha in sorted(dropped - frozenset().union(*blocks))
    )
    snapshot = Snapshot(
        draft.header,
        draft.status,
        draft.covers_seq,
        replay_partition,
        replay_offset,
        inline,
        digest,
        blob,
        draft.summary,
        named or None,
    )
    # The oldest version that holds what the snapshot has: a version before summaries (a file
    # journal's snapshots have none) or before blocks, rolled back to, still restores from it.
    if named:
        value = codec.encode(snapshot)
    else:
        value = codec.encode_with(snapshot, _SNAPSHOT_V2 if snapshot.summary is not None else _SNAPSHOT_V1)
    records.append(OutRecord(Stream.SNAPSHOTS, snapshot_key(rollout_id, slot), value, rollout_id))
    return records, SnapshotSlots(slot, tuple(blobs), tuple(blocks))


def check_stable(draft: SnapshotDraft) -> None:
    """ValueError naming the rollout if ``draft``'s stable sections do not fit its state: raised to
    the appender, before the committer builds a batch (where it would stop the journal)."""
    if sum(draft.stable) > len(draft.state) or any(length < 0 for length in draft.stable):
        raise ValueError(
            f"snapshot of rollout {draft.header.rollout_id}: stable sections {draft.stable} do not fit "
            f"a state of {len(draft.state)} bytes"
        )


def _blocks(state: bytes, stable: tuple[int, ...], block_bytes: int) -> tuple[list[bytes], bytes]:
    """``state``'s stable sections (checked: :func:`check_stable`) cut into blocks (each from its own
    start; a section's last, shorter piece is a block too, since the next section's follow it), and
    the bytes after them. None at all while no section fills one block: a small state stays one
    record, as before blocks."""
    if not any(length >= block_bytes for length in stable):
        return [], state
    pieces: list[bytes] = []
    start = 0
    for length in stable:
        pieces.extend(
            state[at : min(at + block_bytes, start + length)] for at in range(start, start + length, block_bytes)
        )
        start += length
    return pieces, state[start:]


def tombstone_records(rollout_id: str, slots: SnapshotSlots | None, *, keep_fence: bool = False) -> list[OutRecord]:
    """What a rollout holds in the snapshot stream, tombstoned: both slots, the blobs the writer
    knows of (a blob it never learned of stays until the topic is deleted) and, unless
    ``keep_fence`` (an acknowledgement rewrites it instead), the fence."""
    keys = [snapshot_key(rollout_id, slot) for slot in range(SLOTS)] + ([] if keep_fence else [fence_key(rollout_id)])
    if slots is not None:
        keys = [block_key(rollout_id, sha) for sha in sorted(frozenset().union(*slots.blocks))] + keys
    records = [OutRecord(Stream.SNAPSHOTS, key, None, rollout_id) for key in keys]
    blobs = {} if slots is None else {blob.sha256: blob for blob in slots.blobs if blob is not None}
    return [record for blob in blobs.values() for record in blob_tombstones(rollout_id, blob)] + records


def fence_record(codec: Codec, history: FenceHistory) -> OutRecord:
    """The rollout's fence history under its compacted key ``<rollout>/fence``."""
    return OutRecord(Stream.SNAPSHOTS, fence_key(history.rollout_id), codec.encode(history), history.rollout_id)


def bucket_records(codec: Codec, partition: int, acknowledged: Mapping[str, tuple[int, int]]) -> list[OutRecord]:
    """``acknowledged`` (rollout -> its acknowledged epoch and newest attempt, all of ``partition``)
    folded: one write-once bucket naming them, then the tombstones of their fences, for one commit."""
    ids = sorted(acknowledged)
    bucket = AcknowledgedRollouts(partition, ids, [acknowledged[r][0] for r in ids], [acknowledged[r][1] for r in ids])
    records = [OutRecord(Stream.SNAPSHOTS, bucket_key(ids), codec.encode(bucket), ids[0])]
    return records + [OutRecord(Stream.SNAPSHOTS, fence_key(r), None, r) for r in ids]


def blob_tombstones(rollout_id: str, blob: BlobRef) -> list[OutRecord]:
    return [
        OutRecord(Stream.SNAPSHOTS, blob_chunk_key(rollout_id, blob.sha256, i), None, rollout_id)
        for i in range(blob.chunks)
    ]


def load_snapshots(codec: Codec, stored: Iterable[StoredRecord], keep: int = 2) -> SnapshotIndex:
    """Read a snapshot stream to its end and pick each rollout's newest valid snapshot."""
    index = SnapshotIndex()
    buckets: list[StoredRecord] = []

    def unreadable(record: StoredRecord) -> None:
        # cast: compacted() hands on_error only the records whose error is set
        index.errors.append(CorruptRecordError(record.location, cast(str, record.error)))
        if not record.key or BUCKET_MARK in record.key:
            index.unaccounted.add(record.location.partition)

    latest = compacted(stored, keep, unreadable)
    chunks = {key: records[-1] for key, records in latest.items() if BLOB_MARK in key}
    blocks_read = _BlockReader(codec, {key: records[-1] for key, records in latest.items() if BLOCK_MARK in key})
    for key, records in latest.items():
        try:
            if key.endswith(FENCE_SUFFIX):
                index.fences[key[: -len(FENCE_SUFFIX)]] = _fence(codec, records[-1])
            elif BUCKET_MARK in key:
                buckets.append(records[-1])
            elif key.endswith(WORKLOAD_SUFFIX):
                index.workloads[key[: -len(WORKLOAD_SUFFIX)]] = _workload(codec, records[-1])
            elif key.startswith(LEGACY_WORKLOAD_PREFIX):
                index.workloads[key[len(LEGACY_WORKLOAD_PREFIX) :]] = _legacy_workload(codec, records[-1])
        except JournalError as exc:
            index.errors.append(exc)
    _fold(codec, buckets, index)
    candidates: dict[str, list[tuple[int, StoredRecord]]] = {}
    for key, records in latest.items():
        slot_of = _slot_of(key)
        if slot_of is not None:
            candidates.setdefault(slot_of[0], []).extend((slot_of[1], record) for record in records)
    for rollout_id, found in candidates.items():
        fence = index.fences.get(rollout_id)
        if fence is not None and fence.acknowledged:  # its snapshots were tombstoned with this fence
            # One transaction wrote the slots' tombstones and this fence. A value before the fence is one
            # whose tombstone this read missed (the cleaner removed it, past delete.retention.ms, while a
            # long read ran): moot. Only a value after the fence was written since, by a zombie.
            index.errors.extend(
                CorruptRecordError(
                    record.location,
                    f"snapshot of rollout {rollout_id} was written after the rollout was acknowledged "
                    f"at epoch {fence.acknowledged_epoch}: a zombie attempt's; ignored",
                )
                for _, record in found
                if record.location.offset > fence.location.offset
            )
            continue
        index.snapshots[rollout_id] = None
        blobs: list[BlobRef | None] = [None] * SLOTS
        blocks: list[frozenset[str]] = [frozenset()] * SLOTS
        keep_slot: int | None = None
        seen_slots: set[int] = set()
        # Both keys live in the rollout's partition: their offsets order them.
        for slot, record in sorted(found, key=lambda item: item[1].location.offset, reverse=True):
            newest_of_slot = slot not in seen_slots
            seen_slots.add(slot)
            if index.snapshots[rollout_id] is not None and not newest_of_slot:
                continue  # found, and this value is gone at the next compaction: nothing to learn from it
            try:
                snapshot = _decode(codec, record)
            except JournalError as exc:
                index.errors.append(exc)
                continue
            if newest_of_slot and isinstance(snapshot, Snapshot):
                blobs[slot] = snapshot.blob  # what the slot's current value refers to
                # Only the blocks there and whole count as stored: a lost or damaged one is written again
                # by the next snapshot that names it, or it would fail every snapshot of the rollout.
                blocks[slot] = frozenset(sha for sha in snapshot.blocks or () if blocks_read.intact(rollout_id, sha))
            if index.snapshots[rollout_id] is not None:
                continue
            try:
                loaded = _verified(codec, rollout_id, record, snapshot, chunks, blocks_read)
            except JournalError as exc:
                index.errors.append(exc)
                continue
            if (
                fence is not None
                and loaded.snapshot.header.epoch < fence.epoch
                and record.location.offset > fence.location.offset
            ):
                index.errors.append(
                    CorruptRecordError(
                        record.location,
                        f"snapshot of rollout {rollout_id} from epoch {loaded.snapshot.header.epoch} "
                        f"was written after the fence of epoch {fence.epoch}: a zombie attempt's; ignored",
                    )
                )
                continue
            index.snapshots[rollout_id] = loaded
            # Keep the slot holding it; if it is an older value of its key (whose newest is bad), compaction will
            # drop it anyway: keep the other slot instead, and overwrite the bad one.
            keep_slot = slot if newest_of_slot else 1 - slot
        index.slots[rollout_id] = SnapshotSlots(keep_slot, tuple(blobs), tuple(blocks))
    _find_orphans(latest, candidates.keys(), index)
    return index


def _find_orphans(latest: Mapping[str, list[StoredRecord]], with_slots: Collection[str], index: SnapshotIndex) -> None:
    """The block and blob chunk keys of rollouts without a snapshot slot, or acknowledged, into
    ``index.orphans``: a snapshot and its blocks commit together, so nothing will name these again."""
    for key, records in latest.items():
        mark = BLOCK_MARK if BLOCK_MARK in key else BLOB_MARK if BLOB_MARK in key else None
        if mark is None:
            continue
        rollout_id = key.split(mark, 1)[0]
        fence = index.fences.get(rollout_id)
        if rollout_id in with_slots and (fence is None or not fence.acknowledged):
            continue
        partition = records[-1].location.partition
        index.orphans.setdefault(partition, []).append(OutRecord(Stream.SNAPSHOTS, key, None, rollout_id))


def _decode(codec: Codec, record: StoredRecord) -> Record:
    """Decode a record compacted() kept: it has a value (a tombstone drops its key)."""
    if record.value is None:
        raise CorruptRecordError(record.location, f"{record.key} is a tombstone where a value was expected")
    return codec.decode(record.value, record.location)


def _fence(codec: Codec, record: StoredRecord) -> Fence:
    value = _decode(codec, record)
    if isinstance(value, AttemptStarted):  # written before 0.3: the newest attempt only
        h = value.header
        return Fence(h.epoch, h.attempt, h.seq, record.location, (FenceEntry.of(h),))
    if not isinstance(value, FenceHistory):
        raise CorruptRecordError(record.location, f"fence of {record.key} holds a {type(value).__name__}")
    if not value.attempts:  # acknowledged by a writer that knew no attempt of it
        epoch = value.acknowledged_epoch or 0
        return Fence(epoch, 0, 0, record.location, (), value.acknowledged_epoch)
    newest = max(value.attempts, key=lambda entry: entry.epoch)
    return Fence(
        newest.epoch, newest.attempt, newest.seq, record.location, tuple(value.attempts), value.acknowledged_epoch
    )


def _fold(codec: Codec, buckets: list[StoredRecord], index: SnapshotIndex) -> None:
    """The rollouts the buckets name, into ``index.fences.folded``, in bulk (no Python step per
    rollout: a long history names many). A rollout two buckets name keeps the earlier one (from
    there on, a snapshot of it is a zombie's): the newest bucket goes in first, each older one
    overwrites it. An unreadable bucket is reported and leaves its partition unaccounted."""
    folded = index.fences.folded
    for record in sorted(buckets, key=lambda r: (r.location.partition, r.location.offset), reverse=True):
        try:
            bucket = _bucket(codec, record)
        except JournalError as exc:
            index.errors.append(exc)
            index.unaccounted.add(record.location.partition)
            continue
        folded.update(zip(bucket.rollout_ids, zip(bucket.epochs, bucket.newest_attempts, repeat(record.location))))


def _bucket(codec: Codec, record: StoredRecord) -> AcknowledgedRollouts:
    try:
        bucket = _decode(codec, record)
    except CorruptRecordError as exc:
        raise CorruptRecordError(record.location, f"acknowledgement bucket {record.key}: {exc.reason}") from exc
    if not isinstance(bucket, AcknowledgedRollouts) or not (
        len(bucket.rollout_ids) == len(bucket.epochs) == len(bucket.newest_attempts)
    ):
        raise CorruptRecordError(record.location, f"{record.key} holds no well-formed AcknowledgedRollouts")
    return bucket


def _workload(codec: Codec, record: StoredRecord) -> WorkloadRegistered:
    registered = _decode(codec, record)
    if not isinstance(registered, WorkloadRegistered):
        raise CorruptRecordError(record.location, f"{record.key} holds a {type(registered).__name__}")
    return registered


def _legacy_workload(codec: Codec, record: StoredRecord) -> WorkloadRegistered:
    """Upcast 0.1.0's registration (a snapshot of pseudo-rollout ``workload:<name>`` listing
    the rollout ids) to the record type that replaced it."""
    marker = _decode(codec, record)
    try:
        if not isinstance(marker, Snapshot):
            raise TypeError(type(marker).__name__)
        ids = json.loads(marker.state)["rollouts"]
    except (TypeError, ValueError, KeyError) as exc:
        raise CorruptRecordError(
            record.location, f"0.1.0 workload registration {record.key} is unreadable: {exc!r}"
        ) from exc
    h = marker.header
    return WorkloadRegistered(record.key[len(LEGACY_WORKLOAD_PREFIX) :], "{}", list(ids), "", h.ts_ms, h.writer)


def _verified(
    codec: Codec,
    rollout_id: str,
    record: StoredRecord,
    snapshot: object,
    chunks: dict[str, StoredRecord],
    blocks: _BlockReader,
) -> LoadedSnapshot:
    if not isinstance(snapshot, Snapshot):
        raise CorruptRecordError(record.location, f"expected a Snapshot, found {type(snapshot).__name__}")
    rest = (
        snapshot.state
        if snapshot.blob is None
        else b"".join(_blob_parts(codec, rollout_id, record, snapshot.blob, chunks))
    )
    state = b"".join([*(blocks.data(rollout_id, sha, i, record) for i, sha in enumerate(snapshot.blocks or ())), rest])
    if hashlib.sha256(state).hexdigest() != snapshot.state_sha256:
        raise CorruptRecordError(record.location, f"snapshot of rollout {rollout_id} fails its SHA-256 check")
    return LoadedSnapshot(snapshot, state, record.location)


def _blob_parts(
    codec: Codec, rollout_id: str, record: StoredRecord, blob: BlobRef, chunks: dict[str, StoredRecord]
) -> Iterator[bytes]:
    for i in range(blob.chunks):
        stored = chunks.get(blob_chunk_key(rollout_id, blob.sha256, i))
        if stored is None:
            raise CorruptRecordError(record.location, f"snapshot blob {blob.sha256[:12]} lacks chunk {i}/{blob.chunks}")
        chunk = _decode(codec, stored)
        if not isinstance(chunk, BlobChunk):
            raise CorruptRecordError(stored.location, f"expected a BlobChunk, found {type(chunk).__name__}")
        yield chunk.data


class _BlockReader:
    """The blocks of a read snapshot stream, each decoded and checked against its digest once
    (both slots of a rollout name mostly the same blocks)."""

    def __init__(self, codec: Codec, records: dict[str, StoredRecord]) -> None:
        self._codec = codec
        self._records = records
        self._read: dict[str, bytes | CorruptRecordError] = {}

    def data(self, rollout_id: str, sha: str, index: int, snapshot: StoredRecord) -> bytes:
        """Block ``index`` (``sha``) of the snapshot at ``snapshot``; ``CorruptRecordError`` naming
        it when it is missing, not a ``BlobChunk`` or not what its digest says."""
        key = block_key(rollout_id, sha)
        if key not in self._records:  # named here, for this snapshot: never a cached message of another's
            raise CorruptRecordError(snapshot.location, f"snapshot lacks its block {index} ({sha[:12]})")
        found = self._read.get(key)
        if found is None:
            found = self._read[key] = self._decoded(key, sha)
        if isinstance(found, CorruptRecordError):
            raise found
        return found

    def intact(self, rollout_id: str, sha: str) -> bool:
        key = block_key(rollout_id, sha)
        if key not in self._records:
            return False
        try:
            self.data(rollout_id, sha, 0, self._records[key])
            return True
        except CorruptRecordError:
            return False

    def _decoded(self, key: str, sha: str) -> bytes | CorruptRecordError:
        stored = self._records[key]
        try:
            block = _decode(self._codec, stored)
        except CorruptRecordError as exc:
            return exc
        if not isinstance(block, BlobChunk):
            return CorruptRecordError(stored.location, f"expected a BlobChunk, found {type(block).__name__}")
        if hashlib.sha256(block.data).hexdigest() != sha:
            return CorruptRecordError(stored.location, f"block {sha[:12]} fails its SHA-256 check")
        return block.data
