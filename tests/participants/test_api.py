"""The participants package names its public API, and loads it lazily: importing the package,
a name or a submodule never imports torch unless the model backend itself is asked for."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_journal import participants
from tests.support.paths import REPO_ROOT


def imports_torch(code: str) -> bool:
    probe = f"{code}\nimport sys\nprint('torch' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip() == "True"


def test_every_public_name_resolves_to_what_its_module_defines() -> None:
    from rollout_journal.participants.workload.config import WorkloadConfig
    from rollout_journal.participants.workload.runner import Runner

    assert participants.WorkloadConfig is WorkloadConfig and participants.Runner is Runner
    for name in participants.__all__:
        assert getattr(participants, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        participants.Nope  # noqa: B018


@pytest.mark.parametrize(
    "code",
    [
        "import rollout_journal.participants",
        "from rollout_journal.participants import WorkloadConfig, Runner, RolloutState, CoordinatedCheckpointer, make_environment",
        "import rollout_journal.participants.workload.config",
        "import rollout_journal.participants.workload.runner",
    ],
)
def test_the_package_and_its_submodules_load_without_torch(code: str) -> None:
    assert not imports_torch(code)


def test_the_model_backend_brings_torch_when_asked_for() -> None:
    assert imports_torch("from rollout_journal.participants import TorchPolicy")


def test_the_public_names_are_the_lazy_table() -> None:
    assert sorted(participants.__all__) == sorted(participants._EXPORTS)


def modules_loaded_by(code: str) -> set[str]:
    """The project's modules a fresh interpreter holds after running ``code`` (with this
    checkout's import path, so a worktree's own code is what is probed)."""
    probe = f"{code}\nimport sys\nprint(' '.join(m for m in sys.modules if m.startswith('rollout_journal')))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO_ROOT, check=False)
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


def test_the_aggregate_imports_no_environment_no_live_path_and_no_model() -> None:
    """``participants/rollout/`` folds events for every reader, offline ones included: it stands on
    the journal, the schemas and the resource contract alone."""
    every_module = (
        "import importlib, pkgutil\n"
        "import rollout_journal.participants.rollout as room\n"
        "for m in pkgutil.iter_modules(room.__path__):\n"
        "    importlib.import_module(f'{room.__name__}.{m.name}')"
    )
    loaded = modules_loaded_by(every_module)
    rooms = ("environments", "workload", "model", "remote", "trainer")
    assert not {m for m in loaded for room in rooms if m.startswith(f"rollout_journal.participants.{room}")}
    assert {"rollout_journal.participants.rollout.state", "rollout_journal.participants.rollout.lineage"} <= loaded


def imported_by(module_file: Path) -> set[str]:
    """Every module a source file imports, at its top or inside a function."""
    tree = ast.parse(module_file.read_text())
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    return names | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}


def test_the_tokenizer_does_not_import_the_tiny_model() -> None:
    """The tiny model is built from the tokenizer module (and holds the default tokenizer), never
    the other way round: no import cycle, not even one deferred into a function."""
    assert "rollout_journal.participants.model.tiny_model" not in imported_by(
        REPO_ROOT / "participants" / "model" / "tokenizer.py"
    )
    assert "rollout_journal.participants.model.tokenizer" in imported_by(
        REPO_ROOT / "participants" / "model" / "tiny_model.py"
    )
