"""Pytest plugin: real Kafka brokers for the suite (``pytest_plugins = ["tests.kafka_fixtures"]``).

``kafka_bootstrap`` picks the first broker that works, in this order:

1. ``KAFKA_BOOTSTRAP_SERVERS`` from the environment (CI service, ``rollout-journal kafka up``);
2. a testcontainers Kafka container in KRaft mode, when a Docker engine answers;
3. a 1-node broker started from Maven jars by :mod:`compose.local_broker`.

It never skips: with no broker at all, every test needing one fails with the reasons.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from compose.errors import LocalBrokerError
from compose.local_broker import LocalKafkaCluster, start_local_cluster

log = logging.getLogger(__name__)

BOOTSTRAP_ENV_VAR = "KAFKA_BOOTSTRAP_SERVERS"
# Matches the broker settings of the local launcher: transactions work on one node.
_CONTAINER_IMAGE = "confluentinc/cp-kafka:7.6.0"
_DOCKER_PING_TIMEOUT_S = 3


def _docker_engine_answers() -> bool:
    """True if a Docker engine responds within a few seconds.

    The CLI is asked first (it knows about contexts); the SDK only when a socket or
    DOCKER_HOST exists, since a failed SDK connect leaks an unclosed socket.
    """
    if shutil.which("docker") is not None:
        try:
            done = subprocess.run(
                ["docker", "info", "--format", "{{.ServerVersion}}"],
                capture_output=True, timeout=_DOCKER_PING_TIMEOUT_S + 2, stdin=subprocess.DEVNULL,
            )
        except (subprocess.TimeoutExpired, OSError):
            return False
        return done.returncode == 0
    if not os.environ.get("DOCKER_HOST") and not Path("/var/run/docker.sock").exists():
        return False
    try:
        import docker  # type: ignore[import-untyped]

        client = docker.from_env(timeout=_DOCKER_PING_TIMEOUT_S)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception as exc:  # noqa: BLE001 - any failure (or no SDK) means "no engine"
        log.debug("no Docker engine via the SDK: %s", exc)
        return False


def _kafka_container_class() -> Any:
    try:
        from testcontainers.community.kafka import KafkaContainer  # testcontainers >= 4.15
    except ImportError:
        from testcontainers.kafka import KafkaContainer  # older releases
    return KafkaContainer


def _start_container() -> Any:
    container = (
        _kafka_container_class()(_CONTAINER_IMAGE)
        .with_kraft()
        .with_env("KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR", "1")
        .with_env("KAFKA_TRANSACTION_STATE_LOG_MIN_ISR", "1")
        .with_env("KAFKA_AUTO_CREATE_TOPICS_ENABLE", "false")
    )
    container.start()
    return container


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Bootstrap servers of a Kafka broker shared by the whole session (see module doc)."""
    configured = os.environ.get(BOOTSTRAP_ENV_VAR, "").strip()
    if configured:
        yield configured
        return

    reasons: list[str] = []
    container = None
    if _docker_engine_answers():
        try:
            container = _start_container()
        except Exception as exc:  # noqa: BLE001 - fall through to the local broker, keep the reason
            reasons.append(f"testcontainers Kafka failed: {exc}")
    else:
        reasons.append("no Docker engine answered")
    if container is not None:
        try:
            yield container.get_bootstrap_server()
        finally:
            container.stop()
        return

    try:
        cluster = start_local_cluster(1, tmp_path_factory.mktemp("kafka-local"))
    except LocalBrokerError as exc:
        reasons.append(f"local broker from Maven jars failed: {exc}")
        pytest.fail(
            "No Kafka broker for the tests. Set KAFKA_BOOTSTRAP_SERVERS, start Docker, or "
            "install java 17+ and mvn. Tried:\n- " + "\n- ".join(reasons),
            pytrace=False,
        )
    with cluster:
        yield cluster.bootstrap_servers


@pytest.fixture
def kafka_cluster3(tmp_path: Path) -> Iterator[LocalKafkaCluster]:
    """A fresh 3-node local cluster (RF 3, min ISR 2) for fault tests; stopped afterwards."""
    try:
        cluster = start_local_cluster(3, tmp_path / "kafka3")
    except LocalBrokerError as exc:
        pytest.fail(f"could not start a 3-node local Kafka cluster: {exc}", pytrace=False)
    with cluster:
        yield cluster


@pytest.fixture
def kafka_namespace() -> str:
    """A topic prefix unique to this test, so tests share a broker but never a topic."""
    return f"t{uuid.uuid4().hex[:8]}"
