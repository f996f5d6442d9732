"""Start and stop a real Apache Kafka cluster (KRaft) from Maven jars, without Docker.

:func:`start_local_cluster` formats and starts a throwaway 1- or 3-node cluster
and returns once every broker is registered; the :class:`LocalKafkaCluster` it
returns stops it again, or injects faults (:meth:`LocalKafkaCluster.kill_node`,
:meth:`LocalKafkaCluster.restart_node`); its ``with`` block and metadata questions
(``partition_leader``) are :class:`rollout_journal.compose.cluster_handle.ClusterHandle`'s. Attached clusters
are stopped at interpreter exit so a failing test leaves no broker behind. The jars come from
:mod:`rollout_journal.compose.broker.jars`; the detached ``kafka up`` mode is
:mod:`rollout_journal.compose.broker.daemon`.

Every broker listens on free loopback ports only; nothing here binds a fixed port.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka import KafkaException

from rollout_journal.compose.broker.config import (
    STORAGE_TOOL,
    SaslSecurity,
    broker_command,
    format_command,
    hide_arguments,
    log4j2_properties,
    random_cluster_id,
    scram_bootstrap_credential,
    server_config,
    write_properties,
)
from rollout_journal.compose.broker.jars import ensure_broker_jars, require_java
from rollout_journal.compose.cluster_handle import ClusterHandle, admin_client
from rollout_journal.compose.errors import LocalBrokerError
from rollout_journal.journal.deadlines import Deadline

log = logging.getLogger(__name__)


class BrokerStartError(LocalBrokerError):
    """Formatting or starting a broker failed, or it did not become ready in time.

    The message carries the tail of the node's logs, which usually names the cause.
    """


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


@dataclass(eq=False)
class LocalKafkaCluster(ClusterHandle):
    """A running local cluster. Use as a context manager, or call :meth:`stop`.

    ``detached`` clusters (from :func:`rollout_journal.compose.broker.daemon.up`) are not children
    of this process and are not stopped at interpreter exit; attached ones are.
    A cluster started with ``sasl`` admits authenticated clients only: :attr:`admin_security`
    logs in as its super user (its repr never shows the password).
    """

    bootstrap_servers: str
    nodes: list[LocalKafkaNode]
    data_dir: Path
    cluster_id: str
    libs_dir: Path
    detached: bool = False
    owns_data_dir: bool = False
    sasl: SaslSecurity | None = None
    _stopped: bool = field(default=False, repr=False)

    # ----- lifecycle

    @property
    def admin_security(self) -> dict[str, str]:
        """librdkafka properties that log in as the super user (empty without SASL); they hold a secret."""
        return {} if self.sasl is None else self.sasl.client_config()

    def node(self, node_id: int) -> LocalKafkaNode:
        for node in self.nodes:
            if node.node_id == node_id:
                return node
        raise LocalBrokerError(
            f"no node {node_id} in the cluster at {self.bootstrap_servers} (nodes: {[n.node_id for n in self.nodes]})"
        )

    def stop(self, timeout_s: float = 15.0, *, remove_data: bool | None = None) -> None:
        """SIGTERM every node, SIGKILL those still alive after ``timeout_s``. Idempotent.

        ``remove_data`` defaults to whether the cluster created its own data dir.
        """
        if not self._stopped:
            self._stopped = True
            self._admin_client = None
            _terminate_all(self.nodes, timeout_s)
            self._forget_at_exit()
        if remove_data if remove_data is not None else self.owns_data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def _stop_leftover(self) -> None:
        self.stop(timeout_s=5.0)  # at interpreter exit: nobody waits the full grace period

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
            [node],
            self.nodes,
            probe_bootstrap=node.bootstrap,
            expected={node_id},
            timeout_s=ready_timeout_s,
            what=f"restarted node {node_id}",
            security=self.admin_security,
        )
        log.info("node %d restarted (pid %s)", node_id, node.pid)


# --------------------------------------------------------------------------- starting


def start_local_cluster(
    nodes: int = 1,
    data_dir: Path | None = None,
    *,
    extra_config: dict[str, str] | None = None,
    ready_timeout_s: float = 60,
    detached: bool = False,
    libs_dir: Path | None = None,
    sasl: SaslSecurity | None = None,
) -> LocalKafkaCluster:
    """Format and start ``nodes`` combined KRaft nodes on free loopback ports.

    ``nodes=1`` is a standalone controller quorum; more nodes use a static
    ``controller.quorum.voters`` list, replication factor ``min(3, nodes)`` and
    ``min.insync.replicas`` one less, so a 3-node cluster survives one SIGKILL.
    ``extra_config`` overrides any generated server property. Without ``data_dir``
    a temporary one is created and removed by :meth:`LocalKafkaCluster.stop`.
    ``detached`` nodes outlive this process (used by :func:`rollout_journal.compose.broker.daemon.up`).
    ``sasl`` starts a SASL/SCRAM listener with Kafka's authorizer instead of PLAINTEXT
    (see :class:`rollout_journal.compose.broker.config.SaslSecurity`); its super user's SCRAM credential is
    written into the first metadata, other users are added while it runs
    (:func:`rollout_journal.compose.scram_users.upsert_scram_user`).

    Returns once every broker is registered; on failure everything started is
    stopped and :class:`BrokerStartError` carries the logs' tail.
    """
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    java = require_java()
    libs = libs_dir or ensure_broker_jars()
    owns = data_dir is None
    root = Path(tempfile.mkdtemp(prefix="rollout-journal-kafka-")) if data_dir is None else Path(data_dir)
    root = root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    try:
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                return _start_once(java, libs, nodes, root, owns, extra_config, ready_timeout_s, detached, sasl)
            except PortTakenError:
                if attempt == PORT_ATTEMPTS:
                    raise
                log.warning(
                    "a port picked for the %d-node cluster was taken before its broker bound it: "
                    "starting again on other ports",
                    nodes,
                )
        raise AssertionError("unreachable")
    except BaseException:
        if owns:
            shutil.rmtree(root, ignore_errors=True)
        raise


# Ports are picked free, but a JVM binds them seconds later; meanwhile another process (any
# outgoing connection on the machine) may be given one. A start that failed on a taken port
# is tried again on fresh ports, this many times in all.
PORT_ATTEMPTS = 3


class PortTakenError(BrokerStartError):
    """A broker could not bind its port: another process took it between picking and binding."""


def _start_once(
    java: str,
    libs: Path,
    nodes: int,
    root: Path,
    owns: bool,
    extra_config: dict[str, str] | None,
    ready_timeout_s: float,
    detached: bool,
    sasl: SaslSecurity | None,
) -> LocalKafkaCluster:
    """One try of :func:`start_local_cluster` on freshly picked ports."""
    ports = free_ports(2 * nodes)
    members = [
        LocalKafkaNode(
            node_id=i + 1,
            port=ports[2 * i],
            controller_port=ports[2 * i + 1],
            node_dir=root / f"node-{i + 1}",
        )
        for i in range(nodes)
    ]
    cluster = LocalKafkaCluster(
        bootstrap_servers=",".join(n.bootstrap for n in members),
        nodes=members,
        data_dir=root,
        cluster_id=random_cluster_id(),
        libs_dir=libs,
        detached=detached,
        owns_data_dir=owns,
        sasl=sasl,
    )
    started = time.monotonic()
    created: list[Path] = []  # node dirs this try made: removed again if it is tried again
    try:
        for node in members:
            if node.node_dir.exists() and any(node.node_dir.iterdir()):
                raise BrokerStartError(
                    f"{node.node_dir} already holds files: start_local_cluster needs an empty data dir"
                )
            created.append(node.node_dir)
            node.log_dirs.mkdir(parents=True)
            node.logs_dir.mkdir(parents=True)
            write_properties(
                node.server_properties,
                server_config(node, members, node.log_dirs, extra_config or {}, sasl=sasl),
                private=sasl is not None,
            )
            node.log4j_properties.write_text(log4j2_properties())
        scram = () if sasl is None else (scram_bootstrap_credential(sasl.admin_user, sasl.admin_password),)
        _format_all(java, libs, members, cluster.cluster_id, standalone=nodes == 1, scram=scram)
        if not detached:
            cluster.stop_at_exit()
        for node in members:
            _launch(node, libs, detached=detached)
        _wait_registered(
            members,
            members,
            probe_bootstrap=cluster.bootstrap_servers,
            expected={n.node_id for n in members},
            timeout_s=ready_timeout_s,
            what=f"{nodes}-node cluster",
            security=cluster.admin_security,
        )
    except BaseException as error:
        cluster.stop(timeout_s=5.0, remove_data=False)  # the logs say why, below; the caller removes what it owns
        if isinstance(error, BrokerStartError) and any(_bind_failed(node) for node in members):
            for node_dir in created:  # a fresh try needs them empty
                shutil.rmtree(node_dir, ignore_errors=True)
            raise PortTakenError(str(error)) from error
        raise
    log.info(
        "Kafka %d-node cluster ready at %s in %.1f s (data in %s%s)",
        nodes,
        cluster.bootstrap_servers,
        time.monotonic() - started,
        root,
        "" if sasl is None else f"; SASL/SCRAM with ACLs, super user {sasl.admin_user}",
    )
    return cluster


def _bind_failed(node: LocalKafkaNode) -> bool:
    """Whether the node's logs say it could not bind a port (another process holds it)."""
    for path in (node.console_log, node.server_log):
        try:
            if "Address already in use" in path.read_text(errors="replace"):
                return True
        except FileNotFoundError:
            pass
    return False


