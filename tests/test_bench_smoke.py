"""The benchmarks still run and report what their docs promise (tiny sizes; no timing asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.kafka
def test_journal_throughput_reports_its_ratio(kafka_bootstrap: str) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "journal_throughput.py"), "--json", "--rounds", "1",
         "--rollouts", "5", "--turns", "2"],
        capture_output=True, text=True, timeout=300, env=os.environ | {"KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["events"] == 5 * 2 * 3
    for key in ("journal_events_per_s", "raw_producer_events_per_s", "ratio", "commit_p50_ms", "commit_p99_ms"):
        assert report[key] > 0


@pytest.mark.slow
def test_recovery_bench_pieces_run(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from bench.recovery import redone_work, restore_seconds, synthesize

    redone = redone_work(tmp_path, groups=2, siblings=2, turns=4, snapshot_every=2, seed=3)
    strategies = redone["strategies"]
    assert strategies["this_system"]["redone_turns"] == 0
    assert strategies["naive_restart"]["redone_turns"] >= strategies["snapshot_only"]["redone_turns"]
    synthesize(tmp_path / "synth", active=20, turns=3, snapshot_every=2, finished_before=10)
    seconds, replayed = restore_seconds(tmp_path / "synth", repeats=1)
    assert seconds > 0 and replayed == 20 * 3  # one turn after the last snapshot, three events each


@pytest.mark.kafka
def test_replay_scan_reports_its_ratio_and_memory(kafka_bootstrap: str) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "replay_scan.py"), "--json", "--events", "1200", "--rollouts", "20",
         "--growth", "4", "--rounds", "1", "--prompt-delta", "64", "--output", "16"],
        capture_output=True, text=True, timeout=300, env=os.environ | {"KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["journals"]["large"]["events"] == 20 * (1 + 3 * 19)
    assert report["journals"]["small"]["events"] == 20 * (1 + 3 * 4)
    for key in ("raw_events_per_s", "list_events_per_s", "ratio"):
        assert report[key] > 0
    for size in ("small", "large"):
        assert report["memory"][size]["peak_rss_mb"] > 0 and report["memory"][size]["traced_peak_mb"] > 0
    assert report["memory_growth"]["events"] > 3
