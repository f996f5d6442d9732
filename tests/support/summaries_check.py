"""The summaries' promise, checked on every Kafka journal a test leaves behind: ``replay list``
from the rollouts' summaries (what their writers committed with their events) shows exactly what
folding every event shows (``replay list --scan``)."""

from __future__ import annotations

from rollout_journal.journal.errors import JournalError
from rollout_journal.journal.summary import load_summaries
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
    assert_first_offsets_right(location)


def assert_first_offsets_right(location: str) -> None:
    """Every whole summary that names where its rollout's first event lies (what ``replay show``
    reads from) names it right, across restores too. (-1, not known, is written by the commit of a
    rollout's first event, whose offset comes with that commit; ``show`` reads its partition whole.)"""
    with open_replay(location) as source:
        backend = source.journal.backend
        index = load_summaries(source.journal.codec, backend.read_summaries())
        first: dict[str, int] = {}
        for partition in range(backend.partitions):
            for record in backend.read_events(partition):
                first.setdefault(record.key, record.location.offset)
    wrong = {
        rollout_id: (summary.first_offset, first.get(rollout_id))
        for rollout_id, summary in index.summaries.items()
        if summary.complete and summary.first_offset >= 0 and summary.first_offset != first.get(rollout_id)
    }
    assert not wrong, f"{location}: summaries name other first offsets (named, found): {wrong}"
