"""What a combined KRaft node runs with: its server.properties, log4j2 config and java commands.

One source for every way this project starts a broker: the jar launcher
(:mod:`rollout_journal.compose.local_broker`) and the broker image (:mod:`rollout_journal.compose.broker.entrypoint`,
run inside the container). It therefore imports the standard library only and
runs on the Debian Python 3.11 of the image.

Every address is on loopback: jar nodes bind 127.0.0.1, and containers run with
host networking, so a node's config does not depend on how it was started.
"""

from __future__ import annotations

import base64
import hashlib
import os
import secrets
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
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

SCRAM_MECHANISM = "SCRAM-SHA-512"
SCRAM_ITERATIONS = 8192  # Kafka accepts 4096-16384 for SCRAM-SHA-512
STANDARD_AUTHORIZER = "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
SASL_LISTENER = "SASL_PLAINTEXT"
STORAGE_TOOL = "kafka.tools.StorageTool"


@dataclass(frozen=True)
class SaslSecurity:
    """A node that authenticates every connection and authorizes every request.

    Clients reach a ``SASL_PLAINTEXT`` listener on loopback with SCRAM-SHA-512
    (credentials live in the cluster metadata, so users are added while it runs);
    Kafka's own ``StandardAuthorizer`` allows nothing that no ACL grants
    (``allow.everyone.if.no.acl.found=false``). ``admin_user`` is the one super user:
    brokers replicate as it, and the launcher creates users and ACLs as it. The
    controller listener takes SASL/PLAIN for that same user only (SCRAM credentials
    live in the metadata the controllers serve, so controllers cannot log in to each
    other with them), and no anonymous principal exists anywhere.
    """

    admin_user: str = "admin"
    admin_password: str = field(default_factory=lambda: secrets.token_hex(24), repr=False)

    def __post_init__(self) -> None:
        # both go inside a quoted JAAS string: keep them to characters that need no escaping there
        for what, value in (("admin user", self.admin_user), ("admin password", self.admin_password)):
            if not value or any(ch in value for ch in '"\\;= \n\r\t'):
                raise ValueError(f'the {what} must be non-empty and hold none of: " \\ ; = or whitespace')

    def client_config(self) -> dict[str, str]:
        """librdkafka properties that log in as the super user."""
        return {
            "security.protocol": SASL_LISTENER,
            "sasl.mechanism": SCRAM_MECHANISM,
            "sasl.username": self.admin_user,
            "sasl.password": self.admin_password,
        }


class NodePorts(Protocol):
    """The identity and loopback ports of one node, as the cluster's other members see them."""

    @property
    def node_id(self) -> int: ...

    @property
    def port(self) -> int: ...

    @property
    def controller_port(self) -> int: ...


