"""The Docker path, run for real: the locally built broker image under testcontainers and compose.

Where no Docker engine or broker image is at hand these tests skip; where CI set
``ROLLOUT_JOURNAL_EXPECT_DOCKER`` they fail instead (see ``tests/support/kafka_fixtures.py``).
Nothing is pulled from a registry: the image is the one ``rollout_journal.compose.broker.image`` built.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest
import yaml
from confluent_kafka.admin import ConfigResource, ResourceType

from rollout_journal.compose.broker.config import server_config
from rollout_journal.compose.broker.container import BrokerContainer, start_broker_container
from rollout_journal.compose.broker.entrypoint import EntrypointError, prepare, this_node
from rollout_journal.compose.compose_cluster import (
    NODE_IDS,
    compose_command,
    compose_environment,
    service,
    start_compose_cluster,
)
from rollout_journal.compose.local_broker import free_ports
from tests.support.kafka_conformance import KafkaJournalConformance
from tests.support.kafka_drills import leader_kill_drill
from tests.support.kafka_fixtures import BOOTSTRAP_ENV_VAR, BROKER_ENV_VAR, choose_session_broker, require_docker_path

pytestmark = pytest.mark.docker


# --------------------------------------------------------------------------- testcontainers


@pytest.fixture(scope="module")
def broker_container() -> Iterator[BrokerContainer]:
    require_docker_path(testcontainers=True)
    with start_broker_container() as container:
        yield container


@pytest.mark.kafka
class TestContainerJournal(KafkaJournalConformance):
    """The whole journal conformance suite, once, on a broker container started by testcontainers."""

    @pytest.fixture
    def kafka_bootstrap(self, broker_container: BrokerContainer) -> str:
        return broker_container.bootstrap_servers


def test_the_session_broker_follows_the_documented_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """KAFKA_BOOTSTRAP_SERVERS first, then a container where an engine and the image are, unless pinned to jars."""
    require_docker_path(testcontainers=True)
    monkeypatch.setenv(BOOTSTRAP_ENV_VAR, "127.0.0.1:1")
    monkeypatch.setenv(BROKER_ENV_VAR, "container")
    assert choose_session_broker() == ("env", [])

    monkeypatch.delenv(BOOTSTRAP_ENV_VAR)
    monkeypatch.setenv(BROKER_ENV_VAR, "auto")
    assert choose_session_broker() == ("container", [])
    monkeypatch.delenv(BROKER_ENV_VAR)
    assert choose_session_broker() == ("container", [])

    monkeypatch.setenv(BROKER_ENV_VAR, "jars")
    assert choose_session_broker()[0] == "jars"


def test_the_broker_container_never_pulls_a_missing_image() -> None:
    require_docker_path(testcontainers=True)
    missing = f"rollout-journal/not-built:{free_ports(1)[0]}"
    with pytest.raises(Exception, match="never pulled"):
        start_broker_container(missing)
    images = subprocess.run(["docker", "image", "ls", "--quiet", missing], capture_output=True, text=True, check=True)
    assert images.stdout.strip() == ""


# --------------------------------------------------------------------------- docker-compose


def test_the_compose_file_renders_a_three_voter_quorum_on_the_given_image_and_ports() -> None:
    """`docker-compose config` validates the file; its environment then goes through the image's own
    entrypoint and config code, which must give a 3-voter quorum with RF 3 and min.insync.replicas=2."""
    require_docker_path(engine=False, compose_tool=True)
    all_ports = free_ports(6)
    ports = {n: (all_ports[2 * i], all_ports[2 * i + 1]) for i, n in enumerate(NODE_IDS)}
    env = compose_environment(ports, "example.invalid/kafka:override")
    done = subprocess.run(
        [*compose_command(), "--file", "compose/docker-compose.yml", "config"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    services = yaml.safe_load(done.stdout)["services"]
    assert sorted(services) == [service(n) for n in NODE_IDS]

    cluster_ids = set()
    for node_id in NODE_IDS:
        spec = services[service(node_id)]
        assert spec["image"] == "example.invalid/kafka:override"
        assert spec["network_mode"] == "host"
        assert spec["pull_policy"] == "never"
        node, members = this_node({k: str(v) for k, v in spec["environment"].items()})
        assert node.node_id == node_id and (node.port, node.controller_port) == ports[node_id]
        config = server_config(node, members, "/var/lib/kafka/data", {})
        assert config["controller.quorum.voters"] == ",".join(f"{n}@127.0.0.1:{ports[n][1]}" for n in NODE_IDS)
        assert (
            config["listeners"]
            == f"PLAINTEXT://127.0.0.1:{ports[node_id][0]},CONTROLLER://127.0.0.1:{ports[node_id][1]}"
        )
        assert (config["default.replication.factor"], config["min.insync.replicas"]) == ("3", "2")
        assert (config["transaction.state.log.replication.factor"], config["transaction.state.log.min.isr"]) == (
            "3",
            "2",
        )
        cluster_ids.add(spec["environment"]["KAFKA_CLUSTER_ID"])
    assert len(cluster_ids) == 1, "every node must format into the same cluster"


def test_the_entrypoint_refuses_an_environment_that_names_no_valid_node(tmp_path) -> None:
    cases = {
        "KAFKA_QUORUM": {"KAFKA_QUORUM": ""},
        "1:9092": {"KAFKA_QUORUM": "1:9092"},
        "KAFKA_NODE_ID=4": {"KAFKA_NODE_ID": "4", "KAFKA_QUORUM": "1:9092:19092"},
        "KAFKA_CLUSTER_ID": {"KAFKA_NODE_ID": "1", "KAFKA_QUORUM": "1:9092:19092,2:9093:19093"},
        "KAFKA_EXTRA_PROPERTIES": {"KAFKA_QUORUM": "1:9092:19092", "KAFKA_EXTRA_PROPERTIES": "no equals sign"},
    }
    for named, env in cases.items():
        with pytest.raises(EntrypointError, match=named):
            prepare(env, home=tmp_path / "home", libs=tmp_path / "libs")


@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_leader_in_the_compose_cluster_loses_no_committed_batch() -> None:
    """The compose file's 3 nodes, up with docker-compose on the local image, run the leader-kill drill."""
    require_docker_path(compose_tool=True)
    with start_compose_cluster() as cluster:
        for node_id in NODE_IDS:  # librdkafka takes one broker resource per call
            resource = ConfigResource(ResourceType.BROKER, str(node_id))
            configs = cluster.admin.describe_configs([resource])[resource].result(timeout=30)
            assert configs["default.replication.factor"].value == "3", node_id
            assert configs["min.insync.replicas"].value == "2", node_id
        leader_kill_drill(cluster)
