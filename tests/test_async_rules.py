"""An asyncio rule of the house, checked over the source with ``ast``.

No ``asyncio.wait_for``: on Python 3.11 (the floor) it returns the awaited result when it is
cancelled just as that result came, so the cancellation is lost. A periodic task that lost the
one that should stop it ran on, and whoever waited for it waited for ever (a run's end waited so
for its coordinated checkpoints). ``async with asyncio.timeout(s):`` keeps the cancellation.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.support.paths import REPO_ROOT

SOURCE_FOLDERS = ("schemas", "journal", "participants", "replay", "compose", "bench", "examples")


def python_files() -> Iterator[Path]:
    for folder in SOURCE_FOLDERS:
        yield from sorted((REPO_ROOT / folder).rglob("*.py"))


def wait_for_uses(path: Path) -> Iterator[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    where = path.relative_to(REPO_ROOT)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "wait_for"
            and isinstance(node.value, ast.Name)
            and node.value.id == "asyncio"
        ):
            yield f"{where}:{node.lineno}: asyncio.wait_for"
        elif isinstance(node, ast.ImportFrom) and node.module == "asyncio":
            yield from (
                f"{where}:{node.lineno}: from asyncio import wait_for" for a in node.names if a.name == "wait_for"
            )


def test_the_rule_reads_the_source() -> None:
    files = list(python_files())
    assert len(files) > 100, "the source folders were not found"
    assert any(path.name == "checkpoint.py" for path in files)


def test_no_asyncio_wait_for_in_the_source() -> None:
    uses = [use for path in python_files() for use in wait_for_uses(path)]
    assert not uses, "use `async with asyncio.timeout(s):` instead (see this module's docstring):\n" + "\n".join(uses)
