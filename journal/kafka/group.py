"""Which process owns which partition of a namespace: Kafka's consumer group decides.

Every process that writes a Kafka namespace (a fleet's ``worker``, ``run`` and ``resume``) joins the
group ``<namespace>.workers`` subscribed to the namespace's events topic, so the group's assignment
is literally of the partitions it grants: the member that is assigned events partition N is the one
writer of partition N. The assigned partitions are paused the moment they are assigned and never
fetched; the group is Kafka's membership and assignment machinery, and its committed offsets are the
commit points: every transaction of a member ends with ``send_offsets_to_transaction`` under the
member's ``consumer_group_metadata()`` (KIP-447), so the coordinator refuses a member whose
generation has passed (a zombie) and the offsets say where the last owner's commits end.

Why the events topic and not a small topic of its own: the assignment then names the
very partitions it grants, with nothing to keep in step (a second topic whose
partition count drifted from the events topic's would hand out ownership of the
wrong partitions), no topic more to create, check or authorize (a worker reads the
events topic anyway), and ``status`` reads ownership straight from the group's member
assignment.

A member's ``client.id`` says who it is: ``rollout-journal-worker-<name>`` for a fleet's worker,
``rollout-journal-worker-<role>:<name>`` for ``run``/``resume`` (``name``: its ``--writer``), so
:func:`describe_group` names who holds a namespace. A member that serves requests (a gateway)
adds the address other members reach it at, ``...<role>:<name>@<address>``: the group's own
description then says both who owns a partition and where to send its requests, as current as
the assignment itself, with nothing to write or clean up when a member dies (Kafka Streams carries
``application.server`` in its member metadata for the same reason; librdkafka lets a client set
no metadata of its own, but its client id travels with the membership). ``run``/``resume`` are static members
(``group.instance.id = <namespace>.<writer>``): a restarted one takes its place at once, and the
one it replaced learns it (``SlotTakenOverError``).

The protocol is the classic one with the ``cooperative-sticky`` assignor and a short
session timeout (``group_session_timeout_ms``, 6 s): a SIGKILLed worker's partitions
move after the session timeout, which the classic protocol lets the client choose.
The KIP-848 ``consumer`` protocol (``group_protocol=consumer``) works too, but its
session timeout is the broker's (``group.consumer.session.timeout.ms``, at least
``group.consumer.min.session.timeout.ms``, both 45 s by default): a crashed worker's
rollouts would wait 45 s. docs/design-notes.md has the measurements.

Callbacks run on the group's own polling thread and must return at once: ``on_revoked``
and ``on_lost`` first stop the partitions' appends (the backend's ``disown``), then hand the
rest (dropping their rollouts) to the worker. ``consumer_group_metadata()`` is read on the
polling thread only (librdkafka's call blocks off it) and handed to the writer from there.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from rollout_journal.journal.errors import (
    ClusterUnreachableError,
    FatalJournalError,
    JournalError,
    NotAuthorizedError,
    SlotTakenOverError,
)
from rollout_journal.journal.kafka.access import GROUP, TOPIC, refusal, wait_until_authenticated
from rollout_journal.journal.kafka.clients import (
    CLOSE_BOUND_S,
    admin_config,
    base_config,
    close_client,
    describe,
    kafka_error,
    new_client,
    on_client_error,
)
from rollout_journal.journal.kafka.config import KafkaSettings
from rollout_journal.journal.kafka.retry import Action, Retry, Role, classify

log = logging.getLogger(__name__)

PartitionsCallback = Callable[[list[int]], None]
CLIENT_PREFIX = "rollout-journal-worker-"
WORKER = "worker"
ROLES = (WORKER, "run", "resume", "gateway")


def client_id(role: str, name: str, address: str | None = None) -> str:
    """A member's ``client.id``: ``rollout-journal-worker-<name>``, ``rollout-journal-worker-<role>:<name>``,
    ``...<role>:<name>@<address>`` for a member that serves requests at ``address``."""
    if role == WORKER:
        return CLIENT_PREFIX + name
    return CLIENT_PREFIX + f"{role}:{name}" + (f"@{address}" if address else "")


def member_identity(client: str) -> tuple[str, str, str | None]:
    """(role, name, address) from a member's ``client.id`` (see :func:`client_id`)."""
    bare = client.removeprefix(CLIENT_PREFIX)
    role, sep, rest = bare.partition(":")
    if not sep or role not in ROLES:
        return WORKER, bare, None
    name, at, address = rest.partition("@")
    return role, name, (address if at else None)


