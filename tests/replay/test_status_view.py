"""``status --watch`` fits a terminal: the summary first (with turns per second and the ETA), then
the busiest partitions and rollouts, as many as the screen holds, and how many more there are."""

from __future__ import annotations

import dataclasses

from rollout_journal.replay.status import (
    FINISHED,
    PENDING,
    RUNNING,
    FleetStatus,
    Pace,
    PartitionStatus,
    RolloutStatus,
    WorkloadStatus,
    format_status,
)


def fleet(turns: list[int]) -> FleetStatus:
    """60 rollouts of 30 turns on 12 partitions, rollout i at turns[i]."""
    rows = [
        RolloutStatus(
            f"fleet-g{i // 3}-s{i % 3}",
            "fleet",
            i % 12,
            f"w{i % 3}",
            FINISHED if t == 30 else RUNNING if t else PENDING,
            1,
            1,
            t,
            30,
            finished=t == 30,
        )
        for i, t in enumerate(turns)
    ]
    parts = [PartitionStatus(p, f"w{p % 3}") for p in range(12)]
    for r in rows:
        parts[r.partition].rollouts += 1
        parts[r.partition].turns += r.turns
        parts[r.partition].running += r.status == RUNNING
        parts[r.partition].finished += r.finished
        parts[r.partition].pending += r.status == PENDING
    workload = WorkloadStatus(
        "fleet",
        60,
        finished=sum(r.finished for r in rows),
        running=sum(r.status == RUNNING for r in rows),
        pending=sum(r.status == PENDING for r in rows),
        turns=sum(turns),
        max_turns=1800,
    )
    return FleetStatus("kafka://h:1/fleet", "fleet.workers", "STABLE", ["w0", "w1", "w2"], [workload], parts, rows)


def test_a_watched_fleet_of_60_fits_a_24_line_terminal_summary_first() -> None:
    before = fleet([10] * 60)
    after = fleet([30] * 10 + [12] * 40 + [0] * 10)  # 10 finished, 40 going, 10 not started
    pace = Pace.between(before, after, seconds=10.0)
    assert pace.turns_per_s == (10 * 30 + 40 * 12 - 60 * 10) / 10  # turns committed between the readings
    lines = format_status(after, height=24, pace=pace)
    assert len(lines) <= 24
    assert lines[0] == "journal kafka://h:1/fleet" and lines[1].startswith("group fleet.workers: STABLE, 3 worker(s)")
    assert "10/60 finished, 40 running, 10 pending" in lines[2] and "18.0 turns/s, ETA 0m57s" in lines[2]
    assert sum(l.startswith("fleet-") for l in lines) >= 10
    assert all(" running" in l for l in lines if l.startswith("fleet-"))  # the busiest: running ones first
    assert lines[-1].startswith("... ") and "more rollouts" in lines[-1]


def test_without_a_terminal_every_row_is_printed() -> None:
    status = fleet([5] * 60)
    lines = format_status(status)
    assert sum(l.startswith("fleet-") for l in lines) == 60 and not any("more" in l for l in lines)
    assert dataclasses.asdict(status)["rollouts"][0]["turns"] == 5
