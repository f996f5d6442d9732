"""The journal on Apache Kafka: one transaction per commit, read_committed reads.

Layout: ``<namespace>.events`` (``cleanup.policy=delete``, long retention: the
audit trail), ``<namespace>.snapshots`` (``cleanup.policy=compact``: the
latest snapshot per rollout survives, a ``None`` value is a tombstone) and
``<namespace>.results`` (``delete``: each finished rollout's training record,
produced in the transaction of its final turn, for the trainer). All have
``settings.partitions`` partitions and every record goes to the explicit
partition :func:`journal.backend.partition_for` picks from its partition key, so
restore finds a rollout's events without scanning history. Topics are created
by the backend itself, never by broker auto-creation.

:class:`KafkaBackend` composes three roles, each in a module of its own:

- topic administration (:mod:`journal.kafka_topics`): the topics are created if
  asked and their settings checked at every open;
- the writer (:mod:`journal.kafka_writer`): built with ``transactional=True`` (the
  default), one transactional, idempotent, ``acks=all`` producer whose
  ``transactional.id`` is ``<namespace>.<slot>`` (the worker's slot name, qualified
  by the namespace so that a job in another namespace on the same cluster never
  fences this one); :meth:`KafkaBackend.commit` is one Kafka transaction.
  Constructing a backend calls ``init_transactions``, which fences any older
  producer with the same id (a zombie worker) and completes or aborts its open
  transaction. The writer module documents how errors are classified;
- the readers (:mod:`journal.kafka_readers`): pooled ``read_committed`` consumers,
  assigned to partitions, never committing offsets.

``transactional=False`` opens the backend for reading without touching the
worker's transactional id (opening a transactional producer would fence the
running worker). ``commit`` then uses a plain idempotent ``acks=all`` producer:
every record is durable once ``commit`` returns, but a crash mid-batch can leave
a prefix of it, so it is for tools and benchmarks, never for rollout workers.

``partition_writers=True`` is a worker fleet's backend (Kafka Streams' original
exactly-once): no slot producer, but one transactional producer per partition the
worker owns, ``transactional.id = <namespace>.p<N>``. :meth:`KafkaBackend.take_partition`
opens it with ``init_transactions``, which fences the partition's previous owner
and aborts its open transaction, so the partition's last stable offset reaches its
end before restore reads it. A commit is one transaction per partition
(:meth:`KafkaBackend.commit_partitions`): a partition whose writer was fenced (another
worker took it) fails alone with ``PartitionFencedError``.

Reads see every commit this backend has returned from (read-your-writes).
librdkafka logs go to the ``journal.kafka.librdkafka`` logger.

Access: every client logs in with the credentials of the settings (``librdkafka`` passthrough,
from the environment). Opening a backend logs in first, so a refused password is one
``AuthenticationFailedError`` at once rather than a timeout; then, unless the cluster grants this
client everything (no authorizer, or a super user), it checks the rights it will use (READ, and
WRITE when it writes, on both topics; DESCRIBE on its readers' group; READ on the worker group
``<namespace>.workers`` for a fleet's backend), and a missing one is a ``NotAuthorizedError``
naming the resource and the operation before anything is written. ``init_transactions`` names a
refused transactional id (``<namespace>.<slot>``, ``<namespace>.p<N>``) the same way. See
:mod:`journal.kafka_access`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from confluent_kafka.admin import AdminClient

from .backend import Backend, OutRecord, StoredRecord, Stream, partition_for
from .errors import ConfigurationError, JournalClosedError, JournalError, PartitionFencedError, RecordLocation
from .kafka_access import check_group_access, check_topic_access, wait_until_authenticated
from .kafka_clients import ClientErrors, admin_config, new_client
from .kafka_config import KafkaSettings
from .kafka_readers import Follower, ReaderPool, StreamingFollower
from .kafka_topics import TopicState, prepare_topics, record_limits, topic_configs
from .kafka_writer import KafkaWriter, StagedCommit

log = logging.getLogger(__name__)


class KafkaBackend(Backend):
    """Journal storage on Kafka; see the module docstring for the guarantees."""

    kind = "kafka"

    def __init__(self, settings: KafkaSettings, *, create_topics: bool = True, transactional: bool = True,
                 partition_writers: bool = False) -> None:
        self.settings = settings
        self.partitions = settings.partitions
        self.transactional = transactional or partition_writers
        self.writes_per_partition = partition_writers
        self.events_topic = settings.events_topic
        self.snapshots_topic = settings.snapshots_topic
        self.results_topic = settings.results_topic
        self._topics = {Stream.EVENTS: self.events_topic, Stream.SNAPSHOTS: self.snapshots_topic,
                        Stream.RESULTS: self.results_topic}
        self.topics: dict[str, TopicState] = {}  # what the open found: replicas, effective configs
        self._topic_max_bytes: int | None = None
        self._closed = False
        self._client_errors = ClientErrors(settings)  # the admin clients': a refused login ends the open at once
        # A writer's restore never reads a stale prefix.
        self.readers = ReaderPool(settings, stable=self.transactional)
        self.writer: KafkaWriter | None = None  # the slot's, or the plain one; None with partition writers
        self._owned: dict[int, KafkaWriter] = {}  # partition -> its writer <namespace>.p<N>
        self._owned_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None  # commits of several partitions run side by side
        if transactional and not partition_writers and settings.transactional_id is None:
            raise ConfigurationError(
                "KafkaSettings.transactional_id is required to commit (the worker's slot name, e.g. "
                "ROLLOUT_JOURNAL_KAFKA_TRANSACTIONAL_ID=worker-0); open with transactional=False to only read"
            )
        try:
            self._prepare_topics(create_topics)
            if not partition_writers:
                self.writer = self._new_writer(settings.producer_transactional_id if transactional else None)
                self.writer.open()
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        mode = "partition_writers=True" if self.writes_per_partition else f"transactional={self.transactional}"
        return f"KafkaBackend({self.settings!r}, {mode})"

    @property
    def transactional_id(self) -> str | None:
        """The producer's ``transactional.id``: ``<namespace>.<slot>`` (see ``KafkaSettings.producer_transactional_id``);
        None for a reader, and for a fleet's backend (one id per owned partition)."""
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
        """The configs the backend creates its topics with (see :mod:`journal.kafka_topics`)."""
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
                check_topic_access(admin, self.settings, self.topics,
                                   ["READ", "WRITE"] if self.transactional else ["READ"], timeout_s)
                check_group_access(admin, self.settings, self.readers.group, "DESCRIBE", timeout_s)
                if self.writes_per_partition:  # a fleet's worker joins the group that assigns partitions
                    check_group_access(admin, self.settings, self.settings.group_id, "READ", timeout_s)
        finally:
            admin.poll(0)  # deliver queued client logs
        # The journal chunks anything larger than max_record_bytes; the producer keeps batches below the topics' limit.
        self._topic_max_bytes, self.max_record_bytes = record_limits(self.topics, self.settings)

    # -- writing --------------------------------------------------------------------------

    def _new_writer(self, transactional_id: str | None, partition: int | None = None) -> KafkaWriter:
        return KafkaWriter(self.settings, self._topics, transactional_id=transactional_id,
                           max_batch_bytes=self._topic_max_bytes, on_committed=self.readers.note_committed,
                           partition=partition)

    def _writer(self) -> KafkaWriter:
        if self.writer is None:
            if self.writes_per_partition and not self._closed:
                raise ConfigurationError("this backend writes through one producer per owned partition: "
                                         "take_partition() first, and commit one partition's records at a time")
            raise JournalClosedError(f"Kafka backend for {self.events_topic} is closed")
        return self.writer

    def commit(self, records: Sequence[OutRecord]) -> list[RecordLocation]:
        """Write ``records`` in one Kafka transaction; their locations, in order.

        Raises ``AbortableCommitError`` (aborted, nothing visible, redo the batch),
        ``ProducerFencedError`` (a newer producer owns this slot) or
        ``FatalJournalError`` (stop; the backend refuses further commits).
        """
        self._check_open()
        for record in records:
            if record.value is None and record.stream is Stream.EVENTS:  # as the file backend: readers would choke
                raise ValueError(f"event record {record.key!r} has no value; only snapshots take tombstones")
        return self._writer_for(records).commit(records)

    def stage(self, records: Sequence[OutRecord]) -> StagedCommit:
        """Begin a transaction and produce ``records`` with every delivery confirmed, without committing.

        The caller must ``commit()`` or ``abort()`` the result; other commits on this
        backend wait until then. Raises like :meth:`commit` when producing fails.
        """
        self._check_open()
        return self._writer_for(records).stage(records)

    def _writer_for(self, records: Sequence[OutRecord]) -> KafkaWriter:
        """The slot's writer; with partition writers, that of the one partition ``records`` are on."""
        if not self.writes_per_partition:
            return self._writer()
        partitions = {partition_for(r.partition_key, self.partitions) for r in records}
        if len(partitions) != 1:
            raise ValueError(f"records on partitions {sorted(partitions)}: a fleet's backend commits one partition's "
                             "records per transaction (commit_partitions splits a batch)")
        return self._owned_writer(partitions.pop())

    # -- partition ownership (a worker fleet) -----------------------------------------------

    @property
    def owned_partitions(self) -> set[int]:
        with self._owned_lock:
            return set(self._owned)

    def take_partition(self, partition: int) -> None:
        """Become ``partition``'s only writer: open its producer ``<namespace>.p<N>`` with
        ``init_transactions``, which fences the previous owner and aborts (or completes) its open
        transaction. Blocks until done. Restore the partition's rollouts after this, never before."""
        if not self.writes_per_partition:
            raise ConfigurationError("take_partition() needs a backend opened with partition_writers=True")
        self._check_partition(partition)
        self._check_open()
        writer = self._new_writer(self.settings.partition_transactional_id(partition), partition)
        writer.open()
        with self._owned_lock:
            if self._closed:
                closing, previous = writer, None
            else:
                closing, previous = None, self._owned.get(partition)
                self._owned[partition] = writer
        for stale in (closing, previous):
            if stale is not None:
                stale.close()
        if closing is not None:
            raise JournalClosedError(f"Kafka backend for {self.events_topic} is closed")

    def release_partition(self, partition: int) -> None:
        """Stop writing ``partition``: flush and close its producer (its commits so far are durable).
        Later commits to it fail with ``PartitionFencedError``. Idempotent."""
        with self._owned_lock:
            writer = self._owned.pop(partition, None)
        if writer is not None:
            writer.close()

    def _owned_writer(self, partition: int) -> KafkaWriter:
        with self._owned_lock:
            writer = self._owned.get(partition)
        if writer is None:
            self._check_open()
            raise PartitionFencedError(
                f"partition {partition} of {self.events_topic} is not this worker's (never taken, or let go): "
                "its appends are refused", partition)
        return writer

    def commit_partitions(
        self, batches: Mapping[int, Sequence[OutRecord]]
    ) -> dict[int, list[RecordLocation] | BaseException]:
        """One transaction per partition, side by side; per partition, its locations or the error
        that failed it (``PartitionFencedError``: the partition is another worker's now;
        ``AbortableCommitError``: redo it; ``FatalJournalError``: stop)."""
        if not self.writes_per_partition:
            return super().commit_partitions(batches)
        self._check_open()

        def one(partition: int) -> list[RecordLocation] | BaseException:
            try:
                return self.commit(batches[partition])
            except (JournalError, ValueError) as exc:
                return exc

        partitions = [p for p, records in batches.items() if records]
        out: dict[int, list[RecordLocation] | BaseException] = {p: [] for p, records in batches.items() if not records}
        if len(partitions) <= 1:
            out.update({p: one(p) for p in partitions})
            return out
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=min(8, self.partitions), thread_name_prefix="partition-commit")
        out.update(zip(partitions, self._pool.map(one, partitions)))
        return out

    def _check_open(self) -> None:
        if self._closed:
            raise JournalClosedError(f"Kafka backend for {self.events_topic} is closed")

    # -- reading --------------------------------------------------------------------------

    def _check_partition(self, partition: int) -> None:
        if not 0 <= partition < self.partitions:
            raise ValueError(f"partition {partition} out of range: {self.events_topic} has {self.partitions} partitions")

    def end_offset(self, partition: int) -> int:
        """The last stable offset of an events partition: the next committed record's offset is at least this."""
        self._check_partition(partition)
        self._check_open()
        return self.readers.end_offset(self.events_topic, partition)

    def read_events(self, partition: int, from_offset: int = 0) -> Iterator[StoredRecord]:
        """Committed event records of one partition from ``from_offset`` to the end seen when reading starts."""
        self._check_partition(partition)
        if from_offset < 0:
            raise ValueError(f"from_offset must be >= 0, got {from_offset}")
        self._check_open()
        return self.readers.read(self.events_topic, [partition], from_offset)

    def read_snapshots(self, partitions: Collection[int] | None = None) -> Iterator[StoredRecord]:
        """Every retained snapshot record (tombstones as value None) of ``partitions`` (None: all),
        in log order per partition."""
        self._check_open()
        wanted = list(range(self.partitions)) if partitions is None else sorted(partitions)
        for partition in wanted:
            self._check_partition(partition)
        return self.readers.read(self.snapshots_topic, wanted, None)

    def read_results(self, partition: int, from_offset: int = 0) -> Iterator[StoredRecord]:
        """Committed results records of one partition from ``from_offset`` to the end seen when reading starts."""
        self._check_partition(partition)
        self._check_open()
        if self.results_topic not in self.topics:
            raise ConfigurationError(f"topic {self.results_topic} does not exist: namespace {self.settings.namespace} "
                                     "was written before results were published")
        return self.readers.read(self.results_topic, [partition], from_offset)

    def follow_results(self, offsets: dict[int, int]) -> StreamingFollower:
        """The results topic as it is committed, from ``offsets`` (per partition, the next offset to
        read; a partition missing: its start), through a ``read_committed`` consumer of its own."""
        self._check_open()
        if self.results_topic not in self.topics:
            raise ConfigurationError(f"topic {self.results_topic} does not exist: namespace {self.settings.namespace} "
                                     "was written before results were published")
        return StreamingFollower(self.readers, self.results_topic, self.partitions, offsets)

    def follow_snapshots(self) -> Follower:
        """The snapshot stream as it is committed: every retained record at the first ``poll()``,
        then what was committed since (a fleet's workers learn of new workloads this way)."""
        self._check_open()
        return Follower(self.readers, self.snapshots_topic, list(range(self.partitions)))

    # -- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        """Flush and close the producer and every consumer. Idempotent."""
        with self._owned_lock:
            if self._closed:
                return
            self._closed = True
            writers, self._owned = [self.writer, *self._owned.values()], {}
        self.writer = None
        for writer in writers:
            if writer is not None:
                writer.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.readers.close()


__all__ = ["KafkaBackend", "StagedCommit"]
