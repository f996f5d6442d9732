"""Error types of the journal. Each names the record or setting at fault.

Kafka errors follow librdkafka's classes: retriable errors are retried inside
the backend and never surface; ``AbortableCommitError`` means the batch was
aborted and may be redone; ``FatalJournalError`` (and its subclass
``ProducerFencedError``) means this writer must stop and let the next attempt
take over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RecordLocation:
    """Where a record lives: a topic partition offset or a file position."""

    source: str  # topic name or file path
    partition: int
    offset: int

    def __str__(self) -> str:
        if self.source.endswith(".seg") or "/" in self.source:
            return f"file {self.source} position {self.offset}"
        return f"topic {self.source} partition {self.partition} offset {self.offset}"


class RolloutJournalError(Exception):
    """Root of every error rollout-journal raises on purpose (journal, participants, replay).

    Each names the thing at fault; the command line turns one into a single line
    and an exit code, never a traceback.

    Errors pickle whole (class, message and fields), whatever their ``__init__`` takes:
    a scan's worker processes hand theirs to the process that reports them.
    """

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuilt, (type(self), self.args, self.__dict__)


def _rebuilt(cls: type[RolloutJournalError], args: tuple[Any, ...], fields: dict[str, Any]) -> RolloutJournalError:
    """An unpickled error: its class and fields, without calling an ``__init__`` of other arguments."""
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(fields)
    return error


class JournalError(RolloutJournalError):
    """Base class of every error the journal raises."""


class NotInJournalError(RolloutJournalError, LookupError):
    """The journal holds no rollout, resource or workload of the name asked for."""


class ConfigurationError(JournalError):
    """A setting is missing or invalid; the message names it."""


class NotAuthorizedError(ConfigurationError):
    """The cluster refused this client an operation on one resource: no ACL grants it.

    ``operation`` is the ACL operation to grant (``WRITE``), ``resource_type`` Kafka's
    resource type in words (``topic``, ``transactional id``, ``group``, ``cluster``),
    ``resource`` its name and ``principal`` who asked (``user ns-a``). Nothing the refused
    call would have written was written.
    """

    def __init__(self, operation: str, resource_type: str, resource: str, principal: str, hint: str) -> None:
        super().__init__(f"not authorized to {operation} {resource_type} {resource} as {principal}; {hint}")
        self.operation = operation
        self.resource_type = resource_type
        self.resource = resource
        self.principal = principal
        self.hint = hint


class AuthenticationFailedError(ConfigurationError):
    """The cluster refused the credentials themselves (user name, password or SASL mechanism)."""


class CorruptRecordError(JournalError):
    """A record's bytes cannot be decoded (bad CRC, bad magic, bad Avro body)."""

    def __init__(self, location: RecordLocation, reason: str) -> None:
        super().__init__(f"corrupt record at {location}: {reason}")
        self.location = location
        self.reason = reason


class JournalDamageError(JournalError):
    """Part of a journal's storage is gone beyond any one record (a missing file, say); what
    survives is still read, and readers that take a ``ReadReport`` find this in it."""

    def __init__(self, location: RecordLocation, reason: str) -> None:
        super().__init__(f"journal damaged at {location}: {reason}")
        self.location = location
        self.reason = reason


class SnapshotsLostError(JournalDamageError):
    """Records of the snapshot stream were lost, so it no longer lists every rollout: restore
    finds them in the event log instead and replays them from their first event."""


class UnknownSchemaError(CorruptRecordError):
    """The record names a writer schema fingerprint this reader does not keep."""

    def __init__(self, location: RecordLocation, fingerprint: bytes) -> None:
        super().__init__(
            location,
            f"unknown writer schema fingerprint {fingerprint.hex()}; "
            "upgrade rollout-journal or add the schema file to schemas/",
        )
        self.fingerprint = fingerprint


class FencedWriteError(JournalError):
    """An append from an attempt whose epoch is older than the rollout's current one."""

    def __init__(self, rollout_id: str, epoch: int, current_epoch: int) -> None:
        super().__init__(
            f"rollout {rollout_id}: epoch {epoch} is fenced by epoch {current_epoch}; "
            "this attempt was superseded and must stop"
        )
        self.rollout_id = rollout_id
        self.epoch = epoch
        self.current_epoch = current_epoch


class OversizedEventError(JournalError):
    """An event too large to journal even in pieces; only the append that carries it fails."""

    def __init__(self, rollout_id: str, turn: int, record: str, size: int, limit: int) -> None:
        super().__init__(
            f"rollout {rollout_id} turn {turn}: its {record} encodes to {size} bytes, over the journal's "
            f"max_event_bytes={limit}; this append is refused (nothing of it was written)"
        )
        self.rollout_id = rollout_id
        self.turn = turn
        self.size = size
        self.limit = limit


