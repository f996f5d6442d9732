"""The suite's own layout: test modules mirror the packages and share what they share through
``tests/support/``, never by importing one another (a test module imported by another runs its
module-level set-up twice and couples two files' tests).

Mirroring: ``tests/journal/kafka/`` holds the tests of ``journal/kafka/``, and so on for every
room, so a room's tests are found where its code is. A test folder with no room behind it (a room
renamed or removed, a typo) fails here, as does a module that repeats its folder's name as a prefix
(``tests/journal/kafka/test_kafka_retry.py``: the folder already says it), and a test folder without
an ``__init__.py`` (tests/ is one package tree, which is what lets two rooms each have a
``test_backend.py``).

Read with ``ast``: every import in ``tests/`` and ``bench/``, wherever it stands.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.paths import REPO_ROOT

SCANNED = ("tests", "bench")
# Folders of tests/ that mirror no room: shared code and files, not tests.
NOT_ROOMS = ("support", "data", "java")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def python_files() -> list[Path]:
    return [p for folder in SCANNED for p in sorted((REPO_ROOT / folder).rglob("*.py")) if "data" not in p.parts]


def imported(code: str, package: str) -> set[str]:
    """The dotted names code in ``package`` may load: ``import a.b`` -> a.b; ``from a import b`` ->
    a and a.b (b may be a submodule); relative imports resolved from ``package``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def is_test_module(name: str) -> bool:
    return name.startswith("tests.") and name.rpartition(".")[2].startswith("test_")


def test_no_module_imports_a_test_module() -> None:
    wrong = []
    for path in python_files():
        name = module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for target in imported(path.read_text(encoding="utf-8"), package):
            if is_test_module(target) and target != name:
                wrong.append(f"{path.relative_to(REPO_ROOT)} imports {target}")
    assert not wrong, "share it through tests/support/ instead:\n" + "\n".join(sorted(wrong))


def test_the_reader_sees_each_spelling_of_an_import() -> None:
    code = (
        "from tests.journal.kafka import test_conformance\n"
        "import tests.replay.test_audit\n"
        "def f():\n"
        "    from .test_faults import leader_kill_drill\n"
    )
    names = imported(code, "tests.journal.kafka")
    assert {n for n in names if is_test_module(n)} == {
        "tests.journal.kafka.test_conformance",
        "tests.replay.test_audit",
        "tests.journal.kafka.test_faults",
    }


def mirroring_folders() -> list[Path]:
    """Every folder under tests/ that holds tests (not tests/ itself, nor the shared folders)."""
    tests = REPO_ROOT / "tests"
    return sorted(
        d
        for d in tests.rglob("*")
        if d.is_dir() and d.name != "__pycache__" and d.relative_to(tests).parts[0] not in NOT_ROOMS
    )


def test_every_test_folder_mirrors_a_room_of_the_library() -> None:
    folders = mirroring_folders()
    assert folders, "no test folders found under tests/"
    wrong = []
    for folder in folders:
        room = REPO_ROOT / folder.relative_to(REPO_ROOT / "tests")
        if not (room / "__init__.py").is_file():
            wrong.append(f"{folder.relative_to(REPO_ROOT)} mirrors no package ({room.relative_to(REPO_ROOT)}/ is none)")
    assert not wrong, "put each test module in the folder of the room it tests:\n" + "\n".join(wrong)


def test_every_test_folder_is_a_package() -> None:
    missing = [str(f.relative_to(REPO_ROOT)) for f in mirroring_folders() if not (f / "__init__.py").is_file()]
    assert not missing, "add an empty __init__.py (same basenames in two rooms collide without one):\n" + "\n".join(
        missing
    )


def test_no_test_module_repeats_its_folders_name() -> None:
    wrong = [
        str(path.relative_to(REPO_ROOT))
        for folder in mirroring_folders()
        for path in sorted(folder.glob("test_*.py"))
        if path.stem.startswith(f"test_{folder.name}_")
    ]
    assert not wrong, "the folder names the room already; drop the prefix:\n" + "\n".join(wrong)


def test_the_parallel_plugin_names_test_modules_that_exist() -> None:
    """A module renamed away from :mod:`tests.support.parallel`'s lists would start a second vLLM
    engine on another worker, or go last, and nothing else would say so."""
    from tests.support.parallel import LONGEST_FIRST, SHARED_VLLM_MODULES, VLLM_UNIT

    named = [*SHARED_VLLM_MODULES, *(unit for unit in LONGEST_FIRST if unit != VLLM_UNIT)]
    missing = [m for m in named if not (REPO_ROOT / m).is_file()]
    assert not missing, "tests/support/parallel.py names modules that are not there:\n" + "\n".join(missing)
