"""The Kafka backend's writer: one idempotent ``acks=all`` producer, transactional or plain.

A transactional writer holds one producer with a ``transactional.id``; :meth:`KafkaWriter.commit`
is one Kafka transaction, so a batch is wholly visible to read_committed readers or not at
all. :meth:`KafkaWriter.open` calls ``init_transactions``, which fences any older producer
with the same id (a zombie) and completes or aborts its open transaction.

Errors are classified the librdkafka way:

- retriable (``err.retriable()``): the same call is retried with backoff until
  the transaction timeout; it never surfaces;
- abortable (``err.txn_requires_abort()``, or a failed delivery report inside the
  transaction): the transaction is aborted and ``AbortableCommitError`` raised;
  nothing of the batch is visible and the caller may redo it;
- fenced (``_FENCED``, ``PRODUCER_FENCED``, ``INVALID_PRODUCER_EPOCH``):
  ``ProducerFencedError`` (``PartitionFencedError`` for the writer of one partition),
  wherever the zombie learns it (usually the produce and flush of its next batch).
  The delivery callback only stores its report (calling into the message while
  confluent-kafka holds the pending fatal error would turn it into a ``SystemError``);
  a fenced writer's later commits raise the same, and closing it never tries to abort;
- refused by the cluster's ACLs (``TOPIC_`` or ``TRANSACTIONAL_ID_AUTHORIZATION_FAILED``, or
  a transaction whose records were purged while the cluster no longer grants WRITE on a
  topic): ``NotAuthorizedError`` naming the resource and the operation (see
  :mod:`journal.kafka_access`); what can be aborted is;
- fatal or anything else: ``FatalJournalError``. After any of the last three the writer
  refuses every further commit, with the same kind of error.

The ambiguous case: ``commit_transaction`` failing with a retriable error (a
timeout, a coordinator moving) is retried, as librdkafka allows, and the retry
reports the real outcome. Only a fatal error during the commit leaves the
outcome unknown; the next producer with the same ``transactional.id`` resolves
it in ``init_transactions`` (the coordinator completes a transaction whose
commit it had accepted and aborts any other), after which reads show which.

A plain writer (no transactional id) is for tools and benchmarks: every record is
durable once ``commit`` returns, but a crash mid-batch can leave a prefix of it.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient

from .backend import OutRecord, Stream, partition_for
from .errors import (
    AbortableCommitError,
    ConfigurationError,
    FatalJournalError,
    JournalClosedError,
    JournalError,
    NotAuthorizedError,
    PartitionFencedError,
    ProducerFencedError,
    RecordLocation,
)
from .kafka_access import TOPIC, TRANSACTIONAL_ID, check_topic_access, refusal
from .kafka_clients import (
    FENCED_CODES,
    admin_config,
    base_config,
    client_log,
    close_client,
    describe,
    kafka_error,
    new_client,
    unwrapped,
)
from .kafka_config import KafkaSettings
from .kafka_topics import RECORD_FRAMING_BYTES

log = logging.getLogger(__name__)

INIT_TRANSACTIONS_TIMEOUT_S = 60.0  # the first init on a cluster creates __transaction_state
_BACKOFF_FIRST_S = 0.05
_BACKOFF_MAX_S = 2.0
_ROOT_CAUSE_WAIT_S = 2.0  # bound on waiting for the error that made a producer fatal
_ACCESS_CHECK_S = 5.0  # bound on asking, after a failed write, whether writing is still granted


class StagedCommit:
    """A transaction whose records are produced and delivered but not yet committed.

    Returned by :meth:`KafkaWriter.stage`; ``commit()`` or ``abort()`` it exactly
    once. Until then the writer's other commits wait. :meth:`KafkaWriter.commit`
    is ``stage(records).commit()``; staging separately lets tests and tools act
    between produce and commit (a zombie writer that gets fenced, an abort).
    """

    def __init__(self, writer: KafkaWriter, producer: Producer, locations: list[RecordLocation]) -> None:
        self._writer = writer
        self._producer = producer
        self.locations = locations
        self._done = False

    def commit(self) -> list[RecordLocation]:
        """Commit the transaction; the records' locations, in order. Raises like ``Backend.commit``."""
        self._finish()
        try:
            self._writer._commit_transaction(self._producer)
            self._writer.on_committed(self.locations)
        finally:
            self._writer._txn_lock.release()
        return self.locations

    def abort(self) -> None:
        """Abort the transaction: none of its records will ever be visible to read_committed readers."""
        self._finish()
        try:
            self._writer._abort_transaction(self._producer, reason="aborted by the caller")
        finally:
            self._writer._txn_lock.release()

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
        locations = []
        for index, report in enumerate(self.reports):
            if report is None:
                raise RuntimeError(f"record {index} of the batch has no delivery report yet; ask after flush()")
            msg = report[1]
            locations.append(RecordLocation(msg.topic(), msg.partition(), msg.offset()))
        return locations