def server_config(
    node: NodePorts,
    members: Sequence[NodePorts],
    log_dirs: Path | str,
    extra: Mapping[str, str],
    *,
    sasl: SaslSecurity | None = None,
) -> dict[str, str]:
    """The server.properties of ``node`` in a cluster of ``members`` (``node`` included).

    One member is a standalone quorum with replication factor 1; more use a static
    ``controller.quorum.voters`` list, replication factor ``min(3, n)`` and
    ``min.insync.replicas`` one less, so a 3-node cluster survives one SIGKILL.
    ``sasl`` replaces the PLAINTEXT listener with an authenticated, authorized one
    (see :class:`SaslSecurity`); the result then holds the super user's password.
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
        # A timed-out transaction (a stalled or killed writer's) is aborted within a second, not ten.
        "transaction.abort.timed.out.transaction.cleanup.interval.ms": "1000",
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
        config["controller.quorum.voters"] = ",".join(f"{m.node_id}@{LOOPBACK}:{m.controller_port}" for m in members)
        # Fence a SIGKILLed broker within seconds, not the default 9 s.
        config["broker.session.timeout.ms"] = "3000"
        config["broker.heartbeat.interval.ms"] = "500"
    if sasl is not None:
        config.update(_sasl_properties(node, sasl))
    config.update(extra)
    return config


def _sasl_properties(node: NodePorts, sasl: SaslSecurity) -> dict[str, str]:
    listeners = f"{SASL_LISTENER}://{LOOPBACK}:{node.port},CONTROLLER://{LOOPBACK}:{node.controller_port}"
    user, password = sasl.admin_user, sasl.admin_password
    return {
        "listeners": listeners,
        "advertised.listeners": listeners,
        "inter.broker.listener.name": SASL_LISTENER,
        "listener.security.protocol.map": f"CONTROLLER:SASL_PLAINTEXT,{SASL_LISTENER}:SASL_PLAINTEXT",
        "sasl.enabled.mechanisms": SCRAM_MECHANISM,
        "sasl.mechanism.inter.broker.protocol": SCRAM_MECHANISM,
        "listener.name.sasl_plaintext.sasl.enabled.mechanisms": SCRAM_MECHANISM,
        "listener.name.sasl_plaintext.scram-sha-512.sasl.jaas.config": f'org.apache.kafka.common.security.scram.ScramLoginModule required username="{user}" password="{password}";',
        "sasl.mechanism.controller.protocol": "PLAIN",
        "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
        "listener.name.controller.plain.sasl.jaas.config": f'org.apache.kafka.common.security.plain.PlainLoginModule required username="{user}" '
        f'password="{password}" user_{user}="{password}";',
        "authorizer.class.name": STANDARD_AUTHORIZER,
        "super.users": f"User:{user}",
        "allow.everyone.if.no.acl.found": "false",
    }


def scram_bootstrap_credential(name: str, password: str, *, salt: bytes | None = None) -> str:
    """StorageTool's ``--add-scram`` argument for one user, salted here so the password itself is
    never written anywhere. A salted SCRAM password still logs in: pass it through
    :func:`hide_arguments`, never on a command line (``ps`` shows those to every local user)."""
    salt = salt if salt is not None else os.urandom(32)
    salted = hashlib.pbkdf2_hmac("sha512", password.encode("utf-8"), salt, SCRAM_ITERATIONS)
    b64 = base64.b64encode
    return (
        f"{SCRAM_MECHANISM}=[name={name},iterations={SCRAM_ITERATIONS},"
        f'salt="{b64(salt).decode()}",saltedpassword="{b64(salted).decode()}"]'
    )


def write_properties(path: Path, config: Mapping[str, str], *, private: bool = False) -> None:
    """Write ``config`` as a java.util.Properties file; ``private`` ones (holding a password) are
    created readable by their owner only."""
    # java.util.Properties treats backslash as an escape character.
    lines = [f"{key}={value.replace(chr(92), chr(92) * 2)}" for key, value in config.items()]
    if private:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
        with os.fdopen(fd, "w") as out:
            out.write("\n".join(lines) + "\n")
        return
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
    java: str,
    libs: Path | str,
    *,
    server_properties: Path,
    log4j_properties: Path,
    logs_dir: Path,
    cluster_id: str,
    standalone: bool,
    scram: Sequence[str] = (),
) -> list[str]:
    """``kafka.tools.StorageTool format`` for one node (``standalone`` for a 1-node quorum);
    ``scram`` holds :func:`scram_bootstrap_credential` arguments written into the first metadata."""
    cmd = [
        java,
        *TOOL_JVM_OPTS,
        f"-Dlog4j2.configurationFile={log4j_properties}",
        f"-Dkafka.logs.dir={logs_dir}",
        "-cp",
        classpath(libs),
        STORAGE_TOOL,
        "format",
        "-t",
        cluster_id,
        "-c",
        str(server_properties),
    ]
    if standalone:
        cmd.append("--standalone")
    for credential in scram:
        cmd += ["--add-scram", credential]
    return cmd


def hide_arguments(cmd: Sequence[str], main_class: str, argfile: Path) -> list[str]:
    """``cmd`` with ``main_class`` and its arguments moved into ``argfile`` (created readable by its
    owner only), which the java launcher reads back (``java @argfile``, JDK 9+)."""
    at = list(cmd).index(main_class)

    def quoted(arg: str) -> str:
        return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'

    fd = os.open(argfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write("".join(quoted(arg) + "\n" for arg in cmd[at:]))
    return [*cmd[:at], f"@{argfile}"]


def broker_command(
    java: str, libs: Path | str, *, server_properties: Path, log4j_properties: Path, logs_dir: Path
) -> list[str]:
    """The JVM command line of one broker node."""
    return [
        java,
        *BROKER_JVM_OPTS,
        f"-Dlog4j2.configurationFile={log4j_properties}",
        f"-Dkafka.logs.dir={logs_dir}",
        "-cp",
        classpath(libs),
        "kafka.Kafka",
        str(server_properties),
    ]
