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


@pytest.mark.slow
def test_signing_cost_reports_per_checkpoint_and_end_to_end(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from bench.signing_cost import per_checkpoint, throughput

    micro = per_checkpoint(repeats=1, loops=20)
    assert micro["resources_per_checkpoint"] == 3 and micro["sign_us_per_checkpoint"] > 0
    assert micro["verify_us_per_checkpoint"] > 0
    e2e = throughput(tmp_path, rounds=1, groups=1, siblings=2, turns=3)
    assert e2e["turns_per_run"] == 6 and e2e["checkpoints_per_run"] > 0  # the signed runs did sign
    for key in ("turns_per_s_signed", "turns_per_s_plain", "signing_overhead", "signing_cpu_overhead"):
        assert key in e2e
