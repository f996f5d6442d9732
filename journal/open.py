"""Open a journal from one string: a directory path (the embedded file
backend) or ``kafka://host:port[,host:port]/namespace?...`` (Kafka)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, TypedDict, Unpack

from rollout_journal.journal.backend import Backend
from rollout_journal.journal.errors import ConfigurationError
from rollout_journal.journal.file.backend import FileBackend
from rollout_journal.journal.journal import Journal
from rollout_journal.journal.metrics import JournalMetrics

KAFKA_SCHEME = "kafka://"

Mode = Literal["slot", "read", "member", "partitions", "plain", "exclusive"]
"""How a journal is opened: ``slot``, the single writer of its worker slot (``writer``; on Kafka a
library mode for tools and tests: nothing keeps a second slot off the namespace); ``read``, only
reading (never fences a writer); ``member``, a member of the namespace's consumer group that writes
only the partitions the group assigns it (a fleet's ``worker``, and ``run``/``resume``; Kafka only;
``partitions`` is its old name); ``plain``, durable single-record writes without a transaction,
topics created if missing (a trainer's acknowledgement requests; Kafka only); ``exclusive``, a
transactional writer under ``<namespace>.<writer>`` whatever the environment names (``submit``: two
submits of one workload fence each other, and its records on two topics commit together; Kafka
only)."""


class JournalOptions(TypedDict, total=False):
    """The keyword options of :class:`Journal` (see its ``__init__``, where their defaults and
    meaning live), passed on by ``open_journal``. Restated so callers' options are type-checked;
    tests/journal/test_open.py fails when the two lists differ in a name or a type."""

    linger_ms: float
    max_batch_appends: int
    max_commit_attempts: int
    inline_snapshot_limit: int
    max_record_bytes: int
    max_event_bytes: int
    metrics: JournalMetrics | None
    commit_interval_ms: float
    acknowledgement_bucket_size: int
    snapshot_block_bytes: int


def is_kafka_url(location: str) -> bool:
    return location.startswith(KAFKA_SCHEME)


def open_backend(
    location: str, *, writer: str = "worker-0", read_only: bool = False, mode: Mode | None = None
) -> Backend:
    """A backend for ``location``; ``writer`` is the stable worker slot (on Kafka the producer's
    ``transactional.id`` is ``<namespace>.<writer>``). ``read_only`` is ``mode="read"``."""
    mode = mode or ("read" if read_only else "slot")
    if is_kafka_url(location):
        from rollout_journal.journal.kafka.backend import (
            KafkaBackend,  # imported lazily: file users need no broker client
        )
        from rollout_journal.journal.kafka.config import KafkaSettings

        settings = KafkaSettings.from_url(location)
        if mode == "slot" and settings.transactional_id is None:  # neither the URL nor the environment named one
            settings = settings.model_copy(update={"transactional_id": writer})
        if mode in ("member", "partitions"):
            return KafkaBackend(settings, member=writer)
        if mode == "exclusive":  # the writer's own id, never a slot the environment names
            return KafkaBackend(settings.model_copy(update={"transactional_id": writer}))
        return KafkaBackend(settings, transactional=mode == "slot", create_topics=mode != "read")
    if "://" in location:
        raise ConfigurationError(
            f"journal location {location!r}: unknown scheme; use a directory path or kafka://host:port/namespace"
        )
    if mode in ("member", "partitions", "plain", "exclusive"):
        raise ConfigurationError(
            f"journal {location}: a worker fleet shares a namespace on Kafka "
            "(kafka://host:port/namespace); a file journal has one writer: use `rollout-journal run`"
        )
    return FileBackend(Path(location), read_only=mode == "read")


def open_journal(
    location: str,
    *,
    writer: str = "worker-0",
    read_only: bool = False,
    mode: Mode | None = None,
    **journal_options: Unpack[JournalOptions],
) -> Journal:
    return Journal(open_backend(location, writer=writer, read_only=read_only, mode=mode), **journal_options)
