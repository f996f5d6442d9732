"""A detached local cluster that outlives the Python process (``rollout-journal kafka up``).

:func:`up` starts brokers re-parented away from the caller and records them in a
JSON state file; :func:`status` and :func:`down` find them again from that file
in a later process. The file is the only link to the brokers, so anything that
does not parse as one is reported (:class:`ClusterStateError`), never guessed at.

A cluster started with ``sasl=True`` admits SCRAM-authenticated clients only. Its super
user's librdkafka client config (password included) is the file ``admin-client.properties``
beside the state file, readable by its owner only; the state file names it and holds no
secret. :func:`admin_client` logs in with it, for ``kafka user`` and ``kafka grant``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from confluent_kafka.admin import AdminClient

from rollout_journal.compose.broker.config import SaslSecurity, write_properties
from rollout_journal.compose.broker.jars import cache_root, kafka_version
from rollout_journal.compose.cluster_handle import admin_client as _admin_client
from rollout_journal.compose.errors import LocalBrokerError
from rollout_journal.compose.local_broker import LocalKafkaCluster, LocalKafkaNode, start_local_cluster

log = logging.getLogger(__name__)

STATE_FILE_NAME = "state.json"
ADMIN_CLIENT_FILE_NAME = "admin-client.properties"
_STATE_FORMAT = 1


class ClusterStateError(LocalBrokerError):
    """The detached cluster's state file is missing, unreadable or contradicts a request."""


class ClusterConflictError(ClusterStateError):
    """A request for a cluster other than the one running (node count, security): nothing was started."""


def default_state_dir() -> Path:
    """Where :func:`up` records its detached cluster unless told otherwise."""
    return cache_root() / "local-kafka"


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
    sasl_admin_config: Path | None = None
    """The super user's client config of a SASL cluster; None: a PLAINTEXT cluster."""

    @property
    def running(self) -> bool:
        """All recorded nodes are alive."""
        return all(n.alive for n in self.nodes)

    @property
    def alive_node_ids(self) -> list[int]:
        return [n.node_id for n in self.nodes if n.alive]


# --------------------------------------------------------------------------- state file


def _cluster_to_state(cluster: LocalKafkaCluster, admin_config: Path | None) -> dict[str, Any]:
    state: dict[str, Any] = {
        "format": _STATE_FORMAT,
        "kafka_version": kafka_version(),
        "bootstrap_servers": cluster.bootstrap_servers,
        "cluster_id": cluster.cluster_id,
        "data_dir": str(cluster.data_dir),
        "libs_dir": str(cluster.libs_dir),
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "nodes": [
            {
                "node_id": n.node_id,
                "pid": n.pid,
                "port": n.port,
                "controller_port": n.controller_port,
                "node_dir": str(n.node_dir),
            }
            for n in cluster.nodes
        ],
    }
    if cluster.sasl is not None and admin_config is not None:
        state["sasl"] = {"admin_user": cluster.sasl.admin_user, "admin_client_config": str(admin_config)}
    return state


def _write_admin_config(path: Path, cluster: LocalKafkaCluster) -> None:
    """The super user's librdkafka config, owner-only (``kcat -F`` reads the same format)."""
    write_properties(path, {"bootstrap.servers": cluster.bootstrap_servers, **cluster.admin_security}, private=True)


def _read_admin_config(path: Path) -> dict[str, str]:
    config = {}
    for line in path.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep:
            config[key.strip()] = value.strip()
    return config


