"""The broker's runtime jars: fetched once with Maven into a cache outside the repository.

``compose/pom.xml`` pins the Kafka version and lists the classpath; nothing is
built from it. :func:`ensure_broker_jars` runs ``mvn dependency:copy-dependencies``
only when the cache is cold or the POM changed, so a warm start needs just ``java``.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from compose.errors import LocalBrokerError

log = logging.getLogger(__name__)

POM_PATH = Path(__file__).with_name("pom.xml")
CACHE_ENV_VAR = "ROLLOUT_JOURNAL_CACHE"
_MARKER_NAME = "libs.complete"


class MissingToolError(LocalBrokerError):
    """java or mvn is not on PATH; the message says what to install."""


class JarDownloadError(LocalBrokerError):
    """Maven could not fetch the broker's jars."""


def kafka_version(pom: Path = POM_PATH) -> str:
    """The Kafka version pinned in ``compose/pom.xml`` (single source of truth)."""
    ns = {"m": "http://maven.apache.org/POM/4.0.0"}
    node = ET.parse(pom).getroot().find("m:properties/m:kafka.version", ns)
    if node is None or not (node.text or "").strip():
        raise LocalBrokerError(f"{pom}: no <properties><kafka.version> element")
    return (node.text or "").strip()


def cache_root() -> Path:
    """Root of everything cached outside git: ``$ROLLOUT_JOURNAL_CACHE`` or ``~/.cache/rollout-journal``."""
    env = os.environ.get(CACHE_ENV_VAR, "").strip()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "rollout-journal"


def _require_tool(name: str, what_to_install: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise MissingToolError(f"`{name}` not found on PATH: install {what_to_install}")
    return path


def require_java() -> str:
    """Path of ``java``; :class:`MissingToolError` says what to install when there is none."""
    return _require_tool(
        "java",
        "a Java 17+ runtime (e.g. `apt-get install openjdk-17-jre-headless`) "
        "to run the local Kafka broker",
    )


def ensure_broker_jars(cache_dir: Path | None = None) -> Path:
    """Return a folder holding the broker's runtime jars, downloading them once.

    ``cache_dir`` is the cache root (default :func:`cache_root`); the jars land in
    ``<cache_dir>/kafka-<version>/libs``. A marker holding the POM's hash is written
    only after Maven succeeded, so an interrupted download is redone and an edited
    POM is refetched. A file lock makes concurrent callers wait for one download.
    Needs ``mvn`` only when the cache is cold.
    """
    pom_hash = hashlib.sha256(POM_PATH.read_bytes()).hexdigest()
    version_dir = (cache_dir or cache_root()) / f"kafka-{kafka_version()}"
    libs = version_dir / "libs"
    marker = version_dir / _MARKER_NAME
    version_dir.mkdir(parents=True, exist_ok=True)
    with open(version_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists() and marker.read_text().strip() == pom_hash and any(libs.glob("*.jar")):
            return libs
        mvn = _require_tool(
            "mvn",
            "Apache Maven (e.g. `apt-get install maven`) to fetch the Kafka broker "
            "jars from Maven Central once",
        )
        marker.unlink(missing_ok=True)
        shutil.rmtree(libs, ignore_errors=True)
        partial = version_dir / "libs.partial"
        shutil.rmtree(partial, ignore_errors=True)
        cmd = [
            mvn, "-B", "-q", "-f", str(POM_PATH), "dependency:copy-dependencies",
            "-DincludeScope=runtime", f"-DoutputDirectory={partial}",
        ]
        log.info("fetching Kafka %s broker jars into %s", kafka_version(), libs)
        started = time.monotonic()
        done = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if done.returncode != 0 or not any(partial.glob("*.jar")):
            # Maven names the failing artifact or repository at the end of its output.
            output = "\n".join(((done.stdout or "") + (done.stderr or "")).rstrip().splitlines()[-40:])
            raise JarDownloadError(
                f"`mvn dependency:copy-dependencies` on {POM_PATH} failed "
                f"(exit {done.returncode}); check access to Maven Central or a mirror "
                f"in ~/.m2/settings.xml. Maven said:\n{output}"
            )
        partial.rename(libs)
        marker.write_text(pom_hash + "\n")
        log.info("fetched %d jars in %.1f s", len(list(libs.glob("*.jar"))), time.monotonic() - started)
        return libs
