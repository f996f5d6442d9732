"""What an operator watches a fleet with: a real ``rollout-journal worker --metrics-port N`` on the
session's broker, scraped over HTTP as Prometheus would; and the warning a worker logs when the
group has more members than the namespace has partitions."""

from __future__ import annotations

import re
import socket
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rollout_journal.journal.open import open_backend, open_journal
from rollout_journal.participants.trainer import TrainerFeed
from rollout_journal.participants.workload.config import WorkloadConfig
from rollout_journal.replay.cli.main import main
from tests.support.fleet_support import (
    every_turn_reported,
    start_worker,
    submit,
    wait_for,
    workload_yaml,
)

ISO_LINE = re.compile(r"^ts=\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[str, float]:
    """Every sample of the worker's endpoint: ``name{label=value}`` -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "le")
            if "le" not in sample.labels:
                samples[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return samples


def test_worker_help_names_the_metrics_port(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["worker", "--help"])
    assert "--metrics-port N" in capsys.readouterr().out


@pytest.mark.kafka
@pytest.mark.timeout(300)
def test_a_worker_s_endpoint_counts_every_committed_turn_and_owned_partition(
    kafka_bootstrap: str, kafka_namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One worker, four partitions, 4 rollouts x 3 turns: once every turn is durable the endpoint
    says 12 turns, 4 partitions owned and restored, one assignment, nothing fenced, and 4 results
    awaiting the trainer; once a trainer has taken both groups and acknowledged them, none."""
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)
    url = f"kafka://{kafka_bootstrap}/{kafka_namespace}?partitions=4"
    settings = dict(
        name="watched",
        groups=2,
        siblings=2,
        max_turns=3,
        environment="counter",
        seed=3,
        allow_early_submit=False,
        turn_delay_ms=0,
    )
    config = WorkloadConfig(**settings, journal=url)  # type: ignore[arg-type]
    submit(url, workload_yaml(tmp_path / "watched.yaml", **settings))
    port = free_port()
    worker = start_worker(url, "watched-0", tmp_path, "--metrics-port", str(port))
    try:
        wait_for(lambda: every_turn_reported([worker], config), 240, "every turn durable", [worker])
        wait_for(lambda: len(worker.seen("takeover-seconds ")) == 4, 60, "every partition taken", [worker])
        metrics = scrape(port)
        committed = worker.committed()
        # the final turns' commits carried the training records: the trainer's lag is all 4 of them
        wait_for(lambda: scrape(port)["rj_results_awaiting_trainer"] == 4, 60, "4 results awaiting", [worker])
        assert scrape(port)["rj_oldest_result_awaiting_trainer_seconds"] > 0
        acknowledger = open_journal(url, mode="plain", writer="trainer")
        try:
            with TrainerFeed(open_backend(url, read_only=True), acknowledger=acknowledger) as feed:
                groups = list(feed.groups(limit=2, idle_timeout_s=120))
                for group in groups:
                    for future in feed.acknowledge(group):
                        future.result()
        finally:
            acknowledger.close()
        assert len(groups) == 2
        wait_for(lambda: scrape(port)["rj_results_awaiting_trainer"] == 0, 120, "every result acknowledged", [worker])
        lag = scrape(port)
    finally:
        assert worker.stop() == 0, worker.stderr()[-3000:]
    assert worker.seen(f"metrics-serving {port}")
    assert len(committed) == 12
    assert metrics["rj_turns_total"] == len(committed)
    assert metrics["rj_owned_partitions"] == 4
    assert metrics["rj_partitions"] == 4
    assert metrics["rj_restore_seconds_count"] == 4  # one restore per partition taken
    assert metrics["rj_rebalances_total{kind=assigned}"] == 1
    assert metrics["rj_rebalances_total{kind=revoked}"] == 0
    assert metrics["rj_rebalances_total{kind=lost}"] == 0
    assert metrics["rj_fenced_appends_total"] == 0
    # every group commit is one transaction; transactions without a commit of appends (acks' positions) are more
    assert 1 <= metrics["rj_commit_seconds_count"] <= metrics["rj_transactions_total"]
    assert metrics["rj_transaction_reinits_total"] == 0
    assert worker.report()["turns_run"] == 12
    assert lag["rj_oldest_result_awaiting_trainer_seconds"] == 0
    assert len(worker.seen("acknowledged ")) == 4  # each applied once, by this worker


@pytest.mark.kafka
@pytest.mark.timeout(300)
def test_a_worker_beyond_the_partition_count_warns_that_workers_outnumber_partitions(
    kafka_bootstrap: str, kafka_namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two workers on a one-partition namespace: the second owns nothing and says why, in a log
    line that starts with its time like every line it logs; its endpoint counts the two members."""
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)
    url = f"kafka://{kafka_bootstrap}/{kafka_namespace}?partitions=1"
    first = start_worker(url, "first", tmp_path)
    workers = [first]
    try:
        wait_for(lambda: first.partitions() == {0}, 120, "the first worker to own the partition", workers)
        port = free_port()
        second = start_worker(url, "second", tmp_path, "--metrics-port", str(port), progress_lines=False)
        workers.append(second)
        wait_for(lambda: "outnumber partitions" in second.stderr(), 120, "the second worker's warning", workers)
        metrics = scrape(port)
    finally:
        for worker in workers:
            assert worker.stop() == 0, worker.stderr()[-3000:]
    logged = second.stderr().splitlines()
    warning = next(line for line in logged if "outnumber partitions" in line)
    assert "level=warning" in warning and "workers (2) outnumber partitions (1)" in warning
    # every line the worker logs (its membership events, the warning) starts with its UTC time
    assert any('msg="worker joined"' in line for line in logged), logged
    assert all(ISO_LINE.match(line) for line in logged), [line for line in logged if not ISO_LINE.match(line)]
    assert metrics["rj_group_members"] == 2
    assert metrics["rj_owned_partitions"] == 0
    assert "outnumber" not in first.stderr()
