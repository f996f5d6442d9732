"""The 3-node cluster of ``compose/docker-compose.yml``, brought up and faulted with Docker Compose.

:func:`start_compose_cluster` runs ``up -d`` under a project name of its own, on
free loopback ports (the compose file's port variables) and the locally built
image, and returns once all three brokers are registered. The
:class:`ComposeKafkaCluster` it returns has the fault-drill interface of
:class:`rollout_journal.compose.local_broker.LocalKafkaCluster` (``kill_node``, ``restart_node``, and
``partition_leader`` from their shared :class:`rollout_journal.compose.cluster_handle.ClusterHandle`), so one
drill runs on either; ``down`` removes containers and volumes. Debian's ``docker-compose`` (1.29) is used, or ``docker compose``.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from rollout_journal.compose.broker.image import DockerImageError, docker_cli, image_name, image_status
from rollout_journal.compose.cluster_handle import ClusterHandle
from rollout_journal.compose.errors import LocalBrokerError
from rollout_journal.compose.local_broker import free_ports, wait_for_brokers

log = logging.getLogger(__name__)

COMPOSE_FILE = Path(__file__).with_name("docker-compose.yml")
NODE_IDS = (1, 2, 3)


class ComposeError(LocalBrokerError):
    """A docker-compose command failed; the message carries its output."""


def compose_command() -> list[str]:
    """``docker-compose`` (Compose v1, what Debian ships) if installed, else the ``docker compose`` plugin."""
    standalone = shutil.which("docker-compose")
    if standalone is not None:
        return [standalone]
    probe = subprocess.run(
        [docker_cli(), "compose", "version"], capture_output=True, check=False, stdin=subprocess.DEVNULL
    )
    if probe.returncode == 0:
        return [docker_cli(), "compose"]
    raise ComposeError("no compose tool: install `docker-compose` (Debian: `apt-get install docker-compose`)")


def service(node_id: int) -> str:
    return f"kafka-{node_id}"


def compose_environment(
    ports: Mapping[int, tuple[int, int]], image: str, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The variables the compose file reads: image and each node's broker and controller port.

    ``PYTHONPATH`` is dropped: Debian's docker-compose is a Python program whose own
    package is also called ``compose``, and this repository's would shadow it.
    """
    env = dict(os.environ if base is None else base)
    env.pop("PYTHONPATH", None)
    env["KAFKA_IMAGE"] = image
    for node_id, (port, controller_port) in ports.items():
        env[f"KAFKA_{node_id}_PORT"] = str(port)
        env[f"KAFKA_{node_id}_CONTROLLER_PORT"] = str(controller_port)
    return env


def run_compose(
    project: str, env: Mapping[str, str], *args: str, timeout_s: float = 120.0
) -> subprocess.CompletedProcess[str]:
    """Run one compose command on :data:`COMPOSE_FILE`; :class:`ComposeError` with its output on failure."""
    cmd = [*compose_command(), "--project-name", project, "--file", str(COMPOSE_FILE), *args]
    done = subprocess.run(
        cmd, env=dict(env), capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL, check=False
    )
    if done.returncode != 0:
        output = "\n".join((done.stdout + done.stderr).rstrip().splitlines()[-30:])
        raise ComposeError(f"`{' '.join(cmd[len(compose_command()) :])}` failed (exit {done.returncode}):\n{output}")
    return done


