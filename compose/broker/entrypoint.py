"""The broker image's start script: write this node's config, format once, become the broker.

Runs inside the container built by :mod:`rollout_journal.compose.broker.image` (Debian's Python,
standard library only); the config comes from :mod:`rollout_journal.compose.broker.config`, the
same code the jar launcher uses. Containers run with host networking, so the
node's ports are the host's loopback ports, passed in by environment:

``KAFKA_NODE_ID``
    this node's id (default 1).
``KAFKA_QUORUM``
    every node of the cluster as ``id:port:controller_port``, comma-separated, e.g.
    ``1:9092:19092,2:9093:19093,3:9094:19094``. One entry: a standalone node.
``KAFKA_CLUSTER_ID``
    the cluster id every node formats with; required for more than one node.
``KAFKA_EXTRA_PROPERTIES``
    optional ``key=value`` lines that override generated properties.

Everything the node writes lives under ``/var/lib/kafka`` (mount a volume there to
keep it). Storage is formatted only when it holds no ``meta.properties`` yet, so a
restarted container keeps its data. Log lines go to ``logs/server.log`` and stdout.
``--health`` only checks that the node's broker port accepts connections.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from rollout_journal.compose.broker.config import (
    LOOPBACK,
    broker_command,
    format_command,
    log4j2_properties,
    random_cluster_id,
    server_config,
    write_properties,
)

HOME = Path("/var/lib/kafka")
LIBS = Path("/opt/kafka/libs")


class EntrypointError(RuntimeError):
    """The container's environment does not describe a valid node."""


@dataclass(frozen=True)
class QuorumMember:
    node_id: int
    port: int
    controller_port: int


def parse_quorum(text: str) -> list[QuorumMember]:
    """``id:port:controller_port,...`` as members; :class:`EntrypointError` names a bad entry."""
    members = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        parts = entry.split(":")
        if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
            raise EntrypointError(f"KAFKA_QUORUM entry {entry!r} is not id:port:controller_port (e.g. 1:9092:19092)")
        members.append(QuorumMember(*(int(p) for p in parts)))
    if not members:
        raise EntrypointError("KAFKA_QUORUM is empty: list every node as id:port:controller_port")
    return members


def parse_extra(text: str) -> dict[str, str]:
    """``key=value`` lines (blank lines and ``#`` comments ignored)."""
    extra = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise EntrypointError(f"KAFKA_EXTRA_PROPERTIES line {line!r} is not key=value")
        extra[key.strip()] = value.strip()
    return extra


def this_node(env: Mapping[str, str]) -> tuple[QuorumMember, list[QuorumMember]]:
    """This node and every member of its quorum, from ``KAFKA_NODE_ID`` and ``KAFKA_QUORUM``."""
    raw_id = env.get("KAFKA_NODE_ID", "1").strip()
    if not raw_id.isdigit():
        raise EntrypointError(f"KAFKA_NODE_ID={raw_id!r} is not a node id (a number such as 1)")
    node_id = int(raw_id)
    members = parse_quorum(env.get("KAFKA_QUORUM", ""))
    node = next((m for m in members if m.node_id == node_id), None)
    if node is None:
        raise EntrypointError(f"KAFKA_NODE_ID={node_id} is not in KAFKA_QUORUM ({[m.node_id for m in members]})")
    return node, members


def prepare(env: Mapping[str, str], home: Path = HOME, libs: Path = LIBS, java: str = "java") -> list[str]:
    """Write the node's files under ``home``, format its storage if new; return the broker command."""
    node, members = this_node(env)
    cluster_id = env.get("KAFKA_CLUSTER_ID", "").strip()
    if not cluster_id:
        if len(members) > 1:
            raise EntrypointError("KAFKA_CLUSTER_ID must be set (the same on every node) for a multi-node quorum")
        cluster_id = random_cluster_id()

    data, logs = home / "data", home / "logs"
    data.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    properties, log4j = home / "server.properties", home / "log4j2.properties"
    write_properties(properties, server_config(node, members, data, parse_extra(env.get("KAFKA_EXTRA_PROPERTIES", ""))))
    log4j.write_text(log4j2_properties(console=True))
    if not (data / "meta.properties").exists():
        subprocess.run(
            format_command(
                java,
                libs,
                server_properties=properties,
                log4j_properties=log4j,
                logs_dir=logs,
                cluster_id=cluster_id,
                standalone=len(members) == 1,
            ),
            check=True,
            stdin=subprocess.DEVNULL,
        )
    return broker_command(java, libs, server_properties=properties, log4j_properties=log4j, logs_dir=logs)


def healthy(env: Mapping[str, str]) -> bool:
    """Whether this node's broker port accepts connections (the image's health check)."""
    node, _ = this_node(env)
    try:
        with socket.create_connection((LOOPBACK, node.port), timeout=2):
            return True
    except OSError:
        return False


def main(argv: list[str]) -> None:
    try:
        if argv == ["--health"]:
            sys.exit(0 if healthy(os.environ) else 1)
        command = prepare(os.environ)
    except EntrypointError as exc:
        sys.exit(f"kafka entrypoint: {exc}")
    except subprocess.CalledProcessError as exc:
        sys.exit(f"kafka entrypoint: formatting the storage failed (exit {exc.returncode}); see the lines above")
    # The broker replaces this process: it is PID 1 and gets `docker stop`'s SIGTERM itself.
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
