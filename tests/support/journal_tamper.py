"""A vandal who can rewrite a file journal: decode its events, change them, write the log
back with valid frame CRCs and commit markers (batch CRCs and positions recomputed), so
that no storage check can notice, only the audit's hash chains and signed heads.

The snapshot stream is left as it is: the audit reads the event log only.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass
from pathlib import Path

from rollout_journal.journal.codec import Codec
from rollout_journal.journal.errors import RecordLocation
from rollout_journal.journal.events import ChainHead, HeadCheckpoint, ResourceMutation
from rollout_journal.journal.file.frames import COMMIT, EVENT, RESULT, CommitMark, encode_frame, mark_of, read_frames
from rollout_journal.participants.resources import genesis_hash, link_hash
from rollout_journal.participants.rollout import mutation_record


@dataclass
class _Batch:
    records: list[list]  # [key, event] pairs, decoded
    mark: CommitMark
    results: list[tuple[str, bytes]]  # the results stream's frames of the commit, written back as they were


class TamperedLog:
    """The event log of a file journal, decoded batch by batch, to edit and write back."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.codec = Codec()
        self.batches: list[_Batch] = []
        pending: list[list] = []
        results: list[tuple[str, bytes]] = []
        for segment in sorted((self.root / "log").glob("*.seg")):
            base = int(segment.stem)
            for frame in read_frames(segment.read_bytes(), base):
                assert frame.error is None, f"the journal to tamper with is damaged already: {frame.error}"
                mark = mark_of(frame)
                if mark is not None:
                    self.batches.append(_Batch(pending, mark, results))
                    pending, results = [], []
                elif frame.type == RESULT:
                    results.append((frame.key, frame.value))
                else:
                    assert frame.type == EVENT
                    pending.append([frame.key, self.codec.decode(frame.value, RecordLocation(str(segment), 0, 0))])

    # -- looking -------------------------------------------------------------------
    def events(self) -> list:
        return [event for batch in self.batches for _, event in batch.records]

    def mutations(self, resource_id: str) -> list[ResourceMutation]:
        return [e for e in self.events() if isinstance(e, ResourceMutation) and e.resource_id == resource_id]

    def _where(self, event: object) -> tuple[_Batch, int]:
        for batch in self.batches:
            for i, (_, other) in enumerate(batch.records):
                if other is event:
                    return batch, i
        raise LookupError(f"{event!r} is not in the log")

    # -- changing ------------------------------------------------------------------
    def replace(self, old: object, new: object) -> None:
        batch, i = self._where(old)
        batch.records[i][1] = new

    def drop(self, event: object) -> None:
        batch, i = self._where(event)
        del batch.records[i]

    def swap(self, a: object, b: object) -> None:
        """Exchange two records' places, each taking the other's seq (so the seq fold sees nothing)."""
        ha, hb = a.header, b.header
        new_a = dataclasses.replace(a, header=dataclasses.replace(ha, seq=hb.seq))
        new_b = dataclasses.replace(b, header=dataclasses.replace(hb, seq=ha.seq))
        (batch_a, i), (batch_b, j) = self._where(a), self._where(b)
        batch_a.records[i][1], batch_b.records[j][1] = new_b, new_a

    def insert_after(self, anchor: object, event: object) -> None:
        batch, i = self._where(anchor)
        batch.records.insert(i + 1, [event.header.rollout_id, event])

    def renumber(self, rollout_id: str) -> None:
        """Give the rollout's events consecutive seqs in log order again, as a careful vandal would."""
        seq = 0
        for batch in self.batches:
            for record in batch.records:
                event = record[1]
                if getattr(event, "header", None) is not None and event.header.rollout_id == rollout_id:
                    record[1] = dataclasses.replace(event, header=dataclasses.replace(event.header, seq=seq))
                    seq += 1

    def rechain(self, resource_id: str) -> None:
        """Recompute the resource's chain hashes (hashes and all) after its records were changed."""
        head = None
        for event in self.mutations(resource_id):
            record = mutation_record(event)
            if record.prev_revision == 0:
                head = genesis_hash(resource_id)
            head = link_hash(head, record.chain_payload())
            self.replace(event, dataclasses.replace(event, chain_hash=head))

    def resign_heads(self, rollout_id: str, signer) -> None:
        """Rewrite every checkpoint of the rollout to the chain as it stands now, signed by ``signer``
        (the vandal's key; ``signer=None`` leaves the old signatures on the new heads)."""
        heads: dict[str, tuple[int, str]] = {}
        for batch in self.batches:
            for record in batch.records:
                event = record[1]
                if isinstance(event, ResourceMutation) and event.header.rollout_id == rollout_id:
                    heads[event.resource_id] = (event.revision, event.chain_hash)
                elif isinstance(event, HeadCheckpoint) and event.header.rollout_id == rollout_id:
                    new_heads = [
                        ChainHead(h.resource_id, *heads.get(h.resource_id, (h.revision, h.chain_hash)))
                        for h in event.heads
                    ]
                    if signer is None:
                        record[1] = dataclasses.replace(event, heads=new_heads)
                    else:
                        record[1] = signer.checkpoint(event.header, event.life, new_heads)

    # -- writing back --------------------------------------------------------------
    def save(self) -> dict[int, str]:
        """Write the log back as one segment, every frame and commit marker valid. Returns
        where each event now lies, by ``id(event)``, as the audit names a record."""
        log_dir = self.root / "log"
        for segment in log_dir.glob("*.seg"):
            segment.unlink()
        path = log_dir / f"{0:020d}.seg"
        out = bytearray()
        where: dict[int, str] = {}
        for batch in self.batches:
            start = len(out)
            for key, event in batch.records:
                where[id(event)] = str(RecordLocation(str(path), 0, len(out)))
                out += encode_frame(EVENT, key, self.codec.encode(event))
            for key, value in batch.results:
                out += encode_frame(RESULT, key, value)
            mark = CommitMark(batch.mark.snap_generation, batch.mark.snap_length, start, zlib.crc32(out[start:]))
            out += encode_frame(COMMIT, "", mark.encode())
        path.write_bytes(bytes(out))
        return where