@dataclass(eq=False)
class ComposeKafkaCluster(ClusterHandle):
    """A running compose project of the 3-node cluster. Use as a context manager, or call :meth:`down`."""

    project: str
    ports: dict[int, tuple[int, int]]
    image: str
    env: dict[str, str]
    _down: bool = field(default=False, repr=False)

    @property
    def bootstrap_servers(self) -> str:
        return ",".join(self.node_bootstrap(n) for n in sorted(self.ports))

    def node_bootstrap(self, node_id: int) -> str:
        return f"127.0.0.1:{self.ports[node_id][0]}"

    def compose(self, *args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
        return run_compose(self.project, self.env, *args, timeout_s=timeout_s)

    # ----- lifecycle

    def down(self) -> None:
        """Remove the containers and their volumes. Idempotent."""
        if self._down:
            return
        self._down = True
        self._admin_client = None
        self._forget_at_exit()
        self.compose("down", "--volumes", "--timeout", "5")

    stop = down  # the name every broker handle answers to; a ``with`` block calls it

    def kill_node(self, node_id: int) -> None:
        """SIGKILL one node's broker (a crash); Docker does not restart a killed container."""
        self.compose("kill", "-s", "SIGKILL", service(node_id))
        log.info("killed %s of compose project %s", service(node_id), self.project)

    def restart_node(self, node_id: int, ready_timeout_s: float = 60.0) -> None:
        """Start a stopped node's container again (same data) and wait until it serves metadata."""
        self.compose("start", service(node_id))
        wait_for_brokers(
            self.node_bootstrap(node_id),
            {node_id},
            timeout_s=ready_timeout_s,
            what=f"restarted {service(node_id)}",
            dead=lambda: self.exited(node_id),
            details=lambda: self.logs_tail(node_id),
        )
        log.info("%s of compose project %s restarted", service(node_id), self.project)

    def container_id(self, node_id: int) -> str | None:
        """The id of the node's container, found by the labels compose puts on it."""
        done = subprocess.run(
            [
                docker_cli(),
                "ps",
                "--all",
                "--quiet",
                "--filter",
                f"label=com.docker.compose.project={self.project}",
                "--filter",
                f"label=com.docker.compose.service={service(node_id)}",
            ],
            capture_output=True,
            text=True,
            check=False,
            stdin=subprocess.DEVNULL,
        )
        return done.stdout.split()[0] if done.returncode == 0 and done.stdout.split() else None

    def exited(self, node_id: int) -> str | None:
        """None while the node's container runs; otherwise its state, exit code and output tail."""
        cid = self.container_id(node_id)
        if cid is None:
            return f"{service(node_id)} of compose project {self.project} has no container"
        state = subprocess.run(
            [docker_cli(), "inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", cid],
            capture_output=True,
            text=True,
            check=False,
            stdin=subprocess.DEVNULL,
        ).stdout.split()
        if state[:1] == ["running"]:
            return None
        status, code = (state + ["gone", "?"])[:2] if state else ("gone", "?")
        return f"{service(node_id)} is {status} (exit {code})\n{self.logs_tail(node_id)}"

    def logs_tail(self, node_id: int, lines: int = 30) -> str:
        """The last lines the node's broker wrote to stdout (``docker logs``)."""
        cid = self.container_id(node_id)
        if cid is None:
            return f"(no container for {service(node_id)})"
        done = subprocess.run(
            [docker_cli(), "logs", "--tail", str(lines), cid],
            capture_output=True,
            text=True,
            check=False,
            stdin=subprocess.DEVNULL,
        )
        return f"--- {service(node_id)}: docker logs\n" + (done.stdout + done.stderr).rstrip()


def start_compose_cluster(
    image: str | None = None, *, project: str | None = None, ready_timeout_s: float = 120.0
) -> ComposeKafkaCluster:
    """``up -d`` the compose file's 3 nodes on free loopback ports; return once all are registered.

    ``image`` (default :func:`rollout_journal.compose.broker.image.image_name`) must already be in
    the local engine: the compose file says ``pull_policy: never``. On failure the
    project is taken down again and the error carries the nodes' output.
    """
    image = image or image_name()
    if not image_status(image).usable:
        raise DockerImageError(
            f"image {image} is not in the local Docker engine and is never pulled: build it with "
            "`python3 -m rollout_journal.compose.broker.image build`"
        )
    all_ports = free_ports(2 * len(NODE_IDS))
    ports = {n: (all_ports[2 * i], all_ports[2 * i + 1]) for i, n in enumerate(NODE_IDS)}
    project = project or f"rjkafka{uuid.uuid4().hex[:8]}"
    cluster = ComposeKafkaCluster(project, ports, image, compose_environment(ports, image))
    cluster.stop_at_exit()  # a test run that dies must not leave three brokers and their volumes behind
    try:
        cluster.compose("up", "--detach", "--no-build", timeout_s=300)

        def dead() -> str | None:
            return next((r for r in map(cluster.exited, NODE_IDS) if r is not None), None)

        wait_for_brokers(
            cluster.bootstrap_servers,
            set(NODE_IDS),
            timeout_s=ready_timeout_s,
            what=f"compose cluster {project}",
            dead=dead,
            details=lambda: "\n".join(cluster.logs_tail(n) for n in NODE_IDS),
        )
    except BaseException:
        cluster.down()
        raise
    log.info("compose cluster %s ready at %s", project, cluster.bootstrap_servers)
    return cluster
