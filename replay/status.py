"""Where a fleet stands: per rollout and per partition, who owns it and how far it got.

Reads only. Each rollout's standing comes from the journal exactly as a restore sees it
(its newest snapshot, the events after it, folded by the aggregate); the owner of each
partition comes from the worker group's member assignment, as the broker's group
coordinator reports it (``rollout_journal.journal.kafka.group.describe_group``). A file journal has no
group: its rows have no owner.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from rollout_journal.journal.backend import held_back_warnings
from rollout_journal.journal.errors import JournalError
from rollout_journal.journal.events import WorkloadRegistered
from rollout_journal.journal.journal import Journal
from rollout_journal.journal.open import is_kafka_url, open_journal
from rollout_journal.journal.restore import load_rollouts
from rollout_journal.journal.snapshots import Fence
from rollout_journal.participants.rollout.state import StateFoldError, restore_state
from rollout_journal.participants.workload.config import WorkloadConfig
from rollout_journal.participants.workload.specs import workload_specs
from rollout_journal.replay.rollout_status import (
    ACKNOWLEDGED,
    DAMAGED,
    FAILED,
    FINISHED,
    GIVEN_UP,
    RUNNING,
    rollout_status,
)

PENDING = "pending"  # registered, no event of it in the journal yet; the others: rollout_status
__all__ = [
    "ACKNOWLEDGED",
    "DAMAGED",
    "FAILED",
    "FINISHED",
    "GIVEN_UP",
    "PENDING",
    "RUNNING",
    "FleetStatus",
    "fleet_status",
]


@dataclass
class RolloutStatus:
    rollout_id: str
    workload: str | None
    partition: int
    owner: str | None  # the worker assigned its partition (None: nobody, or no group)
    status: str  # pending | running | finished | acknowledged | failed | damaged
    attempt: int = 0
    epoch: int = 0
    turns: int = 0  # committed turns
    max_turns: int | None = None
    finished: bool = False
    acknowledged: bool = False
    note: str | None = None  # why it is damaged or failed


@dataclass
class PartitionStatus:
    partition: int
    owner: str | None
    rollouts: int = 0
    running: int = 0
    finished: int = 0
    pending: int = 0
    turns: int = 0


@dataclass
class WorkloadStatus:
    name: str
    rollouts: int
    finished: int = 0
    acknowledged: int = 0
    running: int = 0
    pending: int = 0
    damaged: int = 0
    given_up: int = 0
    turns: int = 0
    max_turns: int = 0

    @property
    def done(self) -> bool:
        """Every rollout finished, given up (or acknowledged); nothing left for the fleet."""
        return self.finished + self.given_up + self.acknowledged == self.rollouts


@dataclass
class FleetStatus:
    journal: str
    group: str | None
    group_state: str | None
    workers: list[str]
    workloads: list[WorkloadStatus] = field(default_factory=list)
    partitions: list[PartitionStatus] = field(default_factory=list)
    rollouts: list[RolloutStatus] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the read stepped over, why the group is unknown
    held_back: list[str] = field(default_factory=list)  # partitions an open transaction hid turns of (a warning)
    read_seconds: float = 0.0

    @property
    def done(self) -> bool:
        return bool(self.workloads) and all(w.done for w in self.workloads)

    def as_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["done"] = self.done
        for workload, row in zip(doc["workloads"], self.workloads):
            workload["done"] = row.done
        return doc


def fleet_status(location: str) -> FleetStatus:
    """Read the journal at ``location`` (and its worker group, on Kafka) once."""
    started = time.perf_counter()
    with open_journal(location, writer="status", read_only=True) as journal:
        plan = load_rollouts(journal)
        status = FleetStatus(location, None, None, [])
        owners = _owners(journal, location, status)
        partition_count, partition_of = journal.backend.partitions, journal.partition_of
    status.notes.extend(str(e) for e in plan.report.errors)
    status.held_back = held_back_warnings(plan.report.held_back)
    acknowledged: dict[str, Fence | None] = dict(plan.acknowledged)
    max_turns: dict[str, int] = {}
    workload_of: dict[str, str] = {}
    pending: set[str] = set()
    for name, registration in sorted(plan.workloads.items()):
        try:
            config = WorkloadConfig.model_validate_json(registration.spec_json)
            ids = [s.rollout_id for s in workload_specs(config, registration.redispatched)]
            max_turns.update({rid: config.max_turns for rid in ids})
        except ValueError:
            ids = list(registration.rollout_ids)
        workload_of.update({rid: name for rid in ids})
        missing = [rid for rid in ids if rid not in plan.rollouts and rid not in acknowledged]
        if registration.acknowledgement_markers:
            pending.update(missing)
        else:  # registered before markers: a registered rollout gone from the stream was acknowledged
            acknowledged.update({rid: None for rid in missing})
    rows: list[RolloutStatus] = []
    for rid in sorted(plan.rollouts.keys() | acknowledged.keys() | pending):
        partition = partition_of(rid)
        row = RolloutStatus(
            rid, workload_of.get(rid), partition, owners.get(partition), PENDING, max_turns=max_turns.get(rid)
        )
        if rid in acknowledged:
            fence = acknowledged[rid]
            row.status, row.acknowledged, row.finished = ACKNOWLEDGED, True, True
            if fence is not None:
                row.attempt, row.epoch = fence.attempt, fence.epoch
        elif rid in plan.rollouts:
            try:
                state = restore_state(plan.rollouts[rid])
            except StateFoldError as exc:
                row.status, row.note = DAMAGED, str(exc)
            else:
                row.attempt, row.epoch, row.turns, row.finished = (
                    state.attempt,
                    state.epoch,
                    state.next_turn,
                    state.finished,
                )
                row.status = rollout_status(state)
                row.note = state.failure
        rows.append(row)
    status.rollouts = rows
    status.partitions = _partitions(rows, owners, partition_count)
    status.workloads = _workloads(rows, plan.workloads)
    status.read_seconds = time.perf_counter() - started
    return status


def _owners(journal: Journal, location: str, status: FleetStatus) -> dict[int, str]:
    if not is_kafka_url(location):
        return {}
    from rollout_journal.journal.kafka.backend import KafkaBackend
    from rollout_journal.journal.kafka.group import describe_group

    if not isinstance(journal.backend, KafkaBackend):  # a Kafka URL opens one; anything else has no owners
        return {}
    settings = journal.backend.settings
    status.group = settings.group_id
    try:
        group = describe_group(settings)
    except JournalError as exc:
        status.notes.append(f"owners unknown: {exc}")
        return {}
    status.group_state = group.state
    status.workers = [m.name for m in group.members]
    return group.owners()


def _partitions(rows: list[RolloutStatus], owners: dict[int, str], count: int) -> list[PartitionStatus]:
    out = [PartitionStatus(p, owners.get(p)) for p in range(count)]
    for row in rows:
        part = out[row.partition]
        part.rollouts += 1
        part.turns += row.turns
        part.running += row.status == RUNNING
        part.finished += row.finished
        part.pending += row.status == PENDING
    return out


def _workloads(rows: list[RolloutStatus], registrations: Mapping[str, WorkloadRegistered]) -> list[WorkloadStatus]:
    out: dict[str, WorkloadStatus] = {name: WorkloadStatus(name, 0) for name in registrations}
    for row in rows:
        if row.workload is None:
            continue
        w = out.setdefault(row.workload, WorkloadStatus(row.workload, 0))
        w.rollouts += 1
        w.turns += row.turns
        w.max_turns += row.max_turns or 0
        w.finished += row.status == FINISHED
        w.acknowledged += row.status == ACKNOWLEDGED
        w.running += row.status in (RUNNING, FAILED)
        w.pending += row.status == PENDING
        w.damaged += row.status == DAMAGED
        w.given_up += row.status == GIVEN_UP
    return list(out.values())


@dataclass(frozen=True)
class Pace:
    """How fast a fleet goes, from two readings of its status ``seconds`` apart."""

    turns_per_s: float
    eta_s: float | None  # until every workload's turns are done at this pace (None: no progress)

    @classmethod
    def between(cls, before: FleetStatus, after: FleetStatus, seconds: float) -> Pace:
        done = sum(w.turns for w in after.workloads) - sum(w.turns for w in before.workloads)
        rate = max(done, 0) / seconds if seconds > 0 else 0.0
        left = sum(max(w.max_turns - w.turns, 0) for w in after.workloads if not w.done)
        return cls(rate, left / rate if rate > 0 else None)

    def text(self) -> str:
        eta = "-" if self.eta_s is None else _duration(self.eta_s)
        return f"{self.turns_per_s:.1f} turns/s, ETA {eta}"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"
    )


def format_status(
    status: FleetStatus, *, rollouts: bool = True, height: int | None = None, pace: Pace | None = None
) -> list[str]:
    """The status as text lines: the summary first (group, workloads, and with ``pace`` the turns per
    second and the ETA), then the partitions with their owners, then the rollouts. With ``height``
    (a terminal's lines) it fits there: the busiest partitions and rollouts (running first, then the
    furthest along), and a line saying how many more ``--json`` lists."""
    lines = [f"journal {status.journal}"]
    if status.group is not None:
        workers = ", ".join(status.workers) or "none"
        lines.append(
            f"group {status.group}: {status.group_state or 'unknown'}, {len(status.workers)} worker(s): {workers}"
        )
    for w in status.workloads:
        lines.append(
            f"workload {w.name}: {w.finished}/{w.rollouts} finished, {w.running} running, {w.pending} pending, "
            f"{w.acknowledged} acknowledged, {w.given_up} given up, {w.damaged} damaged; {w.turns}/{w.max_turns} turns"
            + (f"; {pace.text()}" if pace is not None and not w.done else "")
            + ("  DONE" if w.done else "")
        )
    lines.extend(f"note: {n}" for n in status.notes)
    room = None if height is None else max(height - len(lines) - 1, 4)  # the rest of the screen (one line spare)
    partitions = status.partitions
    rows = status.rollouts if rollouts else []
    if room is not None:
        # partitions and rollouts share the room; the busiest of each first
        part_room = min(len(partitions), max(2, room // 3 if rows else room - 2)) if partitions else 0
        partitions = sorted(partitions, key=lambda p: (-p.running, -p.pending, p.partition))[: max(part_room - 1, 0)]
        rows = sorted(rows, key=lambda r: (r.status != RUNNING, r.status == FINISHED, -r.turns, r.rollout_id))
        rows = rows[: max(room - len(partitions) - 4, 0)]
    lines.append(
        f"{'partition':>9}  {'owner':<24} {'rollouts':>8} {'running':>7} {'finished':>8} {'pending':>7} {'turns':>6}"
    )
    for p in partitions:
        lines.append(
            f"{p.partition:>9}  {p.owner or '-':<24} {p.rollouts:>8} {p.running:>7} {p.finished:>8} "
            f"{p.pending:>7} {p.turns:>6}"
        )
    if len(partitions) < len(status.partitions):
        lines.append(f"{'':>9}  ... {len(status.partitions) - len(partitions)} more partitions")
    if rollouts:
        lines.append(f"{'rollout':<28} {'part':>4}  {'owner':<24} {'attempt':>7} {'epoch':>5} {'turns':>7}  status")
        for r in rows:
            turns = f"{r.turns}/{r.max_turns}" if r.max_turns else str(r.turns)
            note = f" ({r.note})" if r.note else ""
            lines.append(
                f"{r.rollout_id:<28} {r.partition:>4}  {r.owner or '-':<24} {r.attempt:>7} {r.epoch:>5} "
                f"{turns:>7}  {r.status}{note}"
            )
        if len(rows) < len(status.rollouts):
            lines.append(f"... {len(status.rollouts) - len(rows)} more rollouts (status --json lists every one)")
    return lines
