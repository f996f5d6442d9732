"""A command that needs an extra this install lacks says which to install, in one line.

The extras are hidden in a child interpreter (``sys.modules[name] = None`` makes ``import name``
fail as an absent package does); ``tests/test_packaging.py`` runs the same on a real core-only
install. What a command reads with the core alone is checked there too.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_journal.journal import MissingExtraError, RolloutJournalError
from rollout_journal.journal.extras import missing_extra
from rollout_journal.replay.exit_codes import EXIT_OTHER, exit_code_for
from tests.support.paths import DATA_DIR, REPO_ROOT

GOLDEN = DATA_DIR / "golden" / "file-journal"
DEMO = REPO_ROOT / "examples" / "demo.yaml"


def without(modules: list[str], argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``rollout-journal ARGV`` in a child where ``modules`` cannot be imported."""
    code = (
        "import sys\n"
        f"for name in {modules!r}: sys.modules[name] = None\n"
        "from rollout_journal.replay.cli.main import main\n"
        f"sys.exit(main({argv!r}))\n"
    )
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = result.stderr.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{result.stderr}"
    return lines[0]


def test_export_training_without_torch_names_the_torch_extra(tmp_path: Path) -> None:
    shutil.copytree(GOLDEN, tmp_path / "journal")
    result = without(["torch"], ["export-training", "--journal", "journal", "--out", "t.pt"], tmp_path)
    assert result.returncode == EXIT_OTHER
    assert one_line(result) == (
        "rollout-journal: `export-training` needs torch, which is not installed: pip install 'rollout-journal[torch]'"
    )
    assert not (tmp_path / "t.pt").exists()


def test_run_without_torch_names_the_torch_extra(tmp_path: Path) -> None:
    result = without(["torch"], ["run", str(DEMO), "--journal", str(tmp_path / "j")], tmp_path)
    assert result.returncode == EXIT_OTHER
    assert "pip install 'rollout-journal[torch]'" in one_line(result)


def test_serve_resources_without_the_http_stack_names_the_serve_extra(tmp_path: Path) -> None:
    result = without(["starlette", "uvicorn", "httpx"], ["serve-resources", "--environment", "counter"], tmp_path)
    assert result.returncode == EXIT_OTHER
    assert one_line(result).startswith("rollout-journal: `serve-resources` needs ")
    assert one_line(result).endswith("pip install 'rollout-journal[serve]'")


def test_the_offline_commands_read_a_journal_without_any_extra(tmp_path: Path) -> None:
    shutil.copytree(GOLDEN, tmp_path / "journal")
    extras = ["torch", "transformers", "safetensors", "starlette", "uvicorn", "httpx", "vllm", "testcontainers"]
    for argv in (
        ["replay", "list", "--journal", "journal"],
        ["replay", "show", "golden-g0-s0", "--journal", "journal", "--no-decode"],
        ["audit", "--journal", "journal"],
        ["verify", "--journal", "journal"],
        ["export", "--journal", "journal", "--out", "copy"],
        ["replay", "state", "golden-g0-s0/mail", "--revision", "0", "--journal", "journal"],
        ["replay", "report", "golden-g0-s0", "--journal", "journal", "--html", "report.html"],
        ["status", "--journal", "journal"],
        ["fork", "golden-g1-s0", "--at-turn", "1", "--journal", "journal"],
    ):
        result = without(extras, argv, tmp_path)
        assert result.returncode == 0, f"{argv}: {result.stderr}"


def test_a_missing_module_of_no_extra_is_left_as_it_is() -> None:
    assert missing_extra(ModuleNotFoundError("No module named 'mylab'", name="mylab"), "`run`") is None
    error = missing_extra(ModuleNotFoundError("No module named 'vllm.engine'", name="vllm.engine"), "the vllm backend")
    assert isinstance(error, MissingExtraError) and isinstance(error, RolloutJournalError)
    assert str(error) == "the vllm backend needs vllm, which is not installed: pip install 'rollout-journal[vllm]'"
    assert exit_code_for(error) == EXIT_OTHER


@pytest.mark.parametrize("module", ["torch", "transformers", "safetensors"])
def test_the_embedded_models_modules_come_with_the_torch_extra(module: str) -> None:
    error = missing_extra(ModuleNotFoundError(f"No module named {module!r}", name=module), "`demo`")
    assert error is not None and error.extra == "torch"
