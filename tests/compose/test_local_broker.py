"""The no-Docker Kafka launcher starts real brokers, survives a killed leader, and cleans up."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from rollout_journal.compose.broker.daemon import status
from rollout_journal.compose.broker.jars import MissingToolError, ensure_broker_jars
from rollout_journal.compose.cluster_handle import admin_client, describe_partition
from rollout_journal.compose.errors import LocalBrokerError
from rollout_journal.compose.local_broker import BrokerStartError, LocalKafkaCluster, free_ports, start_local_cluster
from rollout_journal.replay.cli.main import main as cli_main
from rollout_journal.replay.exit_codes import EXIT_JOURNAL_FAILED
from tests.support.paths import REPO_ROOT

CLIENT_LOG = logging.getLogger("tests.kafka.client")


# --------------------------------------------------------------------------- helpers


def create_topic(bootstrap: str, topic: str, partitions: int = 1, replication: int = 1) -> None:
    config: dict[str, Any] = {"bootstrap.servers": bootstrap, "logger": CLIENT_LOG}
    admin = AdminClient(config)
    for future in admin.create_topics([NewTopic(topic, partitions, replication)]).values():
        future.result(timeout=30)


def produce(bootstrap: str, topic: str, values: list[bytes]) -> None:
    producer = Producer(
        {"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True, "logger": CLIENT_LOG}
    )
    failures: list[str] = []

    def on_delivery(err: object, _msg: object) -> None:
        if err is not None:
            failures.append(str(err))

    for value in values:
        producer.produce(topic, value, on_delivery=on_delivery)
    assert producer.flush(30) == 0, "messages still queued after 30 s"
    assert failures == []


def consume(bootstrap: str, topic: str, count: int, timeout_s: float = 60) -> list[bytes]:
    """The first ``count`` records of ``topic``'s partition 0, read by assignment: no consumer
    group, so no wait for a group coordinator and a rebalance (slow on a busy, fresh cluster)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"{topic}-reader",
            "enable.auto.commit": False,
            "logger": CLIENT_LOG,
        }
    )
    consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    got: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < count and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and msg.error() is None:
                got.append(msg.value() or b"")
    finally:
        consumer.close()
    return got


def broker_pids_using(path: Path) -> list[int]:
    """Live kafka.Kafka JVMs whose command line mentions ``path`` (our leak check)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"kafka.Kafka" in cmdline and str(path).encode() in cmdline and state != "Z":
            pids.append(int(proc.name))
    return pids


def wait_for(condition, timeout_s: float, what: str, interval_s: float = 0.2):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            pytest.fail(f"{what} not reached within {timeout_s} s")
        time.sleep(interval_s)


def kafka_cli(*argv: str) -> int:
    """The command line's own entry: it turns a failure into the documented exit code."""
    return cli_main(list(argv))


# --------------------------------------------------------------------------- jars


@pytest.mark.timeout(300)
def test_broker_jars_are_fetched_once_then_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    libs = ensure_broker_jars()  # may download on a cold cache
    # A warm cache must not run Maven again: with no `mvn` to be found, it still answers.
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    assert ensure_broker_jars() == libs
    assert (libs / "kafka-clients-4.3.1.jar").exists()
    assert any(libs.glob("log4j-slf4j-impl-*.jar")), "without the slf4j binding the broker logs nothing"


def test_cold_cache_without_maven_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    with pytest.raises(MissingToolError, match=r"`mvn` not found on PATH: install Apache Maven"):
        ensure_broker_jars(tmp_path / "cache")


# --------------------------------------------------------------------------- one node


@pytest.mark.kafka
@pytest.mark.timeout(180)
def test_one_node_round_trip_then_stop_leaves_no_process(tmp_path: Path) -> None:
    data_dir = tmp_path / "kafka1"
    with start_local_cluster(1, data_dir) as cluster:
        assert cluster.bootstrap_servers.startswith("127.0.0.1:")
        [node] = cluster.nodes
        assert node.is_running()
        create_topic(cluster.bootstrap_servers, "turns")
        produce(cluster.bootstrap_servers, "turns", [b"turn-0", b"turn-1", b"turn-2"])
        assert consume(cluster.bootstrap_servers, "turns", 3) == [b"turn-0", b"turn-1", b"turn-2"]
        assert cluster.partition_leader("turns", 0) == 1

    assert not node.is_running()
    assert node.process is not None and node.process.returncode is not None
    assert broker_pids_using(data_dir) == []
    assert (node.server_log).exists(), "the broker log stays for post-mortems when the caller owns the dir"
    cluster.stop()  # idempotent


