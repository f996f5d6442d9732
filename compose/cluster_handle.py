"""What every handle on brokers this process started shares, however they were started.

The jar launcher (:mod:`rollout_journal.compose.local_broker`), Docker Compose (:mod:`rollout_journal.compose.compose_cluster`)
and testcontainers (:mod:`rollout_journal.compose.broker.container`) each return a handle. :class:`BrokerHandle`
makes any of them a ``with`` block that stops what it started, and stops at interpreter exit
what its caller forgot to; :class:`ClusterHandle` adds the metadata questions a fault drill asks
(:meth:`ClusterHandle.partition_leader`), so one drill runs on either cluster.
:func:`describe_partition` answers them for any cluster, with patience for a topic the answering
broker has not heard of yet.
"""

from __future__ import annotations

import atexit
import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient

from rollout_journal.compose.errors import LocalBrokerError
from rollout_journal.journal.deadlines import Deadline

log = logging.getLogger(__name__)


class _QuietRdkafkaLog(logging.LoggerAdapter[logging.Logger]):
    """librdkafka's connect/refused chatter about brokers we start and kill on purpose is expected: keep it at DEBUG."""

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        self.logger.log(logging.DEBUG, msg, *args, **kwargs)


_RDKAFKA_LOG = _QuietRdkafkaLog(logging.getLogger(f"{__name__}.librdkafka"), {})


def admin_client(bootstrap: str, security: dict[str, str] | None = None) -> AdminClient:
    """An AdminClient whose librdkafka chatter about brokers started and killed on purpose stays at DEBUG;
    ``security`` holds the librdkafka properties that log in (a SASL cluster's super user)."""
    config: dict[str, Any] = {"bootstrap.servers": bootstrap, "logger": _RDKAFKA_LOG, **(security or {})}
    return AdminClient(config)


@dataclass(frozen=True)
class PartitionState:
    """Leader, replicas and in-sync replicas of one partition, as metadata reports them."""

    leader: int | None
    replicas: tuple[int, ...]
    isr: tuple[int, ...]


# How long a metadata question may wait for an answer (a broker that knows the topic). Generous:
# it only bounds a wait that ends as soon as the answer comes, and a 2-core machine running a
# 3-node cluster, a model engine and browsers may take longer than 5 s to hear of a new topic.
DESCRIBE_TIMEOUT_S = 30.0


def describe_partition(
    admin: AdminClient, bootstrap: str, topic: str, partition: int, timeout_s: float = DESCRIBE_TIMEOUT_S
) -> PartitionState:
    """Leader, replicas and ISR of ``topic``/``partition`` as metadata reports them (any cluster).

    The broker that answers may not know a just-created topic yet (each learns of it from the
    controller in its own time), so "unknown topic" is asked again until ``timeout_s`` has passed."""
    deadline = Deadline(timeout_s)
    while True:
        try:
            md = admin.list_topics(topic=topic, timeout=deadline.left(at_least=0.1))
        except KafkaException as exc:  # no answer in time (a busy or restarting cluster): not yet either
            error = str(exc.args[0] if exc.args else exc)
        else:
            admin.poll(0)
            meta = md.topics.get(topic)
            if meta is None:
                error = "not in metadata"
            elif meta.error is None:
                break
            elif meta.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                error = str(meta.error)
            else:
                raise LocalBrokerError(f"topic {topic!r} on {bootstrap}: {meta.error}")
        if deadline.passed():
            raise LocalBrokerError(f"topic {topic!r} on {bootstrap}: {error} after {timeout_s} s")
        time.sleep(0.1)
    part = meta.partitions.get(partition)
    if part is None:
        raise LocalBrokerError(f"topic {topic!r} has no partition {partition}")
    leader = part.leader if part.leader >= 0 else None
    return PartitionState(leader=leader, replicas=tuple(part.replicas), isr=tuple(part.isrs))


# Strong references: brokers whose caller forgot to stop them are still stopped at exit.
_LEFT_RUNNING: set[BrokerHandle] = set()


class BrokerHandle(ABC):
    """Brokers this process started: a ``with`` block calls :meth:`stop` on the way out, and
    after :meth:`stop_at_exit` the interpreter's exit stops them if nobody has by then.

    A subclass provides ``bootstrap_servers`` (a field or a property) and ``stop``.
    """

    if TYPE_CHECKING:  # for the type checker only: a dataclass field of that name would clash with a property

        @property
        def bootstrap_servers(self) -> str: ...

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @abstractmethod
    def stop(self) -> None:
        """Stop the brokers and remove what starting them created. Idempotent; calls :meth:`_forget_at_exit`."""

    def stop_at_exit(self) -> None:
        """Have the interpreter's exit stop these brokers unless :meth:`stop` has: a test run that
        dies on an exception must leave no broker (process, container, volume) behind."""
        _LEFT_RUNNING.add(self)

    def _forget_at_exit(self) -> None:
        """Nothing left for the exit to stop (called by :meth:`stop`)."""
        _LEFT_RUNNING.discard(self)

    def _stop_leftover(self) -> None:
        """How the exit stops them: :meth:`stop`, unless a subclass hurries it."""
        self.stop()


@atexit.register
def _stop_leftovers() -> None:
    for handle in list(_LEFT_RUNNING):
        try:
            handle._stop_leftover()
        except Exception as exc:  # noqa: BLE001 - best effort at interpreter exit: stop the others too
            log.warning("could not stop the %s at %s at exit: %s", type(handle).__name__, handle.bootstrap_servers, exc)


@dataclass(eq=False)
class ClusterHandle(BrokerHandle):
    """A running cluster as a fault drill sees it: an AdminClient and partition metadata.

    A cluster that admits authenticated clients only overrides :attr:`admin_security`; a
    subclass's ``stop`` drops :attr:`admin` by setting ``_admin_client`` to None.
    """

    _admin_client: AdminClient | None = field(default=None, init=False, repr=False)

    @property
    def admin_security(self) -> dict[str, str]:
        """librdkafka properties that log the admin client in (none here; a SASL cluster overrides it)."""
        return {}

    @property
    def admin(self) -> AdminClient:
        """An AdminClient for this cluster, created once and logging through :mod:`logging`."""
        if self._admin_client is None:
            self._admin_client = admin_client(self.bootstrap_servers, self.admin_security)
        return self._admin_client

    def describe_partition(self, topic: str, partition: int, timeout_s: float = DESCRIBE_TIMEOUT_S) -> PartitionState:
        """Leader, replicas and ISR of ``topic``/``partition``; leader is None while none is elected."""
        return describe_partition(self.admin, self.bootstrap_servers, topic, partition, timeout_s)

    def partition_leader(self, topic: str, partition: int, timeout_s: float = DESCRIBE_TIMEOUT_S) -> int | None:
        """Node id leading ``topic``/``partition``, or None while no leader is elected."""
        return self.describe_partition(topic, partition, timeout_s).leader
