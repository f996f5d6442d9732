"""``replay list``: every rollout a journal holds, with where it stands.

One pass over the whole journal; each rollout's events are applied to its
``RolloutProgress`` exactly as restore applies them, so a row is what attempt
N+1 would see. Memory: one bounded row per rollout, whatever the history.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from rollout_journal.journal.backend import HeldBack
from rollout_journal.journal.journal import JournaledEvent, ReadReport
from rollout_journal.journal.progress import CrashCount, RolloutProgress, StateFoldError
from rollout_journal.journal.summary import SummaryFold, load_summaries
from rollout_journal.participants.workload.specs import forks_in
from rollout_journal.replay.partition_scan import PartitionScan, jobs_for
from rollout_journal.replay.progress import Progress
from rollout_journal.replay.rollout_status import STATUSES, rollout_status
from rollout_journal.replay.source import ReplaySource
from rollout_journal.replay.table import table

log = logging.getLogger(__name__)

_DIGITS = re.compile(r"([0-9]+)")  # ASCII digits only: str.isdigit() and \d take others int() refuses

__all__ = ["STATUSES", "Listing", "RolloutFilter", "RolloutRow", "list_rollouts"]


@dataclass
class RolloutRow:
    """One rollout as the journal holds it."""

    fold: SummaryFold  # its events folded (by this scan, or by its writer: its summary)
    damaged: str | None = None  # why its events do not apply in order
    forked_from: str | None = None  # "<rollout>@<turn>" for a fork

    @property
    def progress(self) -> RolloutProgress:
        return self.fold.progress

    @property
    def crash_count(self) -> CrashCount:
        return self.fold.crashes

    @property
    def events(self) -> int:
        """Its events the journal holds."""
        return self.fold.events

    @property
    def rollout_id(self) -> str:
        return self.progress.rollout_id

    @property
    def status(self) -> str:
        """See :func:`rollout_journal.replay.rollout_status.rollout_status`."""
        return rollout_status(self.progress, damaged=self.damaged is not None)

    @property
    def crashes(self) -> int:
        """Attempts a later attempt superseded after they started running (see ``CrashCount``)."""
        return self.crash_count.crashes

    @property
    def crashed(self) -> bool:
        """A crash hit it: an attempt was superseded after it started running, or its newest attempt
        ran and stopped unfinished (crashed and not resumed yet, or running now), or it is damaged."""
        return self.crashes > 0 or self.crash_count.stopped_unfinished or self.damaged is not None

    def as_json(self) -> dict[str, Any]:
        p = self.progress
        return {
            "rollout_id": p.rollout_id,
            "group_id": p.group_id,
            "status": self.status,
            "attempts": p.attempt,
            "epoch": p.epoch,
            "turns": p.next_turn,
            "reward": p.reward,
            "policy_versions": list(p.policy_versions),
            "model_calls": p.model_calls,
            "mutations": p.mutation_count,
            "restarts": p.restarts,
            "crashes": self.crashes,
            "failures": p.failures,
            "forked_from": self.forked_from,
            "damaged": self.damaged,
            "failure": p.failure,
        }


@dataclass(frozen=True)
class RolloutFilter:
    """Which rows ``replay list`` shows; every condition given must hold."""

    statuses: frozenset[str] = frozenset()  # empty: any
    group: str | None = None
    min_attempts: int = 0
    crashed: bool = False

    def admits(self, row: RolloutRow) -> bool:
        return (
            (not self.statuses or row.status in self.statuses)
            and (self.group is None or row.progress.group_id == self.group)
            and row.progress.attempt >= self.min_attempts
            and (not self.crashed or row.crashed)
        )


@dataclass
class Listing:
    """What ``replay list`` found: the rows that pass the filter, and what the read stepped over."""

    location: str
    rows: list[RolloutRow] = field(default_factory=list)
    scanned: int = 0  # rollouts in the journal, before filtering
    events: int = 0
    report: ReadReport = field(default_factory=ReadReport)
    read: str = "events"  # what the rows were folded from: "events", or "summaries" (their writers')

    def as_json(self) -> dict[str, Any]:
        return {
            "journal": self.location,
            "rollouts": [r.as_json() for r in self.rows],
            "shown": len(self.rows),
            "rollouts_in_journal": self.scanned,
            "events": self.events,
            "read": self.read,
        }

    def text(self) -> Iterator[str]:
        rows = [
            [
                r.rollout_id,
                r.progress.group_id,
                r.status,
                r.progress.attempt,
                r.crashes,
                r.progress.next_turn,
                "-" if r.progress.reward is None else f"{r.progress.reward:.3f}",
                ", ".join(r.progress.policy_versions) or "-",
                r.forked_from or "",
            ]
            for r in self.rows
        ]
        yield from table(
            ["rollout", "group", "status", "attempts", "crashes", "turns", "reward", "policy versions", "forked from"],
            rows,
            numeric={3, 4, 5, 6},
        )
        yield f"{len(self.rows)} of {self.scanned} rollouts ({self.events} events) in {self.location}"


def list_rollouts(
    source: ReplaySource,
    where: RolloutFilter = RolloutFilter(),
    progress: Progress | None = None,
    *,
    projected: bool = True,
    jobs: int | None = 1,
    scan: bool = False,
) -> Listing:
    """A row per rollout of the journal that passes ``where``.

    Where the journal keeps a summary of every rollout (a Kafka namespace created by this version:
    ``rollout_journal.journal.summary``), the rows are those summaries, which their writers committed
    with the events they fold: one small record per rollout is read, not every event, and the rows
    are the same. A rollout whose writer could not summarise it is folded from its events. Rows
    are in rollout id order (numbers as numbers). With ``scan`` (or on a journal without summaries)
    every event is read and folded instead, leniently: unreadable records go to
    ``Listing.report`` and the rollouts they break show as damaged; summaries do not show damage to
    the events (``replay verify`` does).

    The scan decodes only what ``RolloutProgress`` reads of the frequent events
    (``RolloutProgress.READS``); ``projected=False`` decodes every field (the same rows, slower).
    ``jobs`` worker processes scan the partitions (``rollout_journal.replay.partition_scan``; None: as many as
    the journal's size repays, what the command line does); the rows are the same either way.
    The default is this process alone: workers are spawned interpreters, which re-run a
    calling script that lacks an ``if __name__ == "__main__"`` guard."""
    listing = Listing(source.location)
    rows = None if scan else _from_summaries(source, listing, progress)
    if rows is None and jobs != 1:  # (one process asks for the partitions' ends itself, as its scan starts)
        ends = source.end_offsets()
        workers = jobs_for(source, jobs, ends)
        if workers > 1:
            workers_scan = PartitionScan(source, partial(_list_partition, projected=projected), workers, ends)
            source.journal.note_damage(listing.report)  # first, as a serial scan notes it
            rows = _merged(workers_scan.run(progress), listing)
    if rows is None:  # one process (or a journal whose rollouts straddle partitions: read it as one)
        listing = Listing(source.location)
        rows = {}
        listing.events = _fold(source.scan(listing.report, progress, _fields(projected)), rows)
    forks = forks_in(source.journal.workloads())
    for row in rows.values():
        fork = forks.get(row.rollout_id)
        row.forked_from = fork.forked_from if fork is not None else None
    listing.scanned = len(rows)
    listing.rows = sorted((row for row in rows.values() if where.admits(row)), key=_listing_order)
    return listing


def _listing_order(row: RolloutRow) -> tuple[list[str | tuple[int, str]], str]:
    """Rows are listed by rollout id, its numbers compared as numbers (``g2`` before ``g10``): the
    same order whatever was read (summaries come as the consumer fetches their partitions, which
    differs from one read to the next), however many processes scanned, and in a copy of the
    journal with other partitions. Any id has its place: a number is compared by its digits, not
    converted (an id may hold more of them than ``int()`` takes), and ids whose numbers are equal
    (``g01``, ``g1``) are ordered by the id itself, not by whichever was read first."""
    parts = _DIGITS.split(row.rollout_id)  # text, number, text, ...: the same kinds at the same places
    numbered = [part if i % 2 == 0 else (len(part.lstrip("0")), part.lstrip("0")) for i, part in enumerate(parts)]
    return numbered, row.rollout_id


def _from_summaries(source: ReplaySource, listing: Listing, progress: Progress | None) -> dict[str, RolloutRow] | None:
    """The rows from the journal's summaries (the events of a rollout summarised incomplete are
    folded); None where the journal keeps no summary of every rollout, or one is unreadable."""
    journal = source.journal
    if not journal.backend.keeps_summaries:
        return None
    held: list[HeldBack] = []
    index = load_summaries(journal.codec, journal.backend.read_summaries(held=held))
    if not index.complete:
        return None
    if index.errors:
        log.warning(
            "%d unreadable record(s) among the summaries (the first: %s): reading every event instead",
            len(index.errors),
            index.errors[0],
        )
        return None
    listing.read = "summaries"
    listing.report.note_held_back(held)
    rows: dict[str, RolloutRow] = {}
    unknown: set[str] = set()
    for rollout_id, summary in index.summaries.items():
        if summary.complete:
            rows[rollout_id] = RolloutRow(SummaryFold.of(summary))
        else:
            unknown.add(rollout_id)
    if unknown:  # their writers did not know their whole history: fold their events
        partitions = sorted({journal.partition_of(r) for r in unknown})
        folded: dict[str, RolloutRow] = {}
        items = source.scan(listing.report, progress, _fields(True), partitions)
        _fold((item for item in items if item.event.header.rollout_id in unknown), folded)
        rows.update(folded)
    listing.events = sum(row.events for row in rows.values())
    return rows


def _fields(projected: bool) -> dict[type, tuple[str, ...]] | None:
    return RolloutProgress.READS if projected else None


def _fold(items: Iterable[JournaledEvent], rows: dict[str, RolloutRow]) -> int:
    """Apply each event to its rollout's row (a row per rollout, in order of first appearance);
    returns how many events there were."""
    events = 0
    for item in items:
        event = item.event
        h = event.header
        events += 1
        row = rows.get(h.rollout_id)
        if row is None:
            row = rows[h.rollout_id] = RolloutRow(SummaryFold.empty(h.rollout_id, h.group_id))
        if row.damaged is not None:
            row.fold.events += 1
            continue
        try:
            row.fold.apply(event)
        except StateFoldError as exc:
            row.damaged = f"{exc} at {item.location}"
    return events


def _list_partition(
    source: ReplaySource, partition: int, report: ReadReport, progress: Progress, *, projected: bool
) -> tuple[list[RolloutRow], int]:
    """One partition's rows and events (a worker's task)."""
    rows: dict[str, RolloutRow] = {}
    events = _fold(source.scan(report, progress, _fields(projected), [partition]), rows)
    return list(rows.values()), events


def _merged(
    results: list[tuple[int, tuple[list[RolloutRow], int], ReadReport]], listing: Listing
) -> dict[str, RolloutRow] | None:
    """The partitions' rows in partition order, their events and reports added to ``listing``;
    None if a rollout has events in two partitions (a damaged or foreign journal), which only
    a serial scan folds as one row."""
    rows: dict[str, RolloutRow] = {}
    for _, (found, events), report in results:
        for row in found:
            if row.rollout_id in rows:
                return None
            rows[row.rollout_id] = row
        listing.events += events
        listing.report.errors += report.errors
        listing.report.fenced += report.fenced
        listing.report.records_read += report.records_read
        listing.report.note_held_back(report.held_back)
    return rows
