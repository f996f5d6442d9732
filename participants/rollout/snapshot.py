"""A rollout's snapshot draft: its state through the last event applied, as restore reads it back.

Building a draft changes nothing: the state it holds is :meth:`RolloutState.with_exports`, the one
rule for what a snapshot keeps of the resources (their exports, and only the mutations those do not
cover). The live path then records the same exports on its own state
(:meth:`RolloutState.record_exports`, the same rule), so the state it runs on is the state restore
reads back from the snapshot, and an offline writer (a fork) drafts without touching its state.
"""

from __future__ import annotations

from collections.abc import Mapping

from rollout_journal.journal.snapshots import RUNNING, SnapshotDraft
from rollout_journal.participants.rollout.state import RolloutState

__all__ = ["snapshot_of"]


def snapshot_of(
    state: RolloutState, resource_states: Mapping[str, bytes], writer: str, block_bytes: int = 0
) -> SnapshotDraft:
    """A snapshot of ``state`` covering every event applied to it, with these resource exports.
    ``block_bytes``: the journal's ``snapshot_block_bytes``. Once the head or the conversation
    fills a block, the state is laid out in sections (:meth:`RolloutState.to_sections`), which the
    journal writes in blocks, each once; before that (and with 0, a journal that writes no blocks)
    it is one compressed record (:meth:`RolloutState.to_bytes`), which every version reads."""
    covers_seq = state.next_seq - 1  # every event applied so far
    status = "finished" if state.finished else "given_up" if state.given_up else RUNNING  # any but RUNNING: final
    exported = state.with_exports(resource_states)
    header = state.header(writer)
    closed = len(state.lineage.closed_ids) if state.lineage is not None else 0
    if block_bytes and (4 * max(len(state.head_tokens), closed) >= block_bytes or _text_bytes(state) >= block_bytes):
        data, stable = exported.to_sections()
        return SnapshotDraft(header, status, covers_seq, data, stable=stable)
    return SnapshotDraft(header, status, covers_seq, exported.to_bytes())


def _text_bytes(state: RolloutState) -> int:
    """About what the conversation takes in a snapshot (its text; a cheap lower bound)."""
    return sum(len(m.content) for m in state.messages)
