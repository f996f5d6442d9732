"""The house's layer rules, checked over the import graph of the five packages.

Dependencies point one way, ``replay -> participants -> journal -> schemas`` (``compose`` runs the
broker and leans on the journal only); inside ``participants`` the aggregate (``rollout/``) knows no
environment and nothing of the live path (``workload/``, ``model/``, ``remote/``); offline replay
(``replay/`` but its command line) reads journals and never imports what runs a rollout.

The graph is read from the source with ``ast``, not by importing it: every ``import`` wherever it
stands (at the top, inside a function, under ``if TYPE_CHECKING:``), and every module a package's
lazy export table (``_EXPORTS`` / ``_LAZY``) names. ``from package import name`` counts as an
import of the package and of the module its table loads ``name`` from, or of the submodule
``name``.

No breach is tolerated: the ones issue 18 found were fixed and their lists deleted, so any edge
that breaks a rule fails its test, named with the line that makes it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from importlib.util import resolve_name
from pathlib import Path

from tests.support.paths import REPO_ROOT

NAMESPACE = "rollout_journal"
FOLDERS = ("schemas", "journal", "participants", "replay", "compose")

# room -> the rooms it may import (its own included)
ALLOWED = {
    "schemas": {"schemas"},
    "journal": {"schemas", "journal"},
    "participants": {"schemas", "journal", "participants"},
    "compose": {"schemas", "journal", "compose"},
    "replay": set(FOLDERS),
}

AGGREGATE = ("rollout_journal.participants.rollout",)
ENVIRONMENTS = ("rollout_journal.participants.environments",)
LIVE_PATH = (
    "rollout_journal.participants.workload",
    "rollout_journal.participants.model",
    "rollout_journal.participants.remote",
)
# The live path's modules offline replay reads a journal with: a workload's config and its rollout
# specs, as its registration records them, the chat tokenizer that decodes token ids, and the model
# folders' digests that prove which tokenizer wrote them (they import nothing else of the live path:
# the reach test below follows their imports as it does offline replay's own).
OFFLINE_SAFE = (
    "rollout_journal.participants.workload.config",
    "rollout_journal.participants.workload.specs",
    "rollout_journal.participants.model.tokenizer",
    "rollout_journal.participants.model.folders",
)
REPLAY = ("rollout_journal.replay",)
REPLAY_CLI = ("rollout_journal.replay.cli",)  # the command line: its live commands may run a rollout


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    lazy: bool  # named by a lazy export table: loaded on first use of the name, not with the package

    def __str__(self) -> str:
        how = "lazily names" if self.lazy else "imports"
        return f"{self.source} {how} {self.target} (line {self.line})"


def within(module: str, prefixes: Iterable[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def live(module: str) -> bool:
    """Of the live path, and not a module offline replay may read a journal with."""
    return within(module, LIVE_PATH) and module not in OFFLINE_SAFE


def room(module: str) -> str:
    return module.split(".")[1]


@cache
def modules() -> dict[str, Path]:
    """Every module of the five packages, by the name it installs as."""
    found: dict[str, Path] = {}
    for folder in FOLDERS:
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            parts = path.relative_to(REPO_ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((NAMESPACE, *parts))] = path
    return found


@cache
def tree(module: str) -> ast.Module:
    path = modules()[module]
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def package_of(module: str) -> str:
    """The package a module's relative imports start from."""
    return module if modules()[module].name == "__init__.py" else module.rpartition(".")[0]


@cache
def lazy_table(module: str) -> dict[str, tuple[str, int]]:
    """name -> (absolute module, line) of a package's ``_EXPORTS`` / ``_LAZY`` table."""
    found: dict[str, tuple[str, int]] = {}
    for node in tree(module).body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if not any(isinstance(t, ast.Name) and t.id in ("_EXPORTS", "_LAZY") for t in targets):
            continue
        assert isinstance(node.value, ast.Dict), f"{module}: a lazy table is a dict literal"
        for key, value in zip(node.value.keys, node.value.values):
            assert isinstance(key, ast.Constant) and isinstance(value, ast.Constant), f"{module}: str -> str"
            found[key.value] = (resolve_name(value.value, package_of(module)), value.lineno)
    return found


