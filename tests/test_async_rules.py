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


def wait_for_uses(path: Path, root: Path = REPO_ROOT) -> Iterator[str]:
    """Every use of asyncio's ``wait_for`` in one file, however asyncio was imported (``import
    asyncio as aio``, ``asyncio.tasks.wait_for``, ``from asyncio.tasks import wait_for as wf``).
    A ``getattr`` by string is beyond it."""
    tree = ast.parse(path.read_text(), filename=str(path))
    where = path.relative_to(root)
    modules = {"asyncio", "asyncio.tasks"}
    aliases = {"asyncio"} | {
        a.asname or a.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for a in node.names
        if a.name in modules
    }
    aliases |= {
        a.asname or a.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "asyncio"
        for a in node.names
        if a.name == "tasks"
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "wait_for" and _names_asyncio(node.value, aliases):
            yield f"{where}:{node.lineno}: {ast.unparse(node)}"
        elif isinstance(node, ast.ImportFrom) and node.module in modules:
            yield from (
                f"{where}:{node.lineno}: from {node.module} import wait_for" for a in node.names if a.name == "wait_for"
            )


def _names_asyncio(value: ast.expr, aliases: set[str]) -> bool:
    """``value`` is asyncio or its tasks module, by any name the file gave them."""
    if isinstance(value, ast.Name):
        return value.id in aliases
    return isinstance(value, ast.Attribute) and value.attr == "tasks" and _names_asyncio(value.value, aliases)


def test_the_rule_finds_every_spelling(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import asyncio\nimport asyncio as aio\nfrom asyncio import tasks\nfrom asyncio.tasks import wait_for as wf\n"
        "asyncio.wait_for(x, 1)\naio.wait_for(x, 1)\nasyncio.tasks.wait_for(x, 1)\ntasks.wait_for(x, 1)\n"
        "other.wait_for(x, 1)\n"
    )
    found = sorted(line.split(": ", 1)[1] for line in wait_for_uses(sample, tmp_path))
    assert found == sorted(
        [
            "from asyncio.tasks import wait_for",
            "asyncio.wait_for",
            "aio.wait_for",
            "asyncio.tasks.wait_for",
            "tasks.wait_for",
        ]
    )


def test_the_rule_reads_the_source() -> None:
    files = list(python_files())
    assert len(files) > 100, "the source folders were not found"
    assert any(path.name == "checkpoint.py" for path in files)


def test_no_asyncio_wait_for_in_the_source() -> None:
    uses = [use for path in python_files() for use in wait_for_uses(path)]
    assert not uses, "use `async with asyncio.timeout(s):` instead (see this module's docstring):\n" + "\n".join(uses)
