"""The ``kafka`` sub-command: run a local Kafka broker for development without Docker.

``replay/cli.py`` calls :func:`register_kafka_commands` on its sub-parsers and hands
the parsed arguments of ``kafka ...`` to :func:`run_kafka_command`. Each command
prints one line: a result on stdout, or an error on stderr with exit code 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from compose.broker_daemon import LocalClusterStatus, default_state_dir, down, status, up
from compose.errors import LocalBrokerError

_DESCRIPTION = """\
Run a real Apache Kafka cluster (KRaft, combined broker+controller nodes) on free
loopback ports, from jars fetched once with Maven into ~/.cache/rollout-journal
(override with ROLLOUT_JOURNAL_CACHE). Needs java 17+ and, the first time, mvn.
The brokers keep running after this command exits; `kafka down` stops them.
With Docker, compose/docker-compose.yml runs a 3-node cluster instead."""


def register_kafka_commands(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``kafka up|down|status`` to an ``add_subparsers()`` object; return the ``kafka`` parser.

    The parsed namespace gets ``kafka_command`` (up/down/status) and
    ``handler=run_kafka_command``.
    """
    kafka = subparsers.add_parser(
        "kafka",
        help="start/stop a local Kafka cluster without Docker",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    kafka.set_defaults(handler=run_kafka_command)
    commands = kafka.add_subparsers(dest="kafka_command", metavar="{up,down,status}", required=True)
    state_help = f"folder holding the cluster's state file and data (default: {default_state_dir()})"

    up_parser = commands.add_parser(
        "up",
        help="start a detached local cluster (no-op if it already runs)",
        description="Start a detached local Kafka cluster and print its bootstrap servers. "
        "1 node: a standalone KRaft node, replication factor 1. 3 nodes: replication "
        "factor 3, min.insync.replicas=2, so one node may die.",
    )
    up_parser.add_argument(
        "--nodes", type=_positive_int, default=1, metavar="N",
        help="number of nodes (default: 1; 3 for fault tests)",
    )
    up_parser.add_argument("--state-dir", type=Path, default=None, metavar="DIR", help=state_help)
    up_parser.add_argument(
        "--ready-timeout", type=float, default=60.0, metavar="SECONDS",
        help="how long to wait for the brokers to register (default: 60)",
    )

    down_parser = commands.add_parser(
        "down",
        help="stop the local cluster and delete its data",
        description="Stop the cluster started by `kafka up` (SIGTERM, then SIGKILL after 15 s) "
        "and delete its data unless --keep-data.",
    )
    down_parser.add_argument("--state-dir", type=Path, default=None, metavar="DIR", help=state_help)
    down_parser.add_argument("--keep-data", action="store_true", help="keep the data and broker logs")

    status_parser = commands.add_parser(
        "status",
        help="say whether the local cluster runs (exit 0) or not (exit 1)",
        description="Print whether the cluster recorded by `kafka up` is running. Exit code 0 "
        "when every node is alive, 1 otherwise.",
    )
    status_parser.add_argument("--state-dir", type=Path, default=None, metavar="DIR", help=state_help)
    return kafka


def run_kafka_command(args: argparse.Namespace) -> int:
    """Run the parsed ``kafka`` sub-command; return the process exit code."""
    command = args.kafka_command
    try:
        if command == "up":
            return _up(args)
        if command == "down":
            return _down(args)
        if command == "status":
            return _status(args)
    except LocalBrokerError as exc:
        print(f"kafka {command}: error: {_indent_details(str(exc))}", file=sys.stderr)
        return 1
    print(f"kafka: unknown command {command!r} (expected up, down or status)", file=sys.stderr)
    return 2


def _up(args: argparse.Namespace) -> int:
    before = status(args.state_dir)
    bootstrap = up(args.nodes, args.state_dir, ready_timeout_s=args.ready_timeout)
    verb = "already running" if before is not None and before.running else "started"
    print(
        f"kafka up: {verb}, {_nodes(args.nodes)} at {bootstrap} "
        f"(export KAFKA_BOOTSTRAP_SERVERS={bootstrap})"
    )
    return 0


def _down(args: argparse.Namespace) -> int:
    stopped = down(args.state_dir, keep_data=args.keep_data)
    if stopped is None:
        print(f"kafka down: nothing to stop (no cluster recorded in {_state_dir(args)})")
        return 0
    data = f"data kept in {stopped.data_dir}" if args.keep_data else "data removed"
    print(f"kafka down: stopped {_nodes(len(stopped.nodes))} at {stopped.bootstrap_servers}, {data}")
    return 0


def _status(args: argparse.Namespace) -> int:
    current = status(args.state_dir)
    if current is None:
        print(f"kafka status: not running (no cluster recorded in {_state_dir(args)})")
        return 1
    print(f"kafka status: {_describe(current)}")
    return 0 if current.running else 1


def _describe(current: LocalClusterStatus) -> str:
    if current.running:
        return f"running, {_nodes(len(current.nodes))} at {current.bootstrap_servers} (data in {current.data_dir})"
    dead = [n.node_id for n in current.nodes if not n.alive]
    return (
        f"degraded, node(s) {dead} of {_nodes(len(current.nodes))} not running at "
        f"{current.bootstrap_servers}; run `kafka down` then `kafka up`"
    )


def _nodes(count: int) -> str:
    return f"{count} node" if count == 1 else f"{count} nodes"


def _state_dir(args: argparse.Namespace) -> Path:
    return args.state_dir if args.state_dir is not None else default_state_dir()


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"--nodes must be at least 1, got {value}")
    return value


def _indent_details(message: str) -> str:
    # First line says what failed; log tails that follow stay readable but set apart.
    first, _, rest = message.partition("\n")
    return first + "".join(f"\n    {line}" for line in rest.splitlines())