def default_member_name() -> str:
    """``<host>-<pid>``: tells a worker apart in ``status`` and in the events it writes."""
    return f"{socket.gethostname()}-{os.getpid()}"


class WorkerGroup:
    """This worker's membership of ``<namespace>.workers``; see the module docstring."""

    def __init__(
        self,
        settings: KafkaSettings,
        name: str,
        *,
        on_assigned: PartitionsCallback,
        on_revoked: PartitionsCallback,
        on_lost: PartitionsCallback,
        instance_id: str | None = None,
        role: str = WORKER,
        address: str | None = None,
        poll_interval_s: float = 0.2,
        on_unassigned: Callable[[], None] = lambda: None,
    ) -> None:
        """``address``: where other members reach this one (a gateway's URL), carried in its client id.
        ``on_unassigned`` hears of a rebalance that left this member no partition at all (more
        members than partitions, or a joiner's first round of a cooperative rebalance)."""
        self.settings = settings
        self.name = name
        self.role = role
        self.address = address
        self.instance_id = instance_id
        self._on_assigned, self._on_revoked, self._on_lost = on_assigned, on_revoked, on_lost
        self._on_unassigned = on_unassigned
        self._poll_interval_s = poll_interval_s
        self._owned: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._consumer: Consumer | None = None
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None  # a callback raised: the polling thread stopped
        self._metadata: object | None = None  # consumer_group_metadata(), refreshed on the polling thread
        self.generations = 0  # assignments seen (each rebalance that gave this member partitions)

    def consumer_config(self) -> dict[str, Any]:
        s = self.settings
        cfg = base_config(s, self.name, "group")
        cfg["client.id"] = client_id(self.role, self.name, self.address)
        cfg.update(
            {
                "group.id": s.group_id,
                "group.protocol": s.group_protocol,
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "auto.offset.reset": "latest",  # nothing is ever fetched: every assigned partition is paused
                "isolation.level": "read_committed",
                "error_cb": on_client_error(s),
            }
        )
        if s.group_protocol == "classic":  # the consumer protocol takes these from the broker's group config
            cfg.update(
                {
                    "partition.assignment.strategy": "cooperative-sticky",
                    "session.timeout.ms": s.group_session_timeout_ms,
                    "heartbeat.interval.ms": max(100, s.group_session_timeout_ms // 6),
                }
            )
        if self.instance_id is not None:
            cfg["group.instance.id"] = self.instance_id
        cfg.update(s.librdkafka)
        return cfg

    @property
    def owned(self) -> set[int]:
        with self._lock:
            return set(self._owned)

    def metadata(self) -> object | None:
        """The member's ``consumer_group_metadata()`` as of its last poll; None before it joined,
        after its partitions were lost, or once it stopped. Safe from any thread."""
        return self._metadata

    def start(self) -> None:
        """Join the group; assignments arrive through the callbacks from now on."""
        consumer = new_client(Consumer, self.consumer_config(), "group consumer")
        try:
            consumer.subscribe(
                [self.settings.events_topic], on_assign=self._assigned, on_revoke=self._revoked, on_lost=self._lost
            )
        except KafkaException as exc:
            close_client(consumer)
            raise JournalError(f"cannot join consumer group {self.settings.group_id}: {exc}") from exc
        self._consumer = consumer
        self._thread = threading.Thread(target=self._run, name="worker-group", daemon=True)
        self._thread.start()

    def close(self, bound_s: float | None = None) -> None:
        """Leave the group: the owned partitions are revoked (``on_revoked`` runs) and handed on.

        Waits ``bound_s`` at most (default: the group's session timeout plus the client close
        bound). librdkafka's ``Consumer.close()`` has no timeout of its own, and with the group
        coordinator's broker away it can wait for good; a stopping worker must still exit. Past
        the bound the leave goes on in the background, and the group hands the partitions on when
        the member's session times out, as after a crash: fencing keeps that safe."""
        self._stop.set()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return
        if bound_s is None:
            bound_s = self.settings.group_session_timeout_ms / 1000 + CLOSE_BOUND_S
        thread.join(bound_s)
        if thread.is_alive():
            log.warning(
                "worker %s: leaving consumer group %s took over %.0f s; going on without waiting (the group "
                "hands its partitions on when its session times out)",
                self.name,
                self.settings.group_id,
                bound_s,
            )

    def _run(self) -> None:
        consumer = self._consumer
        assert consumer is not None
        try:
            while not self._stop.is_set():
                msg = consumer.poll(self._poll_interval_s)  # serves the rebalance callbacks; never returns a record
                if self._owned:
                    self._metadata = consumer.consumer_group_metadata()  # only here: it blocks off this thread
                err = msg.error() if msg is not None else None
                # the cluster refused this worker the group (or the topic it subscribes to): it would
                # wait for an assignment forever
                denied = refusal(
                    self.settings,
                    err,
                    {GROUP: ("READ", self.settings.group_id), TOPIC: ("READ", self.settings.events_topic)},
                )
                if denied is not None:
                    raise denied
                if err is not None and classify(err, Role.GROUP) is Action.FATAL:
                    raise self._fatal(err)
                if err is not None:
                    log.debug("consumer group %s: %s", self.settings.group_id, describe(err))
        except BaseException as exc:  # a callback failed, or the group refused: the worker sees it and stops
            self._metadata = None
            log.log(
                logging.INFO if isinstance(exc, (NotAuthorizedError, SlotTakenOverError)) else logging.ERROR,
                "consumer group %s: %s",
                self.settings.group_id,
                exc,
            )
            self.failure = exc
        finally:
            self._metadata = None
            try:
                consumer.close()  # leaves the group (a static member stays until its session times out)
            except (KafkaException, RuntimeError) as exc:  # after a fatal error (reported above), expected
                log.log(
                    logging.INFO if self.failure is not None else logging.WARNING,
                    "leaving consumer group %s: %s",
                    self.settings.group_id,
                    exc,
                )

    def _fatal(self, err: object) -> JournalError:
        text = describe(err) if hasattr(err, "name") else str(err)  # type: ignore[arg-type]
        if self.instance_id is not None and "group.instance.id" in text:
            return SlotTakenOverError(self.instance_id, self.settings.namespace, text)
        return FatalJournalError(f"consumer group {self.settings.group_id}: member {self.name} failed: {text}")

    # -- the rebalance callbacks (on the polling thread) -----------------------------------

    def _assigned(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        consumer.incremental_assign(partitions)
        if partitions:
            consumer.pause(partitions)  # ownership only: never fetched
        numbers = sorted(tp.partition for tp in partitions)
        if not numbers:
            if not self.owned:
                self._on_unassigned()
            return
        with self._lock:
            self._owned.update(numbers)
        self._metadata = consumer.consumer_group_metadata()  # the new generation's, before any take writes
        self.generations += 1
        log.info("worker %s: assigned partitions %s of %s", self.name, numbers, self.settings.events_topic)
        self._on_assigned(numbers)

    def _revoked(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        numbers = sorted(tp.partition for tp in partitions)
        if numbers:
            log.info("worker %s: partitions %s revoked; letting them go", self.name, numbers)
            with self._lock:
                self._owned.difference_update(numbers)
            self._on_revoked(numbers)  # returns at once: their appends are refused from now on
        consumer.incremental_unassign(partitions)

    def _lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        numbers = sorted(tp.partition for tp in partitions)
        if numbers:
            log.warning(
                "worker %s: partitions %s lost (this worker missed its group session); dropping their "
                "rollouts without writing",
                self.name,
                numbers,
            )
            with self._lock:
                self._owned.difference_update(numbers)
            self._metadata = None  # this generation is over: nothing more commits under it
            self._on_lost(numbers)
        consumer.incremental_unassign(partitions)


@dataclass(frozen=True)
class GroupMember:
    name: str  # the worker's name (its client id without the prefix); run/resume: their --writer
    host: str
    member_id: str
    partitions: tuple[int, ...]
    instance_id: str | None = None
    role: str = WORKER  # worker, run, resume, gateway (see client_id)
    address: str | None = None  # where it serves requests (a gateway's URL), if it does

    def __str__(self) -> str:
        who = self.name if self.role == WORKER else f"{self.role} --writer {self.name}"
        if self.address:
            who += f" at {self.address}"
        return f"{who} (host {self.host.lstrip('/')})"


@dataclass(frozen=True)
class GroupState:
    """The worker group as the broker's group coordinator describes it."""

    group_id: str
    state: str  # Stable, PreparingRebalance, Empty, Dead, ...
    protocol: str
    members: tuple[GroupMember, ...] = field(default_factory=tuple)

    def owners(self) -> dict[int, str]:
        """Partition -> the name of the worker it is assigned to."""
        return {p: member.name for member in self.members for p in member.partitions}

    def assignment(self) -> dict[int, GroupMember]:
        """Partition -> the member it is assigned to."""
        return {p: member for member in self.members for p in member.partitions}


def describe_group(
    settings: KafkaSettings, admin: AdminClient | None = None, *, budget_s: float | None = None
) -> GroupState:
    """Who owns which partition now, from the group's member assignments (AdminClient). Transient
    errors (a broker or the group coordinator away) are retried under the retry policy, for
    ``budget_s`` (default ``cluster_unavailable_timeout_ms``; a command's first contact: less)."""
    timeout_s = settings.operation_timeout_ms / 1000
    budget_s = settings.cluster_unavailable_timeout_ms / 1000 if budget_s is None else budget_s
    client = admin
    if client is None:  # a command's own first contact: refused credentials end it at once, not a timeout
        errors = on_client_error(settings)
        client = new_client(AdminClient, admin_config(settings, "status", errors), "admin")
        wait_until_authenticated(client, settings, errors, max(timeout_s, budget_s))
    retry = Retry(budget_s, f"describing group {settings.group_id}")
    while True:
        try:
            future = client.describe_consumer_groups(
                [settings.group_id], request_timeout=min(timeout_s, max(1.0, retry.left_s()))
            )[settings.group_id]
            description = future.result()
            break
        except KafkaException as exc:
            err = kafka_error(exc)
            denied = refusal(settings, err, {GROUP: ("DESCRIBE", settings.group_id)})
            if denied is not None:
                raise denied from None
            if classify(err, Role.ADMIN) is Action.RETRY and retry.wait(err):
                continue
            detail = describe(err) if err is not None else str(exc)
            cls = ClusterUnreachableError if classify(err, Role.ADMIN) is Action.RETRY else JournalError
            raise cls(
                f"cannot describe consumer group {settings.group_id} on {settings.bootstrap_servers}: {detail}"
            ) from exc
    members = []
    for member in description.members:
        assigned = member.assignment.topic_partitions if member.assignment is not None else []
        partitions = tuple(sorted(tp.partition for tp in assigned if tp.topic == settings.events_topic))
        role, name, address = member_identity(member.client_id)
        instance = getattr(member, "group_instance_id", None)
        members.append(GroupMember(name, member.host, member.member_id, partitions, instance, role, address))
    state = getattr(description.state, "name", str(description.state))
    protocol = getattr(getattr(description, "type", None), "name", "") or getattr(description, "protocol_type", "")
    return GroupState(settings.group_id, state, str(protocol), tuple(sorted(members, key=lambda m: m.name)))


class GroupDescriber:
    """:func:`describe_group` again and again over one admin client (a gateway's view of who owns
    which partition, refreshed as requests for other members' partitions arrive)."""

    def __init__(self, settings: KafkaSettings) -> None:
        self.settings = settings
        errors = on_client_error(settings)
        self._admin = new_client(AdminClient, admin_config(settings, "group-view", errors), "admin")

    def describe(self) -> GroupState:
        return describe_group(self.settings, self._admin, budget_s=self.settings.operation_timeout_ms / 1000)

    def close(self) -> None:
        close_client(self._admin)
