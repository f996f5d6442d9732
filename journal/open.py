"""Open a journal from one string: a directory path (the embedded file
backend) or ``kafka://host:port[,host:port]/namespace?...`` (Kafka)."""

from __future__ import annotations

from pathlib import Path

from .backend import Backend
from .errors import ConfigurationError
from .file_backend import FileBackend
from .journal import Journal

KAFKA_SCHEME = "kafka://"


def is_kafka_url(location: str) -> bool:
    return location.startswith(KAFKA_SCHEME)


def open_backend(location: str, *, writer: str = "worker-0", read_only: bool = False) -> Backend:
    """A backend for ``location``; ``writer`` is the stable worker slot (on Kafka the producer's
    ``transactional.id`` is ``<namespace>.<writer>``)."""
    if is_kafka_url(location):
        from .kafka_backend import KafkaBackend  # imported lazily: file users need no broker client
        from .kafka_config import KafkaSettings

        settings = KafkaSettings.from_url(location)
        if settings.transactional_id is None:  # neither the URL nor the environment named a slot
            settings = settings.model_copy(update={"transactional_id": writer})
        return KafkaBackend(settings, transactional=not read_only, create_topics=not read_only)
    if "://" in location:
        raise ConfigurationError(f"journal location {location!r}: unknown scheme; use a directory path or kafka://host:port/namespace")
    return FileBackend(Path(location), read_only=read_only)


def open_journal(location: str, *, writer: str = "worker-0", read_only: bool = False, **journal_options: object) -> Journal:
    return Journal(open_backend(location, writer=writer, read_only=read_only), **journal_options)