def free_ports(count: int) -> list[int]:
    """Distinct free loopback ports: all sockets stay bound until every port is picked."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
        return ports


def _format_all(
    java: str,
    libs: Path,
    members: list[LocalKafkaNode],
    cluster_id: str,
    *,
    standalone: bool,
    scram: tuple[str, ...] = (),
) -> None:
    """Run StorageTool format for every node in parallel (each is a JVM start)."""
    running = []
    for node in members:
        cmd = format_command(
            java,
            libs,
            server_properties=node.server_properties,
            log4j_properties=node.log4j_properties,
            logs_dir=node.logs_dir,
            cluster_id=cluster_id,
            standalone=standalone,
            scram=scram,
        )
        if scram:  # a salted SCRAM password logs in: keep it off the command line
            cmd = hide_arguments(cmd, STORAGE_TOOL, node.node_dir / "format.args")
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
        (node.node_dir / "format.args").unlink(missing_ok=True)
        if code != 0:
            text = _tail_file(node.node_dir / "format.log", 30)
            failures.append(f"node {node.node_id} (exit {code}):\n{text}")
    if failures:
        raise BrokerStartError("kafka StorageTool format failed for " + "\n".join(failures))


def _launch(node: LocalKafkaNode, libs: Path, *, detached: bool) -> None:
    """Start the node's JVM in its own session, output appended to console.log.

    Detached nodes are started through a shell that exits at once, so the JVM is
    re-parented away from us and survives this process without leaving a
    Popen that Python would warn about.
    """
    cmd = broker_command(
        require_java(),
        libs,
        server_properties=node.server_properties,
        log4j_properties=node.log4j_properties,
        logs_dir=node.logs_dir,
    )
    with open(node.console_log, "ab") as console:
        if not detached:
            node.process = subprocess.Popen(
                cmd,
                stdout=console,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            node.pid = node.process.pid
            return
    script = 'log="$1"; shift; "$@" </dev/null >>"$log" 2>&1 & echo $!'
    done = subprocess.run(
        ["/bin/sh", "-c", script, "sh", str(node.console_log), *cmd],
        capture_output=True,
        text=True,
        start_new_session=True,
        timeout=30,
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
    security: dict[str, str] | None = None,
) -> None:
    """:func:`wait_for_brokers`, failing fast if a watched JVM exits."""

    def dead() -> str | None:
        for node in watched:
            if not node.is_running():
                code = node.process.returncode if node.process is not None else "unknown"
                return f"node {node.node_id} exited during startup (exit {code})\n" + _node_log_tails(node)
        return None

    wait_for_brokers(
        probe_bootstrap,
        expected,
        timeout_s=timeout_s,
        what=what,
        dead=dead,
        details=lambda: "\n".join(_node_log_tails(n) for n in watched),
        security=security,
    )


def wait_for_brokers(
    probe_bootstrap: str,
    expected: set[int],
    *,
    timeout_s: float,
    what: str,
    dead: Callable[[], str | None] = lambda: None,
    details: Callable[[], str] = lambda: "",
    security: dict[str, str] | None = None,
) -> None:
    """Poll metadata through ``probe_bootstrap`` until the broker ids ``expected`` are listed.

    Readiness is asked of the admin client, not read from a log line (a broker
    without a log4j2 config logs nothing). ``dead`` returns a reason as soon as a
    broker being waited for has exited; ``details`` adds its logs to a timeout.
    ``security`` logs the probe in (a SASL cluster's super user). Raises :class:`BrokerStartError`.
    """
    admin = admin_client(probe_bootstrap, security)
    deadline = Deadline(timeout_s)
    seen: set[int] = set()
    while True:
        reason = dead()
        if reason is not None:
            raise BrokerStartError(f"{what}: {reason}")
        try:
            md = admin.list_topics(timeout=deadline.left(at_least=0.1, at_most=2.0))
            seen = set(md.brokers)
            if expected <= seen:
                admin.poll(0)
                return
        except KafkaException:
            pass
        admin.poll(0)
        if deadline.passed():
            raise BrokerStartError(
                f"{what} at {probe_bootstrap} not ready after {timeout_s:.0f} s: brokers "
                f"{sorted(expected)} expected, {sorted(seen) or 'none'} registered\n{details()}"
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


def _wait_gone(node: LocalKafkaNode, deadline: Deadline) -> bool:
    while True:
        if node.process is not None:
            try:
                node.process.wait(timeout=deadline.left(at_most=0.2))
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
        if deadline.passed():
            return not node.is_running()


def _kill_and_reap(node: LocalKafkaNode, sig: signal.Signals, timeout_s: float) -> None:
    _signal(node, sig)
    if not _wait_gone(node, Deadline(timeout_s)):
        raise LocalBrokerError(f"node {node.node_id} (pid {node.pid}) survived {sig.name} for {timeout_s} s")


def _terminate_all(nodes: list[LocalKafkaNode], timeout_s: float) -> None:
    """SIGTERM all at once (so the quorum shuts down together), then SIGKILL stragglers."""
    for node in nodes:
        _signal(node, signal.SIGTERM)
    deadline = Deadline(timeout_s)
    for node in nodes:
        if not _wait_gone(node, deadline):
            log.warning("node %d (pid %s) ignored SIGTERM for %.0f s: killing it", node.node_id, node.pid, timeout_s)
            _kill_and_reap(node, signal.SIGKILL, timeout_s=10.0)


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
