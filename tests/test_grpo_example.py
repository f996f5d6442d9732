"""The GRPO example runs to its end in its small configuration, with a worker, a resource server
and the trainer SIGKILLed once each: every prompt group trained exactly once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.paths import REPO_ROOT


@pytest.mark.slow
@pytest.mark.kafka
def test_the_grpo_example_trains_every_group_once_across_three_kills(kafka_bootstrap: str) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "examples" / "grpo" / "run.py"), "--small", "--json"],
        capture_output=True,
        text=True,
        timeout=1200,
        env=os.environ | {"PYTHONPATH": str(REPO_ROOT), "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["steps"] == report["groups_trained"] == report["groups"] == 6
    assert report["groups_lost"] == 0 and report["groups_trained_twice"] == 0
    assert report["kills"] == {"resource_server": 1, "worker": 1, "trainer": 1}
    assert report["policy_versions_sampled"] >= 1  # how many the workers took up depends on timing