class ClusterUnreachableError(JournalError):
    """No broker of the Kafka cluster answered in time (wrong address, cluster down, network)."""


class UnstableReadError(JournalError):
    """An open transaction of another producer held a partition's last stable offset below its
    high watermark for longer than the bound: a read_committed read would have returned a prefix
    that lacks records committed after that transaction began, so the read is refused."""

    def __init__(self, topic: str, partition: int, stable: int, high: int, waited_s: float) -> None:
        super().__init__(
            f"topic {topic} partition {partition}: an open transaction holds the last stable offset at {stable}, "
            f"below the high watermark {high}, for over {waited_s:g} s; refusing to restore from a prefix that may "
            "lack committed records. Another producer writes this partition (a second worker on the same "
            "namespace, or a crashed one whose transaction the broker aborts after its transaction timeout): "
            "stop it, or retry once it is gone"
        )
        self.topic = topic
        self.partition = partition
        self.stable = stable
        self.high = high


class WriterLockedError(JournalError):
    """Another process holds the file journal's writer lock."""


class WriterTakenError(WriterLockedError):
    """A Kafka namespace is held by other writers (a fleet, or a ``run``/``resume`` of another
    ``--writer``): refused before anything was written; the message names who holds it."""


class AbortableCommitError(JournalError):
    """The commit was aborted (librdkafka ``txn_requires_abort``); nothing of it is visible.
    ``transient``: a broker or coordinator was away; redoing it is worth the wait."""

    transient: bool = False


class TransactionRestartedError(AbortableCommitError):
    """The transaction could not go on (it outlived ``transaction.timeout.ms``, its abort failed, the
    group's generation moved on): the producer was re-initialized under the same transactional id,
    which ends whatever the old one left open. Nothing of the batch is visible: redo what this
    process still owns."""

    transient = True


class RecordsRefusedError(AbortableCommitError):
    """The broker refused the records of some partitions themselves (too large, invalid): the
    transaction was aborted; redoing it without ``refused`` (partition -> why) succeeds or fails
    on its own."""

    def __init__(self, message: str, refused: dict[int, str]) -> None:
        super().__init__(message)
        self.refused = refused


class RevokedMidCommitError(AbortableCommitError):
    """Partitions of the batch were revoked while its transaction was open: it was aborted before its
    offsets were sent (a transaction never commits records of a partition it no longer owns); redo
    it without ``partitions``."""

    transient = True

    def __init__(self, message: str, partitions: set[int]) -> None:
        super().__init__(message)
        self.partitions = partitions


class FatalJournalError(JournalError):
    """The writer can no longer commit; stop it and let the next attempt take over."""


class ProducerFencedError(FatalJournalError):
    """A newer producer with the same ``transactional.id`` took over this worker slot."""


class PartitionFencedError(ProducerFencedError):
    """This process may no longer write one partition (its subclass ``PartitionRevokedError``: the
    group took it away). Only that partition's appends fail; the worker drops its rollouts and
    goes on."""

    def __init__(self, message: str, partition: int) -> None:
        super().__init__(message)
        self.partition = partition


class PartitionRevokedError(PartitionFencedError):
    """The consumer group no longer assigns this partition to this process (revoked, lost, or
    assigned anew since the append's rollout was admitted): the append is refused, nothing of it
    written; the partition's owner continues the rollout from its last committed turn."""


class SlotTakenOverError(ProducerFencedError):
    """A newer process with the same ``--writer`` replaced this one in the namespace's consumer group
    (its static member, ``group.instance.id = <namespace>.<writer>``): stop, it goes on. Said the
    same way whichever client learnt it first (the member's consumer, or its producer)."""

    def __init__(self, slot: str, namespace: str, detail: str) -> None:
        super().__init__(
            f"writer slot {slot} was fenced: a newer process with the same --writer took over "
            f"namespace {namespace} ({detail}); this one stops"
        )
        self.slot = slot


class JournalClosedError(JournalError):
    """The journal was closed or failed fatally; no more appends are accepted."""


class JournalStoppedError(JournalClosedError):
    """The journal's writer stopped after a fatal error, ``cause``; no more appends are accepted."""

    def __init__(self, cause: BaseException) -> None:
        # a fence is no fault: its message says who took over, in full
        super().__init__(
            f"journal stopped: {cause}" if writer_fenced(cause) else f"journal stopped after a fatal error: {cause}"
        )
        self.cause = cause


def writer_fenced(error: BaseException) -> bool:
    """Whether ``error`` means another process took over this writer's slot (directly, or as
    the cause of a stopped journal): the process should stop, and say so distinctly."""
    return isinstance(error, ProducerFencedError) or isinstance(getattr(error, "cause", None), ProducerFencedError)
