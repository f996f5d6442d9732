"""Where a fleet stands: per rollout and per partition, who owns it and how far it got.

Reads only. Each rollout's standing comes from the journal exactly as a restore sees it
(its newest snapshot, the events after it, folded by the aggregate); the owner of each
partition comes from the worker group's member assignment, as the broker's group
coordinator reports it (``journal.kafka_group.describe_group``). A file journal has no
group: its rows have no owner.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from journal.errors import JournalError
from journal.journal import Journal
from journal.open import is_kafka_url, open_journal
from journal.restore import load_rollouts
from journal.snapshots import Fence
from participants.config import WorkloadConfig
from participants.rollout_state import StateFoldError, restore_state
from participants.specs import workload_specs

PENDING, RUNNING, FINISHED, ACKNOWLEDGED, FAILED, DAMAGED = (
    "pending", "running", "finished", "acknowledged", "failed", "damaged")


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
    turns: int = 0
    max_turns: int = 0

    @property
    def done(self) -> bool:
        """Every rollout finished (or acknowledged); nothing left for the fleet."""
        return self.finished + self.acknowledged == self.rollouts


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
    read_seconds: float = 0.0

    @property
    def done(self) -> bool:
        return bool(self.workloads) and all(w.done for w in self.workloads)

    def as_json(self) -> dict:
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
    acknowledged: dict[str, Fence | None] = dict(plan.acknowledged)
    max_turns: dict[str, int] = {}
    workload_of: dict[str, str] = {}
    pending: set[str] = set()
    for name, registration in sorted(plan.workloads.items()):
        try:
            config = WorkloadConfig.model_validate_json(registration.spec_json)
            ids = [s.rollout_id for s in workload_specs(config)]
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
        row = RolloutStatus(rid, workload_of.get(rid), partition, owners.get(partition), PENDING,
                            max_turns=max_turns.get(rid))
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
                row.attempt, row.epoch, row.turns, row.finished = state.attempt, state.epoch, state.next_turn, state.finished
                row.status = FINISHED if state.finished else FAILED if state.failure else RUNNING
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
    from journal.kafka_backend import KafkaBackend
    from journal.kafka_group import describe_group

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


def _workloads(rows: list[RolloutStatus], registrations: dict) -> list[WorkloadStatus]:
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
    return list(out.values())


def format_status(status: FleetStatus, *, rollouts: bool = True) -> list[str]:
    """The status as text lines: workloads, partitions with their owners, then each rollout."""
    lines = [f"journal {status.journal}"]
    if status.group is not None:
        workers = ", ".join(status.workers) or "none"
        lines.append(f"group {status.group}: {status.group_state or 'unknown'}, {len(status.workers)} worker(s): {workers}")
    for w in status.workloads:
        lines.append(f"workload {w.name}: {w.finished}/{w.rollouts} finished, {w.running} running, {w.pending} pending, "
                     f"{w.acknowledged} acknowledged, {w.damaged} damaged; {w.turns}/{w.max_turns} turns"
                     + ("  DONE" if w.done else ""))
    lines.append(f"{'partition':>9}  {'owner':<24} {'rollouts':>8} {'running':>7} {'finished':>8} {'pending':>7} {'turns':>6}")
    for p in status.partitions:
        lines.append(f"{p.partition:>9}  {p.owner or '-':<24} {p.rollouts:>8} {p.running:>7} {p.finished:>8} "
                     f"{p.pending:>7} {p.turns:>6}")
    if rollouts:
        lines.append(f"{'rollout':<28} {'part':>4}  {'owner':<24} {'attempt':>7} {'epoch':>5} {'turns':>7}  status")
        for r in status.rollouts:
            turns = f"{r.turns}/{r.max_turns}" if r.max_turns else str(r.turns)
            note = f" ({r.note})" if r.note else ""
            lines.append(f"{r.rollout_id:<28} {r.partition:>4}  {r.owner or '-':<24} {r.attempt:>7} {r.epoch:>5} "
                         f"{turns:>7}  {r.status}{note}")
    lines.extend(f"note: {n}" for n in status.notes)
    return lines
