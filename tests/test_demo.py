"""The newcomer's command, end to end, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def run_demo(*args: str, cwd: Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "replay.cli", "demo", "--json", *args],
                          capture_output=True, text=True, timeout=600, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.slow
def test_the_demo_throws_away_nothing_on_the_file_journal(tmp_path: Path) -> None:
    report = run_demo("--journal", str(tmp_path / "journal"), "--seed", "4", cwd=Path(__file__).parent.parent)
    assert report["backend"] == "file"
    assert report["turns_committed_at_crash"] >= report["killed_after_turns"] > 0
    assert report["turns_thrown_away"] == 0 and report["turns_lost"] == 0
    assert report["naive_turns_thrown_away"] > 0
    assert report["identical_to_uninterrupted"] is True
    assert report["rollouts"] == 12


@pytest.mark.slow
@pytest.mark.kafka
def test_the_demo_throws_away_nothing_on_kafka(kafka_bootstrap: str, kafka_namespace: str) -> None:
    report = run_demo("--journal", f"kafka://{kafka_bootstrap}/{kafka_namespace}", "--seed", "5",
                      cwd=Path(__file__).parent.parent)
    assert report["backend"] == "kafka"
    assert report["turns_committed_at_crash"] >= report["killed_after_turns"] > 0
    assert report["turns_thrown_away"] == 0 and report["identical_to_uninterrupted"] is True
