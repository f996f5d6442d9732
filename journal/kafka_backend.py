"""The journal on Apache Kafka: one transaction per commit, read_committed reads.

Layout: ``<namespace>.events`` (``cleanup.policy=delete``, long retention: the
audit trail) and ``<namespace>.snapshots`` (``cleanup.policy=compact``: the
latest snapshot per rollout survives, a ``None`` value is a tombstone). Both have
``settings.partitions`` partitions and every record goes to the explicit
partition :func:`journal.backend.partition_for` picks from its partition key, so
restore finds a rollout's events without scanning history. Topics are created
by the backend itself, never by broker auto-creation.

Writing: a backend built with ``transactional=True`` (the default) holds one
transactional, idempotent, ``acks=all`` producer whose ``transactional.id`` is
``<namespace>.<slot>`` (the worker's slot name, qualified by the namespace so
that a job in another namespace on the same cluster never fences this one); :meth:`KafkaBackend.commit` is one Kafka transaction, so a
batch is wholly visible to read_committed readers or not at all. Constructing a
backend calls ``init_transactions``, which fences any older producer with the
same id (a zombie worker) and completes or aborts its open transaction.

Errors are classified the librdkafka way:

- retriable (``err.retriable()``): the same call is retried with backoff until
  the transaction timeout; it never surfaces;
- abortable (``err.txn_requires_abort()``, or a failed delivery report inside the
  transaction): the transaction is aborted and ``AbortableCommitError`` raised;
  nothing of the batch is visible and the caller may redo it;
- fenced (``_FENCED``, ``PRODUCER_FENCED``, ``INVALID_PRODUCER_EPOCH``):
  ``ProducerFencedError``, wherever the zombie learns it (usually the produce and
  flush of its next batch). The delivery callback only stores its report (calling
  into the message while confluent-kafka holds the pending fatal error would turn
  it into a ``SystemError``); a fenced backend's later commits raise
  ``ProducerFencedError`` too, and closing it never tries to abort;
- fatal or anything else: ``FatalJournalError``. After either of these the backend
  refuses every further commit.

The ambiguous case: ``commit_transaction`` failing with a retriable error (a
timeout, a coordinator moving) is retried, as librdkafka allows, and the retry
reports the real outcome. Only a fatal error during the commit leaves the
outcome unknown; the next producer with the same ``transactional.id`` resolves
it in ``init_transactions`` (the coordinator completes a transaction whose
commit it had accepted and aborts any other), after which reads show which.

``transactional=False`` opens the backend for reading without touching the
worker's transactional id (opening a transactional producer would fence the
running worker). ``commit`` then uses a plain idempotent ``acks=all`` producer:
every record is durable once ``commit`` returns, but a crash mid-batch can leave
a prefix of it, so it is for tools and benchmarks, never for rollout workers.

Reads see every commit this backend has returned from (read-your-writes):
``commit_transaction`` returns before the broker writes the commit markers, so a
read waits (milliseconds) until the last stable offset covers them. Another
writer's commit becomes visible once its markers are written.

Reading uses ``isolation.level=read_committed`` consumers that are assigned (not
subscribed) to partitions and never commit offsets; offsets are not contiguous
(transaction markers, aborted records). Consumers are pooled per backend: a read
borrows one, assigns it, and returns it unassigned, so concurrent or interleaved
reads each get their own. librdkafka logs go to the ``journal.kafka.librdkafka``
logger.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from .backend import Backend, OutRecord, StoredRecord, Stream, partition_for
from .errors import (
    AbortableCommitError,
    ConfigurationError,
    FatalJournalError,
    JournalClosedError,
    JournalError,
    ProducerFencedError,
    RecordLocation,
)
from .kafka_config import KafkaSettings, redact_config
from .kafka_topics import TopicState, prepare_topics, topic_configs

log = logging.getLogger(__name__)
client_log = logging.getLogger("journal.kafka.librdkafka")


class _FencingIsATakeover(logging.Filter):
    """librdkafka logs a fenced producer at ERROR and CRITICAL ("fenced by a newer instance",
    "operation with an old epoch"). Here that is another process taking over the slot, raised
    once as ``ProducerFencedError``; its log lines are demoted to INFO."""

    _SIGNS = ("fenced by a newer instance", "operation with an old epoch")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO and any(sign in record.getMessage() for sign in self._SIGNS):
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
            return client_log.isEnabledFor(logging.INFO)
        return True


client_log.addFilter(_FencingIsATakeover())

FENCED_CODES = frozenset({KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH})
_CLIENT_MESSAGE_MAX_BYTES = 1_000_000  # librdkafka's default message.max.bytes
_RECORD_FRAMING_BYTES = 8192
INIT_TRANSACTIONS_TIMEOUT_S = 60.0  # the first init on a cluster creates __transaction_state
_BACKOFF_FIRST_S = 0.05
_BACKOFF_MAX_S = 2.0
# Bounded prefetch of a reader (librdkafka's default is 64 MiB). With librdkafka's default
# fetch.queue.backoff.ms (1 s) a full prefetch queue stalls fetching for a second: measured
# 12 MB/s reading one partition; 10 ms gives ~500-800 MB/s on the dev broker.
_READ_PREFETCH_KBYTES = 16384
_READ_QUEUE_BACKOFF_MS = 10


# Leadership not settled yet (just after topic creation, or while a leader moves):
# librdkafka does not flag these retriable on offset queries, but they are.
_TRANSIENT_METADATA_CODES = frozenset({
    KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE, KafkaError.UNKNOWN_TOPIC_OR_PART,
    KafkaError._TRANSPORT, KafkaError._TIMED_OUT, KafkaError.REQUEST_TIMED_OUT, KafkaError._UNKNOWN_PARTITION,
})


def _kafka_error(exc: BaseException) -> KafkaError | None:
    if isinstance(exc, KafkaException) and exc.args and isinstance(exc.args[0], KafkaError):
        return exc.args[0]
    return None


def _unwrapped(exc: BaseException) -> KafkaException:
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


def _describe(err: KafkaError) -> str:
    return f"{err.name()}: {err.str()}"


class StagedCommit:
    """A transaction whose records are produced and delivered but not yet committed.

    Returned by :meth:`KafkaBackend.stage`; ``commit()`` or ``abort()`` it exactly
    once. Until then the backend's other commits wait. :meth:`KafkaBackend.commit`
    is ``stage(records).commit()``; staging separately lets tests and tools act
    between produce and commit (a zombie writer that gets fenced, an abort).
    """

    def __init__(self, backend: "KafkaBackend", producer: Producer, locations: list[RecordLocation]) -> None:
        self._backend = backend
        self._producer = producer
        self.locations = locations
        self._done = False

    def commit(self) -> list[RecordLocation]:
        """Commit the transaction; the records' locations, in order. Raises like ``Backend.commit``."""
        self._finish()
        try:
            self._backend._commit_transaction(self._producer)
            self._backend._note_committed(self.locations)
        finally:
            self._backend._txn_lock.release()
        return self.locations

    def abort(self) -> None:
        """Abort the transaction: none of its records will ever be visible to read_committed readers."""
        self._finish()
        try:
            self._backend._abort_transaction(self._producer, reason="aborted by the caller")
        finally:
            self._backend._txn_lock.release()

    def _finish(self) -> None:
        if self._done:
            raise JournalError("this staged commit was already committed or aborted")
        self._done = True


