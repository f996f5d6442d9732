"""librdkafka clients as the Kafka backend's roles use them: shared configuration, the
error helpers that classify what a client raised, and creating and closing clients.

The roles themselves live in :mod:`rollout_journal.journal.kafka.topics` (topic administration),
:mod:`rollout_journal.journal.kafka.writer` (the transactional writer) and :mod:`rollout_journal.journal.kafka.readers`
(the pool of read_committed readers); :mod:`rollout_journal.journal.kafka.backend` composes them.
librdkafka logs go to the ``rollout_journal.journal.kafka.librdkafka`` logger.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from confluent_kafka import KafkaError, KafkaException

from rollout_journal.journal.errors import ConfigurationError
from rollout_journal.journal.kafka.config import KafkaSettings, redact_config

log = logging.getLogger(__name__)
client_log = logging.getLogger("rollout_journal.journal.kafka.librdkafka")


class _DemotedToInfo(logging.Filter):
    """librdkafka lines that carry no news for whoever reads the log at WARNING: each names a
    condition the backend raises once, in one line of its own, or one that librdkafka retries
    and that surfaces as an error only if the retries fail. Demoted to INFO, so a command line
    prints one line, not twenty."""

    def __init__(self, signs: tuple[str, ...]) -> None:
        super().__init__()
        self.signs = signs

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO and any(sign in record.getMessage() for sign in self.signs):
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
            return client_log.isEnabledFor(logging.INFO)
        return True


# A fenced producer ("fenced by a newer instance", "operation with an old epoch"): another process
# took over the slot, raised once as ``ProducerFencedError``. A broker it cannot connect to: retried,
# and where it costs an operation, that operation's error names the cluster (``ClusterUnreachableError``).
client_log.addFilter(
    _DemotedToInfo(
        (
            "fenced by a newer instance",
            "operation with an old epoch",
            "Static consumer fenced",
            # a transaction a rebalance or a timeout ended: the writer aborts or re-creates it and says so
            "Failed to commit offsets to transaction",
            "Failed to add offsets to transaction",
            "Current transaction failed",
            "Connect to ",
            "Connection refused",
            "brokers are down",
            "Disconnected",
        )
    )
)
# A refused login or operation, logged once per retry: raised once as ``AuthenticationFailedError`` or
# ``NotAuthorizedError`` naming the resource (:mod:`rollout_journal.journal.kafka.access`).
client_log.addFilter(
    _DemotedToInfo(
        ("authorization failed", "Authorization failed", "SASL authentication error", "Authentication failed")
    )
)
# What librdkafka says it is retrying ("Coordinator load in progress: retrying" while a broker loads
# its transaction log): it either succeeds, or the operation fails and its error says why.
client_log.addFilter(_DemotedToInfo((": retrying",)))

FENCED_CODES = frozenset({KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH})
# The cluster refused the credentials themselves (rollout_journal.journal.kafka.access turns them into one line).
AUTHENTICATION_CODES = frozenset({KafkaError._AUTHENTICATION, KafkaError.SASL_AUTHENTICATION_FAILED})

# Leadership not settled yet (just after topic creation, or while a leader moves):
# librdkafka does not flag these retriable on offset queries, but they are.
TRANSIENT_METADATA_CODES = frozenset(
    {
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError._TRANSPORT,
        KafkaError._TIMED_OUT,
        KafkaError.REQUEST_TIMED_OUT,
        KafkaError._UNKNOWN_PARTITION,
    }
)


# The client's metadata lacks the partition (or topic). librdkafka refreshes a known topic's metadata
# only every ``topic.metadata.refresh.interval.ms`` (5 min), and neither an offset query nor a produce
# asks for it: after a broker loss a worker's queries failed so for minutes on a whole cluster.
STALE_METADATA_CODES = frozenset(
    {KafkaError._UNKNOWN_PARTITION, KafkaError._UNKNOWN_TOPIC, KafkaError.UNKNOWN_TOPIC_OR_PART}
)


def refresh_if_stale(client: Any, err: KafkaError | None, topic: str, timeout_s: float) -> None:
    """After ``err``, ask the cluster for ``topic``'s metadata now if the client's copy may lack it:
    the answer replaces the cached one. Best effort: a failure leaves the cache as it was, and the
    caller's retry goes on."""
    if err is None or err.code() not in STALE_METADATA_CODES:
        return
    try:
        client.list_topics(topic, timeout=timeout_s)
    except KafkaException:
        pass


def kafka_error(exc: BaseException) -> KafkaError | None:
    """The ``KafkaError`` a ``KafkaException`` carries, if any."""
    if isinstance(exc, KafkaException) and exc.args and isinstance(exc.args[0], KafkaError):
        return exc.args[0]
    return None


