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
  :mod:`rollout_journal.journal.kafka.access`); what can be aborted is;
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
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, NoReturn, TypeGuard

from confluent_kafka import KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from rollout_journal.journal.backend import OutRecord, Stream, record_partition
from rollout_journal.journal.deadlines import Deadline
from rollout_journal.journal.errors import (
    AbortableCommitError,
    ConfigurationError,
    FatalJournalError,
    JournalClosedError,
    JournalError,
    NotAuthorizedError,
    PartitionFencedError,
    ProducerFencedError,
    RecordLocation,
    RecordsRefusedError,
    RevokedMidCommitError,
    SlotTakenOverError,
    TransactionRestartedError,
)
from rollout_journal.journal.kafka.access import TOPIC, TRANSACTIONAL_ID, check_topic_access, refusal
from rollout_journal.journal.kafka.clients import (
    FENCED_CODES,
    admin_config,
    base_config,
    client_log,
    close_client,
    describe,
    kafka_error,
    new_client,
    refresh_if_stale,
    unwrapped,
)
from rollout_journal.journal.kafka.config import KafkaSettings
from rollout_journal.journal.kafka.retry import Action, Retry, Role, classify
from rollout_journal.journal.kafka.topics import RECORD_FRAMING_BYTES
from rollout_journal.journal.metrics import NO_METRICS, JournalMetrics

log = logging.getLogger(__name__)

INIT_TRANSACTIONS_TIMEOUT_S = 60.0  # the first init on a cluster creates __transaction_state
_ROOT_CAUSE_WAIT_S = 2.0  # bound on waiting for the error that made a producer fatal
_ACCESS_CHECK_S = 5.0  # bound on asking, after a failed write, whether writing is still granted


