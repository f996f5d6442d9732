"""Run a real Apache Kafka broker (KRaft) from Maven jars, without Docker.

Three ways in:

* :func:`start_local_cluster` -- a throwaway 1- or 3-node cluster owned by the
  calling process (tests, fault injection: :meth:`LocalKafkaCluster.kill_node`,
  :meth:`LocalKafkaCluster.restart_node`).
* :func:`up` / :func:`down` / :func:`status` -- a detached cluster that outlives
  the Python process, recorded in a JSON state file (``rollout-journal kafka up``).
* :func:`ensure_broker_jars` -- the broker classpath, fetched once with Maven into
  a cache outside the repository.

Every broker listens on free loopback ports only; nothing here binds a fixed port.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

log = logging.getLogger(__name__)

POM_PATH = Path(__file__).with_name("pom.xml")
CACHE_ENV_VAR = "ROLLOUT_JOURNAL_CACHE"
STATE_FILE_NAME = "state.json"
_STATE_FORMAT = 1
_MARKER_NAME = "libs.complete"

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
_TOOL_JVM_OPTS: tuple[str, ...] = ("-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1")


# --------------------------------------------------------------------------- errors


class LocalBrokerError(RuntimeError):
    """Base class for every failure of the local Kafka launcher."""


class MissingToolError(LocalBrokerError):
    """java or mvn is not on PATH; the message says what to install."""


class JarDownloadError(LocalBrokerError):
    """Maven could not fetch the broker's jars."""


class BrokerStartError(LocalBrokerError):
    """Formatting or starting a broker failed, or it did not become ready in time.

    The message carries the tail of the node's logs, which usually names the cause.
    """


class ClusterStateError(LocalBrokerError):
    """The detached cluster's state file is missing, unreadable or contradicts a request."""


# --------------------------------------------------------------------------- jars


def kafka_version(pom: Path = POM_PATH) -> str:
    """The Kafka version pinned in ``compose/pom.xml`` (single source of truth)."""
    ns = {"m": "http://maven.apache.org/POM/4.0.0"}
    node = ET.parse(pom).getroot().find("m:properties/m:kafka.version", ns)
    if node is None or not (node.text or "").strip():
        raise LocalBrokerError(f"{pom}: no <properties><kafka.version> element")
    return (node.text or "").strip()


def cache_root() -> Path:
    """Root of everything cached outside git: ``$ROLLOUT_JOURNAL_CACHE`` or ``~/.cache/rollout-journal``."""
    env = os.environ.get(CACHE_ENV_VAR, "").strip()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "rollout-journal"


def default_state_dir() -> Path:
    """Where :func:`up` records its detached cluster unless told otherwise."""
    return cache_root() / "local-kafka"