def ours(name: str) -> str | None:
    """The module of ours that ``import name`` loads (its longest known prefix), or None."""
    while name and name not in modules():
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str) -> Iterator[Edge]:
    """Every import of one module, of our modules only."""
    for node in ast.walk(tree(module)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(NAMESPACE + ".") and (target := ours(alias.name)):
                    yield Edge(module, target, node.lineno, lazy=False)
        elif isinstance(node, ast.ImportFrom):
            base = resolve_name("." * node.level + (node.module or ""), package_of(module))
            if not base.startswith(NAMESPACE + "."):
                continue
            for alias in node.names:
                if f"{base}.{alias.name}" in modules():  # a submodule
                    yield Edge(module, f"{base}.{alias.name}", node.lineno, lazy=False)
                    continue
                if target := ours(base):
                    yield Edge(module, target, node.lineno, lazy=False)
                if alias.name in lazy_table(base):  # what the package loads that name from
                    yield Edge(module, lazy_table(base)[alias.name][0], node.lineno, lazy=False)
    for target, line in lazy_table(module).values():
        yield Edge(module, target, line, lazy=True)


@cache
def graph() -> tuple[Edge, ...]:
    return tuple(edge for module in modules() for edge in imports(module) if edge.target != edge.source)


def pairs(edges: Iterable[Edge]) -> set[tuple[str, str]]:
    return {(e.source, e.target) for e in edges}


def test_the_graph_is_read_whole() -> None:
    """The reader sees imports wherever they stand: a few known ones, of each kind."""
    found = pairs(graph())
    assert ("rollout_journal.schemas", "rollout_journal.schemas.legacy") in found  # from package import submodule
    assert ("rollout_journal.replay.cli.live", "rollout_journal.participants.workload.run") in found  # in a function
    assert ("rollout_journal.replay.cli.live", "rollout_journal.participants.workload.worker") in found  # TYPE_CHECKING
    assert ("rollout_journal.participants", "rollout_journal.participants.workload.agent") in found  # a lazy table
    assert len(modules()) > 100


def test_rooms_import_only_the_rooms_below_them() -> None:
    wrong = [e for e in graph() if room(e.target) not in ALLOWED[room(e.source)]]
    assert not wrong, "\n".join(map(str, wrong))


def test_schemas_import_nothing_of_ours_but_schemas() -> None:
    assert not [e for e in graph() if room(e.source) == "schemas" and room(e.target) != "schemas"]


def test_the_aggregate_imports_no_environment_and_nothing_of_the_live_path() -> None:
    edges = [e for e in graph() if within(e.source, AGGREGATE) and within(e.target, ENVIRONMENTS + LIVE_PATH)]
    assert not edges, "\n".join(map(str, edges))


def offline_replay() -> list[str]:
    return [m for m in modules() if within(m, REPLAY) and not within(m, REPLAY_CLI)]


def test_offline_replay_imports_nothing_of_the_live_path() -> None:
    offline = set(offline_replay())
    edges = [e for e in graph() if e.source in offline and live(e.target)]
    assert not edges, "\n".join(map(str, edges))


def test_offline_replay_reaches_no_live_module_through_another() -> None:
    """Followed import by import (a lazy table's names load only when asked for, so not through
    those): no module offline replay loads brings in the live path."""
    onward: dict[str, list[Edge]] = {}
    for edge in graph():
        if not edge.lazy:
            onward.setdefault(edge.source, []).append(edge)
    reached: dict[str, list[str]] = {m: [m] for m in offline_replay()}  # module -> how it was reached
    frontier = list(reached)
    while frontier:
        module = frontier.pop()
        for edge in onward.get(module, []):
            if edge.target not in reached:
                reached[edge.target] = [*reached[module], edge.target]
                if not live(edge.target):  # the first live module on a path is enough
                    frontier.append(edge.target)
    found = sorted(" -> ".join(path) for m, path in reached.items() if live(m))
    assert not found, "\n".join(found)
