"""The journal on Apache Kafka: one transaction per commit, read_committed reads.

Layout: ``<namespace>.events`` (``cleanup.policy=delete``, long retention: the
audit trail), ``<namespace>.snapshots`` (``cleanup.policy=compact``: the
latest snapshot per rollout survives, a ``None`` value is a tombstone) and
``<namespace>.results`` (``delete``: each finished rollout's training record,
produced in the transaction of its final turn, for the trainer). All have
``settings.partitions`` partitions (but ``<namespace>.workloads``: one partition, compacted,
the newest registration per workload, which a fleet's workers follow with one long-lived
fetch stream) and every record goes to the explicit
partition :func:`rollout_journal.journal.backend.partition_for` picks from its partition key, so
restore finds a rollout's events without scanning history. Topics are created
by the backend itself, never by broker auto-creation.

:class:`KafkaBackend` composes three roles, each in a module of its own:

- topic administration (:mod:`rollout_journal.journal.kafka.topics`): the topics are created if
  asked and their settings checked at every open;
- the writer (:mod:`rollout_journal.journal.kafka.writer`): built with ``transactional=True`` (the
  default), one transactional, idempotent, ``acks=all`` producer whose
  ``transactional.id`` is ``<namespace>.<slot>`` (the worker's slot name, qualified
  by the namespace so that a job in another namespace on the same cluster never
  fences this one); :meth:`KafkaBackend.commit` is one Kafka transaction.
  Constructing a backend calls ``init_transactions``, which fences any older
  producer with the same id (a zombie worker) and completes or aborts its open
  transaction. The writer module documents how errors are classified;
- the readers (:mod:`rollout_journal.journal.kafka.readers`): pooled ``read_committed`` consumers,
  assigned to partitions, never committing offsets.

``transactional=False`` opens the backend for reading without touching the
worker's transactional id (opening a transactional producer would fence the
running worker). ``commit`` then uses a plain idempotent ``acks=all`` producer:
every record is durable once ``commit`` returns, but a crash mid-batch can leave
a prefix of it, so it is for tools and benchmarks, never for rollout workers.

``member="<name>"`` is the backend of a consumer-group member (a fleet's ``worker``, and ``run``/
``resume`` on Kafka; see :mod:`rollout_journal.journal.kafka.group`): it writes only the partitions the
group assigns it (:meth:`KafkaBackend.own` / :meth:`KafkaBackend.disown`, called as the assignment
changes), through one :class:`~rollout_journal.journal.kafka.writer.MemberWriter` per process whose
every transaction carries the group's offsets under the member's generation (KIP-447): a zombie
cannot commit, so Kafka itself keeps one writer per partition. :meth:`KafkaBackend.commit_partitions`
is one transaction over every partition of the batch; a partition no longer assigned, or whose
records the broker refuses, fails alone. Taking a partition (:meth:`KafkaBackend.take_partition`)
reads the group's committed offsets (waiting while the previous owner's last transaction is
undecided): reads of the partition then reach at least that commit point.

Reads see every commit this backend has returned from (read-your-writes).
librdkafka logs go to the ``rollout_journal.journal.kafka.librdkafka`` logger.

Access: every client logs in with the credentials of the settings (``librdkafka`` passthrough,
from the environment). Opening a backend logs in first, so a refused password is one
``AuthenticationFailedError`` at once rather than a timeout; then, unless the cluster grants this
client everything (no authorizer, or a super user), it checks the rights it will use (READ, and
WRITE when it writes, on both topics; DESCRIBE on its readers' group; READ on the worker group
``<namespace>.workers`` for a member's backend), and a missing one is a ``NotAuthorizedError``
naming the resource and the operation before anything is written. ``init_transactions`` names a
refused transactional id (``<namespace>.<slot>``, ``<namespace>.w.<member>.<boot>``) the same way. See
:mod:`rollout_journal.journal.kafka.access`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import Future, InvalidStateError
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from rollout_journal.journal.backend import (
    Backend,
    HeldBack,
    OutRecord,
    StoredRecord,
    Stream,
    partition_for,
    summaries_partition,
)
from rollout_journal.journal.errors import (
    ClusterUnreachableError,
    ConfigurationError,
    JournalClosedError,
    JournalError,
    PartitionRevokedError,
    RecordLocation,
    RecordsRefusedError,
    RevokedMidCommitError,
)
from rollout_journal.journal.kafka.access import check_group_access, check_topic_access, wait_until_authenticated
from rollout_journal.journal.kafka.clients import (
    ClientErrors,
    admin_config,
    base_config,
    close_client,
    kafka_error,
    new_client,
    on_client_error,
)
from rollout_journal.journal.kafka.config import KafkaSettings
from rollout_journal.journal.kafka.readers import CatchUpFollower, ReaderPool, StreamingFollower
from rollout_journal.journal.kafka.retry import Action, Retry, Role, classify
from rollout_journal.journal.kafka.topics import TopicState, prepare_topics, record_limits, topic_configs
from rollout_journal.journal.kafka.writer import KafkaWriter, MemberWriter, StagedCommit
from rollout_journal.journal.metrics import JournalMetrics
from rollout_journal.journal.summary import COMPLETE_KEY, COMPLETE_VALUE

log = logging.getLogger(__name__)


class KafkaBackend(Backend):
    """Journal storage on Kafka; see the module docstring for the guarantees."""

    kind = "kafka"

    def __init__(
        self,
        settings: KafkaSettings,
        *,
        create_topics: bool = True,
        transactional: bool = True,
        member: str | None = None,
    ) -> None:
        self.settings = settings
        self.partitions = settings.partitions
        self.member = member
        self.transactional = transactional or member is not None
        self.writes_per_partition = member is not None
        self.redo_budget_s = settings.cluster_unavailable_timeout_ms / 1000
        self.transaction_hold_s = settings.transaction_timeout_ms / 1000
        self.events_topic = settings.events_topic
        self.snapshots_topic = settings.snapshots_topic
        self.results_topic = settings.results_topic
        self.workloads_topic = settings.workloads_topic
        self.summaries_topic = settings.summaries_topic
        self._topics = {
            Stream.EVENTS: self.events_topic,
            Stream.SNAPSHOTS: self.snapshots_topic,
            Stream.RESULTS: self.results_topic,
            Stream.WORKLOADS: self.workloads_topic,
            Stream.SUMMARIES: self.summaries_topic,
        }
        self.topics: dict[str, TopicState] = {}  # what the open found: replicas, effective configs
        self._topic_max_bytes: int | None = None
        self._closed = False
        self._client_errors = ClientErrors(settings)  # the admin clients': a refused login ends the open at once
        # A slot writer's restore never reads a stale prefix; a member's reads to the commit points its takes learn.
        self.readers = ReaderPool(settings, stable=self.transactional and member is None)
        self.writer: KafkaWriter | None = None  # the slot's, the member's, or the plain one
        # A member's ownership: partition -> the token of its current assignment (see own()).
        self._owned: dict[int, int] = {}
        self._tokens = 0
        self._owned_lock = threading.Lock()
        self._group_metadata: Callable[[], Any] = lambda: None
        self._offsets: Consumer | None = None  # reads the group's committed offsets (a member's)
        self._offsets_lock = threading.Lock()
        self.acks_topic = settings.acks_topic
        self.acks_from: dict[int, int | None] = {}  # a member's: per taken partition, where its acks start
        self._consumed: dict[int, int] = {}  # acks applied and durable: offsets the next transaction commits
        self._ack_producer: Producer | None = None  # the trainer's: acknowledgements, never an owner's partitions
        self._ack_lock = threading.Lock()
        self._summaries_unmarked = False  # a writer opened it with no event yet: it marks its summaries complete
        if transactional and member is None and settings.transactional_id is None:
            raise ConfigurationError(
                "KafkaSettings.transactional_id is required to commit (the worker's slot name, e.g. "
                "ROLLOUT_JOURNAL_KAFKA_TRANSACTIONAL_ID=worker-0); open with transactional=False to only read"
            )
        try:
            self._prepare_topics(create_topics)
            if member is not None:
                self.writer = MemberWriter(
                    settings,
                    self._topics,
                    member=member,
                    max_batch_bytes=self._topic_max_bytes,
                    on_committed=self.readers.note_committed,
                    group_metadata=lambda: self._group_metadata(),
                    landed=self._landed,
                )
            else:
                self.writer = self._new_writer(settings.producer_transactional_id if transactional else None)
            self.writer.open()
            if self._summaries_unmarked:  # once every right was granted: a refused open writes nothing
                self._mark_summaries_complete()
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        mode = f"member={self.member!r}" if self.member is not None else f"transactional={self.transactional}"
        return f"KafkaBackend({self.settings!r}, {mode})"

    @property
    def transactional_id(self) -> str | None:
        """The producer's ``transactional.id``: ``<namespace>.<slot>`` (see ``KafkaSettings.producer_transactional_id``),
        a member's ``<namespace>.w.<member>.<boot>``; None for a reader."""
        return self.writer.transactional_id if self.writer is not None else None

    # -- client configuration --------------------------------------------------------------

    def producer_config(self) -> dict[str, Any]:
        """The producer's librdkafka config (passthrough applied); contains secrets, do not log it raw."""
        return self._writer().producer_config()

    def consumer_config(self) -> dict[str, Any]:
        """A reader consumer's librdkafka config (passthrough applied)."""
        return self.readers.consumer_config()

    def admin_config(self) -> dict[str, Any]:
        """The admin client's librdkafka config (passthrough applied); contains secrets."""
        return admin_config(self.settings, self.settings.transactional_id or "reader", self._client_errors)

    # -- topics ---------------------------------------------------------------------------

    def topic_configs(self) -> dict[str, dict[str, str]]:
        """The configs the backend creates its topics with (see :mod:`rollout_journal.journal.kafka.topics`)."""
        return topic_configs(self.settings)

    def _prepare_topics(self, create: bool) -> None:
        """Log in, create or find the topics, and check every right the backend will use, so that a
        refusal ends the open, naming the resource, before anything is written."""
        admin = new_client(AdminClient, self.admin_config(), "admin")
        timeout_s = self.settings.operation_timeout_ms / 1000
        try:
            unrestricted = wait_until_authenticated(admin, self.settings, self._client_errors, timeout_s)
            self.topics = prepare_topics(admin, self.settings, create=create)
            # A cluster without an authorizer (or a super user) grants everything: nothing to check,
            # and no coordinator lookup that a failover could leave hanging in the admin client.
            if not unrestricted:
                check_topic_access(
                    admin, self.settings, self.topics, ["READ", "WRITE"] if self.transactional else ["READ"], timeout_s
                )
                check_group_access(admin, self.settings, self.readers.group, "DESCRIBE", timeout_s)
                if self.member is not None:  # a member joins the group that assigns partitions
                    check_group_access(admin, self.settings, self.settings.group_id, "READ", timeout_s)
            self.keeps_summaries = self.summaries_topic in self.topics
            self._summaries_unmarked = (
                self.keeps_summaries and self.transactional and self._no_event_yet(admin, timeout_s)
            )
        finally:
            admin.poll(0)  # deliver queued client logs
        # The journal chunks anything larger than max_record_bytes; the producer keeps batches below the topics' limit.
        self._topic_max_bytes, self.max_record_bytes = record_limits(self.topics, self.settings)
        # A namespace of an older version, opened without creating topics, has none: registrations are on the snapshots.
        self.keeps_workloads = self.workloads_topic in self.topics

    def _no_event_yet(self, admin: AdminClient, timeout_s: float) -> bool:
        """Whether the events topic has never held a record (every partition's end is 0), in one
        request; transient errors (a leader not elected yet just after the topics were created) are
        retried. Unsure: no."""
        latest = OffsetSpec.latest()  # type: ignore[no-untyped-call]
        wanted = {TopicPartition(self.events_topic, p): latest for p in range(self.partitions)}
        retry = Retry(timeout_s, f"the end offsets of {self.events_topic}")
        while True:
            try:
                ends = admin.list_offsets(wanted, request_timeout=max(1.0, retry.left_s()))
                return all(future.result().offset == 0 for future in ends.values())
            except KafkaException as exc:
                err = kafka_error(exc)
                if classify(err, Role.OFFSETS) is Action.RETRY and retry.wait(err):
                    continue
                log.info("could not learn whether %s is empty (%s): summaries not marked", self.events_topic, exc)
                return False

    def _mark_summaries_complete(self) -> None:
        """(A writer opening a namespace with no event yet.) Every rollout will have a summary: say so
        on the summaries topic, so that a listing reads summaries. A writer of this version knows that
        only while no event exists (whoever created the topics: a first open, an operator); a namespace
        without the mark (this write failed, one written before summaries) is listed by folding its
        events, slower but the same. Several openers may each write it: it is one key."""
        cfg = base_config(self.settings, self.settings.transactional_id or "creator", "summaries")
        cfg.update({"enable.idempotence": True, "acks": "all", "error_cb": on_client_error(self.settings)})
        cfg.update(self.settings.librdkafka)
        producer = new_client(Producer, cfg, "producer")
        failed: list[str] = []

        def delivered(err: KafkaError | None, msg: Any) -> None:
            if err is not None:
                failed.append(str(err))

        try:
            producer.produce(self.summaries_topic, value=COMPLETE_VALUE, key=COMPLETE_KEY.encode(), partition=0,
                             on_delivery=delivered)  # fmt: skip
            remaining = producer.flush(self.settings.operation_timeout_ms / 1000)
        finally:
            close_client(producer)
        if remaining or failed:
            log.warning(
                "could not mark %s complete (%s): listings of this namespace fold every event",
                self.summaries_topic,
                failed[0] if failed else "not delivered in time",
            )

    # -- writing --------------------------------------------------------------------------

    def _new_writer(self, transactional_id: str | None) -> KafkaWriter:
        return KafkaWriter(
            self.settings,
            self._topics,
            transactional_id=transactional_id,
            max_batch_bytes=self._topic_max_bytes,
            on_committed=self.readers.note_committed,
        )

    def _writer(self) -> KafkaWriter:
        if self.writer is None:
            raise JournalClosedError(f"Kafka backend for {self.events_topic} is closed")
        return self.writer

    def commit(self, records: Sequence[OutRecord]) -> list[RecordLocation]:
        """Write ``records`` in one Kafka transaction; their locations, in order.

        Raises ``AbortableCommitError`` (aborted, nothing visible, redo the batch),
        ``ProducerFencedError`` (a newer producer owns this slot; a member: ``PartitionRevokedError``,
        a partition of the batch is not assigned to it) or ``FatalJournalError`` (stop; the backend
        refuses further commits).
        """
        self._check_open()
        for record in records:
            if record.value is None and record.stream is Stream.EVENTS:  # as the file backend: readers would choke
                raise ValueError(f"event record {record.key!r} has no value; only snapshots take tombstones")
        if self.member is not None:
            for partition in sorted({partition_for(r.partition_key, self.partitions) for r in records}):
                if self.owner_token(partition) is None:
                    raise self._revoked(partition)
        return self._writer().commit(records)

    def stage(self, records: Sequence[OutRecord]) -> StagedCommit:
        """Begin a transaction and produce ``records`` with every delivery confirmed, without committing.

        The caller must ``commit()`` or ``abort()`` the result; other commits on this
        backend wait until then. Raises like :meth:`commit` when producing fails.
        """
        self._check_open()
        return self._writer().stage(records)

    def observe(self, metrics: JournalMetrics) -> None:
        """The writer reports its transactions and producer re-creations to ``metrics``."""
        if self.writer is not None:
            self.writer.metrics = metrics

    # -- partition ownership (a consumer-group member) ----------------------------------------

    def join(self, group_metadata: Callable[[], Any]) -> None:
        """The member's group: ``group_metadata()`` is its current ``consumer_group_metadata()``
        (None while it is no member), which every transaction's offsets are sent under."""
        self._group_metadata = group_metadata

    @property
    def owned_partitions(self) -> set[int]:
        with self._owned_lock:
            return set(self._owned)

    def own(self, partitions: Collection[int]) -> dict[int, int]:
        """The group assigned ``partitions`` to this member (called from the group's callback):
        each gets a fresh token; appends of rollouts admitted under another token are refused."""
        with self._owned_lock:
            tokens = {}
            for partition in partitions:
                self._check_partition(partition)
                self._tokens += 1
                self._owned[partition] = tokens[partition] = self._tokens
            return tokens

    def disown(self, partitions: Collection[int]) -> None:
        """The group revoked ``partitions`` (or they were lost): from now on their appends fail with
        ``PartitionRevokedError``. Returns at once (called from the group's callback)."""
        with self._owned_lock:
            for partition in partitions:
                self._owned.pop(partition, None)

    def owner_token(self, partition: int) -> int | None:
        if self.member is None:
            return 0
        with self._owned_lock:
            return self._owned.get(partition)

    def _revoked(self, partition: int) -> PartitionRevokedError:
        return PartitionRevokedError(
            f"partition {partition} of {self.events_topic} is not assigned to {self.member} (revoked, lost, or "
            "never assigned): its appends are refused; its owner continues its rollouts",
            partition,
        )

    def take_partition(self, partition: int) -> None:
        """Prepare to write ``partition`` (assigned to this member by the group): read the group's
        committed offsets of its events and snapshots, waiting while the previous owner's last
        transaction is undecided (``read_committed``: OffsetFetch with require_stable). Reads of the
        partition then reach at least those commit points. Restore the partition after this."""
        if self.member is None:
            raise ConfigurationError(
                "take_partition() needs a consumer-group member's backend (KafkaBackend(settings, member=...))"
            )
        self._check_partition(partition)
        self._check_open()
        if self.owner_token(partition) is None:
            raise self._revoked(partition)
        points = self.commit_points([partition])
        for topic in (self.events_topic, self.snapshots_topic):
            self.readers.note_floor(topic, partition, points.get((topic, partition)))
        self.acks_from[partition] = points.get((self.acks_topic, partition))

    def release_partition(self, partition: int) -> None:
        """Stop writing ``partition`` and forget where it ends: the next owner learns that. Idempotent."""
        self.disown([partition])
        for topic in self._topics.values():
            self.readers.forget(topic, partition)
        self.acks_from.pop(partition, None)
        with self._owned_lock:
            self._consumed.pop(partition, None)

    def commit_points(self, partitions: Collection[int]) -> dict[tuple[str, int], int | None]:
        """The group's committed offsets of the events, snapshots and acks partitions (None: nothing
        committed there by a member yet). Waits while a transaction that carries offsets for them is
        undecided: up to its transaction timeout, which the broker enforces, and then some."""
        topics = [self.events_topic, self.snapshots_topic] + (
            [self.acks_topic] if self.acks_topic in self.topics else []
        )
        wanted = [TopicPartition(t, p) for p in sorted(partitions) for t in topics]
        budget_s = (
            max(self.settings.cluster_unavailable_timeout_ms, 2 * self.settings.transaction_timeout_ms + 15_000) / 1000
        )
        retry = Retry(budget_s, f"committed offsets of group {self.settings.group_id}")
        while True:
            try:
                with self._offsets_lock:
                    consumer = self._offsets_consumer()
                    found = consumer.committed(wanted, timeout=min(retry.left_s() or 1.0, 10.0))
            except KafkaException as exc:
                err = kafka_error(exc)
                if classify(err, Role.COMMITTED) is Action.RETRY and retry.wait(err):
                    continue  # the previous owner's transaction undecided, or a coordinator moving
                raise ClusterUnreachableError(
                    f"cannot read the committed offsets of group {self.settings.group_id} for partitions "
                    f"{sorted(partitions)} within {retry.elapsed_s:.0f} s: {exc}"
                ) from exc
            errors = [tp.error for tp in found if tp.error is not None]
            if errors:
                if classify(errors[0], Role.COMMITTED) is Action.RETRY and retry.wait(errors[0]):
                    continue
                raise JournalError(f"committed offsets of group {self.settings.group_id}: {errors[0]}")
            return {(tp.topic, tp.partition): (tp.offset if tp.offset >= 0 else None) for tp in found}

    def _landed(self, offsets: list[TopicPartition]) -> bool | None:
        """Whether a transaction that sent ``offsets`` committed: the group's offsets equal them (only this
        member writes its partitions; one whose offset is past them was taken over since, and is judged
        by the others). None when the group's offsets cannot be read."""
        try:
            points = self.commit_points({tp.partition for tp in offsets})
        except JournalError as exc:
            log.error("cannot tell whether a transaction committed: %s", exc)
            return None
        judged = [
            (points[tp.topic, tp.partition] or 0, tp.offset) for tp in offsets if (tp.topic, tp.partition) in points
        ]
        judged = [(found, sent) for found, sent in judged if found <= sent]
        return bool(judged) and all(found == sent for found, sent in judged)

    def _offsets_consumer(self) -> Consumer:
        """A consumer of the member's group id that never joins it: it reads committed offsets only."""
        if self._offsets is None:
            cfg = base_config(self.settings, self.member or "reader", "offsets")
            cfg.update(
                {
                    "group.id": self.settings.group_id,
                    "isolation.level": "read_committed",  # OffsetFetch waits for pending transactional offsets
                    "enable.auto.commit": False,
                    "enable.auto.offset.store": False,
                    "error_cb": on_client_error(self.settings),
                }
            )
            cfg.update(self.settings.librdkafka)
            self._offsets = new_client(Consumer, cfg, "offsets consumer")
        return self._offsets

    def commit_partitions(
        self, batches: Mapping[int, Sequence[OutRecord]]
    ) -> dict[int, list[RecordLocation] | BaseException]:
        """One transaction over every partition of ``batches`` still assigned to this member; per
        partition, its records' locations or the error that failed it alone: ``PartitionRevokedError``
        (no longer assigned), ``RecordsRefusedError`` (the broker refused its records; the others are
        committed without them), or, for every partition, the transaction's own failure
        (``AbortableCommitError``: redo; ``FatalJournalError``: stop)."""
        if self.member is None:
            return super().commit_partitions(batches)
        self._check_open()
        out: dict[int, list[RecordLocation] | BaseException] = {}
        todo: dict[int, Sequence[OutRecord]] = {}
        for partition, records in batches.items():
            if not records:
                out[partition] = []
            elif self.owner_token(partition) is None:
                out[partition] = self._revoked(partition)
            else:
                todo[partition] = records
        tokens = {partition: self.owner_token(partition) for partition in todo}

        def revoked() -> set[int]:
            return {p for p in todo if self.owner_token(p) != tokens[p]}

        writer = self._writer()
        assert isinstance(writer, MemberWriter)
        with self._owned_lock:  # acks applied since the last transaction: their positions commit with this one
            consumed = [TopicPartition(self.acks_topic, p, o) for p, o in self._consumed.items() if p in self._owned]
        while todo:
            order = sorted(todo)
            try:
                locations = writer.commit([r for p in order for r in todo[p]], consumed=consumed, revoked=revoked)
            except RevokedMidCommitError as exc:
                for partition in exc.partitions:
                    out[partition] = self._revoked(partition)
                    todo.pop(partition, None)
                continue
            except RecordsRefusedError as exc:
                for partition, why in exc.refused.items():
                    out[partition] = RecordsRefusedError(f"partition {partition}: {why}", {partition: why})
                    todo.pop(partition, None)
                if not set(exc.refused) & set(order):  # named nothing of the batch: fail it all, never loop
                    out.update(dict.fromkeys(todo, exc))
                    break
                continue
            except (JournalError, ValueError) as exc:
                out.update(dict.fromkeys(todo, exc))
                break
            start = 0
            for partition in order:
                out[partition] = locations[start : start + len(todo[partition])]
                start += len(todo[partition])
            with self._owned_lock:
                for tp in consumed:
                    if self._consumed.get(tp.partition) == tp.offset:
                        del self._consumed[tp.partition]
            break
        return out

    # -- acknowledgements: the trainer's topic, applied by each partition's owner ----------------

    def publish_acknowledgement(self, rollout_id: str, value: bytes) -> Future[RecordLocation]:
        """(The trainer's.) Put one acknowledgement on ``<namespace>.acks``, partition ``crc32(rollout)``:
        an idempotent ``acks=all`` record, no transaction, so it never holds an owner's read back. The
        future resolves once it is durable; the partition's owner applies it."""
        if self.acks_topic not in self.topics:
            raise ConfigurationError(
                f"topic {self.acks_topic} does not exist: open namespace {self.settings.namespace} once with "
                "a version that creates it (any writer does), or acknowledge with this version's workers"
            )
        future: Future[RecordLocation] = Future()

        def delivered(err: KafkaError | None, msg: Any) -> None:
            try:
                if err is None:
                    future.set_result(RecordLocation(msg.topic(), msg.partition(), msg.offset()))
                else:
                    future.set_exception(JournalError(f"acknowledgement of {rollout_id} to {self.acks_topic}: {err}"))
            except InvalidStateError:  # reported undelivered in time below: this is its late outcome
                log.warning(
                    "acknowledgement of %s reported late, after its caller was told it failed: %s",
                    rollout_id,
                    err or "durable after all",
                )

        with self._ack_lock:
            if self._ack_producer is None:
                cfg = base_config(self.settings, self.settings.transactional_id or "trainer", "acks")
                cfg.update(
                    {
                        "enable.idempotence": True,
                        "acks": "all",
                        "linger.ms": 5,
                        "error_cb": on_client_error(self.settings),
                    }
                )
                cfg.update(self.settings.librdkafka)
                self._ack_producer = new_client(Producer, cfg, "producer")
            producer = self._ack_producer
            producer.produce(
                self.acks_topic,
                value=value,
                key=rollout_id.encode(),
                partition=partition_for(rollout_id, self.partitions),
                on_delivery=delivered,
            )
            producer.poll(0)
            remaining = producer.flush(self.settings.operation_timeout_ms / 1000)
        if remaining:
            try:
                future.set_exception(JournalError(f"acknowledgement of {rollout_id} not delivered in time"))
            except InvalidStateError:  # delivered meanwhile (another thread's poll served its report)
                pass
        return future

    def read_acks(self, partition: int) -> tuple[list[StoredRecord], int]:
        """(A member's, at a take.) The acknowledgements of ``partition`` waiting since the last owner
        stopped (from the group's committed position), and the offset after them."""
        start = self.acks_from.get(partition)
        if self.acks_topic not in self.topics:
            return [], 0
        ends: dict[int, int] = {}
        records = list(self.readers.read_from(self.acks_topic, {partition: start}, ends, stable=False))
        end = ends.get(partition, start or 0)
        self.acks_from[partition] = end
        return records, end

    def follow_acks(self) -> StreamingFollower | None:
        """(A member's.) A consumer of ``<namespace>.acks``, assigned nothing yet (see
        ``StreamingFollower.assign``); None when the namespace has no such topic."""
        if self.acks_topic not in self.topics:
            return None
        # A fetch returns as soon as an ack lands; the wait only paces an idle member's fetches (2/s, not 20/s).
        return StreamingFollower(self.readers, self.acks_topic, 0, {}, fetch_wait_ms=500)

    def acknowledgement_applied(self, partition: int, next_offset: int) -> None:
        """(A member's.) The acks of ``partition`` before ``next_offset`` are applied and durable: the
        next transaction commits that position, so a later owner starts after them."""
        with self._owned_lock:
            if partition in self._owned and self._consumed.get(partition, -1) < next_offset:
                self._consumed[partition] = next_offset

    def _check_open(self) -> None:
        if self._closed:
            raise JournalClosedError(f"Kafka backend for {self.events_topic} is closed")

    # -- reading --------------------------------------------------------------------------

    def _check_partition(self, partition: int) -> None:
        if not 0 <= partition < self.partitions:
            raise ValueError(
                f"partition {partition} out of range: {self.events_topic} has {self.partitions} partitions"
            )

    def end_offset(self, partition: int) -> int:
        """The last stable offset of an events partition: the next committed record's offset is at least this.
        A member answers from what it knows of a partition it owns (the take's commit point, its own
        commits) without waiting on another producer's open transaction."""
        self._check_partition(partition)
        self._check_open()
        if self.member is not None:
            known = self.readers.known_end(self.events_topic, partition)
            if known is not None:
                return known
        return self.readers.end_offset(self.events_topic, partition)

    def read_events(
        self, partition: int, from_offset: int = 0, held: list[HeldBack] | None = None
    ) -> Iterator[StoredRecord]:
        """Committed event records of one partition from ``from_offset`` to the end seen when reading starts.
        ``held`` receives the partition if a transaction still open held the read back (a read-only
        backend's: a writer's restore waits for it instead, a member's reads to its take's commit point)."""
        self._check_partition(partition)
        if from_offset < 0:
            raise ValueError(f"from_offset must be >= 0, got {from_offset}")
        self._check_open()
        if held is None or self.transactional:
            return self.readers.read(self.events_topic, [partition], from_offset)
        return self.readers.read_from(self.events_topic, {partition: from_offset}, held=held)

    def read_snapshots(self, partitions: Collection[int] | None = None) -> Iterator[StoredRecord]:
        """Every retained snapshot record (tombstones as value None) of ``partitions`` (None: all),
        in log order per partition."""
        self._check_open()
        wanted = list(range(self.partitions)) if partitions is None else sorted(partitions)
        for partition in wanted:
            self._check_partition(partition)
        return self.readers.read(self.snapshots_topic, wanted, None)

    def read_summaries(
        self, partitions: Collection[int] | None = None, held: list[HeldBack] | None = None
    ) -> Iterator[StoredRecord]:
        """Every retained record of ``<namespace>.summaries`` (of the summaries partitions of events
        ``partitions`` only, if given, which hold other partitions' too: ``summaries_partition``;
        the completeness mark lies on partition 0), in log order per partition; ``held`` as for
        :meth:`read_events`, naming summaries partitions."""
        self._check_open()
        if not self.keeps_summaries:
            return super().read_summaries(partitions, held)
        for partition in partitions or ():
            self._check_partition(partition)
        every = range(self.partitions) if partitions is None else partitions
        wanted = sorted({summaries_partition(p, self.partitions) for p in every})
        if held is None or self.transactional:
            return self.readers.read(self.summaries_topic, wanted, None)
        return self.readers.read_from(self.summaries_topic, dict.fromkeys(wanted), held=held)

    def read_results(self, partition: int, from_offset: int = 0) -> Iterator[StoredRecord]:
        """Committed results records of one partition from ``from_offset`` to the end seen when reading starts."""
        self._check_partition(partition)
        self._check_open()
        if self.results_topic not in self.topics:
            raise ConfigurationError(
                f"topic {self.results_topic} does not exist: namespace {self.settings.namespace} "
                "was written before results were published"
            )
        return self.readers.read(self.results_topic, [partition], from_offset)

    def follow_results(self, offsets: dict[int, int]) -> StreamingFollower:
        """The results topic as it is committed, from ``offsets`` (per partition, the next offset to
        read; a partition missing: its start), through a ``read_committed`` consumer of its own."""
        self._check_open()
        if self.results_topic not in self.topics:
            raise ConfigurationError(
                f"topic {self.results_topic} does not exist: namespace {self.settings.namespace} "
                "was written before results were published"
            )
        return StreamingFollower(self.readers, self.results_topic, self.partitions, offsets)

    def read_workloads(self) -> Iterator[StoredRecord]:
        """Every retained record of ``<namespace>.workloads`` (one partition), in log order."""
        self._check_open()
        if not self.keeps_workloads:
            return super().read_workloads()
        return self.readers.read(self.workloads_topic, [0], None)

    def follow_workloads(self) -> CatchUpFollower | None:
        """``<namespace>.workloads`` as it is committed: every retained registration at the first
        ``poll()``, then only what was committed since, from one long-lived fetch stream (a fleet's
        workers learn of new workloads this way; no snapshot read, no offset query per poll).
        None when the namespace has no such topic (opened without creating topics)."""
        self._check_open()
        if not self.keeps_workloads:
            return None
        return CatchUpFollower(self.readers, self.workloads_topic)

    # -- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        """Flush and close the producer and every consumer. Idempotent."""
        with self._owned_lock:
            if self._closed:
                return
            self._closed = True
            self._owned = {}
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.close()
        with self._offsets_lock:
            if self._offsets is not None:
                close_client(self._offsets)
                self._offsets = None
        with self._ack_lock:
            if self._ack_producer is not None:
                self._ack_producer.flush(self.settings.operation_timeout_ms / 1000)
                close_client(self._ack_producer)
                self._ack_producer = None
        self.readers.close()


__all__ = ["KafkaBackend", "StagedCommit"]