class KafkaWriter:
    """One producer of the backend: ``transactional_id`` set, a transactional writer; None, a plain one.

    ``partition`` names the one partition this writer owns (a worker fleet's writer
    ``<namespace>.p<N>``): being fenced then raises ``PartitionFencedError`` naming it.
    ``on_committed`` hears where every committed batch landed (the readers' read-your-writes).
    """

    def __init__(
        self, settings: KafkaSettings, topics: dict[Stream, str], *, transactional_id: str | None,
        max_batch_bytes: int | None, on_committed: Callable[[Sequence[RecordLocation]], None],
        partition: int | None = None,
    ) -> None:
        self.settings = settings
        self.transactional_id = transactional_id
        self.partition = partition
        self.on_committed = on_committed
        self._topics = topics
        self._max_batch_bytes = max_batch_bytes
        self._txn_lock = threading.Lock()  # one transaction at a time; held from stage() to commit/abort
        self._producer: Producer | None = None
        self._failed: JournalError | None = None
        self._fatal_error: KafkaError | None = None  # what made the producer fatal (_root_cause finds it)
        self._closed = False

    def __repr__(self) -> str:
        return f"KafkaWriter(transactional_id={self.transactional_id!r})"

    @property
    def transactional(self) -> bool:
        return self.transactional_id is not None

    @property
    def failed(self) -> JournalError | None:
        """The error that stopped this writer (fenced or fatal); None while it can commit."""
        return self._failed

    def producer_config(self) -> dict[str, Any]:
        """The producer's librdkafka config (passthrough applied); contains secrets, do not log it raw."""
        s = self.settings
        who = (s.transactional_id or "reader") if self.partition is None else f"p{self.partition}"
        cfg = base_config(s, who, "producer")
        cfg.update({
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": s.linger_ms,
            # A topic's max.message.bytes bounds a whole record batch, not a record: batches stay below it.
            "batch.size": s.batch_size if self._max_batch_bytes is None
            else min(s.batch_size, self._max_batch_bytes - RECORD_FRAMING_BYTES),
            "compression.type": s.compression_type,
            "error_cb": self._on_producer_error,
        })
        if self.transactional:
            cfg["transactional.id"] = self.transactional_id
            cfg["transaction.timeout.ms"] = s.transaction_timeout_ms
        cfg.update(s.librdkafka)
        return cfg

    def _on_producer_error(self, err: KafkaError) -> None:
        # confluent-kafka raises a fatal error from poll()/flush() instead of calling this (see
        # _root_cause); kept for a client version that calls it.
        if err.fatal():
            self._fatal_error = err
            client_log.error("producer %s fatal error: %s", self.transactional_id, describe(err))
        else:
            client_log.info("producer %s: %s", self.transactional_id, describe(err))  # librdkafka logged it too

    # -- opening ----------------------------------------------------------------------------

    def open(self) -> None:
        """A transactional writer: create the producer and ``init_transactions`` (fencing the previous
        producer of this id, completing or aborting its open transaction). A plain one: nothing yet."""
        if not self.transactional:
            return
        producer = new_client(Producer, self.producer_config(), "producer")
        deadline = time.monotonic() + max(INIT_TRANSACTIONS_TIMEOUT_S, self.settings.operation_timeout_ms / 1000)
        backoff = _BACKOFF_FIRST_S
        while True:
            try:
                producer.init_transactions(max(1.0, deadline - time.monotonic()))
                self._producer = producer
                return
            except (KafkaException, SystemError) as raised:
                exc = unwrapped(raised)
                err = kafka_error(exc)
                where = f"init_transactions of transactional id {self.transactional_id} on {self.settings.bootstrap_servers}"
                if err is not None and err.retriable() and not err.fatal() and time.monotonic() < deadline:
                    log.warning("%s: %s; retrying", where, describe(err))
                    time.sleep(backoff)
                    backoff = min(backoff * 2, _BACKOFF_MAX_S)
                    continue
                close_client(producer)
                if err is not None and err.code() == KafkaError.INVALID_TRANSACTION_TIMEOUT:
                    raise ConfigurationError(
                        f"{where}: transaction_timeout_ms={self.settings.transaction_timeout_ms} exceeds the "
                        "broker's transaction.max.timeout.ms; lower the setting"
                    ) from exc
                denied = refusal(self.settings, err, {TRANSACTIONAL_ID: ("WRITE", self.transactional_id or "")})
                if denied is not None:
                    raise denied from None
                if err is not None and err.code() in FENCED_CODES:
                    raise self._fenced(f"{where}: fenced: {describe(err)}") from exc
                detail = describe(err) if err is not None else repr(exc)
                raise FatalJournalError(f"{where} failed: {detail}") from exc

    # -- committing -------------------------------------------------------------------------

    def _writable_producer(self) -> Producer:
        self._check_writable()
        if self._producer is None:  # non-transactional: created on first use
            self._producer = new_client(Producer, self.producer_config(), "producer")
        return self._producer

    def _check_writable(self) -> None:
        if self._closed:
            raise JournalClosedError(f"Kafka writer {self.transactional_id or '(plain)'} is closed")
        if self._failed is not None:
            if isinstance(self._failed, NotAuthorizedError):  # stays a refusal, naming the resource
                f = self._failed
                raise NotAuthorizedError(f.operation, f.resource_type, f.resource, f.principal, f.hint) from f
            fenced = isinstance(self._failed, ProducerFencedError)  # stays "fenced" for every later caller
            message = (f"commit refused: the producer of transactional id {self.transactional_id} failed earlier "
                       f"({self._failed}); open a new backend (its producer fences this one)")
            raise (self._fenced(message) if fenced else FatalJournalError(message)) from self._failed

    def check_writable(self) -> None:
        """Raise as a commit would if this writer can no longer commit (closed, fenced, failed)."""
        self._check_writable()

    def commit(self, records: Sequence[OutRecord]) -> list[RecordLocation]:
        """Write ``records`` in one Kafka transaction (a plain writer: produce and flush them); their
        locations, in order. Raises ``AbortableCommitError`` (aborted, nothing visible, redo the
        batch), ``ProducerFencedError`` (a newer producer took this id) or ``FatalJournalError``."""
        if not records:
            self._check_writable()
            return []
        if not self.transactional:
            return self._commit_plain(records)
        return self.stage(records).commit()

    def stage(self, records: Sequence[OutRecord]) -> StagedCommit:
        """Begin a transaction and produce ``records`` with every delivery confirmed, without committing.

        The caller must ``commit()`` or ``abort()`` the result; other commits on this
        writer wait until then. Raises like :meth:`commit` when producing fails.
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
        n = self.settings.partitions
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
                    exc = unwrapped(raised)
                    err = kafka_error(exc)
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
            err = self._root_cause(producer, err)
            topic, partition = topics[records[index].stream], partition_for(records[index].partition_key, n)
            where = (
                f"delivery of record {index} (key {records[index].key!r}) to topic {topic} partition {partition} "
                f"failed: {describe(err)}" + (f" (and {len(failed) - 1} more)" if len(failed) > 1 else "")
            )
            if not in_txn:
                self._fail(FatalJournalError(f"{where}; a prefix of the batch may be written (non-transactional)"))
            if err.code() in FENCED_CODES:
                self._fail(self._fenced(self._fenced_message(where, err)))
            denied = self._write_refusal(err, topic)
            if denied is None and err.code() == KafkaError._PURGE_QUEUE:
                denied = self._write_still_granted()
            if denied is not None:
                self._refused(producer, denied, in_txn)
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
            exc = unwrapped(raised)
            err = kafka_error(exc)
            if err is not None and err.code() == KafkaError._TIMED_OUT and not err.fatal():
                return len(producer)  # nothing delivered in time yet: the caller's deadline decides
            self._raise_classified(producer, exc, "flush", in_txn)

    def _commit_plain(self, records: Sequence[OutRecord]) -> list[RecordLocation]:
        with self._txn_lock:
            producer = self._writable_producer()
            deadline = time.monotonic() + self.settings.transaction_timeout_ms / 1000
            locations = self._produce_all(producer, records, deadline, in_txn=False)
            self.on_committed(locations)
            return locations

    def _commit_transaction(self, producer: Producer) -> None:
        deadline = time.monotonic() + self.settings.transaction_timeout_ms / 1000
        self._retrying(producer, "commit_transaction", producer.commit_transaction, deadline, in_txn=True, timed=True)

    def _abort_transaction(self, producer: Producer, *, reason: str, stop_on_failure: bool = True) -> None:
        """Abort the open transaction; raises only when the abort itself fails (fatally): then the
        writer stops, unless ``stop_on_failure`` is False (the caller stops it with its own error)."""
        log.warning("transactional id %s: aborting transaction: %s", self.transactional_id, reason)
        deadline = time.monotonic() + self.settings.operation_timeout_ms / 1000
        backoff = _BACKOFF_FIRST_S
        while True:
            try:
                producer.abort_transaction(max(1.0, deadline - time.monotonic()))
                return
            except (KafkaException, SystemError) as raised:
                exc = unwrapped(raised)
                err = kafka_error(exc)
                if err is not None and err.retriable() and not err.fatal() and time.monotonic() < deadline:
                    time.sleep(backoff)
                    backoff = min(backoff * 2, _BACKOFF_MAX_S)
                    continue
                where = f"abort_transaction (after: {reason})"
                if not stop_on_failure:
                    raise JournalError(f"transactional id {self.transactional_id}: {where} failed: {exc}") from exc
                if err is not None:
                    err = self._root_cause(producer, err)
                if err is not None and err.code() in FENCED_CODES:
                    self._fail(self._fenced(self._fenced_message(where, err)), exc)
                detail = describe(err) if err is not None else repr(exc)
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
                exc = unwrapped(raised)
                err = kafka_error(exc)
                if (
                    err is not None and err.retriable() and not err.fatal() and not err.txn_requires_abort()
                    and time.monotonic() < deadline
                ):
                    log.warning("transactional id %s: %s: %s; retrying", self.transactional_id, what, describe(err))
                    time.sleep(backoff)
                    backoff = min(backoff * 2, _BACKOFF_MAX_S)
                    continue
                if err is not None and err.retriable() and what == "commit_transaction":
                    self._fail(FatalJournalError(
                        f"transactional id {self.transactional_id}: commit_transaction still failing after the "
                        f"transaction timeout ({describe(err)}); the outcome is unknown until the next producer "
                        "with this transactional id runs init_transactions"
                    ), exc)
                self._raise_classified(producer, exc, what, in_txn)

    def _root_cause(self, producer: Producer, err: KafkaError) -> KafkaError:
        """librdkafka answers every call after a fatal error with ``_FATAL``; the error that made
        it fatal (a fencing, say) is handed out once, by the next ``poll()``: confluent-kafka raises
        it there rather than calling ``error_cb``. Poll, and report that one."""
        if err.code() != KafkaError._FATAL:
            return err
        # librdkafka's own thread may learn of the fencing between two of our calls (a zombie's
        # produce answered _FATAL, seen in the racing-resumes test): its error is queued, unserved.
        deadline = time.monotonic() + _ROOT_CAUSE_WAIT_S
        while self._fatal_error is None and time.monotonic() < deadline:
            try:
                producer.poll(0.05)
            except KafkaException as exc:
                cause = kafka_error(exc)
                if cause is not None and cause.code() != KafkaError._FATAL:
                    self._fatal_error = cause
                    break
                log.debug("serving callbacks of a fatal producer: %s", exc)
            except RuntimeError as exc:
                log.debug("serving callbacks of a fatal producer: %s", exc)
                break
        return self._fatal_error or err

    def _raise_classified(self, producer: Producer, exc: KafkaException, what: str, in_txn: bool) -> NoReturn:
        err = kafka_error(exc)
        if err is not None:
            err = self._root_cause(producer, err)
        tid = self.transactional_id
        if err is None:
            self._fail(FatalJournalError(f"transactional id {tid}: {what} failed: {exc!r}"), exc)
        if err.code() in FENCED_CODES:
            self._fail(self._fenced(self._fenced_message(what, err)), exc)
        denied = self._write_refusal(err)
        if denied is not None:
            self._refused(producer, denied, in_txn, exc)
        if err.fatal():
            self._fail(FatalJournalError(f"transactional id {tid}: {what}: fatal {describe(err)}"), exc)
        if in_txn and err.txn_requires_abort():
            self._abort_transaction(producer, reason=f"{what}: {describe(err)}")
            raise AbortableCommitError(
                f"transactional id {tid}: {what} failed ({describe(err)}); transaction aborted, redo the batch"
            ) from exc
        # Unknown: neither retriable in time nor abortable. Abort what we can, then stop this writer.
        if in_txn:
            try:
                self._abort_transaction(producer, reason=f"{what}: {describe(err)}")
            except JournalError:
                pass  # the fatal error below is the one that matters; the abort failure was logged
        self._fail(FatalJournalError(f"transactional id {tid}: {what} failed: {describe(err)}"), exc)

    def _write_refusal(self, err: KafkaError | None, topic: str | None = None) -> NotAuthorizedError | None:
        """``err`` as the refusal of a write, naming the resource, or None."""
        return refusal(self.settings, err, {
            TOPIC: ("WRITE", topic or self._topics[Stream.EVENTS]),
            TRANSACTIONAL_ID: ("WRITE", self.transactional_id or ""),
        })

    def _refused(self, producer: Producer, denied: NotAuthorizedError, in_txn: bool,
                 cause: BaseException | None = None) -> NoReturn:
        """Abort what can be aborted (a refused transaction may not even abort), then stop writing."""
        if in_txn:
            try:
                self._abort_transaction(producer, reason=str(denied), stop_on_failure=False)
            except JournalError:
                pass
        self._fail(denied, cause)

    def _write_still_granted(self) -> NotAuthorizedError | None:
        """A refused write reaches librdkafka's log only: the transaction fails, its records are
        purged (``_PURGE_QUEUE``) and even its abort is refused, with no code that says why. Asked
        then, the cluster says whether this client still may write: the refusal, or None."""
        try:
            admin = new_client(AdminClient, admin_config(self.settings, self.transactional_id or "plain"), "admin")
            check_topic_access(admin, self.settings, self._topics.values(), ["WRITE"],
                               min(_ACCESS_CHECK_S, self.settings.operation_timeout_ms / 1000))
        except NotAuthorizedError as denied:
            # a copy without the traceback: that holds the admin client, which must be destroyed
            # here, on this thread, not by the garbage collector on whichever thread it runs
            return NotAuthorizedError(denied.operation, denied.resource_type, denied.resource, denied.principal,
                                      denied.hint)
        except (JournalError, KafkaException) as exc:
            log.debug("could not ask the cluster whether %s may still write: %s", self.transactional_id, exc)
        return None

    def _fenced(self, message: str) -> ProducerFencedError:
        if self.partition is None:
            return ProducerFencedError(message)
        return PartitionFencedError(message, self.partition)

    def _fenced_message(self, what: str, err: KafkaError) -> str:
        took = "this worker slot" if self.partition is None else f"partition {self.partition}"
        return (
            f"transactional id {self.transactional_id} was fenced by a newer producer with the same id "
            f"(another process took over {took}) during {what}: {describe(err)}"
        )

    def _fail(self, error: JournalError, cause: BaseException | None = None) -> NoReturn:
        """Mark the writer failed (no more commits) and raise ``error``."""
        self._failed = error
        # Being fenced is a takeover, and a refusal a matter of ACLs, not a fault of this process:
        # the caller reports either once.
        quiet = isinstance(error, (ProducerFencedError, NotAuthorizedError))
        log.log(logging.INFO if quiet else logging.ERROR, "%s", error)
        if cause is not None:
            raise error from cause
        raise error

    # -- closing ----------------------------------------------------------------------------

    def close(self) -> None:
        """Flush and close the producer. Idempotent. A transaction under way in another thread is
        given the operation timeout to end first; a staged one left open is aborted by the close."""
        waited = self._txn_lock.acquire(timeout=self.settings.operation_timeout_ms / 1000)
        try:
            if self._closed:
                return
            self._closed = True
            producer, self._producer = self._producer, None
        finally:
            if waited:
                self._txn_lock.release()
        if producer is None:
            return
        if self._failed is None:
            try:
                remaining = producer.flush(self.settings.operation_timeout_ms / 1000)
                if remaining:
                    log.error("closing producer %s with %d undelivered records", self.transactional_id, remaining)
            except (KafkaException, SystemError) as exc:
                log.warning("flushing producer %s on close: %s", self.transactional_id, exc)
            close_client(producer)
        else:
            # Producer.close() aborts the open transaction first; a fenced or fatally failed producer
            # cannot, and says so with a RuntimeWarning. The failure was raised already: log it only.
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                close_client(producer)
            for warning in caught:
                log.debug("closing failed producer %s: %s", self.transactional_id, warning.message)
