"""The benchmarks still run and report what their docs promise (tiny sizes; no timing asserted)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.paths import REPO_ROOT

STACK_DUMP_S = 3.0  # how long a bench run past its time gets to print its stacks before it is killed


def bench_report(script: str, *args: str, timeout_s: float, env: dict[str, str] | None = None) -> Any:
    """``bench/<script> --json ARGS`` run as a user runs it (its own process, tiny sizes): its
    JSON report; a failed run shows the end of its stderr. One still running after ``timeout_s``
    is sent SIGUSR1 first (a bench that called ``dump_stacks_on`` prints its threads and tasks),
    then killed: the failure shows where it waited."""
    with subprocess.Popen(
        [sys.executable, str(REPO_ROOT / "bench" / script), "--json", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    ) as child:
        try:
            stdout, stderr = child.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGUSR1)
            time.sleep(STACK_DUMP_S)
            child.kill()
            stdout, stderr = child.communicate()
            raise AssertionError(f"bench/{script} ran past {timeout_s} s; its stacks:\n{stderr[-12000:]}") from None
    assert child.returncode == 0, stderr[-3000:]
    return json.loads(stdout)


@pytest.mark.slow
@pytest.mark.kafka
def test_journal_throughput_reports_its_ratio(kafka_bootstrap: str) -> None:
    report = bench_report(
        "journal_throughput.py",
        "--rounds",
        "1",
        "--rollouts",
        "5",
        "--turns",
        "2",
        timeout_s=300,
        env=os.environ | {"KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap},
    )
    assert report["events"] == 5 * 2 * 3
    for key in ("journal_events_per_s", "raw_producer_events_per_s", "ratio", "commit_p50_ms", "commit_p99_ms"):
        assert report[key] > 0


@pytest.mark.slow
def test_the_redone_figure_is_what_the_journal_shows_not_a_constant(tmp_path: Path) -> None:
    """Three environment kinds, SIGKILLed with every rollout mid-way. The restart-only
    (sandbox) rollouts redo exactly the turns and tokens they had committed, as their
    environment (not the runner) says they must; the others redo none. The benchmark's
    old figure, 0 by construction, fails here."""
    sys.path.insert(0, str(REPO_ROOT))
    from bench.recovery import crash_trial, redo_config, strategy_totals
    from rollout_journal.participants.workload.runner import workload_specs

    config = redo_config(
        tmp_path, "smoke", groups=3, siblings=2, turns=4, environment="workplace,counter,sandbox", concurrency=6
    )
    restart_only = {s.rollout_id for s in workload_specs(config) if s.environment == "sandbox"}
    trial = crash_trial(config, kill_after=12, extra_delay_s=0.0)  # 6 rollouts in step, 4 turns each: half way
    assert trial is not None, "the child finished before the kill"
    rows = {r["rollout_id"]: r for r in trial["rollouts"]}
    must_redo = {rid for rid in restart_only if not rows[rid]["finished_at_crash"] and rows[rid]["turns_at_crash"]}
    assert must_redo, f"no restart-only rollout had committed turns at the crash: {rows}"
    for rid, row in rows.items():
        expected = [row["turns_at_crash"], row["tokens_at_crash"]] if rid in must_redo else [0, 0]
        assert row["this_system"] == expected, rid
        assert row["restarted"] == (rid in must_redo), rid
    unfinished = [r for r in rows.values() if not r["finished_at_crash"]]
    totals = strategy_totals(trial["rollouts"])
    assert totals["this_system"]["redone_tokens"] == sum(rows[rid]["tokens_at_crash"] for rid in must_redo) > 0
    assert totals["naive_restart"]["redone_turns"] == sum(r["turns_at_crash"] for r in unfinished)
    assert (
        totals["this_system"]["redone_turns"]
        <= totals["snapshot_only"]["redone_turns"]
        <= totals["naive_restart"]["redone_turns"]
    )
    assert sum(trial["restore_ms"][phase] for phase in ("read", "fold", "rebuild", "fence")) == pytest.approx(
        trial["restore_ms"]["total"], abs=0.05
    )


@pytest.mark.slow
def test_synthesized_restore_journals_fold(tmp_path: Path) -> None:
    """The restore-time journals hold real rollout states that their events fold onto, so the
    benchmark times the fold, not only the read."""
    sys.path.insert(0, str(REPO_ROOT))
    from bench.recovery import restore_phases, synthesize

    synthesize(tmp_path / "synth", active=20, turns=3, snapshot_every=2, finished_before=10)
    phases = restore_phases(tmp_path / "synth", repeats=1)
    assert phases["rollouts"] == 20 and phases["turns_folded"] == 20 * 3  # the acknowledged 10 are gone
    assert phases["events_replayed"] == 20 * 3  # one turn after the last snapshot, three events each
    assert phases["restore_s"] == pytest.approx(phases["read_s"] + phases["fold_s"])


@pytest.mark.slow
def test_restore_growth_separates_history_from_state_size(tmp_path: Path) -> None:
    """History grows the journal 10x around the same states; state grows each active rollout
    8x in turns; both do both. Each is timed against the same base journal."""
    sys.path.insert(0, str(REPO_ROOT))
    from bench.recovery import growth_section

    report = growth_section(tmp_path, active=4, rounds=1)
    journals = report["restore_growth"]["journals"]
    assert journals["history"]["journal_mb"] == pytest.approx(10 * journals["base"]["journal_mb"], rel=0.2)
    assert journals["state"]["active_turns"] == journals["both"]["active_turns"] == 41
    assert journals["history"]["events_replayed"] == journals["base"]["events_replayed"]  # the log since snapshots
    for key in (
        "restore_time_ratio_10x_history",
        "restore_time_ratio_8x_state",
        "restore_time_ratio_history_and_state",
    ):
        assert report[key] > 0


@pytest.mark.slow
def test_signing_cost_reports_per_checkpoint_and_end_to_end(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO_ROOT))
    from bench.signing_cost import per_checkpoint, throughput

    micro = per_checkpoint(repeats=1, loops=20)
    assert micro["resources_per_checkpoint"] == 3 and micro["sign_us_per_checkpoint"] > 0
    assert micro["verify_us_per_checkpoint"] > 0
    e2e = throughput(tmp_path, rounds=1, groups=1, siblings=2, turns=3)
    assert e2e["turns_per_run"] == 6 and e2e["checkpoints_per_run"] > 0  # the signed runs did sign
    for key in ("turns_per_s_signed", "turns_per_s_plain", "signing_overhead", "signing_cpu_overhead"):
        assert key in e2e


@pytest.mark.kafka
def test_replay_scan_reports_its_ratio_and_memory(kafka_bootstrap: str) -> None:
    report = bench_report(
        "replay_scan.py",
        "--events",
        "1200",
        "--rollouts",
        "20",
        "--growth",
        "4",
        "--rounds",
        "1",
        "--prompt-delta",
        "64",
        "--output",
        "16",
        "--segment-ms",
        "2000",
        timeout_s=300,
        env=os.environ | {"KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap},
    )
    assert report["journals"]["large"]["events"] == 20 * (1 + 3 * 19)
    assert report["summaries_ratio"] > 0 and report["summaries_fresh_ratio"] > 0
    assert report["summary_records_fresh"] == 1 + 20 * (1 + 19)  # the mark, then one an append
    assert report["summary_records_compacted"] < report["summary_records_fresh"]
    assert report["journals"]["small"]["events"] == 20 * (1 + 3 * 4)
    for key in ("raw_events_per_s", "list_events_per_s", "ratio", "serial_ratio"):
        assert report[key] > 0
    assert report["scan_jobs"] == 1  # a journal this small is scanned in one process
    for size in ("small", "large"):
        assert report["memory"][size]["peak_rss_mb"] > 0 and report["memory"][size]["traced_peak_mb"] > 0
    assert report["memory_growth"]["events"] > 3


@pytest.mark.slow
def test_services_reports_the_http_ratio_and_the_pauses() -> None:
    """Resource servers as processes, tiny sizes: the figures the docs quote are there."""
    report = bench_report(
        "services.py",
        "--rounds",
        "1",
        "--groups",
        "2",
        "--siblings",
        "1",
        "--turns",
        "3",
        "--only",
        "throughput,pause",
        timeout_s=600,
        env=os.environ | {"PYTHONPATH": str(REPO_ROOT)},
    )
    for key in ("http_vs_inprocess_ratio", "turns_per_s_http", "turns_per_s_inprocess", "pause_p50_ms", "pause_p99_ms"):
        assert report[key] > 0, key
    assert report["pause_checkpoints"] > 0


@pytest.mark.slow
def test_prefix_recovery_counts_what_the_resume_generated() -> None:
    """One SIGKILL inside a long generation, with and without prefix recovery, and one on/off
    throughput round: the regenerated tokens are what the lineage shows the resume generated at
    positions the killed call had reached (the prefix kept is exactly the journaled progress),
    and the continued output equals the uninterrupted one."""
    report = bench_report(
        "prefix_recovery.py",
        "--crashes",
        "1",
        "--rounds",
        "1",
        "--tokens",
        "96",
        "--every",
        "16",
        "--rollouts",
        "2",
        "--turns",
        "2",
        timeout_s=600,
        env=os.environ | {"PYTHONPATH": str(REPO_ROOT)},
    )
    assert report["crashes"] == 1 and report["progress_every_tokens"] == 16
    with_prefix, without = report["trials"]["with_prefix"], report["trials"]["without_prefix"]
    assert len(with_prefix) == len(without) == 1
    for trial in with_prefix:
        assert trial["prefix_kept"] == trial["journaled_at_crash"] and trial["prefix_kept"] % 16 == 0
        assert trial["regenerated"] == trial["tokens_at_crash"] - trial["prefix_kept"] >= trial["after_last_mark"]
        assert trial["generated_by_resume"] == trial["call_tokens"] - trial["prefix_kept"]
    for trial in without:
        assert trial["prefix_kept"] == trial["journaled_at_crash"] == 0
        assert trial["regenerated"] == trial["tokens_at_crash"] > 16
    assert report["tokens_regenerated_with_prefix"] == sum(t["regenerated"] for t in with_prefix)
    assert report["tokens_regenerated_without_prefix"] == sum(t["regenerated"] for t in without)
    assert report["continued_equals_uninterrupted"] is True
    assert isinstance(report["progress_overhead"], float) and isinstance(
        report["progress_overhead_every_token_mark"], float
    )
    # a time floor between marks can only leave marks out
    assert report["progress_marks_per_run_exact"] >= report["progress_marks_per_run_on"]
    assert report["progress_marks_per_run_exact"] >= 2 * (96 // 16 - 1)  # at least each rollout's 96-token call's
    assert (
        report["tokens_per_s_on"] > 0 and report["tokens_per_s_exact"] > 0 and report["tokens_per_s_progress_off"] > 0
    )


@pytest.mark.slow
@pytest.mark.kafka
def test_services_reports_the_results_read_ratio(kafka_bootstrap: str) -> None:
    """The trainer's feed and a raw consumer read the same results topic in one run."""
    report = bench_report(
        "services.py",
        "--rounds",
        "1",
        "--only",
        "results",
        "--results-records",
        "40",
        "--results-tokens",
        "64",
        timeout_s=300,
        env=os.environ | {"PYTHONPATH": str(REPO_ROOT), "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap},
    )
    assert report["results_records"] == 40
    for key in (
        "results_read_ratio",
        "results_read_ratio_no_tensors",
        "results_records_per_s_raw",
        "results_records_per_s_feed",
    ):
        assert report[key] > 0, key


def test_snapshot_state_reports_both_layouts() -> None:
    report = bench_report(
        "snapshot_state.py",
        "--turns",
        "2",
        "--rounds",
        "2",
        "--repeat",
        "2",
        timeout_s=300,
    )["turns_2"]
    assert report["head_tokens"] > 0 and report["bytes"] > 0 and report["earlier_bytes"] > 0
    for key in ("to_bytes_ms", "from_bytes_ms", "earlier_from_bytes_ms", "read_speedup"):
        assert report[key] > 0
    assert len(report["read_speedup_per_round"]) == 2


def test_snapshot_blocks_measures_both_layouts_and_their_growth() -> None:
    """A figure that can come out badly: blocks are counted from what the journal committed, so a
    head written whole each time would grow as whole snapshots do."""
    report = bench_report(
        "snapshot_blocks.py",
        "--turns",
        "2,8",
        "--output",
        "4096",
        "--rounds",
        "1",
        "--restores",
        "1",
        timeout_s=300,
    )
    assert report["block_bytes_8"] > 0 and report["snapshot_bytes_8_whole"] > 0
    assert report["growth_blocks"] < report["growth_whole"]
    for key in ("restore_ms_8_blocks", "restore_ms_8_whole", "restore_ratio_8", "bytes_ratio_8"):
        assert report[key] > 0, key


@pytest.mark.slow
@pytest.mark.kafka
@pytest.mark.timeout(1800)
def test_fleet_reports_its_failover_handoff_and_race_figures(kafka_bootstrap: str) -> None:
    """bench/fleet.py --smoke on the session's broker: every figure is there, the counters are zero."""
    report = bench_report(
        "fleet.py",
        "--smoke",
        "--bootstrap",
        kafka_bootstrap,
        timeout_s=1700,
        env={k: v for k, v in os.environ.items() if k != "KAFKA_BOOTSTRAP_SERVERS"},
    )
    for key in ("failover_seconds", "handoff_seconds_p99", "broker_kills_survived", "session_timeout_seconds"):
        assert key in report, key
    assert report["handoff_moves"] > 0 and report["handoff_seconds_p99"] is not None
    assert report["turns_lost"] == report["duplicate_turns"] == report["zombie_writes_visible"] == 0
    assert report["duplicate_training_records"] == 0 and report["workers_exited"] == 0
    assert report["identical_to_uninterrupted"] is True


@pytest.mark.slow
@pytest.mark.kafka
def test_fleet_scale_reports_per_member_costs_and_audits_the_journal(kafka_bootstrap: str) -> None:
    """bench/fleet_scale.py --smoke on the session's broker: several members per process, each its
    own group member and producer; every figure is there and the audit's counters are zero."""
    report = bench_report(
        "fleet_scale.py",
        "--smoke",
        "--bootstrap",
        kafka_bootstrap,
        timeout_s=900,
        env={k: v for k, v in os.environ.items() if k != "KAFKA_BOOTSTRAP_SERVERS"},
    )
    assert report["members_reporting"] == report["members"] == 6 and report["processes"] == 2
    assert report["members_that_took_partitions"] == 6  # 24 partitions: every member owns some
    for key in (
        "transactions_per_worker_s",
        "idle_requests_per_worker_s",
        "busy_requests_per_worker_s",
        "event_bytes_per_turn",
    ):
        assert report[key] > 0, key
    assert report["turns_lost"] == report["duplicate_turns"] == report["zombie_writes_visible"] == 0
    assert report["processes_exited"] == 0


@pytest.mark.slow
def test_training_data_reports_every_figure_per_backend() -> None:
    report = bench_report(
        "training_data.py",
        "--backends",
        "torch-constrained,torch-reasoning",
        "--groups",
        "1",
        "--turns",
        "2",
        timeout_s=600,
    )
    assert set(report["backends"]) == {"torch-constrained", "torch-reasoning"}
    for row in report["backends"].values():
        for key in ("calls", "calls_drifted", "sampled_tokens", "sampled_tokens_in_loss_mask", "logprob_max_abs_error"):
            assert key in row
        assert row["calls"] > 0 and row["sampled_tokens"] > 0
    assert report["all_sampled_tokens_in_loss_mask"] is True and report["max_logprob_error"] <= 1e-4


@pytest.mark.slow
def test_the_gateway_bench_reports_its_ratio_against_the_fixed_rate_upstream() -> None:
    report = bench_report(
        "gateway.py",
        "--quick",
        "--skip-vllm",
        "--skip-peer",
        "--skip-drill",
        "--tokens",
        "16",
        "--rate",
        "0",
        timeout_s=600,
    )["upstream_fixed_rate"]
    assert report["overhead_ratio"] > 0 and report["completions_per_s_gateway"] > 0
    assert len(report["rounds"]["gateway"]) == 1 and report["rounds"]["gateway"][0]["completions"] == 8 * 4


@pytest.mark.slow
@pytest.mark.kafka
@pytest.mark.timeout(600)
def test_idle_requests_reports_a_rate_per_partition_count_and_their_ratio(kafka_bootstrap: str) -> None:
    report = bench_report(
        "idle_requests.py",
        "--bootstrap",
        kafka_bootstrap,
        "--partitions",
        "2,4",
        "--window-s",
        "2",
        "--settle-s",
        "0",
        timeout_s=500,
    )
    for partitions in (2, 4):
        assert report[f"idle_requests_per_s_{partitions}_partitions"] > 0  # at least the group's heartbeats
    assert report["idle_requests_ratio_4_vs_2"] > 0


@pytest.mark.slow
@pytest.mark.kafka
@pytest.mark.timeout(600)
def test_commit_interval_counts_the_worker_s_transactions_both_ways(kafka_bootstrap: str) -> None:
    report = bench_report(
        "commit_interval.py",
        "--bootstrap",
        kafka_bootstrap,
        "--reps",
        "1",
        "--rollouts",
        "4",
        "--turns",
        "2",
        timeout_s=500,
    )
    for setting in ("without", "with"):
        (run,) = report["runs"][setting]
        assert run["turns"] == 4 * 2 and run["transactions"] > 0  # counted by the worker, not assumed
    assert report["transactions_per_s_ratio"] > 0 and report["turns_per_s_ratio"] > 0


@pytest.mark.slow
@pytest.mark.kafka
@pytest.mark.timeout(600)
def test_restore_history_measures_what_history_leaves_after_the_cleaner_and_the_retention(
    kafka_bootstrap: str,
) -> None:
    """After the broker's cleaner ran, each live rollout leaves three records on the snapshot topic
    (its two slots and its fence); each acknowledged one two slot tombstones and either its fence or
    a fence tombstone and a place in a bucket. Once the tombstones' retention passed, history
    leaves only buckets and the fences not folded yet (fewer than a bucket's size and an
    acknowledgement wave). A cleaner that never ran, acknowledgement leaving values behind, or a
    writer that never folds, fails here; so does a restore that misses an acknowledged rollout."""
    live, bucket, wave = 4, 8, 4
    report = bench_report(
        "restore_history.py",
        "--bootstrap",
        kafka_bootstrap,
        "--live",
        str(live),
        "--turns",
        "2",
        "--rounds",
        "1",
        "--segment-ms",
        "1000",
        "--delete-retention-ms",
        "1000",
        "--bucket-size",
        str(bucket),
        "--ack-wave",
        str(wave),
        "--wait-s",
        "240",
        timeout_s=540,
    )
    before = report["before_cleaner"]["snapshot_records"]
    assert before["1x"] > 6 * live and before["10x"] > 33 * live
    retained = report["after_retention"]
    assert retained["tombstones"] == {"1x": 0, "10x": 0}
    assert retained["buckets"]["1x"] == 0 and retained["fences"]["1x"] == live + live  # 4 acknowledged: no fold
    loose = retained["fences"]["10x"] - live
    assert retained["buckets"]["10x"] >= 1 and loose < bucket + wave
    assert retained["snapshot_records"]["10x"] == 3 * live + retained["buckets"]["10x"] + loose
    assert report["restore_ratio_10x_history_kafka"] > 0
