"""Pytest plugin: the suite on several worker processes (``make test`` runs ``pytest -n 2 --dist loadfile``).

Most of the suite waits (on the broker's commits, on a worker process that was killed, on a JVM
that restarts), so on two cores two workers finish it well before one. What the suite shares
stays shared:

- **One broker.** The controller starts the session's broker before the workers start and hands
  it to them in ``ROLLOUT_JOURNAL_TEST_SHARED_BOOTSTRAP``, which only ``kafka_bootstrap`` reads
  (each test has its own namespace on it); it is stopped after the last worker finished. Not in
  ``KAFKA_BOOTSTRAP_SERVERS``: that would override every ``kafka://`` URL a test opens. Where it
  cannot start one, each worker tries on its own and its Kafka tests fail with the reasons, as
  without workers.
- **One vLLM engine and one vLLM server.** A test module runs whole on one worker (``loadfile``),
  and the modules that use the engine or the server (:data:`SHARED_VLLM_MODULES`) run on the same
  one: the engine and the server start once, as without workers. A module that uses them without
  being listed there is refused at collection, naming it (it would start a second engine).
- **The longest modules first** (:data:`LONGEST_FIRST`): a module that takes minutes and starts
  last would leave one worker alone at the end.

Without ``-n``, nothing here changes anything.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import OrderedDict
from contextlib import ExitStack
from pathlib import Path

import pytest

from tests.support.kafka_fixtures import BOOTSTRAP_ENV_VAR, SHARED_BOOTSTRAP_ENV_VAR, NoSessionBroker, session_broker

SHARED_VLLM_MODULES = (
    "tests/participants/model/test_vllm.py",
    "tests/participants/model/test_training_data.py",
    "tests/participants/model/test_weight_sync.py",
    "tests/participants/remote/gateway/test_vllm.py",
    "tests/participants/adapters/test_verifiers.py",
)
"""The modules using the session's vLLM engine or server (``vllm_engine``, ``vllm_server``): one unit of work."""

VLLM_UNIT = "vllm"
VLLM_FIXTURES = frozenset({"vllm_engine", "vllm_server"})

LONGEST_FIRST = (
    "tests/participants/workload/test_recovery.py",
    "tests/test_bench_smoke.py",
    "tests/journal/kafka/test_broker_loss.py",
    "tests/participants/workload/test_fleet.py",
    "tests/journal/kafka/test_security.py",
    VLLM_UNIT,
    "tests/participants/workload/test_racing_writers.py",
    "tests/journal/kafka/test_backend.py",
)
"""Units of work that take minutes, longest first (from ``--durations``); the others follow."""


def workers_asked(config: pytest.Config) -> bool:
    """Whether this process is the controller of ``pytest -n N`` workers (N > 0)."""
    return not hasattr(config, "workerinput") and bool(getattr(config.option, "numprocesses", None))


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its module, or :data:`VLLM_UNIT` for the shared engine's."""
    module = module_of(nodeid)
    return VLLM_UNIT if module in SHARED_VLLM_MODULES else module


_broker = ExitStack()


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    """In the controller, before the workers start (they inherit the environment): the broker."""
    if not workers_asked(session.config) or os.environ.get(BOOTSTRAP_ENV_VAR, "").strip():
        return  # a serial run, or a broker given: each worker's kafka_bootstrap takes it as before
    data = Path(tempfile.mkdtemp(prefix="rj-test-broker-"))
    _broker.callback(shutil.rmtree, data, ignore_errors=True)
    try:
        bootstrap = _broker.enter_context(session_broker(data))
    except (NoSessionBroker, pytest.fail.Exception) as exc:  # each worker tries, and its tests say why
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"no broker shared by the workers; each tries its own: {exc}", yellow=True)
        return
    os.environ[SHARED_BOOTSTRAP_ENV_VAR] = bootstrap
    _broker.callback(os.environ.pop, SHARED_BOOTSTRAP_ENV_VAR, None)


def pytest_unconfigure(config: pytest.Config) -> None:
    _broker.close()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse a module that uses the shared vLLM engine or server without sharing its unit."""
    strays = sorted(
        {
            module_of(item.nodeid)
            for item in items
            if VLLM_FIXTURES & set(getattr(item, "fixturenames", ())) and unit_of(item.nodeid) != VLLM_UNIT
        }
    )
    if strays:
        raise pytest.UsageError(
            f"{', '.join(strays)} use the session's vLLM engine or server: add them to SHARED_VLLM_MODULES "
            "in tests/support/parallel.py, so that every worker but one goes without an engine"
        )


@pytest.hookimpl(optionalhook=True)  # a hook of xdist's own: none without it
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """``--dist loadfile`` with the vLLM modules as one unit and the longest units first."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling  # only under -n: xdist is there

    class ModulesLongestFirst(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

        def _assign_work_unit(self, node: object) -> None:
            queue: OrderedDict[str, dict[str, bool]] = self.workqueue
            for unit in reversed(LONGEST_FIRST):
                if unit in queue:
                    queue.move_to_end(unit, last=False)
            super()._assign_work_unit(node)

    return ModulesLongestFirst(config, log)
