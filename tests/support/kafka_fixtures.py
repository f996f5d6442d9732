"""Pytest plugin: real Kafka brokers for the suite (``pytest_plugins = ["tests.support.kafka_fixtures"]``).

``kafka_bootstrap`` picks the first broker that works, in this order:

1. ``KAFKA_BOOTSTRAP_SERVERS`` from the environment (CI service, ``rollout-journal kafka up``);
2. a broker container started through testcontainers, when a Docker engine answers and the
   locally built broker image (:mod:`rollout_journal.compose.broker.image`) is there: nothing is pulled;
3. a 1-node broker started from Maven jars by :mod:`rollout_journal.compose.local_broker`.

``ROLLOUT_JOURNAL_TEST_BROKER`` pins step 2 or 3: ``jars`` skips the container,
``container`` insists on it (no fallback); ``auto``, the default, is the order above.
CI pins ``jars``: both run the same broker jars in one JVM, so a container makes the
suite no faster, while it would make every Kafka test depend on the engine CI just
started. The Docker path has tests of its own instead (``tests/compose/broker/test_docker_path.py``),
which call :func:`require_docker_path`: they skip where Docker is missing, and fail
where ``ROLLOUT_JOURNAL_EXPECT_DOCKER`` says it should be there (CI).

It never skips: with no broker at all, every test needing one fails with the reasons.
"""

from __future__ import annotations

import importlib
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from rollout_journal.compose.broker.image import engine_answers, image_name, image_status
from rollout_journal.compose.errors import LocalBrokerError
from rollout_journal.compose.local_broker import LocalKafkaCluster, start_local_cluster
from tests.support.summaries_check import assert_summaries_agree

log = logging.getLogger(__name__)

BOOTSTRAP_ENV_VAR = "KAFKA_BOOTSTRAP_SERVERS"
# The broker the controller of ``pytest -n`` workers started for them (tests.support.parallel). Not
# KAFKA_BOOTSTRAP_SERVERS: that one overrides the servers of every kafka:// URL a test or its child
# processes open, which a test of another cluster or of an unreachable one must not see.
SHARED_BOOTSTRAP_ENV_VAR = "ROLLOUT_JOURNAL_TEST_SHARED_BOOTSTRAP"
BROKER_ENV_VAR = "ROLLOUT_JOURNAL_TEST_BROKER"
BROKER_CHOICES = ("auto", "container", "jars")
# Set by CI after it set up Docker (or tried to): the Docker path's tests then fail, never skip.
EXPECT_DOCKER_ENV_VAR = "ROLLOUT_JOURNAL_EXPECT_DOCKER"
DOCKER_SETUP_LOG_ENV_VAR = "ROLLOUT_JOURNAL_DOCKER_SETUP_LOG"


def broker_mode() -> str:
    """The session broker's mode from ``ROLLOUT_JOURNAL_TEST_BROKER`` (default ``auto``)."""
    mode = os.environ.get(BROKER_ENV_VAR, "").strip().lower() or "auto"
    if mode not in BROKER_CHOICES:
        pytest.fail(f"{BROKER_ENV_VAR}={mode!r}: expected one of {', '.join(BROKER_CHOICES)}", pytrace=False)
    return mode


def docker_path_problems(*, engine: bool = True, testcontainers: bool = False, compose_tool: bool = False) -> list[str]:
    """What stops the Docker path here (empty when nothing does): engine and image, and the tools asked for."""
    problems = []
    if engine and not engine_answers():
        problems.append("no Docker engine answers `docker info` (as root: `dockerd --iptables=false --bridge=none &`)")
    elif engine and not image_status().usable:
        problems.append(
            f"the broker image {image_name()} is not built: run `python3 -m rollout_journal.compose.broker.image build`"
        )
    if testcontainers:
        try:
            importlib.import_module("testcontainers.core.container")
        except ImportError:
            problems.append("testcontainers is not installed: `pip install -e '.[docker]'`")
    if compose_tool and shutil.which("docker-compose") is None:
        problems.append("docker-compose is not installed (Debian: `apt-get install docker-compose`)")
    return problems


def choose_session_broker() -> tuple[str, list[str]]:
    """``("env" | "container" | "jars", reasons)``: which broker ``kafka_bootstrap`` uses, and why not the others."""
    if os.environ.get(BOOTSTRAP_ENV_VAR, "").strip():
        return "env", []
    mode = broker_mode()
    if mode == "jars":
        return "jars", [f"{BROKER_ENV_VAR}=jars"]
    problems = docker_path_problems(testcontainers=True)
    if mode == "container" or not problems:
        return "container", problems
    return "jars", problems


