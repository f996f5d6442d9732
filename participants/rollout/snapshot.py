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


def snapshot_of(state: RolloutState, resource_states: Mapping[str, bytes], writer: str) -> SnapshotDraft:
    """A snapshot of ``state`` covering every event applied to it, with these resource exports."""
    covers_seq = state.next_seq - 1  # every event applied so far
    status = "finished" if state.finished else "given_up" if state.given_up else RUNNING  # any but RUNNING: final
    return SnapshotDraft(state.header(writer), status, covers_seq, state.with_exports(resource_states).to_bytes())
