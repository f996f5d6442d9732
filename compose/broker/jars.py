"""The broker's runtime jars: fetched once with Maven into a cache outside the repository.

``compose/broker/pom.xml`` pins the Kafka version and lists the classpath; nothing is
built from it. :func:`ensure_broker_jars` fetches it with
:func:`rollout_journal.compose.maven_jars.ensure_maven_jars`, which runs Maven only when the
cache is cold or the POM changed, so a warm start needs just ``java``.
"""

from __future__ import annotations

from pathlib import Path

from rollout_journal.compose.maven_jars import (
    CACHE_ENV_VAR,
    JarDownloadError,
    MissingToolError,
    cache_root,
    ensure_maven_jars,
    pom_property,
    require_tool,
)

__all__ = [
    "CACHE_ENV_VAR",
    "POM_PATH",
    "JarDownloadError",
    "MissingToolError",
    "cache_root",
    "ensure_broker_jars",
    "kafka_version",
    "require_java",
]

POM_PATH = Path(__file__).with_name("pom.xml")


def kafka_version(pom: Path = POM_PATH) -> str:
    """The Kafka version pinned in ``compose/broker/pom.xml`` (single source of truth)."""
    return pom_property(pom, "kafka.version")


def require_java() -> str:
    """Path of ``java``; :class:`MissingToolError` says what to install when there is none."""
    return require_tool(
        "java",
        "a Java 17+ runtime (e.g. `apt-get install openjdk-17-jre-headless`) to run the local Kafka broker",
    )


def ensure_broker_jars(cache_dir: Path | None = None) -> Path:
    """Return a folder holding the broker's runtime jars, downloading them once.

    ``cache_dir`` is the cache root (default :func:`cache_root`); the jars land in
    ``<cache_dir>/kafka-<version>/libs``. Needs ``mvn`` only when the cache is cold.
    """
    return ensure_maven_jars(
        POM_PATH, (cache_dir or cache_root()) / f"kafka-{kafka_version()}", "the Kafka broker jars"
    )
