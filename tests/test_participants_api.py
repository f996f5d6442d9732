"""The participants package names its public API, and loads it lazily: importing the package,
a name or a submodule never imports torch unless the model backend itself is asked for."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import participants

REPO = Path(__file__).resolve().parent.parent


def imports_torch(code: str) -> bool:
    probe = f"{code}\nimport sys\nprint('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip() == "True"


def test_every_public_name_resolves_to_what_its_module_defines() -> None:
    from participants.config import WorkloadConfig
    from participants.runner import Runner

    assert participants.WorkloadConfig is WorkloadConfig and participants.Runner is Runner
    for name in participants.__all__:
        assert getattr(participants, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        participants.Nope  # noqa: B018


@pytest.mark.parametrize("code", [
    "import participants",
    "from participants import WorkloadConfig, Runner, RolloutState, CoordinatedCheckpointer, make_environment",
    "import participants.config",
    "import participants.runner",
])
def test_the_package_and_its_submodules_load_without_torch(code: str) -> None:
    assert not imports_torch(code)


def test_the_model_backend_brings_torch_when_asked_for() -> None:
    assert imports_torch("from participants import TorchPolicy")


def test_the_public_names_are_the_lazy_table() -> None:
    assert sorted(participants.__all__) == sorted(participants._EXPORTS)
