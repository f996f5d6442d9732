"""Jars from Maven Central, fetched once into a cache outside the repository.

A POM that only lists dependencies (``<packaging>pom</packaging>``) names a
classpath; :func:`ensure_maven_jars` runs ``mvn dependency:copy-dependencies``
on it when the cache is cold or the POM changed, so a warm start needs neither
Maven nor the network. :func:`build_once` is the cache discipline it rests on
(a lock, a partial folder, a marker written last), for anything else built
from those jars once (tests compile a Java peer with it).
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
from collections.abc import Callable
from pathlib import Path

from rollout_journal.compose.errors import LocalBrokerError

log = logging.getLogger(__name__)

CACHE_ENV_VAR = "ROLLOUT_JOURNAL_CACHE"
_POM_NS = {"m": "http://maven.apache.org/POM/4.0.0"}


class MissingToolError(LocalBrokerError):
    """A tool (java, javac, mvn) is not on PATH; the message says what to install."""


class JarDownloadError(LocalBrokerError):
    """Maven could not fetch a POM's jars."""


def cache_root() -> Path:
    """Root of everything cached outside git: ``$ROLLOUT_JOURNAL_CACHE`` or ``~/.cache/rollout-journal``."""
    env = os.environ.get(CACHE_ENV_VAR, "").strip()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "rollout-journal"


def pom_property(pom: Path, name: str) -> str:
    """The value of ``<properties><name>`` in ``pom`` (where each POM pins its version)."""
    node = ET.parse(pom).getroot().find(f"m:properties/m:{name}", _POM_NS)
    if node is None or not (node.text or "").strip():
        raise LocalBrokerError(f"{pom}: no <properties><{name}> element")
    return (node.text or "").strip()


def require_tool(name: str, what_to_install: str) -> str:
    """Path of ``name`` on PATH; :class:`MissingToolError` says what to install when absent."""
    path = shutil.which(name)
    if path is None:
        raise MissingToolError(f"`{name}` not found on PATH: install {what_to_install}")
    return path


def build_once(target: Path, key: str, build: Callable[[Path], None]) -> Path:
    """Return ``target``, built by ``build(folder)`` unless a build for ``key`` completed.

    ``build`` fills a fresh partial folder that is renamed to ``target`` only when
    it returns; a marker holding ``key`` is written after that, so an interrupted
    build is redone and a changed key (a new POM, new sources) rebuilds. A file
    lock makes concurrent callers, in any process, wait for one build.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    marker = target.with_name(f"{target.name}.complete")
    with open(target.with_name(f".{target.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists() and marker.read_text().strip() == key and target.is_dir():
            return target
        marker.unlink(missing_ok=True)
        shutil.rmtree(target, ignore_errors=True)
        partial = target.with_name(f"{target.name}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        build(partial)
        partial.rename(target)
        marker.write_text(key + "\n")
        return target


def ensure_maven_jars(pom: Path, folder: Path, purpose: str) -> Path:
    """Return a folder holding the runtime jars of ``pom``'s dependencies, downloading them once.

    The jars land in ``folder/libs`` (``folder`` is named after what the POM
    pins, e.g. ``<cache>/kafka-4.3.1``); ``purpose`` finishes the sentence
    "to fetch ... from Maven Central" in errors. Needs ``mvn`` only when the
    cache is cold or the POM changed.
    """

    def fetch(partial: Path) -> None:
        mvn = require_tool(
            "mvn", f"Apache Maven (e.g. `apt-get install maven`) to fetch {purpose} from Maven Central once"
        )
        cmd = [
            mvn,
            "-B",
            "-q",
            "-f",
            str(pom),
            "dependency:copy-dependencies",
            "-DincludeScope=runtime",
            f"-DoutputDirectory={partial}",
        ]
        log.info("fetching %s into %s", purpose, folder / "libs")
        started = time.monotonic()
        done = subprocess.run(cmd, check=False, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if done.returncode != 0 or not any(partial.glob("*.jar")):
            # Maven names the failing artifact or repository at the end of its output.
            output = "\n".join(((done.stdout or "") + (done.stderr or "")).rstrip().splitlines()[-40:])
            raise JarDownloadError(
                f"`mvn dependency:copy-dependencies` on {pom} failed "
                f"(exit {done.returncode}); check access to Maven Central or a mirror "
                f"in ~/.m2/settings.xml. Maven said:\n{output}"
            )
        log.info("fetched %d jars in %.1f s", len(list(partial.glob("*.jar"))), time.monotonic() - started)

    return build_once(folder / "libs", hashlib.sha256(pom.read_bytes()).hexdigest(), fetch)