@pytest.mark.kafka
@pytest.mark.timeout(300)
def test_a_port_taken_before_the_broker_binds_it_starts_again_on_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ports are picked free and bound by the JVM seconds later: another process may take one
    meanwhile (here a listener on the first port picked). The start goes on other ports."""
    import rollout_journal.compose.local_broker as local_broker

    taken = socket.create_server(("127.0.0.1", 0))
    picks: list[list[int]] = []

    def first_pick_taken(count: int) -> list[int]:
        ports = free_ports(count)
        if not picks:
            ports[0] = taken.getsockname()[1]
        picks.append(ports)
        return ports

    monkeypatch.setattr(local_broker, "free_ports", first_pick_taken)
    data_dir = tmp_path / "kafka-retry"
    with taken, start_local_cluster(1, data_dir) as cluster:
        assert len(picks) == 2 and cluster.nodes[0].port == picks[1][0]
        assert cluster.nodes[0].is_running()  # and registered: start_local_cluster waited for it
    assert broker_pids_using(data_dir) == []


@pytest.mark.kafka
@pytest.mark.timeout(120)
def test_broker_not_ready_in_time_raises_with_log_tail_and_cleans_up(tmp_path: Path) -> None:
    data_dir = tmp_path / "kafka-slow"
    with pytest.raises(BrokerStartError, match=r"not ready after") as info:
        start_local_cluster(1, data_dir, ready_timeout_s=0.1)
    assert "tail of" in str(info.value) and "console.log" in str(info.value)
    assert broker_pids_using(data_dir) == []


_DIE_WITH_A_CLUSTER_RUNNING = """
import sys
from pathlib import Path
from rollout_journal.compose.local_broker import start_local_cluster
cluster = start_local_cluster(1, Path(sys.argv[1]))
print(cluster.nodes[0].pid, flush=True)
raise RuntimeError("the test run died with its cluster running")
"""


@pytest.mark.kafka
@pytest.mark.timeout(180)
def test_a_cluster_its_caller_forgot_to_stop_is_stopped_when_the_interpreter_exits(tmp_path: Path) -> None:
    """The broker runs in a session of its own, so nothing but the exit hook stops it with its process."""
    data_dir = tmp_path / "kafka-left-running"
    child = subprocess.run(
        [sys.executable, "-c", _DIE_WITH_A_CLUSTER_RUNNING, str(data_dir)],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert child.returncode == 1 and "the test run died" in child.stderr, child.stderr
    assert child.stdout.strip().isdigit(), "the child never had a running broker"
    left = broker_pids_using(data_dir)
    for pid in left:  # a failing run must not leave the broker behind either
        os.kill(pid, signal.SIGKILL)
    assert left == []


@pytest.mark.kafka
@pytest.mark.timeout(180)
def test_kafka_bootstrap_fixture_serves_a_round_trip(kafka_bootstrap: str, kafka_namespace: str) -> None:
    topic = f"{kafka_namespace}.turns"
    create_topic(kafka_bootstrap, topic)
    produce(kafka_bootstrap, topic, [b"a", b"b"])
    assert consume(kafka_bootstrap, topic, 2) == [b"a", b"b"]


def test_namespaces_differ_between_tests(kafka_namespace: str) -> None:
    assert kafka_namespace.startswith("t") and len(kafka_namespace) == 9


@pytest.mark.kafka
@pytest.mark.timeout(60)
def test_describe_partition_waits_for_a_topic_the_broker_does_not_know_yet(
    kafka_bootstrap: str, kafka_namespace: str
) -> None:
    """On a cluster, the broker that answers may learn of a just-created topic a moment after
    another one did (CI saw UNKNOWN_TOPIC_OR_PART on a 3-node cluster): that is "not yet", not an error."""
    topic = f"{kafka_namespace}.late"
    creator = threading.Timer(1.0, create_topic, (kafka_bootstrap, topic))
    creator.start()
    try:
        state = describe_partition(admin_client(kafka_bootstrap), kafka_bootstrap, topic, 0, timeout_s=30)
    finally:
        creator.join()
    assert state.leader == 1 and state.isr == (1,)
    with pytest.raises(LocalBrokerError, match=rf"{kafka_namespace}\.never.*UNKNOWN_TOPIC_OR_PART.*after 5\.0 s"):
        describe_partition(admin_client(kafka_bootstrap), kafka_bootstrap, f"{kafka_namespace}.never", 0, timeout_s=5.0)


def test_describe_partition_without_an_answer_names_the_topic_not_a_raw_kafka_error() -> None:
    silent = "127.0.0.1:1"  # nothing listens there
    with pytest.raises(LocalBrokerError, match=r"topic 'turns' on 127\.0\.0\.1:1: .*after 1\.0 s"):
        describe_partition(admin_client(silent), silent, "turns", 0, timeout_s=1.0)


# --------------------------------------------------------------------------- three nodes


@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_three_nodes_elect_a_new_leader_after_sigkill_and_the_node_rejoins(
    kafka_cluster3: LocalKafkaCluster, kafka_namespace: str
) -> None:
    cluster = kafka_cluster3
    topic = f"{kafka_namespace}.journal"
    create_topic(cluster.bootstrap_servers, topic, partitions=1, replication=3)
    wait_for(lambda: len(cluster.describe_partition(topic, 0).isr) == 3, 30, "ISR of 3")
    produce(cluster.bootstrap_servers, topic, [b"before-crash"])

    old_leader = cluster.partition_leader(topic, 0)
    assert old_leader is not None
    cluster.kill_node(old_leader)
    assert not cluster.node(old_leader).is_running()

    new_leader = wait_for(
        lambda: (leader := cluster.partition_leader(topic, 0)) not in (None, old_leader) and leader,
        30,
        f"a leader other than node {old_leader}",
    )
    assert new_leader in {1, 2, 3} - {old_leader}
    # Two in-sync replicas remain, which min.insync.replicas=2 accepts.
    produce(cluster.bootstrap_servers, topic, [b"after-crash"])

    cluster.restart_node(old_leader)
    wait_for(lambda: old_leader in cluster.describe_partition(topic, 0).isr, 60, f"node {old_leader} back in ISR")
    assert consume(cluster.bootstrap_servers, topic, 2) == [b"before-crash", b"after-crash"]


# --------------------------------------------------------------------------- detached up/down


_UP_IN_CHILD = """
import sys
from pathlib import Path
from rollout_journal.compose.broker.daemon import up
print(up(1, Path(sys.argv[1])))
"""


@pytest.mark.kafka
@pytest.mark.timeout(180)
def test_up_outlives_its_process_and_down_stops_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state_dir = tmp_path / "state"
    child = subprocess.run(
        [sys.executable, "-c", _UP_IN_CHILD, str(state_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert child.returncode == 0, child.stderr
    bootstrap = child.stdout.strip()

    try:
        recorded = json.loads((state_dir / "state.json").read_text())
        assert recorded["bootstrap_servers"] == bootstrap
        current = status(state_dir)
        assert current is not None and current.running, "the broker died with the process that started it"

        create_topic(bootstrap, "detached")
        produce(bootstrap, "detached", [b"still here"])
        assert consume(bootstrap, "detached", 1) == [b"still here"]

        assert kafka_cli("kafka", "status", "--state-dir", str(state_dir)) == 0
        assert kafka_cli("kafka", "up", "--state-dir", str(state_dir)) == 0
        out = capsys.readouterr().out
        assert f"kafka status: running, 1 node at {bootstrap}" in out
        assert f"kafka up: already running, 1 node at {bootstrap} (export KAFKA_BOOTSTRAP_SERVERS={bootstrap})" in out
    finally:
        assert kafka_cli("kafka", "down", "--state-dir", str(state_dir)) == 0

    assert f"kafka down: stopped 1 node at {bootstrap}, data removed" in capsys.readouterr().out
    assert broker_pids_using(state_dir) == []
    assert not (state_dir / "state.json").exists()
    assert not (state_dir / "data").exists()
    assert kafka_cli("kafka", "status", "--state-dir", str(state_dir)) == 1


def test_a_corrupt_state_file_is_reported_not_guessed_at(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "state.json").write_text("{not json")
    # the documented code of a local cluster that is not there as recorded (README, exit codes)
    assert kafka_cli("kafka", "status", "--state-dir", str(tmp_path)) == EXIT_JOURNAL_FAILED
    assert kafka_cli("kafka", "down", "--state-dir", str(tmp_path)) == EXIT_JOURNAL_FAILED
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("kafka status: error: ") and "is not a local-kafka state file" in err[0]
    assert err[1].startswith("kafka down: error: ")