def retryable(err: KafkaError | None) -> TypeGuard[KafkaError]:
    """Whether a producer call that failed with ``err`` may simply be called again: a transient
    error the retry policy names, on a producer that is not fatal (a fatal one needs re-creating)."""
    return err is not None and not err.fatal() and classify(err, Role.PRODUCER) is Action.RETRY


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
        self,
        settings: KafkaSettings,
        topics: dict[Stream, str],
        *,
        transactional_id: str | None,
        max_batch_bytes: int | None,
        on_committed: Callable[[Sequence[RecordLocation]], None],
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
        self.metrics: JournalMetrics = NO_METRICS  # the backend's observe() sets the journal's

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
        who = getattr(self, "member", None) or (
            (s.transactional_id or "reader") if self.partition is None else f"p{self.partition}"
        )
        cfg = base_config(s, who, "producer")
        cfg.update(
            {
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": s.linger_ms,
                # A topic's max.message.bytes bounds a whole record batch, not a record: batches stay below it.
                "batch.size": s.batch_size
                if self._max_batch_bytes is None
                else min(s.batch_size, self._max_batch_bytes - RECORD_FRAMING_BYTES),
                "compression.type": s.compression_type,
                "error_cb": self._on_producer_error,
            }
        )
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
        self._producer = self._init_producer()

    def _init_producer(self) -> Producer:
        """A new producer of this transactional id, ``init_transactions`` done. Transient errors (a
        coordinator loading or moving, a broker gone) are retried under the retry policy."""
        producer = new_client(Producer, self.producer_config(), "producer")
        budget_s = max(
            INIT_TRANSACTIONS_TIMEOUT_S,
            self.settings.operation_timeout_ms / 1000,
            self.settings.cluster_unavailable_timeout_ms / 1000,
        )
        where = f"init_transactions of transactional id {self.transactional_id} on {self.settings.bootstrap_servers}"
        retry = Retry(budget_s, where)
        while True:
            try:
                producer.init_transactions(max(1.0, min(INIT_TRANSACTIONS_TIMEOUT_S, retry.left_s())))
                return producer
            except (KafkaException, SystemError) as raised:
                exc = unwrapped(raised)
                err = kafka_error(exc)
                if retryable(err) and retry.wait(err):
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
            message = (
                f"commit refused: the producer of transactional id {self.transactional_id} failed earlier "
                f"({self._failed}); open a new backend (its producer fences this one)"
            )
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
            deadline = Deadline(self.settings.transaction_timeout_ms / 1000)
            self._retrying(producer, "begin_transaction", producer.begin_transaction, deadline, in_txn=False)
            locations = self._produce_all(producer, records, deadline, in_txn=True)
        except BaseException:
            self._txn_lock.release()
            raise
        return StagedCommit(self, producer, locations)

    def _produce_all(
        self, producer: Producer, records: Sequence[OutRecord], deadline: Deadline, *, in_txn: bool
    ) -> list[RecordLocation]:
        deliveries = _Deliveries(len(records))
        n = self.settings.partitions
        topics = self._topics
        for index, record in enumerate(records):
            topic = topics[record.stream]
            partition = record_partition(record, n)
            on_delivery = deliveries.callback(index)
            while True:
                try:
                    producer.produce(
                        topic,
                        value=record.value,
                        key=record.key.encode("utf-8"),
                        partition=partition,
                        on_delivery=on_delivery,
                    )
                    break
                except BufferError:  # local queue full: serve delivery reports, then retry
                    self._serving_reports(producer, lambda: producer.poll(0.05), in_txn)
                except (KafkaException, SystemError) as raised:
                    exc = unwrapped(raised)
                    err = kafka_error(exc)
                    if retryable(err) and not deadline.passed():
                        refresh_if_stale(producer, err, topic, max(0.1, min(5.0, deadline.left() / 10)))
                        self._serving_reports(producer, lambda: producer.poll(Retry.FIRST_S), in_txn)
                        continue
                    self._raise_classified(producer, exc, f"producing to topic {topic} partition {partition}", in_txn)
        while True:
            remaining = self._serving_reports(producer, lambda: producer.flush(deadline.left(at_most=1.0)), in_txn)
            if remaining == 0:
                break
            if deadline.passed():
                what = f"{remaining} of {len(records)} records undelivered within the transaction timeout"
                if in_txn:
                    self._abort_transaction(producer, reason=what)
                    raise AbortableCommitError(f"transactional id {self.transactional_id}: {what}; batch aborted")
                self._fail(FatalJournalError(f"{what} (non-transactional producer)"))
        failed = deliveries.errors()
        if failed:
            self._delivery_failed(producer, records, failed, in_txn)
        return deliveries.locations()

    def _delivery_failed(
        self, producer: Producer, records: Sequence[OutRecord], failed: list[tuple[int, KafkaError]], in_txn: bool
    ) -> NoReturn:
        """Some records of the batch were not delivered: classify the first failure and raise."""
        n, topics = self.settings.partitions, self._topics
        index, err = failed[0]
        err = self._root_cause(producer, err)
        topic, partition = topics[records[index].stream], record_partition(records[index], n)
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
            deadline = Deadline(self.settings.transaction_timeout_ms / 1000)
            locations = self._produce_all(producer, records, deadline, in_txn=False)
            self.on_committed(locations)
            return locations

    def _commit_transaction(self, producer: Producer) -> None:
        deadline = Deadline(self.settings.transaction_timeout_ms / 1000)
        self._retrying(producer, "commit_transaction", producer.commit_transaction, deadline, in_txn=True, timed=True)
        self.metrics.transaction_committed()

    def _abort_transaction(self, producer: Producer, *, reason: str, stop_on_failure: bool = True) -> None:
        """Abort the open transaction; raises only when the abort itself fails (fatally): then the
        writer stops, unless ``stop_on_failure`` is False (the caller stops it with its own error)."""
        log.warning("transactional id %s: aborting transaction: %s", self.transactional_id, reason)
        retry = Retry(self.settings.operation_timeout_ms / 1000, f"abort of {self.transactional_id}")
        while True:
            try:
                producer.abort_transaction(max(1.0, retry.left_s()))
                return
            except (KafkaException, SystemError) as raised:
                exc = unwrapped(raised)
                err = kafka_error(exc)
                if retryable(err) and retry.wait(err):
                    continue
                where = f"abort_transaction (after: {reason})"
                if not stop_on_failure:
                    raise JournalError(f"transactional id {self.transactional_id}: {where} failed: {exc}") from exc
                if err is not None:
                    err = self._root_cause(producer, err)
                if err is not None and err.code() in FENCED_CODES:
                    self._fail(self._fenced(self._fenced_message(where, err)), exc)
                detail = describe(err) if err is not None else repr(exc)
                self._fail(
                    FatalJournalError(f"transactional id {self.transactional_id}: {where} failed: {detail}"), exc
                )

    def _retrying(
        self,
        producer: Producer,
        what: str,
        call: Callable[..., None],
        deadline: Deadline,
        *,
        in_txn: bool,
        timed: bool = False,
    ) -> None:
        """``call`` until it succeeds, its transient errors retried under the retry policy until
        ``deadline``; any other error is classified (``_raise_classified``)."""
        retry = Retry(deadline.left(), f"transactional id {self.transactional_id}: {what}")
        while True:
            try:
                if timed:
                    call(max(1.0, retry.left_s()))
                else:
                    call()
                return
            except (KafkaException, SystemError) as raised:
                exc = unwrapped(raised)
                err = kafka_error(exc)
                if retryable(err) and not err.txn_requires_abort() and retry.wait(err):
                    continue
                if err is not None and classify(err, Role.PRODUCER) is Action.RETRY and what == "commit_transaction":
                    self._fail(
                        FatalJournalError(
                            f"transactional id {self.transactional_id}: commit_transaction still failing after the "
                            f"transaction timeout ({describe(err)}); the outcome is unknown until the next producer "
                            "with this transactional id runs init_transactions"
                        ),
                        exc,
                    )
                self._raise_classified(producer, exc, what, in_txn)

    def _root_cause(self, producer: Producer, err: KafkaError) -> KafkaError:
        """librdkafka answers every call after a fatal error with ``_FATAL``; the error that made
        it fatal (a fencing, say) is handed out once, by the next ``poll()``: confluent-kafka raises
        it there rather than calling ``error_cb``. Poll, and report that one."""
        if err.code() != KafkaError._FATAL:
            return err
        # librdkafka's own thread may learn of the fencing between two of our calls (a zombie's
        # produce answered _FATAL, seen in the racing-resumes test): its error is queued, unserved.
        deadline = Deadline(_ROOT_CAUSE_WAIT_S)
        while self._fatal_error is None and not deadline.passed():
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
        return refusal(
            self.settings,
            err,
            {
                TOPIC: ("WRITE", topic or self._topics[Stream.EVENTS]),
                TRANSACTIONAL_ID: ("WRITE", self.transactional_id or ""),
            },
        )

    def _refused(
        self, producer: Producer, denied: NotAuthorizedError, in_txn: bool, cause: BaseException | None = None
    ) -> NoReturn:
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
            check_topic_access(
                admin,
                self.settings,
                self._topics.values(),
                ["WRITE"],
                min(_ACCESS_CHECK_S, self.settings.operation_timeout_ms / 1000),
            )
        except NotAuthorizedError as denied:
            # a copy without the traceback: that holds the admin client, which must be destroyed
            # here, on this thread, not by the garbage collector on whichever thread it runs
            return NotAuthorizedError(
                denied.operation, denied.resource_type, denied.resource, denied.principal, denied.hint
            )
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
            # cannot, and says so with a RuntimeWarning (logged at debug: the failure was raised already).
            close_client(producer, discard=True)


