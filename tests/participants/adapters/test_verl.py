"""verl 0.9.1's ``AgentLoopBase`` on the session API (in verl's own venv, CPU, no Ray): its model
calls are journaled, and the same trainer step run again is answered from the journal."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.support.paths import REPO_ROOT

VENV = REPO_ROOT / ".venv-verl"


def verl_python() -> Path:
    if not (VENV / ".stamp").exists():
        # -o: never the project's own venv again (it would be rebuilt when pyproject.toml is newer
        # than its stamp), which the other test worker and its child processes are running from
        subprocess.run(["make", "-C", str(REPO_ROOT), "-o", ".venv/.installed-stamp", "venv-verl"], check=True)
    subprocess.run(["make", "-s", "-C", str(REPO_ROOT), "namespace"], check=True)
    return VENV / "bin" / "python"


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_rerun_trainer_step_gets_verl_loops_answered_from_the_journal(tmp_path: Path, upstream) -> None:
    python = verl_python()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def step() -> list[dict]:
        done = subprocess.run(
            [str(python), str(REPO_ROOT / "examples/verl_session_loop/run.py"), "--upstream", upstream.url,
             "--journal", str(tmp_path / "journal"), "--prompts", "2", "--turns", "3",
             "--upstream-logprobs", "processed"],  # the fixed-rate upstream's, declared
            capture_output=True, text=True, env=env, timeout=1200,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]

    first = step()
    generated = upstream.upstream.completions
    again = step()
    assert [r["live_calls"] for r in first] == [3, 3] and [r["replayed_calls"] for r in again] == [3, 3]
    assert [r["response_ids"] for r in again] == [r["response_ids"] for r in first]
    assert upstream.upstream.completions == generated + 1  # the rerun's upstream probe only: nothing regenerated
    assert all(r["sampled"] == 24 and r["reward"] == 3.0 for r in first)