def _cluster_from_state(state: Mapping[str, Any]) -> LocalKafkaCluster:
    """Rebuild a handle on a detached cluster from :func:`_cluster_to_state` output."""
    nodes = [
        LocalKafkaNode(
            node_id=int(n["node_id"]),
            port=int(n["port"]),
            controller_port=int(n["controller_port"]),
            node_dir=Path(n["node_dir"]),
            pid=int(n["pid"]) if n.get("pid") is not None else None,
        )
        for n in state["nodes"]
    ]
    sasl = None
    if state.get("sasl") is not None:
        admin = _read_admin_config(Path(state["sasl"]["admin_client_config"]))
        sasl = SaslSecurity(admin_user=admin["sasl.username"], admin_password=admin["sasl.password"])
    return LocalKafkaCluster(
        bootstrap_servers=str(state["bootstrap_servers"]),
        nodes=nodes,
        data_dir=Path(state["data_dir"]),
        cluster_id=str(state["cluster_id"]),
        libs_dir=Path(state["libs_dir"]),
        detached=True,
        sasl=sasl,
    )


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
        return _cluster_from_state(state)
    except (KeyError, TypeError, ValueError, OSError) as exc:
        raise ClusterStateError(
            f"{state_file} lacks {exc} or holds a bad value; stop any broker by hand "
            f"(`ps aux | grep kafka.Kafka`) and delete the file"
        ) from exc


# --------------------------------------------------------------------------- up / down / status


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
        sasl_admin_config=state_file.parent / ADMIN_CLIENT_FILE_NAME if cluster.sasl is not None else None,
    )


def admin_client(state_dir: Path | None = None) -> tuple[AdminClient, LocalClusterStatus]:
    """An AdminClient logged in as the super user of the running SASL cluster in ``state_dir``."""
    state_file = _state_file(state_dir)
    cluster = _load_cluster(state_file)
    current = status(state_dir)
    if cluster is None or current is None or not current.running:
        raise ClusterStateError(f"no local cluster runs (state {state_file}); start one with `kafka up --sasl`")
    if cluster.sasl is None:
        raise ClusterStateError(
            f"the cluster at {cluster.bootstrap_servers} runs without SASL: it has no users or ACLs; "
            "`kafka down`, then `kafka up --sasl`"
        )
    return _admin_client(cluster.bootstrap_servers, cluster.admin_security), current


def up(
    nodes: int = 1,
    state_dir: Path | None = None,
    *,
    ready_timeout_s: float = 60,
    extra_config: dict[str, str] | None = None,
    sasl: bool = False,
) -> str:
    """Start a detached cluster that outlives this process; return its bootstrap servers.

    Idempotent: if the cluster recorded in ``state_dir`` is fully alive with the
    same node count and security, its bootstrap is returned. A stale record (some
    node dead) is cleaned up and replaced. Data lives in ``<state_dir>/data``.
    ``sasl`` starts a SASL/SCRAM listener with ACLs and a generated super user
    (see :class:`rollout_journal.compose.broker.config.SaslSecurity`).
    """
    state_file = _state_file(state_dir)
    current = status(state_dir)
    if current is not None:
        same = len(current.nodes) == nodes and (current.sasl_admin_config is not None) == sasl
        if current.running and same:
            return current.bootstrap_servers
        if current.running:
            security = "with SASL" if current.sasl_admin_config is not None else "without SASL"
            raise ClusterConflictError(
                f"a {len(current.nodes)}-node cluster {security} already runs at {current.bootstrap_servers} "
                f"(state {state_file}); run `kafka down` before asking for {nodes} nodes "
                f"{'with' if sasl else 'without'} SASL"
            )
        log.warning("replacing stale local Kafka state %s (alive: %s)", state_file, current.alive_node_ids)
        down(state_dir)
    data_dir = state_file.parent / "data"
    shutil.rmtree(data_dir, ignore_errors=True)
    cluster = start_local_cluster(
        nodes,
        data_dir,
        extra_config=extra_config,
        ready_timeout_s=ready_timeout_s,
        detached=True,
        sasl=SaslSecurity() if sasl else None,
    )
    try:
        admin_config = state_file.parent / ADMIN_CLIENT_FILE_NAME if sasl else None
        if admin_config is not None:
            _write_admin_config(admin_config, cluster)
        tmp = state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(_cluster_to_state(cluster, admin_config), indent=2) + "\n")
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
    (state_file.parent / ADMIN_CLIENT_FILE_NAME).unlink(missing_ok=True)
    return before
