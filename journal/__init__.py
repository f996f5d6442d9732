"""The journal: Avro events of rollouts, made durable on Kafka or local files.

Public API (import from here, not from the modules)::

    from journal import Journal, open_journal, ReadReport, load_rollouts

``KafkaBackend`` and ``KafkaSettings`` load lazily, so file-journal users never
import the Kafka client; so do ``HeadSigner`` and ``HeadVerifier`` (cryptography).
"""

from __future__ import annotations

from typing import Any

from .backend import Backend, OutRecord, StoredRecord, Stream, partition_for
from .codec import Codec
from .errors import (
    AbortableCommitError,
    AuthenticationFailedError,
    ClusterUnreachableError,
    ConfigurationError,
    CorruptRecordError,
    FatalJournalError,
    FencedWriteError,
    JournalClosedError,
    JournalDamageError,
    JournalError,
    JournalStoppedError,
    NotAuthorizedError,
    NotInJournalError,
    OversizedEventError,
    PartitionFencedError,
    ProducerFencedError,
    RecordLocation,
    RolloutJournalError,
    SnapshotsLostError,
    UnknownSchemaError,
    UnstableReadError,
    WriterLockedError,
    writer_fenced,
)
from .events import (
    AttemptFenced,
    AttemptStarted,
    BlobChunk,
    BlobRef,
    ChainHead,
    EventChunk,
    HeadCheckpoint,
    Header,
    Message,
    ModelCall,
    ModelCallProgress,
    OutputSegment,
    Record,
    ResourceMutation,
    RolloutAcknowledged,
    RolloutEvent,
    RolloutFailed,
    RolloutFinished,
    SamplingParams,
    Snapshot,
    TokenSegment,
    TrainingRecord,
    TurnCompleted,
    WorkloadRegistered,
)
from .fencing import EpochFence, FencedEventDropped
from .file_backend import FileBackend
from .group_commit import AppendReceipt
from .journal import Cursor, Journal, JournaledEvent, ReadReport
from .open import is_kafka_url, open_backend, open_journal
from .restore import RestorePlan, RolloutHistory, load_rollouts
from .results import PublishedResult, ResultsFollower, follow_results
from .snapshots import SnapshotDraft

_LAZY = {
    "KafkaBackend": ".kafka_backend", "KafkaSettings": ".kafka_config",
    # signing loads the cryptography package: only for those who sign or verify
    "HeadSigner": ".anchoring", "HeadVerifier": ".anchoring", "SigningKeyError": ".anchoring",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AbortableCommitError",
    "AppendReceipt",
    "AttemptFenced",
    "AttemptStarted",
    "AuthenticationFailedError",
    "Backend",
    "BlobChunk",
    "BlobRef",
    "ChainHead",
    "ClusterUnreachableError",
    "Codec",
    "ConfigurationError",
    "CorruptRecordError",
    "Cursor",
    "EpochFence",
    "EventChunk",
    "FatalJournalError",
    "FencedEventDropped",
    "FencedWriteError",
    "FileBackend",
    "HeadCheckpoint",
    "HeadSigner",
    "HeadVerifier",
    "Header",
    "Journal",
    "JournalClosedError",
    "JournalDamageError",
    "JournalError",
    "JournalStoppedError",
    "JournaledEvent",
    "KafkaBackend",
    "KafkaSettings",
    "Message",
    "ModelCall",
    "ModelCallProgress",
    "OutputSegment",
    "NotAuthorizedError",
    "NotInJournalError",
    "OutRecord",
    "OversizedEventError",
    "PartitionFencedError",
    "ProducerFencedError",
    "PublishedResult",
    "ReadReport",
    "Record",
    "RecordLocation",
    "ResourceMutation",
    "ResultsFollower",
    "RestorePlan",
    "RolloutAcknowledged",
    "RolloutEvent",
    "RolloutFailed",
    "RolloutFinished",
    "RolloutHistory",
    "RolloutJournalError",
    "SamplingParams",
    "SigningKeyError",
    "Snapshot",
    "SnapshotDraft",
    "SnapshotsLostError",
    "StoredRecord",
    "Stream",
    "TokenSegment",
    "TrainingRecord",
    "TurnCompleted",
    "UnknownSchemaError",
    "UnstableReadError",
    "WorkloadRegistered",
    "WriterLockedError",
    "follow_results",
    "is_kafka_url",
    "load_rollouts",
    "open_backend",
    "open_journal",
    "partition_for",
    "writer_fenced",
]