def require_docker_path(*, engine: bool = True, testcontainers: bool = False, compose_tool: bool = False) -> None:
    """Skip the calling test when the Docker path is missing here, or FAIL when CI expected it."""
    problems = docker_path_problems(engine=engine, testcontainers=testcontainers, compose_tool=compose_tool)
    if not problems:
        return
    text = "the Docker path is not available: " + "; ".join(problems)
    if os.environ.get(EXPECT_DOCKER_ENV_VAR, "").strip() not in ("", "0"):
        setup_log = os.environ.get(DOCKER_SETUP_LOG_ENV_VAR, "").strip()
        tail = ""
        if setup_log and Path(setup_log).exists():
            tail = (
                "\n--- tail of the Docker set-up log "
                + setup_log
                + "\n"
                + "\n".join(Path(setup_log).read_text(errors="replace").splitlines()[-30:])
            )
        pytest.fail(f"{text}\n({EXPECT_DOCKER_ENV_VAR} is set: Docker was expected here){tail}", pytrace=False)
    pytest.skip(text)


class NoSessionBroker(Exception):
    """No broker could be started for the session; the message names every way tried."""


@contextmanager
def session_broker(data_root: Path) -> Iterator[str]:
    """The session's broker as :func:`choose_session_broker` picks it (its data under ``data_root``),
    yielding its bootstrap servers; stopped on exit. Raises :class:`NoSessionBroker`."""
    choice, reasons = choose_session_broker()
    if choice == "env":
        yield os.environ[BOOTSTRAP_ENV_VAR].strip()
        return

    if choice == "container":
        from rollout_journal.compose.broker.container import start_broker_container

        if reasons:  # mode "container" with something missing: no fallback
            raise NoSessionBroker(f"{BROKER_ENV_VAR}=container, but: " + "; ".join(reasons))
        try:
            container = start_broker_container()
        except LocalBrokerError as exc:
            if broker_mode() == "container":
                raise NoSessionBroker(f"the broker container did not start: {exc}") from exc
            log.warning("the broker container did not start (%s); using the jar launcher", exc)
            reasons.append(f"broker container failed: {exc}")
        else:
            with container:
                yield container.bootstrap_servers
            return

    log.info("session broker from Maven jars (%s)", "; ".join(reasons) or "default")
    try:
        cluster = start_local_cluster(1, data_root)
    except LocalBrokerError as exc:
        reasons.append(f"local broker from Maven jars failed: {exc}")
        raise NoSessionBroker(
            "No Kafka broker for the tests. Set KAFKA_BOOTSTRAP_SERVERS, start Docker, or "
            "install java 17+ and mvn. Tried:\n- " + "\n- ".join(reasons)
        ) from exc
    with cluster:
        yield cluster.bootstrap_servers


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Bootstrap servers of a Kafka broker shared by the whole session (see module doc). Under
    ``pytest -n`` the controller started it for every worker (:mod:`tests.support.parallel`)."""
    shared = os.environ.get(SHARED_BOOTSTRAP_ENV_VAR, "").strip()
    if shared:
        yield shared
        return
    try:
        with session_broker(tmp_path_factory.mktemp("kafka-local")) as bootstrap:
            yield bootstrap
    except NoSessionBroker as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture
def kafka_cluster3(tmp_path: Path) -> Iterator[LocalKafkaCluster]:
    """A fresh 3-node local cluster (RF 3, min ISR 2) for fault tests; stopped afterwards."""
    try:
        cluster = start_local_cluster(3, tmp_path / "kafka3")
    except LocalBrokerError as exc:
        pytest.fail(f"could not start a 3-node local Kafka cluster: {exc}", pytrace=False)
    with cluster:
        yield cluster


@pytest.fixture
def kafka_namespace() -> str:
    """A topic prefix unique to this test, so tests share a broker but never a topic."""
    return f"t{uuid.uuid4().hex[:8]}"


BACKENDS = ["file", pytest.param("kafka", marks=pytest.mark.kafka)]
"""The journal backends a test runs on: the file journal, and Kafka (on the session's broker)."""


@pytest.fixture(params=BACKENDS)
def journal_location(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh journal on each backend: a directory, or a namespace of 4 partitions. What a test
    leaves in the namespace is listed from the rollouts' summaries and from their events after it:
    the two must agree."""
    if request.param == "file":
        yield str(tmp_path / "journal")
        return
    bootstrap = request.getfixturevalue("kafka_bootstrap")
    location = f"kafka://{bootstrap}/{request.getfixturevalue('kafka_namespace')}?partitions=4"
    yield location
    assert_summaries_agree(location)
