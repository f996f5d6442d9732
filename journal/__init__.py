"""The journal: Avro events of rollouts, made durable on Kafka or local files.

Public API (import from here, not from the modules)::

    from rollout_journal.journal import Journal, open_journal, ReadReport, load_rollouts

``KafkaBackend`` and ``KafkaSettings`` load lazily, so file-journal users never
import the Kafka client; so do ``HeadSigner`` and ``HeadVerifier`` (cryptography).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rollout_journal.journal.backend import Backend, HeldBack, OutRecord, StoredRecord, Stream, partition_for
from rollout_journal.journal.codec import Codec
from rollout_journal.journal.errors import (
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
from rollout_journal.journal.events import (
    AttemptFenced,
    AttemptStarted,
    BlobChunk,
    BlobRef,
    ChainHead,
    ChatMessage,
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
    RolloutGivenUp,
    SamplingParams,
    Snapshot,
    TemplateCheck,
    TokenSegment,
    ToolCallRef,
    TrainingRecord,
    TurnCompleted,
    WorkloadRegistered,
)
from rollout_journal.journal.extras import MissingExtraError
from rollout_journal.journal.fencing import EpochFence, FencedEventDropped
from rollout_journal.journal.file.backend import FileBackend
from rollout_journal.journal.group_commit import AppendReceipt
from rollout_journal.journal.journal import Cursor, Journal, JournaledEvent, ReadReport
from rollout_journal.journal.metrics import NO_METRICS, JournalMetrics
from rollout_journal.journal.open import is_kafka_url, open_backend, open_journal
from rollout_journal.journal.restore import RestorePlan, RolloutHistory, load_rollouts
from rollout_journal.journal.results import PublishedResult, ResultsFollower, follow_results
from rollout_journal.journal.snapshots import SnapshotDraft

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ loads on first use
    from rollout_journal.journal.anchoring import HeadSigner, HeadVerifier, SigningKeyError
    from rollout_journal.journal.kafka.backend import KafkaBackend
    from rollout_journal.journal.kafka.config import KafkaSettings

_LAZY = {
    "KafkaBackend": ".kafka.backend",
    "KafkaSettings": ".kafka.config",
    # signing loads the cryptography package: only for those who sign or verify
    "HeadSigner": ".anchoring",
    "HeadVerifier": ".anchoring",
    "SigningKeyError": ".anchoring",
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
    "HeldBack",
    "Journal",
    "JournalClosedError",
    "JournalDamageError",
    "JournalError",
    "JournalMetrics",
    "JournalStoppedError",
    "JournaledEvent",
    "KafkaBackend",
    "KafkaSettings",
    "Message",
    "ChatMessage",
    "MissingExtraError",
    "ModelCall",
    "ModelCallProgress",
    "OutputSegment",
    "NO_METRICS",
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
    "RolloutGivenUp",
    "RolloutHistory",
    "RolloutJournalError",
    "SamplingParams",
    "SigningKeyError",
    "Snapshot",
    "SnapshotDraft",
    "SnapshotsLostError",
    "StoredRecord",
    "Stream",
    "TemplateCheck",
    "TokenSegment",
    "ToolCallRef",
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