def unwrapped(exc: BaseException) -> KafkaException:
    """The KafkaException behind a failed producer call (re-raises anything else).

    confluent-kafka raises a fatal error (a fenced producer) from inside ``flush()``
    or ``poll()`` and may go on serving callbacks, its log callback included, with
    that exception pending; CPython then reports a ``SystemError`` whose cause is
    the ``KafkaException``."""
    if isinstance(exc, KafkaException):
        return exc
    if isinstance(exc.__cause__, KafkaException):
        return exc.__cause__
    raise exc


def describe(err: KafkaError) -> str:
    return f"{err.name()}: {err.str()}"


def transient(err: KafkaError | None) -> bool:
    """Worth retrying: flagged retriable, or a leadership change librdkafka does not flag."""
    return err is not None and (err.retriable() or err.code() in TRANSIENT_METADATA_CODES)


def base_config(settings: KafkaSettings, who: str, role: str) -> dict[str, Any]:
    """What every client of a backend shares; the caller applies ``settings.librdkafka`` last."""
    return {
        "bootstrap.servers": settings.bootstrap_servers,
        "client.id": f"rollout-journal-{settings.namespace}-{who}-{role}",
        "logger": client_log,
    }


class ClientErrors:
    """The ``error_cb`` of readers, admin clients and the worker group: librdkafka logged the
    error already, so it is logged at INFO, and remembered.

    librdkafka reports a refused login here only, while the call that needs the connection
    waits out its whole timeout; remembering it lets
    :func:`rollout_journal.journal.kafka.access.wait_until_authenticated` end at once."""

    def __init__(self, settings: KafkaSettings) -> None:
        self.bootstrap_servers = settings.bootstrap_servers
        self.authentication: KafkaError | None = None
        self.last: KafkaError | None = None

    def __call__(self, err: KafkaError) -> None:
        if err.code() in AUTHENTICATION_CODES:
            self.authentication = err
        self.last = err
        client_log.info("Kafka client (%s): %s", self.bootstrap_servers, describe(err))


def on_client_error(settings: KafkaSettings) -> ClientErrors:
    """An ``error_cb`` for readers and admin clients (see :class:`ClientErrors`)."""
    return ClientErrors(settings)


def admin_config(settings: KafkaSettings, who: str, errors: ClientErrors | None = None) -> dict[str, Any]:
    """An admin client's librdkafka config (passthrough applied); contains secrets, do not log it raw."""
    cfg = base_config(settings, who, "admin")
    cfg["error_cb"] = errors if errors is not None else on_client_error(settings)
    cfg.update(settings.librdkafka)
    return cfg


Client = TypeVar("Client")


def new_client(cls: Callable[[dict[str, Any]], Client], config: dict[str, Any], role: str) -> Client:
    """A librdkafka client; a config it refuses becomes a ConfigurationError (secrets redacted)."""
    try:
        return cls(config)
    except (KafkaException, ValueError, TypeError) as exc:
        raise ConfigurationError(
            f"librdkafka refused the {role} config ({exc}); config: {redact_config(config)}"
        ) from None


CLOSE_BOUND_S = 10.0


def close_client(client: Any, *, discard: bool = False, bound_s: float = CLOSE_BOUND_S) -> None:
    """Close a client, waiting ``bound_s`` at most. A producer's ``close()`` aborts its open
    transaction and flushes, both without a timeout of their own (confluent-kafka 2.16): with the
    transaction coordinator away, or records that cannot be delivered, it would hold the caller (a
    committer re-creating its producer, under its transaction lock) for ever, and a worker went
    silent so. Past the bound the close goes on in the background, and a warning says so.

    ``discard``: the producer's queued records are not wanted (its transaction is being redone by a
    new producer): purged first, so the close has nothing to flush. Warnings the close raises (a
    fenced producer cannot abort) are logged at debug level: the failure was reported already."""
    close = getattr(client, "close", None)  # Producer.close arrived in confluent-kafka 2.x
    if close is None:
        return
    if discard:
        try:
            client.purge(in_queue=True, in_flight=True, blocking=False)
        except (KafkaException, RuntimeError, AttributeError, TypeError) as exc:
            log.debug("purging a Kafka client before closing it: %s", exc)
    closed = threading.Event()

    def run() -> None:
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                close()
            for warning in caught:
                log.debug("closing Kafka client: %s", warning.message)
        except (KafkaException, RuntimeError) as exc:
            log.debug("closing Kafka client: %s", exc)
        finally:
            closed.set()

    threading.Thread(target=run, name=f"close-{type(client).__name__}", daemon=True).start()
    if not closed.wait(bound_s):
        log.warning(
            "closing a Kafka %s took over %.0f s (a broker or its transaction coordinator away?); "
            "it goes on in the background",
            type(client).__name__,
            bound_s,
        )
