"""``rollout-journal --version`` prints the installed distribution's version, read from its
metadata (what pip installed), and exits 0 without needing a command."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

from rollout_journal.replay.cli.main import main


def test_version_prints_the_installed_distributions_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"rollout-journal {importlib.metadata.version('rollout-journal')}\n"


def test_the_command_line_prints_it_too() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "rollout_journal.replay.cli.main", "--version"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == f"rollout-journal {importlib.metadata.version('rollout-journal')}\n"
