"""Suite-wide set-up: the Kafka fixtures, and one embedded model folder per test session.

The tiny Llama every backend loads is built once into a folder of this session
(``ROLLOUT_JOURNAL_MODEL_CACHE``, set before any test or child process starts, so the
workload children of the recovery tests load the same folder). vLLM's compile caches
live under the project (``.cache/vllm``, ignored by git): kept between sessions, they
spare the first engine of a session its kernel compilation.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

# The shared pieces in tests/support/ hold assertions of their own (scenarios, drills, checks):
# rewritten like a test module's, so a failure there shows its values too.
pytest.register_assert_rewrite("tests.support")

pytest_plugins = [
    "tests.support.kafka_fixtures",
    "tests.support.vllm_fixtures",
    "tests.support.gateway_fixtures",
    "tests.support.parallel",
    "tests.support.signal_state",
]

_session_models: str | None = None


def pytest_configure(config) -> None:
    # imported here, not above: tests.support must be registered for assertion rewriting first
    from tests.support.paths import REPO_ROOT

    global _session_models
    if "ROLLOUT_JOURNAL_MODEL_CACHE" not in os.environ:
        _session_models = tempfile.mkdtemp(prefix="rj-test-models-")
        os.environ["ROLLOUT_JOURNAL_MODEL_CACHE"] = _session_models
    os.environ.setdefault("ROLLOUT_JOURNAL_VLLM_CACHE", str(REPO_ROOT / ".cache" / "vllm"))
    os.environ.setdefault("TMPDIR", tempfile.gettempdir())


def pytest_unconfigure(config) -> None:
    if _session_models is not None:
        shutil.rmtree(_session_models, ignore_errors=True)
