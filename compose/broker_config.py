"""What a combined KRaft node runs with: its server.properties, log4j2 config and java commands.

One source for every way this project starts a broker: the jar launcher
(:mod:`compose.local_broker`) and the broker image (:mod:`compose.broker_entrypoint`,
run inside the container). It therefore imports the standard library only and
runs on the Debian Python 3.11 of the image.

Every address is on loopback: jar nodes bind 127.0.0.1, and containers run with
host networking, so a node's config does not depend on how it was started.
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

# Same heap as the verified manual run; G1 as in Kafka's own start scripts.
BROKER_JVM_OPTS: tuple[str, ...] = (
    "-Xms256m",
    "-Xmx512m",
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:+ExitOnOutOfMemoryError",
    "-Djava.awt.headless=true",
)
# StorageTool is a one-shot CLI: a small serial heap and C1 only start it faster.
TOOL_JVM_OPTS: tuple[str, ...] = ("-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1")

LOOPBACK = "127.0.0.1"


class NodePorts(Protocol):
    """The identity and loopback ports of one node, as the cluster's other members see them."""

    @property
    def node_id(self) -> int: ...

    @property
    def port(self) -> int: ...

    @property
    def controller_port(self) -> int: ...


def server_config(
    node: NodePorts, members: Sequence[NodePorts], log_dirs: Path | str, extra: Mapping[str, str]
) -> dict[str, str]:
    """The server.properties of ``node`` in a cluster of ``members`` (``node`` included).

    One member is a standalone quorum with replication factor 1; more use a static
    ``controller.quorum.voters`` list, replication factor ``min(3, n)`` and
    ``min.insync.replicas`` one less, so a 3-node cluster survives one SIGKILL.
    ``extra`` overrides any generated property.
    """
    n = len(members)
    rf = min(3, n)
    min_isr = max(1, rf - 1)
    listeners = f"PLAINTEXT://{LOOPBACK}:{node.port},CONTROLLER://{LOOPBACK}:{node.controller_port}"
    config: dict[str, str] = {
        "process.roles": "broker,controller",
        "node.id": str(node.node_id),
        "listeners": listeners,
        "advertised.listeners": listeners,
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "log.dirs": str(log_dirs),
        "default.replication.factor": str(rf),
        "min.insync.replicas": str(min_isr),
        "offsets.topic.replication.factor": str(rf),
        "transaction.state.log.replication.factor": str(rf),
        "transaction.state.log.min.isr": str(min_isr),
        "share.coordinator.state.topic.replication.factor": str(rf),
        "share.coordinator.state.topic.min.isr": str(min_isr),
        # Test tuning: small, fast, explicit.
        "auto.create.topics.enable": "false",
        "group.initial.rebalance.delay.ms": "0",
        "offsets.topic.num.partitions": "1",
        "transaction.state.log.num.partitions": "1",
        "share.coordinator.state.topic.num.partitions": "1",
        "num.network.threads": "2",
        "num.io.threads": "2",
        "num.replica.fetchers": "1",
        "num.recovery.threads.per.data.dir": "1",
        "background.threads": "4",
        "log.cleaner.threads": "1",
        "log.cleaner.backoff.ms": "500",
        "log.cleaner.dedupe.buffer.size": "16777216",
    }
    if n == 1:
        config["controller.quorum.bootstrap.servers"] = f"{LOOPBACK}:{node.controller_port}"
    else:
        config["controller.quorum.voters"] = ",".join(
            f"{m.node_id}@{LOOPBACK}:{m.controller_port}" for m in members
        )
        # Fence a SIGKILLed broker within seconds, not the default 9 s.
        config["broker.session.timeout.ms"] = "3000"
        config["broker.heartbeat.interval.ms"] = "500"
    config.update(extra)
    return config


def write_properties(path: Path, config: Mapping[str, str]) -> None:
    """Write ``config`` as a java.util.Properties file."""
    # java.util.Properties treats backslash as an escape character.
    lines = [f"{key}={value.replace(chr(92), chr(92) * 2)}" for key, value in config.items()]
    path.write_text("\n".join(lines) + "\n")


# Broker log: warnings and errors, plus the start/stop milestones of the server classes.
_LOG4J2_FILE = """\
status = warn
appender.server.type = File
appender.server.name = server
appender.server.fileName = ${sys:kafka.logs.dir}/server.log
appender.server.layout.type = PatternLayout
appender.server.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = WARN
rootLogger.appenderRef.server.ref = server
logger.raftserver.name = kafka.server.KafkaRaftServer
logger.raftserver.level = INFO
logger.broker.name = kafka.server.BrokerServer
logger.broker.level = INFO
logger.controller.name = kafka.server.ControllerServer
logger.controller.level = INFO
"""
# A container also writes the same lines to stdout, where `docker logs` looks.
_LOG4J2_CONSOLE = """\
appender.console.type = Console
appender.console.name = console
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = [%d] %p %m (%c)%n
rootLogger.appenderRef.console.ref = console
"""


def log4j2_properties(*, console: bool = False) -> str:
    """The broker's log4j2 config: ``server.log`` under ``kafka.logs.dir``, and stdout if ``console``."""
    return _LOG4J2_FILE + (_LOG4J2_CONSOLE if console else "")


def random_cluster_id() -> str:
    """Kafka's Uuid format (URL-safe base64, no padding), made here to save a JVM start."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cid.startswith("-"):  # Kafka avoids ids that look like CLI flags
            return cid


def classpath(libs: Path | str) -> str:
    """The broker's classpath: a wildcard expanded by java itself, never by a shell."""
    return f"{libs}/*"


def format_command(
    java: str, libs: Path | str, *, server_properties: Path, log4j_properties: Path, logs_dir: Path,
    cluster_id: str, standalone: bool,
) -> list[str]:
    """``kafka.tools.StorageTool format`` for one node (``standalone`` for a 1-node quorum)."""
    cmd = [
        java, *TOOL_JVM_OPTS, f"-Dlog4j2.configurationFile={log4j_properties}",
        f"-Dkafka.logs.dir={logs_dir}", "-cp", classpath(libs),
        "kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(server_properties),
    ]
    if standalone:
        cmd.append("--standalone")
    return cmd


def broker_command(
    java: str, libs: Path | str, *, server_properties: Path, log4j_properties: Path, logs_dir: Path
) -> list[str]:
    """The JVM command line of one broker node."""
    return [
        java, *BROKER_JVM_OPTS,
        f"-Dlog4j2.configurationFile={log4j_properties}",
        f"-Dkafka.logs.dir={logs_dir}",
        "-cp", classpath(libs), "kafka.Kafka", str(server_properties),
    ]
