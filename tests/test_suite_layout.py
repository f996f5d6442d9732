"""The suite's own layout: test modules mirror the packages and share what they share through
``tests/support/``, never by importing one another (a test module imported by another runs its
module-level set-up twice and couples two files' tests).

Read with ``ast``: every import in ``tests/`` and ``bench/``, wherever it stands.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.paths import REPO_ROOT

SCANNED = ("tests", "bench")


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
        "from tests.journal import test_conformance_kafka\n"
        "import tests.replay.test_audit\n"
        "def f():\n"
        "    from .test_kafka_faults import leader_kill_drill\n"
    )
    names = imported(code, "tests.journal")
    assert {n for n in names if is_test_module(n)} == {
        "tests.journal.test_conformance_kafka",
        "tests.replay.test_audit",
        "tests.journal.test_kafka_faults",
    }