def _require_tool(name: str, what_to_install: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise MissingToolError(f"`{name}` not found on PATH: install {what_to_install}")
    return path


def _require_java() -> str:
    return _require_tool(
        "java",
        "a Java 17+ runtime (e.g. `apt-get install openjdk-17-jre-headless`) "
        "to run the local Kafka broker",
    )


def ensure_broker_jars(cache_dir: Path | None = None) -> Path:
    """Return a folder holding the broker's runtime jars, downloading them once.

    ``cache_dir`` is the cache root (default :func:`cache_root`); the jars land in
    ``<cache_dir>/kafka-<version>/libs``. A marker holding the POM's hash is written
    only after Maven succeeded, so an interrupted download is redone and an edited
    POM is refetched. A file lock makes concurrent callers wait for one download.
    Needs ``mvn`` only when the cache is cold.
    """
    pom_hash = hashlib.sha256(POM_PATH.read_bytes()).hexdigest()
    version_dir = (cache_dir or cache_root()) / f"kafka-{kafka_version()}"
    libs = version_dir / "libs"
    marker = version_dir / _MARKER_NAME
    version_dir.mkdir(parents=True, exist_ok=True)
    with open(version_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists() and marker.read_text().strip() == pom_hash and any(libs.glob("*.jar")):
            return libs
        mvn = _require_tool(
            "mvn",
            "Apache Maven (e.g. `apt-get install maven`) to fetch the Kafka broker "
            "jars from Maven Central once",
        )
        marker.unlink(missing_ok=True)
        shutil.rmtree(libs, ignore_errors=True)
        partial = version_dir / "libs.partial"
        shutil.rmtree(partial, ignore_errors=True)
        cmd = [
            mvn, "-B", "-q", "-f", str(POM_PATH), "dependency:copy-dependencies",
            "-DincludeScope=runtime", f"-DoutputDirectory={partial}",
        ]
        log.info("fetching Kafka %s broker jars into %s", kafka_version(), libs)
        started = time.monotonic()
        done = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if done.returncode != 0 or not any(partial.glob("*.jar")):
            output = _tail_text((done.stdout or "") + (done.stderr or ""), 40)
            raise JarDownloadError(
                f"`mvn dependency:copy-dependencies` on {POM_PATH} failed "
                f"(exit {done.returncode}); check access to Maven Central or a mirror "
                f"in ~/.m2/settings.xml. Maven said:\n{output}"
            )
        partial.rename(libs)
        marker.write_text(pom_hash + "\n")
        log.info("fetched %d jars in %.1f s", len(list(libs.glob("*.jar"))), time.monotonic() - started)
        return libs


# --------------------------------------------------------------------------- cluster model


@dataclass(eq=False)
class LocalKafkaNode:
    """One combined broker+controller process and the files it owns."""

    node_id: int
    port: int
    controller_port: int
    node_dir: Path
    process: subprocess.Popen[bytes] | None = None
    pid: int | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def server_properties(self) -> Path:
        return self.node_dir / "server.properties"

    @property
    def log4j_properties(self) -> Path:
        return self.node_dir / "log4j2.properties"

    @property
    def logs_dir(self) -> Path:
        return self.node_dir / "logs"

    @property
    def server_log(self) -> Path:
        return self.logs_dir / "server.log"

    @property
    def console_log(self) -> Path:
        return self.node_dir / "console.log"

    @property
    def log_dirs(self) -> Path:
        return self.node_dir / "data"

    def is_running(self) -> bool:
        """Whether this node's JVM is alive (a zombie or a recycled pid counts as dead)."""
        if self.process is not None:
            return self.process.poll() is None
        return self.pid is not None and _pid_is_broker(self.pid, self.server_properties)


@dataclass(frozen=True)
class PartitionState:
    """Leader, replicas and in-sync replicas of one partition, as metadata reports them."""

    leader: int | None
    replicas: tuple[int, ...]
    isr: tuple[int, ...]


class _QuietRdkafkaLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """librdkafka's connect/refused chatter about brokers we start and kill on purpose is expected: keep it at DEBUG."""

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        self.logger.log(logging.DEBUG, msg, *args, **kwargs)


_RDKAFKA_LOG = _QuietRdkafkaLog(logging.getLogger(f"{__name__}.librdkafka"), {})
# Strong references: a cluster its caller forgot to stop is still stopped at exit.
_LIVE_CLUSTERS: set[LocalKafkaCluster] = set()


def _admin(bootstrap: str) -> AdminClient:
    config: dict[str, Any] = {"bootstrap.servers": bootstrap, "logger": _RDKAFKA_LOG}
    return AdminClient(config)


@dataclass(eq=False)
class LocalKafkaCluster:
    """A running local cluster. Use as a context manager, or call :meth:`stop`.

    ``detached`` clusters (from :func:`up`) are not children of this process and
    are not stopped at interpreter exit; attached ones are.
    """

    bootstrap_servers: str
    nodes: list[LocalKafkaNode]
    data_dir: Path
    cluster_id: str
    libs_dir: Path
    detached: bool = False
    owns_data_dir: bool = False
    _stopped: bool = field(default=False, repr=False)
    _admin_client: AdminClient | None = field(default=None, repr=False)

    # ----- lifecycle

    def __enter__(self) -> LocalKafkaCluster:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def node(self, node_id: int) -> LocalKafkaNode:
        for node in self.nodes:
            if node.node_id == node_id:
                return node
        raise LocalBrokerError(
            f"no node {node_id} in the cluster at {self.bootstrap_servers} "
            f"(nodes: {[n.node_id for n in self.nodes]})"
        )

    def stop(self, timeout_s: float = 15.0, *, remove_data: bool | None = None) -> None:
        """SIGTERM every node, SIGKILL those still alive after ``timeout_s``. Idempotent.

        ``remove_data`` defaults to whether the cluster created its own data dir.
        """
        if not self._stopped:
            self._stopped = True
            self._admin_client = None
            _terminate_all(self.nodes, timeout_s)
            _LIVE_CLUSTERS.discard(self)
        if remove_data if remove_data is not None else self.owns_data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def kill_node(self, node_id: int) -> None:
        """SIGKILL one node (a crash, for fault tests) and wait until it is gone."""
        node = self.node(node_id)
        _kill_and_reap(node, signal.SIGKILL, timeout_s=10.0)
        log.info("killed node %d (pid %s)", node_id, node.pid)

    def stop_node(self, node_id: int, timeout_s: float = 15.0) -> None:
        """Stop one node gracefully (SIGTERM, then SIGKILL after ``timeout_s``)."""
        _terminate_all([self.node(node_id)], timeout_s)

    def restart_node(self, node_id: int, ready_timeout_s: float = 60.0) -> None:
        """Start ``node_id`` again on its ports and data dir; return once it serves metadata
        and is listed among the cluster's brokers. A running node is stopped first."""
        node = self.node(node_id)
        if node.is_running():
            self.stop_node(node_id)
        _launch(node, self.libs_dir, detached=self.detached)
        # Probe through this node only: an answer proves the new process serves requests.
        _wait_registered(
            [node], self.nodes, probe_bootstrap=node.bootstrap, expected={node_id},
            timeout_s=ready_timeout_s, what=f"restarted node {node_id}",
        )
        log.info("node %d restarted (pid %s)", node_id, node.pid)

    # ----- metadata

    @property
    def admin(self) -> AdminClient:
        """An AdminClient for this cluster, created once and logging through :mod:`logging`."""
        if self._admin_client is None:
            self._admin_client = _admin(self.bootstrap_servers)
        return self._admin_client

    def describe_partition(self, topic: str, partition: int, timeout_s: float = 5.0) -> PartitionState:
        """Leader, replicas and ISR of ``topic``/``partition``; leader is None while none is elected."""
        md = self.admin.list_topics(topic=topic, timeout=timeout_s)
        self.admin.poll(0)
        meta = md.topics.get(topic)
        if meta is None or meta.error is not None:
            raise LocalBrokerError(
                f"topic {topic!r} on {self.bootstrap_servers}: {meta.error if meta else 'not in metadata'}"
            )
        part = meta.partitions.get(partition)
        if part is None:
            raise LocalBrokerError(f"topic {topic!r} has no partition {partition}")
        leader = part.leader if part.leader >= 0 else None
        return PartitionState(leader=leader, replicas=tuple(part.replicas), isr=tuple(part.isrs))

    def partition_leader(self, topic: str, partition: int, timeout_s: float = 5.0) -> int | None:
        """Node id leading ``topic``/``partition``, or None while no leader is elected."""
        return self.describe_partition(topic, partition, timeout_s).leader

    # ----- state file

    def to_state(self) -> dict[str, Any]:
        return {
            "format": _STATE_FORMAT,
            "kafka_version": kafka_version(),
            "bootstrap_servers": self.bootstrap_servers,
            "cluster_id": self.cluster_id,
            "data_dir": str(self.data_dir),
            "libs_dir": str(self.libs_dir),
            "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "nodes": [
                {
                    "node_id": n.node_id, "pid": n.pid, "port": n.port,
                    "controller_port": n.controller_port, "node_dir": str(n.node_dir),
                }
                for n in self.nodes
            ],
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> LocalKafkaCluster:
        """Rebuild a handle on a detached cluster from :meth:`to_state` output."""
        nodes = [
            LocalKafkaNode(
                node_id=int(n["node_id"]), port=int(n["port"]),
                controller_port=int(n["controller_port"]), node_dir=Path(n["node_dir"]),
                pid=int(n["pid"]) if n.get("pid") is not None else None,
            )
            for n in state["nodes"]
        ]
        return cls(
            bootstrap_servers=str(state["bootstrap_servers"]), nodes=nodes,
            data_dir=Path(state["data_dir"]), cluster_id=str(state["cluster_id"]),
            libs_dir=Path(state["libs_dir"]), detached=True,
        )


@atexit.register
def _stop_attached_clusters() -> None:
    # A test run that dies on an exception must not leave brokers behind.
    for cluster in list(_LIVE_CLUSTERS):
        cluster.stop(timeout_s=5.0)


# --------------------------------------------------------------------------- starting


def start_local_cluster(
    nodes: int = 1,
    data_dir: Path | None = None,
    *,
    extra_config: dict[str, str] | None = None,
    ready_timeout_s: float = 60,
    detached: bool = False,
    libs_dir: Path | None = None,
) -> LocalKafkaCluster:
    """Format and start ``nodes`` combined KRaft nodes on free loopback ports.

    ``nodes=1`` is a standalone controller quorum; more nodes use a static
    ``controller.quorum.voters`` list, replication factor ``min(3, nodes)`` and
    ``min.insync.replicas`` one less, so a 3-node cluster survives one SIGKILL.
    ``extra_config`` overrides any generated server property. Without ``data_dir``
    a temporary one is created and removed by :meth:`LocalKafkaCluster.stop`.
    ``detached`` nodes outlive this process (used by :func:`up`).

    Returns once every broker is registered; on failure everything started is
    stopped and :class:`BrokerStartError` carries the logs' tail.
    """
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    java = _require_java()
    libs = libs_dir or ensure_broker_jars()
    owns = data_dir is None
    root = Path(tempfile.mkdtemp(prefix="rollout-journal-kafka-")) if data_dir is None else Path(data_dir)
    root = root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    ports = _free_ports(2 * nodes)
    members = [
        LocalKafkaNode(
            node_id=i + 1, port=ports[2 * i], controller_port=ports[2 * i + 1],
            node_dir=root / f"node-{i + 1}",
        )
        for i in range(nodes)
    ]
    cluster = LocalKafkaCluster(
        bootstrap_servers=",".join(n.bootstrap for n in members), nodes=members,
        data_dir=root, cluster_id=_random_cluster_id(), libs_dir=libs,
        detached=detached, owns_data_dir=owns,
    )
    started = time.monotonic()
    try:
        for node in members:
            if node.node_dir.exists() and any(node.node_dir.iterdir()):
                raise BrokerStartError(
                    f"{node.node_dir} already holds files: start_local_cluster needs an empty data dir"
                )
            node.log_dirs.mkdir(parents=True)
            node.logs_dir.mkdir(parents=True)
            _write_properties(node.server_properties, _server_config(node, members, extra_config or {}))
            node.log4j_properties.write_text(_LOG4J2_PROPERTIES)
        _format_all(java, libs, members, cluster.cluster_id, standalone=nodes == 1)
        if not detached:
            _LIVE_CLUSTERS.add(cluster)
        for node in members:
            _launch(node, libs, detached=detached)
        _wait_registered(
            members, members, probe_bootstrap=cluster.bootstrap_servers,
            expected={n.node_id for n in members}, timeout_s=ready_timeout_s,
            what=f"{nodes}-node cluster",
        )
    except BaseException:
        cluster.stop(timeout_s=5.0, remove_data=owns)
        raise
    log.info(
        "Kafka %d-node cluster ready at %s in %.1f s (data in %s)",
        nodes, cluster.bootstrap_servers, time.monotonic() - started, root,
    )
    return cluster


def _server_config(node: LocalKafkaNode, members: list[LocalKafkaNode], extra: Mapping[str, str]) -> dict[str, str]:
    n = len(members)
    rf = min(3, n)
    min_isr = max(1, rf - 1)
    listeners = f"PLAINTEXT://127.0.0.1:{node.port},CONTROLLER://127.0.0.1:{node.controller_port}"
    config: dict[str, str] = {
        "process.roles": "broker,controller",
        "node.id": str(node.node_id),
        "listeners": listeners,
        "advertised.listeners": listeners,
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "log.dirs": str(node.log_dirs),
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
        config["controller.quorum.bootstrap.servers"] = f"127.0.0.1:{node.controller_port}"
    else:
        config["controller.quorum.voters"] = ",".join(
            f"{m.node_id}@127.0.0.1:{m.controller_port}" for m in members
        )
        # Fence a SIGKILLed broker within seconds, not the default 9 s.
        config["broker.session.timeout.ms"] = "3000"
        config["broker.heartbeat.interval.ms"] = "500"
    config.update(extra)
    return config


# Broker log: warnings and errors, plus the start/stop milestones of the server classes.
_LOG4J2_PROPERTIES = """\
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


def _write_properties(path: Path, config: Mapping[str, str]) -> None:
    # java.util.Properties treats backslash as an escape character.
    lines = [f"{key}={value.replace(chr(92), chr(92) * 2)}" for key, value in config.items()]
    path.write_text("\n".join(lines) + "\n")


def _random_cluster_id() -> str:
    """Kafka's Uuid format (URL-safe base64, no padding), made here to save a JVM start."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cid.startswith("-"):  # Kafka avoids ids that look like CLI flags
            return cid


def _free_ports(count: int) -> list[int]:
    """Distinct free loopback ports: all sockets stay bound until every port is picked."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
        return ports


def _classpath(libs: Path) -> str:
    return f"{libs}/*"  # expanded by java itself, never by a shell


def _format_all(java: str, libs: Path, members: list[LocalKafkaNode], cluster_id: str, *, standalone: bool) -> None:
    """Run StorageTool format for every node in parallel (each is a JVM start)."""
    running = []
    for node in members:
        cmd = [
            java, *_TOOL_JVM_OPTS, f"-Dlog4j2.configurationFile={node.log4j_properties}",
            f"-Dkafka.logs.dir={node.logs_dir}", "-cp", _classpath(libs),
            "kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(node.server_properties),
        ]
        if standalone:
            cmd.append("--standalone")
        out = open(node.node_dir / "format.log", "wb")
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        running.append((node, proc, out))
    failures = []
    for node, proc, out in running:
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        out.close()
        if code != 0:
            text = _tail_file(node.node_dir / "format.log", 30)
            failures.append(f"node {node.node_id} (exit {code}):\n{text}")
    if failures:
        raise BrokerStartError("kafka StorageTool format failed for " + "\n".join(failures))


def _broker_command(java: str, node: LocalKafkaNode, libs: Path) -> list[str]:
    return [
        java, *BROKER_JVM_OPTS,
        f"-Dlog4j2.configurationFile={node.log4j_properties}",
        f"-Dkafka.logs.dir={node.logs_dir}",
        "-cp", _classpath(libs), "kafka.Kafka", str(node.server_properties),
    ]


def _launch(node: LocalKafkaNode, libs: Path, *, detached: bool) -> None:
    """Start the node's JVM in its own session, output appended to console.log.

    Detached nodes are started through a shell that exits at once, so the JVM is
    re-parented away from us and survives this process without leaving a
    Popen that Python would warn about.
    """
    cmd = _broker_command(_require_java(), node, libs)
    with open(node.console_log, "ab") as console:
        if not detached:
            node.process = subprocess.Popen(
                cmd, stdout=console, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            node.pid = node.process.pid
            return
    script = 'log="$1"; shift; "$@" </dev/null >>"$log" 2>&1 & echo $!'
    done = subprocess.run(
        ["/bin/sh", "-c", script, "sh", str(node.console_log), *cmd],
        capture_output=True, text=True, start_new_session=True, timeout=30,
    )
    if done.returncode != 0 or not done.stdout.strip().isdigit():
        raise BrokerStartError(f"could not launch node {node.node_id} detached: {done.stderr.strip()}")
    node.process = None
    node.pid = int(done.stdout.strip())


def _wait_registered(
    watched: list[LocalKafkaNode],
    all_nodes: list[LocalKafkaNode],
    *,
    probe_bootstrap: str,
    expected: set[int],
    timeout_s: float,
    what: str,
) -> None:
    """Poll metadata until ``expected`` broker ids are listed; fail fast if a watched JVM exits."""
    admin = _admin(probe_bootstrap)
    deadline = time.monotonic() + timeout_s
    seen: set[int] = set()
    while True:
        for node in watched:
            if not node.is_running():
                code = node.process.returncode if node.process is not None else "unknown"
                raise BrokerStartError(
                    f"{what}: node {node.node_id} exited during startup (exit {code})\n"
                    + _node_log_tails(node)
                )
        try:
            md = admin.list_topics(timeout=min(2.0, max(0.1, deadline - time.monotonic())))
            seen = set(md.brokers)
            if expected <= seen:
                admin.poll(0)
                return
        except KafkaException:
            pass
        admin.poll(0)
        if time.monotonic() >= deadline:
            tails = "\n".join(_node_log_tails(n) for n in watched)
            raise BrokerStartError(
                f"{what} at {probe_bootstrap} not ready after {timeout_s:.0f} s: brokers "
                f"{sorted(expected)} expected, {sorted(seen) or 'none'} registered\n{tails}"
            )
        time.sleep(0.25)


# --------------------------------------------------------------------------- stopping


def _pid_is_broker(pid: int, server_properties: Path) -> bool:
    """True if ``pid`` is a live (non-zombie) JVM running this node's config.

    Checking the command line guards against signalling a recycled pid.
    """
    proc = Path(f"/proc/{pid}")
    if proc.exists():
        try:
            stat = (proc / "stat").read_text()
            if stat.rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                return False
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        return b"kafka.Kafka" in cmdline and str(server_properties).encode() in cmdline
    if Path("/proc/self").exists():
        return False
    try:  # no procfs (macOS): best effort
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _signal(node: LocalKafkaNode, sig: signal.Signals) -> None:
    if not node.is_running():
        return
    with contextlib.suppress(ProcessLookupError):
        if node.process is not None:
            node.process.send_signal(sig)
        elif node.pid is not None:
            os.kill(node.pid, sig)


def _wait_gone(node: LocalKafkaNode, deadline: float) -> bool:
    while True:
        if node.process is not None:
            try:
                node.process.wait(timeout=max(0.0, min(0.2, deadline - time.monotonic())))
                return True
            except subprocess.TimeoutExpired:
                pass
        elif not node.is_running():
            if node.pid is not None:  # reap it if it happens to be our child
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(node.pid, os.WNOHANG)
            return True
        else:
            time.sleep(0.1)
        if time.monotonic() >= deadline:
            return not node.is_running()


def _kill_and_reap(node: LocalKafkaNode, sig: signal.Signals, timeout_s: float) -> None:
    _signal(node, sig)
    if not _wait_gone(node, time.monotonic() + timeout_s):
        raise LocalBrokerError(f"node {node.node_id} (pid {node.pid}) survived {sig.name} for {timeout_s} s")


def _terminate_all(nodes: list[LocalKafkaNode], timeout_s: float) -> None:
    """SIGTERM all at once (so the quorum shuts down together), then SIGKILL stragglers."""
    for node in nodes:
        _signal(node, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for node in nodes:
        if not _wait_gone(node, deadline):
            log.warning("node %d (pid %s) ignored SIGTERM for %.0f s: killing it", node.node_id, node.pid, timeout_s)
            _kill_and_reap(node, signal.SIGKILL, timeout_s=10.0)


# --------------------------------------------------------------------------- detached mode


@dataclass(frozen=True)
class NodeStatus:
    node_id: int
    pid: int | None
    port: int
    alive: bool


@dataclass(frozen=True)
class LocalClusterStatus:
    """What a state file records, checked against the live processes."""

    state_file: Path
    bootstrap_servers: str
    data_dir: Path
    nodes: tuple[NodeStatus, ...]

    @property
    def running(self) -> bool:
        """All recorded nodes are alive."""
        return all(n.alive for n in self.nodes)

    @property
    def alive_node_ids(self) -> list[int]:
        return [n.node_id for n in self.nodes if n.alive]


def _state_file(state_dir: Path | None) -> Path:
    return (Path(state_dir) if state_dir is not None else default_state_dir()) / STATE_FILE_NAME


def _read_state(state_file: Path) -> dict[str, Any] | None:
    if not state_file.exists():
        return None
    try:
        state = json.loads(state_file.read_text())
        if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
            raise ValueError("not a format-1 state object")
        if not isinstance(state.get("nodes"), list):
            raise ValueError("no node list")
        return state
    except (ValueError, OSError) as exc:
        raise ClusterStateError(
            f"{state_file} is not a local-kafka state file ({exc}); stop any broker by hand "
            f"(`ps aux | grep kafka.Kafka`) and delete the file"
        ) from exc


def _load_cluster(state_file: Path) -> LocalKafkaCluster | None:
    state = _read_state(state_file)
    if state is None:
        return None
    try:
        return LocalKafkaCluster.from_state(state)
    except (KeyError, TypeError, ValueError) as exc:
        raise ClusterStateError(
            f"{state_file} lacks {exc} or holds a bad value; stop any broker by hand "
            f"(`ps aux | grep kafka.Kafka`) and delete the file"
        ) from exc


def status(state_dir: Path | None = None) -> LocalClusterStatus | None:
    """The detached cluster recorded in ``state_dir``, or None when nothing is recorded."""
    state_file = _state_file(state_dir)
    cluster = _load_cluster(state_file)
    if cluster is None:
        return None
    return LocalClusterStatus(
        state_file=state_file,
        bootstrap_servers=cluster.bootstrap_servers,
        data_dir=cluster.data_dir,
        nodes=tuple(NodeStatus(n.node_id, n.pid, n.port, n.is_running()) for n in cluster.nodes),
    )


def up(
    nodes: int = 1,
    state_dir: Path | None = None,
    *,
    ready_timeout_s: float = 60,
    extra_config: dict[str, str] | None = None,
) -> str:
    """Start a detached cluster that outlives this process; return its bootstrap servers.

    Idempotent: if the cluster recorded in ``state_dir`` is fully alive with the
    same node count, its bootstrap is returned. A stale record (some node dead)
    is cleaned up and replaced. Data lives in ``<state_dir>/data``.
    """
    state_file = _state_file(state_dir)
    current = status(state_dir)
    if current is not None:
        if current.running and len(current.nodes) == nodes:
            return current.bootstrap_servers
        if current.running:
            raise ClusterStateError(
                f"a {len(current.nodes)}-node cluster already runs at {current.bootstrap_servers} "
                f"(state {state_file}); run `kafka down` before asking for {nodes} nodes"
            )
        log.warning("replacing stale local Kafka state %s (alive: %s)", state_file, current.alive_node_ids)
        down(state_dir)
    data_dir = state_file.parent / "data"
    shutil.rmtree(data_dir, ignore_errors=True)
    cluster = start_local_cluster(
        nodes, data_dir, extra_config=extra_config, ready_timeout_s=ready_timeout_s, detached=True,
    )
    try:
        tmp = state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(cluster.to_state(), indent=2) + "\n")
        os.replace(tmp, state_file)
    except BaseException:
        cluster.stop(timeout_s=5.0, remove_data=True)
        raise
    return cluster.bootstrap_servers


def down(
    state_dir: Path | None = None, *, keep_data: bool = False, timeout_s: float = 15.0
) -> LocalClusterStatus | None:
    """Stop the detached cluster recorded in ``state_dir`` and forget it.

    Returns its status as it was before stopping, or None if nothing was recorded.
    The data dir is removed unless ``keep_data``.
    """
    state_file = _state_file(state_dir)
    cluster = _load_cluster(state_file)
    if cluster is None:
        return None
    before = status(state_dir)
    cluster.stop(timeout_s=timeout_s, remove_data=not keep_data)
    state_file.unlink(missing_ok=True)
    return before


# --------------------------------------------------------------------------- log tails


def _tail_text(text: str, lines: int) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _tail_file(path: Path, lines: int) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 64 * 1024))
            return _tail_text(fh.read().decode("utf-8", "replace"), lines)
    except FileNotFoundError:
        return "(no such file)"


def _node_log_tails(node: LocalKafkaNode, lines: int = 25) -> str:
    return (
        f"--- node {node.node_id}: tail of {node.server_log}\n{_tail_file(node.server_log, lines)}\n"
        f"--- node {node.node_id}: tail of {node.console_log}\n{_tail_file(node.console_log, lines)}"
    )

