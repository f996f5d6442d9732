"""Which worker of a fleet owns which partition: Kafka's consumer group decides.

Every worker on a namespace joins the group ``<namespace>.workers`` subscribed to the
namespace's events topic, so the group's assignment is literally of the partitions it
grants: the worker that is assigned events partition N is the one writer of partition
N (it then opens ``<namespace>.p<N>``, which fences the previous owner). The assigned
partitions are paused the moment they are assigned and never fetched; the group is
only Kafka's membership and assignment machinery, with no offsets committed.

Why the events topic and not a small topic of its own: the assignment then names the
very partitions it grants, with nothing to keep in step (a second topic whose
partition count drifted from the events topic's would hand out ownership of the
wrong partitions), no topic more to create, check or authorize (a worker reads the
events topic anyway), and ``status`` reads ownership straight from the group's member
assignment.

The protocol is the classic one with the ``cooperative-sticky`` assignor and a short
session timeout (``group_session_timeout_ms``, 6 s): a SIGKILLed worker's partitions
move after the session timeout, which the classic protocol lets the client choose.
The KIP-848 ``consumer`` protocol (``group_protocol=consumer``) works too, but its
session timeout is the broker's (``group.consumer.session.timeout.ms``, at least
``group.consumer.min.session.timeout.ms``, both 45 s by default): a crashed worker's
rollouts would wait 45 s. docs/design-notes.md has the measurements.

Callbacks run on the group's own polling thread. ``on_revoked`` must not return
before the worker stopped writing those partitions (the rebalance waits for it, so
a planned move loses nothing); ``on_lost`` says the partitions are already someone
else's (this worker missed its session: a stall, a network partition): drop their
rollouts without writing.
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

from .errors import JournalError, NotAuthorizedError
from .kafka_access import GROUP, TOPIC, refusal
from .kafka_clients import admin_config, base_config, close_client, describe, kafka_error, new_client, on_client_error
from .kafka_config import KafkaSettings

log = logging.getLogger(__name__)

PartitionsCallback = Callable[[list[int]], None]
CLIENT_PREFIX = "rollout-journal-worker-"


def default_member_name() -> str:
    """``<host>-<pid>``: tells a worker apart in ``status`` and in the events it writes."""
    return f"{socket.gethostname()}-{os.getpid()}"


class WorkerGroup:
    """This worker's membership of ``<namespace>.workers``; see the module docstring."""

    def __init__(self, settings: KafkaSettings, name: str, *, on_assigned: PartitionsCallback,
                 on_revoked: PartitionsCallback, on_lost: PartitionsCallback, instance_id: str | None = None,
                 poll_interval_s: float = 0.2) -> None:
        self.settings = settings
        self.name = name
        self.instance_id = instance_id
        self._on_assigned, self._on_revoked, self._on_lost = on_assigned, on_revoked, on_lost
        self._poll_interval_s = poll_interval_s
        self._owned: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._consumer: Consumer | None = None
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None  # a callback raised: the polling thread stopped

    def consumer_config(self) -> dict[str, Any]:
        s = self.settings
        cfg = base_config(s, self.name, "group")
        cfg["client.id"] = CLIENT_PREFIX + self.name
        cfg.update({
            "group.id": s.group_id,
            "group.protocol": s.group_protocol,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "latest",  # nothing is ever fetched: every assigned partition is paused
            "isolation.level": "read_committed",
            "error_cb": on_client_error(s),
        })
        if s.group_protocol == "classic":  # the consumer protocol takes these from the broker's group config
            cfg.update({
                "partition.assignment.strategy": "cooperative-sticky",
                "session.timeout.ms": s.group_session_timeout_ms,
                "heartbeat.interval.ms": max(100, s.group_session_timeout_ms // 6),
            })
        if self.instance_id is not None:
            cfg["group.instance.id"] = self.instance_id
        cfg.update(s.librdkafka)
        return cfg

    @property
    def owned(self) -> set[int]:
        with self._lock:
            return set(self._owned)

    def start(self) -> None:
        """Join the group; assignments arrive through the callbacks from now on."""
        consumer = new_client(Consumer, self.consumer_config(), "group consumer")
        try:
            consumer.subscribe([self.settings.events_topic], on_assign=self._assigned, on_revoke=self._revoked,
                               on_lost=self._lost)
        except KafkaException as exc:
            close_client(consumer)
            raise JournalError(f"cannot join consumer group {self.settings.group_id}: {exc}") from exc
        self._consumer = consumer
        self._thread = threading.Thread(target=self._run, name="worker-group", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Leave the group: the owned partitions are revoked (``on_revoked`` runs) and handed on."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        consumer = self._consumer
        assert consumer is not None
        try:
            while not self._stop.is_set():
                msg = consumer.poll(self._poll_interval_s)  # serves the rebalance callbacks; never returns a record
                err = msg.error() if msg is not None else None
                # the cluster refused this worker the group (or the topic it subscribes to): it would
                # wait for an assignment forever
                denied = refusal(self.settings, err, {GROUP: ("READ", self.settings.group_id),
                                                      TOPIC: ("READ", self.settings.events_topic)})
                if denied is not None:
                    raise denied
        except BaseException as exc:  # a callback failed, or the group refused: the worker sees it and stops
            log.log(logging.INFO if isinstance(exc, NotAuthorizedError) else logging.ERROR,
                    "consumer group %s: %s", self.settings.group_id, exc)
            self.failure = exc
        finally:
            try:
                consumer.close()  # leaves the group (a static member stays until its session times out)
            except (KafkaException, RuntimeError) as exc:
                log.warning("leaving consumer group %s: %s", self.settings.group_id, exc)

    # -- the rebalance callbacks (on the polling thread) -----------------------------------

    def _assigned(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        consumer.incremental_assign(partitions)
        if partitions:
            consumer.pause(partitions)  # ownership only: never fetched
        numbers = sorted(tp.partition for tp in partitions)
        if not numbers:
            return
        with self._lock:
            self._owned.update(numbers)
        log.info("worker %s: assigned partitions %s of %s", self.name, numbers, self.settings.events_topic)
        self._on_assigned(numbers)

    def _revoked(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        numbers = sorted(tp.partition for tp in partitions)
        if numbers:
            log.info("worker %s: partitions %s revoked; letting them go", self.name, numbers)
            self._on_revoked(numbers)  # returns once nothing of them is written any more
            with self._lock:
                self._owned.difference_update(numbers)
        consumer.incremental_unassign(partitions)

    def _lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        numbers = sorted(tp.partition for tp in partitions)
        if numbers:
            log.warning("worker %s: partitions %s lost (this worker missed its group session); dropping their "
                        "rollouts without writing", self.name, numbers)
            with self._lock:
                self._owned.difference_update(numbers)
            self._on_lost(numbers)
        consumer.incremental_unassign(partitions)


@dataclass(frozen=True)
class GroupMember:
    name: str  # the worker's name (its client id without the prefix)
    host: str
    member_id: str
    partitions: tuple[int, ...]
    instance_id: str | None = None


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


def describe_group(settings: KafkaSettings, admin: AdminClient | None = None) -> GroupState:
    """Who owns which partition now, from the group's member assignments (AdminClient)."""
    client = admin or new_client(AdminClient, admin_config(settings, "status"), "admin")
    timeout_s = settings.operation_timeout_ms / 1000
    try:
        future = client.describe_consumer_groups([settings.group_id], request_timeout=timeout_s)[settings.group_id]
        description = future.result()
    except KafkaException as exc:
        err = kafka_error(exc)
        denied = refusal(settings, err, {GROUP: ("DESCRIBE", settings.group_id)})
        if denied is not None:
            raise denied from None
        detail = describe(err) if err is not None else str(exc)
        raise JournalError(f"cannot describe consumer group {settings.group_id} on {settings.bootstrap_servers}: "
                           f"{detail}") from exc
    members = []
    for member in description.members:
        assigned = member.assignment.topic_partitions if member.assignment is not None else []
        partitions = tuple(sorted(tp.partition for tp in assigned if tp.topic == settings.events_topic))
        name = member.client_id.removeprefix(CLIENT_PREFIX)
        members.append(GroupMember(name, member.host, member.member_id, partitions,
                                   getattr(member, "group_instance_id", None)))
    state = getattr(description.state, "name", str(description.state))
    protocol = getattr(getattr(description, "type", None), "name", "") or getattr(description, "protocol_type", "")
    return GroupState(settings.group_id, state, str(protocol), tuple(sorted(members, key=lambda m: m.name)))