GroupMetadata = Callable[[], Any]  # the member's consumer_group_metadata(), None while it is not a member
Landed = Callable[[list[TopicPartition]], bool | None]  # did a transaction with these offsets commit? None: unknown


class MemberWriter(KafkaWriter):
    """The one transactional producer of a consumer-group member (Kafka Streams' exactly-once v2, KIP-447).

    Its ``transactional.id`` is ``<namespace>.w.<member>.<boot>``, unique to this process start
    (``boot``: 8 random hex digits), so no other process ever shares it and being fenced never
    means "taken over": only the group says who owns which partition. A commit is one transaction
    over every partition it writes, ended by ``send_offsets_to_transaction`` with the end of every
    topic-partition written and the member's ``consumer_group_metadata()``: the group coordinator
    accepts the offsets only from the current generation's member, so a zombie (a member that
    stalled past its session, whose partitions moved) can never commit, and the group's committed
    offsets are the commit points a take reads to.

    Errors (``journal.kafka.retry``): transient ones are retried; abortable ones abort and raise
    ``AbortableCommitError`` (redo); records the broker refuses abort and raise
    ``RecordsRefusedError`` naming their partitions (redo without them); a dead transaction (it
    outlived ``transaction.timeout.ms``, a failed abort, a stale generation, ``_FENCED``) re-creates
    the producer under the same id, whose ``init_transactions`` ends what the old one left open,
    and raises ``TransactionRestartedError`` (redo what is still owned). More than
    ``MAX_REINITS_PER_MINUTE`` re-creations, a refusal or an unknown error stop the writer.
    A commit whose outcome the producer could not learn (``commit_transaction`` failing after the
    broker may have accepted it) is resolved by the group's committed offsets: landed, or redone.
    """

    MAX_REINITS_PER_MINUTE = 5

    def __init__(
        self,
        settings: KafkaSettings,
        topics: dict[Stream, str],
        *,
        member: str,
        max_batch_bytes: int | None,
        on_committed: Callable[[Sequence[RecordLocation]], None],
        group_metadata: GroupMetadata,
        landed: Landed,
    ) -> None:
        boot = secrets.token_hex(4)
        self.member = member  # names its client.id (set before the producer config is built)
        super().__init__(
            settings,
            topics,
            transactional_id=f"{settings.namespace}.w.{member}.{boot}",
            max_batch_bytes=max_batch_bytes,
            on_committed=on_committed,
        )
        self.member = member
        self._group_metadata = group_metadata
        self._landed = landed
        self._reinit_times: deque[float] = deque()
        self.reinits = 0  # how often the producer was re-created (a stalled or timed-out transaction healed)
        self._refused_generation: str | None = None

    def _current_metadata(self) -> Any:
        """The member's group metadata. After the coordinator refused the transaction sent under it
        (a stale generation, if this member stalled past its session), wait two heartbeats for the
        group to tell the member where it stands (a new generation, or its partitions lost) rather
        than be refused again; a generation that stays is a valid one (the transaction timed out)."""
        metadata = self._group_metadata()
        if self._refused_generation is None:
            return metadata
        deadline = Deadline(2 * max(0.1, self.settings.group_session_timeout_ms / 6000))
        while metadata is not None and repr(metadata) == self._refused_generation and not deadline.passed():
            deadline.sleep(0.05)
            metadata = self._group_metadata()
        return metadata

    def __repr__(self) -> str:
        return f"MemberWriter(transactional_id={self.transactional_id!r})"

    def commit(
        self,
        records: Sequence[OutRecord],
        consumed: Sequence[TopicPartition] = (),
        revoked: Callable[[], set[int]] = set,
    ) -> list[RecordLocation]:
        """One transaction: ``records`` (any partitions), then the group's offsets (the end of each
        topic-partition written, and ``consumed``: positions of input this transaction consumed),
        sent under the member's generation, then commit. Their locations, in order.

        ``revoked()`` names the batch's partitions the group took away since it was built; asked after
        the generation is read and before the offsets are sent, so offsets are never sent under a
        generation that no longer assigns a partition written (``RevokedMidCommitError``: redo
        without them)."""
        if not records and not consumed:
            self._check_writable()
            return []
        with self._txn_lock:
            producer = self._writable_producer()
            metadata = self._current_metadata()  # before the transaction: waiting on it must not age it
            deadline = Deadline(self.settings.transaction_timeout_ms / 1000)
            self._retrying(producer, "begin_transaction", producer.begin_transaction, deadline, in_txn=False)
            locations = self._produce_all(producer, records, deadline, in_txn=True) if records else []
            offsets = commit_points(locations) + list(consumed)
            if metadata is not None:
                metadata = self._group_metadata()  # the newest, then the ownership check (see revoked)
            gone = revoked() if metadata is not None else set()
            if gone:
                self._abort_transaction(producer, reason=f"partitions {sorted(gone)} revoked mid-commit")
                raise RevokedMidCommitError(
                    f"transactional id {self.transactional_id}: partitions {sorted(gone)} were revoked while the "
                    "transaction was open; aborted, redo without them",
                    gone,
                )
            if metadata is None:
                self._abort_transaction(producer, reason="this process is not a member of the group right now")
                error = AbortableCommitError(
                    f"transactional id {self.transactional_id}: not a member of group {self.settings.group_id} "
                    "right now (joining or rebalancing); batch aborted, redo it"
                )
                error.transient = True
                raise error

            def send(timeout_s: float) -> None:
                self._send_offsets_bounded(producer, offsets, metadata, timeout_s)

            try:
                self._retrying(producer, "send_offsets_to_transaction", send, deadline, in_txn=True, timed=True)
            except TransactionRestartedError:
                self._refused_generation = repr(metadata)  # a zombie's generation: the next commit waits for a new one
                raise
            self._commit_or_resolve(producer, offsets)
            self._refused_generation = None
            self.on_committed(locations)
            return locations

    def stage(self, records: Sequence[OutRecord]) -> StagedCommit:
        raise ConfigurationError("a group member's writer commits whole transactions only (commit())")

    def _commit_or_resolve(self, producer: Producer, offsets: list[TopicPartition]) -> None:
        """``commit_transaction``; if its outcome stays unknown, the group's committed offsets tell."""
        retry = Retry(self.settings.transaction_timeout_ms / 1000, f"commit of {self.transactional_id}")
        while True:
            try:
                producer.commit_transaction(max(1.0, retry.left_s()))
                self.metrics.transaction_committed()
                return
            except (KafkaException, SystemError) as raised:
                exc = unwrapped(raised)
                err = kafka_error(exc)
                if err is not None:
                    err = self._root_cause(producer, err)
                action = classify(err, Role.PRODUCER)
                if retryable(err) and retry.wait(err):
                    continue
                if action is Action.ABORT and err is not None:
                    self._abort_transaction(producer, reason=f"commit_transaction: {describe(err)}")
                    aborted = AbortableCommitError(
                        f"transactional id {self.transactional_id}: commit_transaction failed ({describe(err)}); "
                        "transaction aborted, redo the batch"
                    )
                    aborted.transient = True
                    raise aborted from exc
                denied = self._write_refusal(err)
                if denied is not None:
                    self._fail(denied, exc)
                # Dead or unknown: the coordinator may have accepted the commit. A new producer of this id
                # completes or aborts it in init_transactions; the group's offsets then say which.
                what = f"commit_transaction: {describe(err) if err is not None else repr(exc)}"
                self._reinit(what)
                landed = self._landed(offsets)
                if landed:
                    log.warning(
                        "transactional id %s: %s, but the transaction had committed", self.transactional_id, what
                    )
                    self.metrics.transaction_committed()
                    return
                if landed is None:
                    self._fail(
                        FatalJournalError(
                            f"transactional id {self.transactional_id}: {what}; whether it committed is unknown "
                            f"(the group's committed offsets could not be read)"
                        ),
                        exc,
                    )
                raise TransactionRestartedError(
                    f"transactional id {self.transactional_id}: {what}; it did not commit; producer "
                    "re-initialized, redo the batch"
                ) from exc

    def _raise_classified(self, producer: Producer, exc: KafkaException, what: str, in_txn: bool) -> NoReturn:
        err = kafka_error(exc)
        if err is not None:
            err = self._root_cause(producer, err)
        tid = self.transactional_id
        if err is None:
            self._fail(FatalJournalError(f"transactional id {tid}: {what} failed: {exc!r}"), exc)
        denied = self._write_refusal(err)
        if denied is not None:
            self._refused(producer, denied, in_txn, exc)
        action = classify(err, Role.PRODUCER)
        if action is Action.TAKEN:  # the member's static slot went to a newer process
            member = getattr(self, "member", None)  # a group member's producer (MemberWriter)
            slot = f"{self.settings.namespace}.{member}" if member else str(tid)
            self._fail(SlotTakenOverError(slot, self.settings.namespace, f"{what}: {describe(err)}"), exc)
        if action is Action.REINIT:
            self._restart(what, err, exc)
        if in_txn and action in (Action.ABORT, Action.RETRY):  # RETRY here: its budget ran out
            self._abort_transaction(producer, reason=f"{what}: {describe(err)}")
            aborted = AbortableCommitError(
                f"transactional id {tid}: {what} failed ({describe(err)}); transaction aborted, redo the batch"
            )
            aborted.transient = True
            raise aborted from exc
        if in_txn:
            self._abort_transaction(producer, reason=f"{what}: {describe(err)}")
        self._fail(FatalJournalError(f"transactional id {tid}: {what} failed: {describe(err)}"), exc)

    def _delivery_failed(
        self, producer: Producer, records: Sequence[OutRecord], failed: list[tuple[int, KafkaError]], in_txn: bool
    ) -> NoReturn:
        n, topics = self.settings.partitions, self._topics
        refused: dict[int, str] = {}
        first = ""
        for index, raw in failed:
            err = self._root_cause(producer, raw)
            topic, partition = topics[records[index].stream], record_partition(records[index], n)
            where = f"delivery of record {index} (key {records[index].key!r}) to {topic}[{partition}]: {describe(err)}"
            first = first or where
            denied = self._write_refusal(err, topic)
            if denied is None and err.code() == KafkaError._PURGE_QUEUE:
                denied = self._write_still_granted()
            if denied is not None:
                self._refused(producer, denied, in_txn)
            action = classify(err, Role.DELIVERY)
            if action is Action.REINIT:
                self._restart(where, err, None)
            if action is Action.RECORD:
                refused.setdefault(partition, where)
        self._abort_transaction(producer, reason=first)
        if refused:
            raise RecordsRefusedError(
                f"transactional id {self.transactional_id}: the broker refused records of partitions "
                f"{sorted(refused)} ({first}); batch aborted, redo it without them",
                refused,
            )
        aborted = AbortableCommitError(
            f"transactional id {self.transactional_id}: {first}"
            + (f" (and {len(failed) - 1} more)" if len(failed) > 1 else "")
            + "; batch aborted, redo it"
        )
        aborted.transient = True
        raise aborted

    def _abort_transaction(self, producer: Producer, *, reason: str, stop_on_failure: bool = True) -> None:
        """Abort; if the abort itself fails (``INVALID_TXN_STATE``: the coordinator already aborted a
        timed-out transaction), re-create the producer, which ends the transaction just as well."""
        log.info("transactional id %s: aborting transaction: %s", self.transactional_id, reason)
        retry = Retry(self.settings.operation_timeout_ms / 1000, f"abort of {self.transactional_id}")
        while True:
            try:
                producer.abort_transaction(max(1.0, retry.left_s()))
                return
            except (KafkaException, SystemError) as raised:
                err = kafka_error(unwrapped(raised))
                if retryable(err) and retry.wait(err):
                    continue
                self._reinit(f"abort_transaction (after: {reason}) failed: {describe(err) if err else raised!r}")
                return

    # librdkafka 2.16 does not honour send_offsets_to_transaction's timeout (librdkafka #5456), and
    # hangs for good when the group coordinator's broker left the metadata (#5511): in the broker-loss
    # drill every member's committer sat in it, silent, for minutes after a broker was killed.
    SEND_OFFSETS_GRACE_S = 5.0

    def _send_offsets_bounded(
        self, producer: Producer, offsets: list[TopicPartition], metadata: Any, timeout_s: float
    ) -> None:
        """``send_offsets_to_transaction`` with its timeout enforced here: the call runs on a thread of
        its own; one that overruns ``timeout_s`` by the grace leaves its producer behind, stuck, and
        a new producer under the same transactional id fences it (its ``init_transactions`` aborts the
        open transaction): the batch is redone (``TransactionRestartedError``)."""
        # A daemon thread per call (~0.1 ms beside a transaction's 13-43 ms): an executor's threads are
        # joined at interpreter exit, so one left hanging in librdkafka would hold a worker's exit too.
        outcome: Future[None] = Future()

        def call() -> None:
            try:
                producer.send_offsets_to_transaction(offsets, metadata, timeout_s)
            except BaseException as exc:  # handed to the committer, which classifies it
                outcome.set_exception(exc)
            else:
                outcome.set_result(None)

        threading.Thread(target=call, name="send-offsets", daemon=True).start()
        try:
            outcome.result(timeout_s + self.SEND_OFFSETS_GRACE_S)
        except FutureTimeout:
            err = KafkaError(
                KafkaError._TIMED_OUT,
                f"send_offsets_to_transaction still blocked {timeout_s + self.SEND_OFFSETS_GRACE_S:.0f} s after its call",
            )
            log.warning(
                "transactional id %s: send_offsets_to_transaction overran its %.0f s timeout (librdkafka #5456); "
                "re-creating the producer",
                self.transactional_id,
                timeout_s,
            )
            self._restart("send_offsets_to_transaction", err, None)

    def _restart(self, what: str, err: KafkaError, exc: BaseException | None) -> NoReturn:
        self._reinit(f"{what}: {describe(err)}")
        raise TransactionRestartedError(
            f"transactional id {self.transactional_id}: {what} ({describe(err)}); the transaction could not go "
            "on, the producer was re-initialized; redo the batch"
        ) from exc

    def _reinit(self, reason: str) -> None:
        """A new producer under the same transactional id; its ``init_transactions`` ends whatever the
        old one left open (aborts it, or completes a commit the coordinator had accepted)."""
        now = time.monotonic()
        self._reinit_times.append(now)
        while self._reinit_times and self._reinit_times[0] < now - 60:
            self._reinit_times.popleft()
        if len(self._reinit_times) > self.MAX_REINITS_PER_MINUTE:
            self._fail(
                FatalJournalError(
                    f"transactional id {self.transactional_id}: the producer had to be re-initialized "
                    f"{len(self._reinit_times)} times within a minute; last: {reason}"
                )
            )
        old, self._producer = self._producer, None
        if old is not None:  # its batch is redone by the new producer: nothing of it is wanted
            close_client(old, discard=True)
        started = time.monotonic()
        try:
            self._producer = self._init_producer()
        except JournalError as exc:
            self._fail(exc if isinstance(exc, FatalJournalError) else FatalJournalError(str(exc)), exc)
        self._fatal_error = None
        self.reinits += 1
        self.metrics.transaction_reinitialized()
        # Healed without anyone's help (the count is kept in ``reinits``): news, not a problem.
        log.info(
            "transactional id %s: %s; producer re-initialized in %.2f s",
            self.transactional_id,
            reason,
            time.monotonic() - started,
        )


def commit_points(locations: Sequence[RecordLocation]) -> list[TopicPartition]:
    """Per topic-partition written, the offset after its last record: what the group commits."""
    ends: dict[tuple[str, int], int] = {}
    for loc in locations:
        key = (loc.source, loc.partition)
        ends[key] = max(ends.get(key, 0), loc.offset + 1)
    return [TopicPartition(topic, partition, end) for (topic, partition), end in sorted(ends.items())]
