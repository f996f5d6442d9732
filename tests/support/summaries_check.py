"""The summaries' promise, checked on every Kafka journal a test leaves behind: ``replay list``
from the rollouts' summaries (what their writers committed with their events) shows exactly what
folding every event shows (``replay list --scan``)."""

from __future__ import annotations

from rollout_journal.journal.errors import JournalError
from rollout_journal.replay.listing import list_rollouts
from rollout_journal.replay.source import open_replay


def assert_summaries_agree(location: str) -> None:
    """Where the namespace reads cleanly (no damage, no open transaction holding a read back), the
    rows from its summaries are the rows from its events."""
    try:
        source = open_replay(location)
    except JournalError:
        return  # the test made no namespace there
    with source:
        if not source.journal.backend.keeps_summaries:
            return
        scanned = list_rollouts(source, scan=True)
        report = scanned.report
        if report.errors or report.held_back or any(row.damaged for row in scanned.rows):
            return  # damage shows in a scan only, and a held-back read is short
        summarized = list_rollouts(source)
        if summarized.report.held_back:
            return
    assert summarized.read == "summaries", f"{location}: the listing read {summarized.read}, not the summaries"
    from_events = {row.rollout_id: row.as_json() for row in scanned.rows}
    from_summaries = {row.rollout_id: row.as_json() for row in summarized.rows}
    assert from_summaries == from_events, f"{location}: the summaries disagree with the events"
    assert summarized.events == scanned.events
