"""The journal: Avro events of rollouts, made durable on Kafka or local files.

Public API (import from here, not from the modules)::

    from journal import Journal, open_journal, ReadReport, load_rollouts

``KafkaBackend`` and ``KafkaSettings`` load lazily, so file-journal users never
import the Kafka client.
"""

from __future__ import annotations

from typing import Any

from .backend import Backend, OutRecord, StoredRecord, Stream, partition_for
from .codec import Codec
from .errors import (
    AbortableCommitError,
    ConfigurationError,
    CorruptRecordError,
    FatalJournalError,
    FencedWriteError,
    JournalClosedError,
    JournalError,
    JournalStoppedError,
    OversizedEventError,
    ProducerFencedError,
    RecordLocation,
    RolloutJournalError,
    UnknownSchemaError,
    WriterLockedError,
    writer_fenced,
)
from .events import (
    AttemptFenced,
    AttemptStarted,
    BlobChunk,
    BlobRef,
    EventChunk,
    Header,
    Message,
    ModelCall,
    Record,
    ResourceMutation,
    RolloutAcknowledged,
    RolloutEvent,
    RolloutFinished,
    SamplingParams,
    Snapshot,
    TurnCompleted,
)
from .fencing import EpochFence, FencedEventDropped
from .file_backend import FileBackend
from .group_commit import AppendReceipt
from .journal import Cursor, Journal, JournaledEvent, ReadReport
from .open import is_kafka_url, open_backend, open_journal
from .restore import RestorePlan, RolloutHistory, load_rollouts
from .snapshots import SnapshotDraft

_LAZY = {"KafkaBackend": ".kafka_backend", "KafkaSettings": ".kafka_config"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AbortableCommitError", "AppendReceipt", "AttemptFenced", "AttemptStarted", "Backend", "BlobChunk", "BlobRef",
    "Codec", "ConfigurationError", "CorruptRecordError", "Cursor", "EpochFence", "EventChunk", "FatalJournalError",
    "FencedEventDropped", "FencedWriteError", "FileBackend", "Header", "Journal", "JournalClosedError",
    "JournalError", "JournalStoppedError", "JournaledEvent", "KafkaBackend", "KafkaSettings", "Message", "ModelCall",
    "OutRecord", "OversizedEventError",
    "ProducerFencedError", "ReadReport", "Record", "RecordLocation", "ResourceMutation", "RestorePlan",
    "RolloutAcknowledged", "RolloutEvent", "RolloutFinished", "RolloutHistory", "RolloutJournalError",
    "SamplingParams", "Snapshot", "SnapshotDraft", "StoredRecord", "Stream", "TurnCompleted", "UnknownSchemaError",
    "WriterLockedError", "is_kafka_url", "load_rollouts", "open_backend", "open_journal", "partition_for",
    "writer_fenced",
]
