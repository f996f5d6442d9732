"""Events too large for one record travel as ``EventChunk`` pieces, as large snapshots do as blobs.

One model call with a long prompt can encode to more than a broker accepts in one
record (Kafka's ``message.max.bytes``, 1 MiB by default). Such an event is split,
at append, into pieces of at most ``max_record_bytes``: each piece carries the
event's own header (so readers fence pieces, and restore steps over covered ones by
``header.seq`` without joining them), the SHA-256 and size of the whole encoding,
and its index. The pieces of one event are consecutive records of one commit, so
readers join them as they come: memory holds one event per rollout being joined
(bounded by ``max_event_bytes``), never a whole partition. An event larger than
``max_event_bytes`` is refused at append, failing that append alone.

The same limit applies on every backend, so a workload the file journal accepts is
one Kafka accepts.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from rollout_journal.journal.codec import Codec
from rollout_journal.journal.errors import CorruptRecordError, OversizedEventError, RecordLocation
from rollout_journal.journal.events import EventChunk, RolloutEvent, TrainingRecord

_LENGTH_BYTES = 10  # room for the Avro length of the data field


def split_event(
    codec: Codec, event: RolloutEvent | TrainingRecord, encoded: bytes, max_record_bytes: int, max_event_bytes: int
) -> list[bytes]:
    """The records that carry ``event`` (or a results record, which has a header too): ``encoded``
    itself if it fits one record, else its pieces."""
    if len(encoded) <= max_record_bytes:
        return [encoded]
    h = event.header
    if len(encoded) > max_event_bytes:
        raise OversizedEventError(h.rollout_id, h.turn, type(event).__name__, len(encoded), max_event_bytes)
    digest = hashlib.sha256(encoded).hexdigest()
    empty = EventChunk(h, type(event).__name__, digest, 0, 0, len(encoded), b"")
    piece = max_record_bytes - len(codec.encode(empty)) - _LENGTH_BYTES
    if piece <= 0:
        raise OversizedEventError(h.rollout_id, h.turn, type(event).__name__, len(encoded), max_event_bytes)
    count = -(-len(encoded) // piece)
    view = memoryview(encoded)
    return [
        codec.encode(
            EventChunk(
                h, type(event).__name__, digest, i, count, len(encoded), bytes(view[i * piece : (i + 1) * piece])
            )
        )
        for i in range(count)
    ]


@dataclass
class _Joining:
    first: RecordLocation
    chunk: EventChunk  # the first piece: what every later one must agree with
    parts: list[bytes] = field(default_factory=list)


@dataclass(frozen=True)
class JoinedEvent:
    encoded: bytes
    location: RecordLocation  # of its first piece


class ChunkJoiner:
    """Joins the pieces of chunked events during one read; one event per rollout at a time."""

    def __init__(self, max_event_bytes: int) -> None:
        self.max_event_bytes = max_event_bytes
        self._joining: dict[str, _Joining] = {}

    def add(self, chunk: EventChunk, location: RecordLocation) -> JoinedEvent | None:
        """The whole event once its last piece arrives; raises ``CorruptRecordError`` for a piece
        that cannot belong (and for an unfinished event it displaces)."""
        rollout_id = chunk.header.rollout_id
        joining = self._joining.get(rollout_id)
        if chunk.index == 0:
            if chunk.size > self.max_event_bytes or chunk.count < 1:
                raise CorruptRecordError(
                    location,
                    f"chunked {chunk.record} of rollout {rollout_id} claims "
                    f"{chunk.size} bytes in {chunk.count} pieces; this reader "
                    f"joins at most {self.max_event_bytes}",
                )
            self._joining[rollout_id] = _Joining(location, chunk, [chunk.data])
            if joining is not None:
                raise self._unfinished(rollout_id, joining)
        elif (
            joining is None
            or (chunk.sha256, chunk.count, chunk.header.seq)
            != (joining.chunk.sha256, joining.chunk.count, joining.chunk.header.seq)
            or chunk.index != len(joining.parts)
        ):
            raise CorruptRecordError(
                location,
                f"piece {chunk.index}/{chunk.count} of a chunked {chunk.record} of "
                f"rollout {rollout_id} (seq {chunk.header.seq}) follows no matching "
                "earlier piece",
            )
        else:
            joining.parts.append(chunk.data)
        joining = self._joining[rollout_id]
        if len(joining.parts) < joining.chunk.count:
            return None
        del self._joining[rollout_id]
        encoded = b"".join(joining.parts)
        if len(encoded) != joining.chunk.size or hashlib.sha256(encoded).hexdigest() != joining.chunk.sha256:
            raise CorruptRecordError(
                joining.first,
                f"chunked {joining.chunk.record} of rollout {rollout_id} "
                f"(seq {joining.chunk.header.seq}) fails its size or SHA-256 check",
            )
        return JoinedEvent(encoded, joining.first)

    def first_locations(self) -> list[RecordLocation]:
        """Where each event still being joined began."""
        return [joining.first for joining in self._joining.values()]

    def unfinished(self) -> list[CorruptRecordError]:
        """Events whose pieces stopped before their last (read at the end of a read); forgets them."""
        errors = [self._unfinished(rollout_id, joining) for rollout_id, joining in self._joining.items()]
        self._joining.clear()
        return errors

    @staticmethod
    def _unfinished(rollout_id: str, joining: _Joining) -> CorruptRecordError:
        c = joining.chunk
        return CorruptRecordError(
            joining.first,
            f"chunked {c.record} of rollout {rollout_id} (seq {c.header.seq}) "
            f"stops after {len(joining.parts)} of its {c.count} pieces",
        )
