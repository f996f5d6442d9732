"""The ``kafka`` sub-command: run a local Kafka broker for development without Docker.

``replay/cli/main.py`` calls :func:`register_kafka_commands` on its sub-parsers and hands
the parsed arguments of ``kafka ...`` to :func:`run_kafka_command`. Each command
prints one line: a result on stdout, or an error on stderr with exit code 1.

``kafka up --sasl`` starts the cluster with a SASL/SCRAM listener and Kafka's authorizer;
``kafka user`` adds a SCRAM user to it and ``kafka grant`` gives a user the minimal ACLs
of one namespace (:mod:`rollout_journal.journal.kafka.access`). ``user`` and ``grant`` also work on any
other cluster (``--bootstrap-servers``), logged in with the credentials of the environment
(``ROLLOUT_JOURNAL_LIBRDKAFKA_SASL_USERNAME`` ...) of an admin who may alter it.
"""

from __future__ import annotations

import argparse
import getpass
import os
import sys
from pathlib import Path
from typing import Any

from confluent_kafka.admin import AdminClient

from rollout_journal.compose.broker.config import SASL_LISTENER, SCRAM_MECHANISM
from rollout_journal.compose.broker.daemon import (
    LocalClusterStatus,
    admin_client,
    default_state_dir,
    down,
    status,
    up,
)

_DESCRIPTION = """\
Run a real Apache Kafka cluster (KRaft, combined broker+controller nodes) on free
loopback ports, from jars fetched once with Maven into ~/.cache/rollout-journal
(override with ROLLOUT_JOURNAL_CACHE). Needs java 17+ and, the first time, mvn.
The brokers keep running after this command exits; `kafka down` stops them.
With Docker, compose/docker-compose.yml runs a 3-node cluster instead."""