class _Deliveries:
    """Delivery reports of one batch, in record order."""

    __slots__ = ("reports",)

    def __init__(self, n: int) -> None:
        self.reports: list[tuple[KafkaError | None, Any] | None] = [None] * n

    def callback(self, index: int) -> Callable[[KafkaError | None, Any], None]:
        reports = self.reports

        def on_delivery(err: KafkaError | None, msg: Any) -> None:
            # Runs inside produce()/flush(), possibly while confluent-kafka holds a pending fatal
            # error (a fenced producer): any call made here, msg.topic() or list.append, would turn
            # it into a SystemError. So only store; the message is read once flush() has returned.
            reports[index] = (err, msg)

        return on_delivery

    def errors(self) -> list[tuple[int, KafkaError]]:
        return [(i, r[0]) for i, r in enumerate(self.reports) if r is not None and r[0] is not None]

    def locations(self) -> list[RecordLocation]:
        """Where each record landed; call only when every report arrived without error."""
        return [RecordLocation(msg.topic(), msg.partition(), msg.offset()) for _, msg in self.reports]  # type: ignore[misc]


class KafkaBackend(Backend):
    """Journal storage on Kafka; see the module docstring for the guarantees."""

    kind = "kafka"

    def __init__(self, settings: KafkaSettings, *, create_topics: bool = True, transactional: bool = True) -> None:
        self.settings = settings
        self.partitions = settings.partitions
        self.transactional = transactional
        self.events_topic = settings.events_topic
        self.snapshots_topic = settings.snapshots_topic
        self._topics = {Stream.EVENTS: self.events_topic, Stream.SNAPSHOTS: self.snapshots_topic}
        self._txn_lock = threading.Lock()  # one transaction at a time; held from stage() to commit/abort
        self._pool_lock = threading.Lock()
        self._idle_consumers: list[Consumer] = []
        self._all_consumers: list[Consumer] = []
        self._producer: Producer | None = None
        self._failed: JournalError | None = None
        self._closed = False
        # Read-your-writes: commit_transaction returns before the broker has written the commit
        # markers, so the last stable offset lags a few ms; reads wait until it covers our commits.
        self._committed_end: dict[tuple[str, int], int] = {}
        self.topics: dict[str, TopicState] = {}  # what the open found: replicas, effective configs
        self._topic_max_bytes: int | None = None
        self._reader_group = f"rollout-journal-reader-{settings.namespace}-{uuid.uuid4().hex[:8]}"
        if transactional and settings.transactional_id is None:
            raise ConfigurationError(
                "KafkaSettings.transactional_id is required to commit (the worker's slot name, e.g. "
                "ROLLOUT_JOURNAL_KAFKA_TRANSACTIONAL_ID=worker-0); open with transactional=False to only read"
            )
        try:
            self._prepare_topics(create_topics)
            if transactional:
                self._producer = self._new_transactional_producer()
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        return f"KafkaBackend({self.settings!r}, transactional={self.transactional})"

    @property
    def transactional_id(self) -> str | None:
        """The producer's ``transactional.id``: ``<namespace>.<slot>`` (see ``KafkaSettings.producer_transactional_id``)."""
        return self.settings.producer_transactional_id if self.transactional else None

    # -- client configuration --------------------------------------------------------------

    def _base_config(self, role: str) -> dict[str, Any]:
        who = self.settings.transactional_id or "reader"
        return {
            "bootstrap.servers": self.settings.bootstrap_servers,
            "client.id": f"rollout-journal-{self.settings.namespace}-{who}-{role}",
            "logger": client_log,
        }

    def producer_config(self) -> dict[str, Any]:
        """The producer's librdkafka config (passthrough applied); contains secrets, do not log it raw."""
        s = self.settings
        cfg = self._base_config("producer")
        cfg.update({
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": s.linger_ms,
            # A topic's max.message.bytes bounds a whole record batch, not a record: batches stay below it.
            "batch.size": s.batch_size if self._topic_max_bytes is None
            else min(s.batch_size, self._topic_max_bytes - _RECORD_FRAMING_BYTES),
            "compression.type": s.compression_type,
            "error_cb": self._on_producer_error,
        })
        if self.transactional:
            cfg["transactional.id"] = s.producer_transactional_id
            cfg["transaction.timeout.ms"] = s.transaction_timeout_ms
        cfg.update(s.librdkafka)
        return cfg

    def consumer_config(self) -> dict[str, Any]:
        """A reader consumer's librdkafka config (passthrough applied)."""
        cfg = self._base_config("reader")
        cfg.update({
            # librdkafka requires a group id; readers are assigned, never join it, never commit.
            "group.id": self._reader_group,
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "enable.partition.eof": True,
            "auto.offset.reset": "error",  # a deleted offset is an error, never a silent skip
            # A read ends at EOF, found by a fetch that waits up to this long at the tail; requests on a
            # connection are served in order, so the next offset query waits behind it too. 500 ms
            # (default) -> 10 ms -> 1 ms: a 50-record read takes ~1 s -> ~22 ms -> ~4 ms on the dev broker.
            "fetch.wait.max.ms": 1,
            "queued.max.messages.kbytes": _READ_PREFETCH_KBYTES,
            "fetch.queue.backoff.ms": _READ_QUEUE_BACKOFF_MS,
            "error_cb": self._on_client_error,
        })
        cfg.update(self.settings.librdkafka)
        return cfg

    def admin_config(self) -> dict[str, Any]:
        cfg = self._base_config("admin")
        cfg["error_cb"] = self._on_client_error
        cfg.update(self.settings.librdkafka)
        return cfg

    def _on_producer_error(self, err: KafkaError) -> None:
        if err.fatal():
            client_log.error("producer %s fatal error: %s", self.transactional_id, _describe(err))
        else:
            client_log.info("producer %s: %s", self.transactional_id, _describe(err))  # librdkafka logged it too

    def _on_client_error(self, err: KafkaError) -> None:
        client_log.info("Kafka client (%s): %s", self.settings.bootstrap_servers, _describe(err))

    # -- topics ---------------------------------------------------------------------------

    def topic_configs(self) -> dict[str, dict[str, str]]:
        """The configs the backend creates its two topics with (see :mod:`journal.kafka_topics`)."""
        return topic_configs(self.settings)

    def _prepare_topics(self, create: bool) -> None:
        admin = _new_client(AdminClient, self.admin_config(), "admin")
        try:
            self.topics = prepare_topics(admin, self.settings, create=create)
        finally:
            admin.poll(0)  # deliver queued client logs
        # The journal chunks anything larger: the topics' max.message.bytes and the client's own limit,
        # less room for the key, the record and batch framing, and compression's worst case.
        topic_limits = [state.max_message_bytes for state in self.topics.values() if state.max_message_bytes]
        self._topic_max_bytes = min(topic_limits, default=None)
        client_limit = int(self.settings.librdkafka.get("message.max.bytes", _CLIENT_MESSAGE_MAX_BYTES))
        self.max_record_bytes = min(*topic_limits, client_limit) - _RECORD_FRAMING_BYTES

    # -- producing ------------------------------------------------------------------------

    def _new_transactional_producer(self) -> Producer:
        producer = _new_client(Producer, self.producer_config(), "producer")
        deadline = time.monotonic() + max(INIT_TRANSACTIONS_TIMEOUT_S, self.settings.operation_timeout_ms / 1000)
        backoff = _BACKOFF_FIRST_S
        while True:
            try:
                producer.init_transactions(max(1.0, deadline - time.monotonic()))
                return producer
            except (KafkaException, SystemError) as raised:
                exc = _unwrapped(raised)
                err = _kafka_error(exc)
                where = f"init_transactions of transactional id {self.transactional_id} on {self.settings.bootstrap_servers}"
                if err is not None and err.retriable() and not err.fatal() and time.monotonic() < deadline:
                    log.warning("%s: %s; retrying", where, _describe(err))
                    time.sleep(backoff)
                    backoff = min(backoff * 2, _BACKOFF_MAX_S)
                    continue
                _close_client(producer)
                if err is not None and err.code() == KafkaError.INVALID_TRANSACTION_TIMEOUT:
                    raise ConfigurationError(
                        f"{where}: transaction_timeout_ms={self.settings.transaction_timeout_ms} exceeds the "
                        "broker's transaction.max.timeout.ms; lower the setting"
                    ) from exc
                if err is not None and err.code() == KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED:
                    raise ConfigurationError(
                        f"{where}: not authorized to use this transactional id (grant WRITE/DESCRIBE on it)"
                    ) from exc
                if err is not None and err.code() in FENCED_CODES:
                    raise ProducerFencedError(f"{where}: fenced: {_describe(err)}") from exc
                detail = _describe(err) if err is not None else repr(exc)
                raise FatalJournalError(f"{where} failed: {detail}") from exc

    def _writable_producer(self) -> Producer:
        self._check_writable()
        if self._producer is None:  # non-transactional: created on first use
            self._producer = _new_client(Producer, self.producer_config(), "producer")
        return self._producer

    def _check_writable(self) -> None:
        if self._closed:
            raise JournalClosedError(f"Kafka backend for {self.events_topic} is closed")
        if self._failed is not None:
            fenced = isinstance(self._failed, ProducerFencedError)  # stays "fenced" for every later caller
            raise (ProducerFencedError if fenced else FatalJournalError)(
                f"commit refused: the producer of transactional id {self.transactional_id} failed earlier "
                f"({self._failed}); open a new backend (its producer fences this one)"
            ) from self._failed

    def commit(self, records: Sequence[OutRecord]) -> list[RecordLocation]:
        """Write ``records`` in one Kafka transaction; their locations, in order.

        Raises ``AbortableCommitError`` (aborted, nothing visible, redo the batch),
        ``ProducerFencedError`` (a newer producer owns this slot) or
        ``FatalJournalError`` (stop; the backend refuses further commits).
        """
        if not records:
            self._check_writable()
            return []
        for record in records:
            if record.value is None and record.stream is Stream.EVENTS:  # as the file backend: readers would choke
                raise ValueError(f"event record {record.key!r} has no value; only snapshots take tombstones")
        if not self.transactional:
            return self._commit_plain(records)
        return self.stage(records).commit()

    def stage(self, records: Sequence[OutRecord]) -> StagedCommit:
        """Begin a transaction and produce ``records`` with every delivery confirmed, without committing.

        The caller must ``commit()`` or ``abort()`` the result; other commits on this
        backend wait until then. Raises like :meth:`commit` when producing fails.
        """
        if not self.transactional:
            raise ConfigurationError("stage() needs a transactional backend (transactional=True)")
        self._txn_lock.acquire()
        try:
            producer = self._writable_producer()
            deadline = time.monotonic() + self.settings.transaction_timeout_ms / 1000
            self._retrying(producer, "begin_transaction", producer.begin_transaction, deadline, in_txn=False)
            locations = self._produce_all(producer, records, deadline, in_txn=True)
        except BaseException:
            self._txn_lock.release()
            raise
        return StagedCommit(self, producer, locations)

    def _produce_all(
        self, producer: Producer, records: Sequence[OutRecord], deadline: float, *, in_txn: bool
    ) -> list[RecordLocation]:
        deliveries = _Deliveries(len(records))
        n = self.partitions
        topics = self._topics
        for index, record in enumerate(records):
            topic = topics[record.stream]
            partition = partition_for(record.partition_key, n)
            on_delivery = deliveries.callback(index)
            while True:
                try:
                    producer.produce(
                        topic, value=record.value, key=record.key.encode("utf-8"),
                        partition=partition, on_delivery=on_delivery,
                    )
                    break
                except BufferError:  # local queue full: serve delivery reports, then retry
                    self._serving_reports(producer, lambda: producer.poll(0.05), in_txn)
                except (KafkaException, SystemError) as raised:
                    exc = _unwrapped(raised)
                    err = _kafka_error(exc)
                    if err is not None and err.retriable() and not err.fatal() and time.monotonic() < deadline:
                        self._serving_reports(producer, lambda: producer.poll(_BACKOFF_FIRST_S), in_txn)
                        continue
                    self._raise_classified(producer, exc, f"producing to topic {topic} partition {partition}", in_txn)
        while True:
            remaining = self._serving_reports(
                producer, lambda: producer.flush(max(0.0, min(1.0, deadline - time.monotonic()))), in_txn)
            if remaining == 0:
                break
            if time.monotonic() >= deadline:
                what = f"{remaining} of {len(records)} records undelivered within the transaction timeout"
                if in_txn:
                    self._abort_transaction(producer, reason=what)
                    raise AbortableCommitError(f"transactional id {self.transactional_id}: {what}; batch aborted")
                self._fail(FatalJournalError(f"{what} (non-transactional producer)"))
        failed = deliveries.errors()
        if failed:
            index, err = failed[0]
            topic, partition = topics[records[index].stream], partition_for(records[index].partition_key, n)
            where = (
                f"delivery of record {index} (key {records[index].key!r}) to topic {topic} partition {partition} "
                f"failed: {_describe(err)}" + (f" (and {len(failed) - 1} more)" if len(failed) > 1 else "")
            )
            if not in_txn:
                self._fail(FatalJournalError(f"{where}; a prefix of the batch may be written (non-transactional)"))
            if err.code() in FENCED_CODES:
                self._fail(ProducerFencedError(self._fenced_message(where, err)))
            if err.fatal():
                self._fail(FatalJournalError(f"transactional id {self.transactional_id}: {where}"))
            self._abort_transaction(producer, reason=where)
            raise AbortableCommitError(f"transactional id {self.transactional_id}: {where}; batch aborted, redo it")
        return deliveries.locations()

    def _serving_reports(self, producer: Producer, call: Callable[[], Any], in_txn: bool) -> Any:
        """``poll``/``flush``: a fatal error they raise (fenced) is classified, never passed on raw."""
        try:
            return call()
        except (KafkaException, SystemError) as raised:
            exc = _unwrapped(raised)
            err = _kafka_error(exc)
            if err is not None and err.code() == KafkaError._TIMED_OUT and not err.fatal():
                return len(producer)  # nothing delivered in time yet: the caller's deadline decides
            self._raise_classified(producer, exc, "flush", in_txn)

    def _note_committed(self, locations: Sequence[RecordLocation]) -> None:
        ends = self._committed_end
        for loc in locations:
            key = (loc.source, loc.partition)
            if ends.get(key, -1) <= loc.offset:
                ends[key] = loc.offset + 1

    def _commit_plain(self, records: Sequence[OutRecord]) -> list[RecordLocation]:
        with self._txn_lock:
            producer = self._writable_producer()
            deadline = time.monotonic() + self.settings.transaction_timeout_ms / 1000
            locations = self._produce_all(producer, records, deadline, in_txn=False)
            self._note_committed(locations)
            return locations

    def _commit_transaction(self, producer: Producer) -> None:
        deadline = time.monotonic() + self.settings.transaction_timeout_ms / 1000
        self._retrying(producer, "commit_transaction", producer.commit_transaction, deadline, in_txn=True, timed=True)

    def _abort_transaction(self, producer: Producer, *, reason: str) -> None:
        """Abort the open transaction; raises only when the abort itself fails (fatally)."""
        log.warning("transactional id %s: aborting transaction: %s", self.transactional_id, reason)
        deadline = time.monotonic() + self.settings.operation_timeout_ms / 1000
        backoff = _BACKOFF_FIRST_S
        while True:
            try:
                producer.abort_transaction(max(1.0, deadline - time.monotonic()))
                return
            except (KafkaException, SystemError) as raised:
                exc = _unwrapped(raised)
                err = _kafka_error(exc)
                if err is not None and err.retriable() and not err.fatal() and time.monotonic() < deadline:
                    time.sleep(backoff)
                    backoff = min(backoff * 2, _BACKOFF_MAX_S)
                    continue
                where = f"abort_transaction (after: {reason})"
                if err is not None and err.code() in FENCED_CODES:
                    self._fail(ProducerFencedError(self._fenced_message(where, err)), exc)
                detail = _describe(err) if err is not None else repr(exc)
                self._fail(FatalJournalError(f"transactional id {self.transactional_id}: {where} failed: {detail}"), exc)

    def _retrying(
        self, producer: Producer, what: str, call: Callable[..., None], deadline: float,
        *, in_txn: bool, timed: bool = False,
    ) -> None:
        backoff = _BACKOFF_FIRST_S
        while True:
            try:
                if timed:
                    call(max(1.0, deadline - time.monotonic()))
                else:
                    call()
                return
            except (KafkaException, SystemError) as raised:
                exc = _unwrapped(raised)
                err = _kafka_error(exc)
                if (
                    err is not None and err.retriable() and not err.fatal() and not err.txn_requires_abort()
                    and time.monotonic() < deadline
                ):
                    log.warning("transactional id %s: %s: %s; retrying", self.transactional_id, what, _describe(err))
                    time.sleep(backoff)
                    backoff = min(backoff * 2, _BACKOFF_MAX_S)
                    continue
                if err is not None and err.retriable() and what == "commit_transaction":
                    self._fail(FatalJournalError(
                        f"transactional id {self.transactional_id}: commit_transaction still failing after the "
                        f"transaction timeout ({_describe(err)}); the outcome is unknown until the next producer "
                        "with this transactional id runs init_transactions"
                    ), exc)
                self._raise_classified(producer, exc, what, in_txn)

    def _raise_classified(self, producer: Producer, exc: KafkaException, what: str, in_txn: bool) -> None:
        err = _kafka_error(exc)
        tid = self.transactional_id
        if err is None:
            self._fail(FatalJournalError(f"transactional id {tid}: {what} failed: {exc!r}"), exc)
        if err.code() in FENCED_CODES:
            self._fail(ProducerFencedError(self._fenced_message(what, err)), exc)
        if err.fatal():
            self._fail(FatalJournalError(f"transactional id {tid}: {what}: fatal {_describe(err)}"), exc)
        if in_txn and err.txn_requires_abort():
            self._abort_transaction(producer, reason=f"{what}: {_describe(err)}")
            raise AbortableCommitError(
                f"transactional id {tid}: {what} failed ({_describe(err)}); transaction aborted, redo the batch"
            ) from exc
        # Unknown: neither retriable in time nor abortable. Abort what we can, then stop this writer.
        if in_txn:
            try:
                self._abort_transaction(producer, reason=f"{what}: {_describe(err)}")
            except JournalError:
                pass  # the fatal error below is the one that matters; the abort failure was logged
        self._fail(FatalJournalError(f"transactional id {tid}: {what} failed: {_describe(err)}"), exc)

    def _fenced_message(self, what: str, err: KafkaError) -> str:
        return (
            f"transactional id {self.transactional_id} was fenced by a newer producer with the same id "
            f"(another process took over this worker slot) during {what}: {_describe(err)}"
        )

    def _fail(self, error: JournalError, cause: BaseException | None = None) -> None:
        """Mark the backend failed (no more commits) and raise ``error``."""
        self._failed = error
        # Being fenced is a takeover, not a fault of this process: the caller reports it once.
        log.log(logging.INFO if isinstance(error, ProducerFencedError) else logging.ERROR, "%s", error)
        if cause is not None:
            raise error from cause
        raise error

    # -- reading --------------------------------------------------------------------------

    def _check_partition(self, partition: int) -> None:
        if not 0 <= partition < self.partitions:
            raise ValueError(f"partition {partition} out of range: {self.events_topic} has {self.partitions} partitions")

    def _acquire_consumer(self) -> Consumer:
        with self._pool_lock:
            if self._closed:
                raise JournalClosedError(f"Kafka backend for {self.events_topic} is closed")
            if self._idle_consumers:
                return self._idle_consumers.pop()
        consumer = _new_client(Consumer, self.consumer_config(), "consumer")
        with self._pool_lock:
            self._all_consumers.append(consumer)
            if self._closed:
                self._all_consumers.remove(consumer)
                _close_client(consumer)
                raise JournalClosedError(f"Kafka backend for {self.events_topic} is closed")
        return consumer

    def _release_consumer(self, consumer: Consumer, *, healthy: bool = True) -> None:
        if healthy:
            try:
                consumer.unassign()
            except (KafkaException, RuntimeError):
                healthy = False
        with self._pool_lock:
            if healthy and not self._closed:
                self._idle_consumers.append(consumer)
                return
            if consumer in self._all_consumers:
                self._all_consumers.remove(consumer)
        _close_client(consumer)

    def _watermarks(self, consumer: Consumer, topic: str, partition: int) -> tuple[int, int]:
        """(log start, last stable offset): read_committed consumers report the LSO as the high mark.

        Retriable errors (a leader not elected yet just after topic creation, a leader
        moving) are retried until the operation timeout."""
        deadline = time.monotonic() + self.settings.operation_timeout_ms / 1000
        delay = 0.01
        while True:
            try:
                marks = consumer.get_watermark_offsets(
                    TopicPartition(topic, partition), timeout=self.settings.operation_timeout_ms / 1000, cached=False
                )
                break
            except KafkaException as exc:
                err = _kafka_error(exc)
                transient = err is not None and (err.retriable() or err.code() in _TRANSIENT_METADATA_CODES)
                if transient and time.monotonic() < deadline:
                    log.debug("offsets of %s[%d]: %s; retrying", topic, partition, _describe(err))
                    time.sleep(delay)
                    delay = min(delay * 2, 0.5)
                    continue
                raise JournalError(f"cannot query offsets of topic {topic} partition {partition}: {exc}") from exc
        if marks is None:
            raise JournalError(
                f"timed out querying offsets of topic {topic} partition {partition} "
                f"after {self.settings.operation_timeout_ms} ms"
            )
        return marks

    def _stable_marks(self, consumer: Consumer, topic: str, partition: int) -> tuple[int, int]:
        """Watermarks that cover every commit this backend has returned from (read-your-writes)."""
        low, end = self._watermarks(consumer, topic, partition)
        wanted = self._committed_end.get((topic, partition), 0)
        if end >= wanted:
            return low, end
        deadline = time.monotonic() + self.settings.operation_timeout_ms / 1000
        delay = 0.002
        while end < wanted:
            if time.monotonic() > deadline:
                raise JournalError(
                    f"topic {topic} partition {partition}: this backend committed through offset {wanted - 1} "
                    f"but the broker's last stable offset is still {end} after "
                    f"{self.settings.operation_timeout_ms} ms (commit markers not written?)"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.2)
            low, end = self._watermarks(consumer, topic, partition)
        return low, end

    def end_offset(self, partition: int) -> int:
        """The last stable offset of an events partition: the next committed record's offset is at least this."""
        self._check_partition(partition)
        consumer = self._acquire_consumer()
        try:
            return self._stable_marks(consumer, self.events_topic, partition)[1]
        finally:
            self._release_consumer(consumer)

    def read_events(self, partition: int, from_offset: int = 0) -> Iterator[StoredRecord]:
        """Committed event records of one partition from ``from_offset`` to the end seen when reading starts."""
        self._check_partition(partition)
        if from_offset < 0:
            raise ValueError(f"from_offset must be >= 0, got {from_offset}")
        return self._read(self.events_topic, [partition], from_offset)

    def read_snapshots(self) -> Iterator[StoredRecord]:
        """Every retained snapshot record (tombstones as value None), in log order per partition."""
        return self._read(self.snapshots_topic, list(range(self.partitions)), None)

    def _read(self, topic: str, partitions: list[int], from_offset: int | None) -> Iterator[StoredRecord]:
        consumer = self._acquire_consumer()
        healthy = False
        try:
            ends: dict[int, int] = {}
            next_offset: dict[int, int] = {}
            assignment: list[TopicPartition] = []
            for p in partitions:
                low, end = self._stable_marks(consumer, topic, p)
                start = low if from_offset is None else from_offset
                if start < low:
                    raise JournalError(
                        f"topic {topic} partition {p}: offsets before {low} were deleted by retention; "
                        f"cannot read from offset {start}"
                    )
                if start < end:
                    ends[p] = end
                    next_offset[p] = start
                    assignment.append(TopicPartition(topic, p, start))
            if assignment:
                # No pause() of finished partitions: a paused-then-reassigned partition stalls ~1 s in librdkafka.
                consumer.assign(assignment)
            yield from self._consume(consumer, topic, ends, next_offset)
            healthy = True
        finally:
            self._release_consumer(consumer, healthy=healthy)

    def _consume(
        self, consumer: Consumer, topic: str, ends: dict[int, int], next_offset: dict[int, int]
    ) -> Iterator[StoredRecord]:
        pending = set(ends)
        stall_s = self.settings.operation_timeout_ms / 1000
        last_progress = time.monotonic()

        while pending:
            msg = consumer.poll(0.2)
            now = time.monotonic()
            if msg is None:
                if now - last_progress > stall_s:
                    where = ", ".join(f"{p}@{next_offset[p]}" for p in sorted(pending))
                    raise JournalError(
                        f"reading topic {topic} made no progress for {stall_s:.0f} s at partition@offset {where} "
                        f"(end {', '.join(str(ends[p]) for p in sorted(pending))}); is the cluster reachable?"
                    )
                continue
            last_progress = now
            p = msg.partition()
            if msg.topic() != topic or p not in pending:
                continue  # a finished partition (fetched ahead) or an outdated assignment
            err = msg.error()
            offset = msg.offset()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    if offset is not None and offset >= ends[p]:
                        pending.discard(p)
                    continue
                raise JournalError(
                    f"reading topic {topic} partition {p} at offset {next_offset[p]}: {_describe(err)}"
                )
            if offset < next_offset[p]:
                continue  # already seen: an outdated fetch
            if offset >= ends[p]:
                pending.discard(p)  # committed after the read started: not ours to return
                continue
            next_offset[p] = offset + 1
            yield _stored(topic, p, offset, msg.key(), msg.value())
            if offset + 1 >= ends[p]:
                pending.discard(p)

    # -- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        """Flush and close the producer and every consumer. Idempotent."""
        with self._pool_lock:
            if self._closed:
                return
            self._closed = True
            consumers, self._all_consumers, self._idle_consumers = self._all_consumers, [], []
        producer, self._producer = self._producer, None
        if producer is not None:
            if self._failed is None:
                try:
                    remaining = producer.flush(self.settings.operation_timeout_ms / 1000)
                    if remaining:
                        log.error("closing producer %s with %d undelivered records", self.transactional_id, remaining)
                except (KafkaException, SystemError) as exc:
                    log.warning("flushing producer %s on close: %s", self.transactional_id, exc)
                _close_client(producer)
            else:
                # Producer.close() aborts the open transaction first; a fenced or fatally failed producer
                # cannot, and says so with a RuntimeWarning. The failure was raised already: log it only.
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    _close_client(producer)
                for warning in caught:
                    log.debug("closing failed producer %s: %s", self.transactional_id, warning.message)
        for consumer in consumers:
            _close_client(consumer)


def _stored(topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None) -> StoredRecord:
    location = RecordLocation(topic, partition, offset)
    if key is None:
        return StoredRecord("", value, location, error=f"record at {location} has no key")
    try:
        return StoredRecord(key.decode("utf-8"), value, location)
    except UnicodeDecodeError as exc:
        return StoredRecord(
            key.decode("utf-8", "replace"), value, location, error=f"key of record at {location} is not UTF-8: {exc}"
        )


def _new_client(cls: Callable[[dict[str, Any]], Any], config: dict[str, Any], role: str) -> Any:
    """A librdkafka client; a config it refuses becomes a ConfigurationError (secrets redacted)."""
    try:
        return cls(config)
    except (KafkaException, ValueError, TypeError) as exc:
        raise ConfigurationError(
            f"librdkafka refused the {role} config ({exc}); config: {redact_config(config)}"
        ) from None


def _close_client(client: Any) -> None:
    close = getattr(client, "close", None)  # Producer.close arrived in confluent-kafka 2.x
    if close is None:
        return
    try:
        close()
    except (KafkaException, RuntimeError) as exc:
        log.debug("closing Kafka client: %s", exc)


__all__ = ["KafkaBackend", "StagedCommit"]
