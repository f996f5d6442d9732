"""The newcomer's command, end to end, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rollout_journal.participants.workload.config import WorkloadConfig
from rollout_journal.participants.workload.runner import workload_specs
from rollout_journal.replay.cli.crash import crash_midway
from rollout_journal.replay.cli.demo import run_demo as run_demo_here
from rollout_journal.replay.redone import workload_at_crash
from tests.support.paths import REPO_ROOT


def run_demo(*args: str, cwd: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "rollout_journal.replay.cli.main", "demo", "--json", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.slow
def test_the_demo_throws_away_nothing_on_the_file_journal(tmp_path: Path) -> None:
    report = run_demo("--journal", str(tmp_path / "journal"), "--seed", "4", cwd=REPO_ROOT)
    assert report["backend"] == "file"
    assert report["turns_committed_at_crash"] >= report["killed_after_turns"] > 0
    assert report["turns_thrown_away"] == 0 and report["turns_lost"] == 0
    assert report["tokens_redone"] == 0
    assert report["naive_turns_thrown_away"] > 0
    assert report["identical_to_uninterrupted"] is True
    assert report["rollouts"] == 12
    phases = report["restore_ms"]
    assert sum(phases[p] for p in ("read", "fold", "rebuild", "fence")) == pytest.approx(phases["total"], abs=0.05)
    assert report["restore_seconds"] * 1000 == pytest.approx(phases["total"], abs=0.1)


@pytest.mark.slow
@pytest.mark.kafka
def test_the_demo_throws_away_nothing_on_kafka(kafka_bootstrap: str, kafka_namespace: str) -> None:
    report = run_demo(
        "--journal",
        f"kafka://{kafka_bootstrap}/{kafka_namespace}",
        "--seed",
        "5",
        cwd=REPO_ROOT,
    )
    assert report["backend"] == "kafka"
    assert report["turns_committed_at_crash"] >= report["killed_after_turns"] > 0
    assert report["turns_thrown_away"] == 0 and report["identical_to_uninterrupted"] is True


@pytest.mark.slow
def test_the_demo_shows_what_a_restart_only_rollout_redid(tmp_path: Path) -> None:
    """The "this restart redid" column is read from the journal: a rollout on the restart-only
    sandbox redoes every turn it had committed, one on the event-sourced workplace none."""
    config = WorkloadConfig(
        name="sbx",
        groups=2,
        siblings=2,
        max_turns=4,
        environment="workplace,sandbox",
        seed=3,
        allow_early_submit=False,
        concurrency=4,
        turn_delay_ms=20,
    )
    restart_only = {s.rollout_id for s in workload_specs(config) if s.environment == "sandbox"}
    report = run_demo_here(str(tmp_path / "journal"), kill_after=7, config=config).as_json()
    rows = {r["rollout_id"]: r for r in report["per_rollout"]}
    must_redo = {rid for rid in restart_only if not rows[rid]["finished_at_crash"] and rows[rid]["turns_at_crash"]}
    assert must_redo, f"no sandbox rollout had committed turns at the crash: {rows}"
    for rid, row in rows.items():
        assert row["redone_here"] == (row["turns_at_crash"] if rid in must_redo else 0), rid
        assert (row["redone_tokens_here"] > 0) == (rid in must_redo), rid
    assert report["turns_redone"] == sum(rows[rid]["turns_at_crash"] for rid in must_redo)
    assert report["identical_to_uninterrupted"] is True


def test_a_crash_drill_run_kills_itself_once_its_turns_are_durable(tmp_path: Path) -> None:
    """``run --crash-after N`` (the child ``crash_midway`` starts): the workload SIGKILLs itself N
    durable turns in. The kill is armed in the child, so a parent slow to read its progress (a
    loaded machine) cannot miss the crash point and find the workload finished; every turn it
    reported durable is in the journal."""
    config = WorkloadConfig(
        name="drill",
        groups=2,
        siblings=2,
        max_turns=6,
        seed=2,
        allow_early_submit=False,
        concurrency=4,
        turn_delay_ms=0,
        journal=str(tmp_path / "journal"),
    )
    assert crash_midway(config, 3) == 3, "with no --crash-delay the kill lands inside the third turn's report"
    at_crash = workload_at_crash(config)
    assert sum(a.turns for a in at_crash.values()) >= 3
    assert not all(a.finished for a in at_crash.values())


def test_crash_midway_counts_every_turn_the_child_reported(tmp_path: Path) -> None:
    # Paced (50 ms a turn, 19 turns left after the fifth): the 0.05 s delay ends long before the work.
    config = WorkloadConfig(
        name="mid",
        groups=2,
        siblings=2,
        max_turns=6,
        seed=2,
        allow_early_submit=False,
        concurrency=4,
        turn_delay_ms=50,
        journal=str(tmp_path / "journal"),
    )
    killed_after = crash_midway(config, 5, extra_delay_s=0.05)
    assert killed_after is not None and killed_after >= 5
    assert sum(a.turns for a in workload_at_crash(config).values()) >= killed_after


def test_a_crash_drill_that_never_fires_says_so_and_is_not_a_crash(tmp_path: Path) -> None:
    config = WorkloadConfig(
        name="nofire",
        groups=1,
        siblings=2,
        max_turns=2,
        seed=2,
        allow_early_submit=False,
        turn_delay_ms=0,
        journal=str(tmp_path / "journal"),
    )
    config_path = tmp_path / "nofire.yaml"
    config_path.write_text(yaml.safe_dump(config.model_dump()))
    done = subprocess.run(
        [sys.executable, "-m", "rollout_journal.replay.cli.main", "run", str(config_path), "--crash-after", "100"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--crash-after 100: the workload ended after 4 durable turns, before the crash point" in done.stderr