def register_kafka_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
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
    commands = kafka.add_subparsers(dest="kafka_command", metavar="{up,down,status,user,grant}", required=True)
    state_help = f"folder holding the cluster's state file and data (default: {default_state_dir()})"

    up_parser = commands.add_parser(
        "up",
        help="start a detached local cluster (no-op if it already runs)",
        description="Start a detached local Kafka cluster and print its bootstrap servers. "
        "1 node: a standalone KRaft node, replication factor 1. 3 nodes: replication "
        "factor 3, min.insync.replicas=2, so one node may die.",
    )
    up_parser.add_argument(
        "--nodes",
        type=_positive_int,
        default=1,
        metavar="N",
        help="number of nodes (default: 1; 3 for fault tests)",
    )
    up_parser.add_argument("--state-dir", type=Path, default=None, metavar="DIR", help=state_help)
    up_parser.add_argument(
        "--ready-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how long to wait for the brokers to register (default: 60)",
    )
    up_parser.add_argument(
        "--sasl",
        action="store_true",
        help="clients log in with SASL/SCRAM-SHA-512 and Kafka's authorizer allows only what ACLs grant; "
        "add users with `kafka user`, give them a namespace with `kafka grant`",
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

    cluster_help = (
        "another cluster to act on (default: the one `kafka up --sasl` started), logged in with "
        "the ROLLOUT_JOURNAL_LIBRDKAFKA_* credentials of the environment"
    )
    user_parser = commands.add_parser(
        "user",
        help="create a SCRAM-SHA-512 user (or give it a new password); the password is read from stdin",
        description="Create user NAME, or replace its password, for SASL/SCRAM-SHA-512. The password is read "
        "from stdin (a prompt on a terminal), never from the command line, where `ps` would show it.",
    )
    user_parser.add_argument("name", help="the user name (the principal is User:NAME)")
    user_parser.add_argument("--state-dir", type=Path, default=None, metavar="DIR", help=state_help)
    user_parser.add_argument("--bootstrap-servers", metavar="HOST:PORT", help=cluster_help)

    grant_parser = commands.add_parser(
        "grant",
        help="give a user the minimal ACLs of one namespace",
        description="Create the prefixed ACLs that let USER work in namespace NS and nowhere else: topics "
        "NS.*: READ, WRITE, CREATE, DESCRIBE_CONFIGS; transactional ids NS.*: WRITE; groups NS.*: READ "
        "(--reader: topics READ, DESCRIBE_CONFIGS; groups DESCRIBE). See README: Securing a shared cluster.",
    )
    grant_parser.add_argument("--namespace", required=True, metavar="NS", help="the journal's namespace")
    grant_parser.add_argument("--user", required=True, metavar="USER", help="the user name (User:USER)")
    grant_parser.add_argument("--reader", action="store_true", help="read-only: list, show, audit, replay")
    grant_parser.add_argument(
        "--no-create", action="store_true", help="leave out CREATE on the topics (an operator creates them)"
    )
    grant_parser.add_argument("--state-dir", type=Path, default=None, metavar="DIR", help=state_help)
    grant_parser.add_argument("--bootstrap-servers", metavar="HOST:PORT", help=cluster_help)
    return kafka


def run_kafka_command(args: argparse.Namespace) -> int:
    """Run the parsed ``kafka`` sub-command; return the process exit code. A failure is raised
    (``LocalBrokerError`` or a journal error): the command line turns it into its exit code
    (``replay.cli.live.kafka``), which this room does not know."""
    command = args.kafka_command
    if command == "up":
        return _up(args)
    if command == "down":
        return _down(args)
    if command == "status":
        return _status(args)
    if command == "user":
        return _user(args)
    if command == "grant":
        return _grant(args)
    print(f"kafka: unknown command {command!r} (expected up, down, status, user or grant)", file=sys.stderr)
    return 2


def _up(args: argparse.Namespace) -> int:
    before = status(args.state_dir)
    bootstrap = up(args.nodes, args.state_dir, ready_timeout_s=args.ready_timeout, sasl=args.sasl)
    verb = "already running" if before is not None and before.running else "started"
    if not args.sasl:
        print(f"kafka up: {verb}, {_nodes(args.nodes)} at {bootstrap} (export KAFKA_BOOTSTRAP_SERVERS={bootstrap})")
        return 0
    current = status(args.state_dir)
    print(
        f"kafka up: {verb}, {_nodes(args.nodes)} at {bootstrap} with SASL/{SCRAM_MECHANISM} and ACLs "
        f"(super user's client config: {current.sasl_admin_config if current else '?'}); add a user with "
        "`kafka user NAME`, grant it a namespace with `kafka grant --namespace NS --user NAME`, and run as it "
        f"with KAFKA_BOOTSTRAP_SERVERS={bootstrap} ROLLOUT_JOURNAL_LIBRDKAFKA_SECURITY_PROTOCOL={SASL_LISTENER} "
        f"ROLLOUT_JOURNAL_LIBRDKAFKA_SASL_MECHANISM={SCRAM_MECHANISM} ROLLOUT_JOURNAL_LIBRDKAFKA_SASL_USERNAME=NAME "
        "ROLLOUT_JOURNAL_LIBRDKAFKA_SASL_PASSWORD=..."
    )
    return 0


def _admin(args: argparse.Namespace, namespace: str = "rollout-journal") -> tuple[AdminClient, str]:
    """The admin client the command acts through, and the cluster's bootstrap servers."""
    if args.bootstrap_servers is None:
        admin, current = admin_client(args.state_dir)
        return admin, current.bootstrap_servers
    from rollout_journal.journal.kafka.config import (
        KafkaSettings,  # the same environment variables as every journal client
    )

    settings = KafkaSettings.from_env(
        {k: v for k, v in os.environ.items() if k != "KAFKA_BOOTSTRAP_SERVERS"},
        bootstrap_servers=args.bootstrap_servers,
        namespace=namespace,
    )
    config: dict[str, Any] = {"bootstrap.servers": settings.bootstrap_servers, **settings.librdkafka}
    return AdminClient(config), settings.bootstrap_servers


def _user(args: argparse.Namespace) -> int:
    from rollout_journal.compose.scram_users import upsert_scram_user

    if sys.stdin.isatty():
        password = getpass.getpass(f"password of user {args.name}: ")
    else:
        password = sys.stdin.readline().rstrip("\r\n")
    admin, bootstrap = _admin(args)
    upsert_scram_user(admin, args.name, password)
    print(
        f"kafka user: {args.name} logs in with {SCRAM_MECHANISM} at {bootstrap}; it may do nothing until "
        f"`kafka grant --namespace NS --user {args.name}`"
    )
    return 0


def _grant(args: argparse.Namespace) -> int:
    from rollout_journal.journal.kafka.access import (
        Role,
        create_acls,
        describe_rights,
        namespace_acls,
        namespace_rights,
    )

    role: Role = "reader" if args.reader else "worker"
    bindings = namespace_acls(args.namespace, args.user, role=role, create_topics=not args.no_create)
    admin, bootstrap = _admin(args, args.namespace)
    create_acls(admin, bindings)
    rights = namespace_rights(role, create_topics=not args.no_create)
    print(
        f"kafka grant: user {args.user} may now work in namespace {args.namespace} as a {role} at {bootstrap} "
        f"({describe_rights(args.namespace, rights)})"
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


def indent_details(message: str) -> str:
    # First line says what failed; log tails that follow stay readable but set apart.
    first, _, rest = message.partition("\n")
    return first + "".join(f"\n    {line}" for line in rest.splitlines())
