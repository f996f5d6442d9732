"""The 0.1 reading API, kept for callers that still use it: ``list_rollouts(journal)``.

New code uses :func:`rollout_journal.replay.list_rollouts` (filters, progress, one row type);
this adapter runs it and hands back the old shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rollout_journal.journal.journal import Journal, ReadReport
from rollout_journal.participants.rollout.state import RolloutProgress
from rollout_journal.replay import listing
from rollout_journal.replay.source import ReplaySource


@dataclass
class JournalListing:
    rollouts: dict[str, RolloutProgress] = field(default_factory=dict)
    damaged: dict[str, str] = field(default_factory=dict)  # rollout -> why its events do not apply in order
    report: ReadReport = field(default_factory=ReadReport)


def list_rollouts(journal: Journal) -> JournalListing:
    """Every rollout of an open journal, as ``replay list`` finds it (the journal stays open)."""
    found = listing.list_rollouts(ReplaySource(f"{journal.backend.kind} journal", journal))
    return JournalListing(
        {r.rollout_id: r.progress for r in found.rows},
        {r.rollout_id: r.damaged for r in found.rows if r.damaged is not None},
        found.report,
    )
