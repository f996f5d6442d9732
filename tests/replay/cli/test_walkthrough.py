"""The README's "Debugging a crashed rollout" runs as written: every command of its code blocks,
in order, in a fresh folder that holds the repository's ``examples/``, each ending with exit code
0; where the README shows a command's output, the real output begins with the same line.

(Set ``ROLLOUT_JOURNAL_WALKTHROUGH_OUT=DIR`` to keep each command's output there: the README's
samples are pasted from it.)"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.paths import REPO_ROOT

ELSEWHERE = "kafka://"  # the Kafka export needs the demo run on Kafka: replay/test_commands.py exports a namespace


@dataclass
class Step:
    command: str
    shown: list[str]  # the output the README shows (console blocks), empty if none


def walkthrough() -> list[Step]:
    text = (REPO_ROOT / "README.md").read_text()
    section = text[text.index("## Debugging a crashed rollout") :]
    section = section[: section.index("\n## ", 10)]
    steps: list[Step] = []
    for kind, body in re.findall(r"^```(sh|console)\n(.*?)^```$", section, re.M | re.S):
        if kind == "sh":
            steps += [Step(line, []) for line in body.splitlines() if line.strip() and not line.startswith("#")]
            continue
        for chunk in re.split(r"^\$ ", body, flags=re.M)[1:]:
            command, *shown = chunk.splitlines()
            steps.append(Step(command, shown))
    return steps


def timeless(line: str) -> str:
    """A line with its measured times (``26.731 s``, ``1.27``) left out: they differ run to run."""
    return re.sub(r"\d+\.\d+", "N", line.rstrip())


@pytest.mark.slow
def test_the_debugging_walkthrough_runs_as_written(tmp_path: Path) -> None:
    shutil.copytree(REPO_ROOT / "examples", tmp_path / "examples", ignore=shutil.ignore_patterns("grpo"))
    keep = os.environ.get("ROLLOUT_JOURNAL_WALKTHROUGH_OUT")
    env = os.environ | {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("ROLLOUT_JOURNAL_URL", None)
    steps = walkthrough()
    assert len(steps) >= 12 and steps[0].command.startswith("rollout-journal demo")
    differ = []
    for i, step in enumerate(steps):
        if ELSEWHERE in step.command:
            continue
        done = subprocess.run(
            ["bash", "-c", step.command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=True)
            (Path(keep) / f"{i:02d}.txt").write_text(f"$ {step.command}\n{done.stdout}{done.stderr}")
        assert done.returncode == 0, f"{step.command}: exit {done.returncode}\n{done.stderr[-3000:]}"
        if step.shown and "..." not in step.shown[0]:
            first = done.stdout.splitlines()[0] if done.stdout else ""
            if timeless(first) != timeless(step.shown[0]):
                differ.append(f"{step.command}: the README shows {step.shown[0]!r}, it printed {first!r}")
    assert differ == []
