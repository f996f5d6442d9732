"""Each of the five packages (and the rooms of participants) states its public API once, and type checkers see what it loads lazily.

A package's ``__all__`` is its lazy table (PEP 562 ``__getattr__``: ``_EXPORTS`` or ``_LAZY``, name ->
module) plus the public names it binds when imported; every one of them resolves, a lazy one to what
its table's module defines; and its ``if TYPE_CHECKING:`` block imports exactly the lazy names, each
from its table's module, so IDEs and mypy see their types instead of ``Any``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from importlib.util import resolve_name
from types import ModuleType

import pytest

PACKAGES = [
    "rollout_journal.schemas",
    "rollout_journal.journal",
    "rollout_journal.participants",
    "rollout_journal.participants.model",
    "rollout_journal.participants.remote",
    "rollout_journal.participants.workload",
    "rollout_journal.replay",
    "rollout_journal.compose",
]


def lazy_table(package: ModuleType) -> dict[str, str]:
    """Name -> absolute module of what the package loads on first use (empty: it loads nothing lazily)."""
    table = getattr(package, "_EXPORTS", None) or getattr(package, "_LAZY", None) or {}
    return {name: resolve_name(module, package.__name__) for name, module in table.items()}


def is_type_checking(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def eager_names(package: ModuleType, tree: ast.Module) -> set[str]:
    """Public names the package binds at import time: its own definitions and what it imports from
    rollout_journal (not the standard library's or a dependency's helpers, nor submodules)."""
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("rollout_journal")):
            found.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            found.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found.update(t.id for t in targets if isinstance(t, ast.Name))
    return {
        name for name in found if not name.startswith("_") and not isinstance(getattr(package, name, None), ModuleType)
    }


def type_checking_imports(package: ModuleType, tree: ast.Module) -> dict[str, str]:
    """Name -> absolute module of every import inside the package's ``if TYPE_CHECKING:`` blocks."""
    found: dict[str, str] = {}
    for block in filter(is_type_checking, tree.body):
        assert isinstance(block, ast.If) and not block.orelse
        for node in block.body:
            assert isinstance(node, ast.ImportFrom), f"{package.__name__}: only `from ... import` here"
            module = resolve_name("." * node.level + (node.module or ""), package.__name__)
            for alias in node.names:
                assert alias.asname is None, f"{package.__name__}: {alias.name} imported as {alias.asname}"
                found[alias.name] = module
    return found


@pytest.fixture(params=PACKAGES)
def package(request: pytest.FixtureRequest) -> tuple[ModuleType, ast.Module]:
    module = importlib.import_module(request.param)
    return module, ast.parse(inspect.getsource(module))


def test_all_is_the_lazy_table_plus_the_eager_names(package: tuple[ModuleType, ast.Module]) -> None:
    module, tree = package
    lazy, eager = set(lazy_table(module)), eager_names(module, tree)
    assert not lazy & eager, f"{module.__name__}: both imported and loaded lazily: {sorted(lazy & eager)}"
    assert len(module.__all__) == len(set(module.__all__)), f"{module.__name__}: a name twice in __all__"
    assert set(module.__all__) == lazy | eager, (
        f"{module.__name__}: missing from __all__ {sorted((lazy | eager) - set(module.__all__))}, "
        f"in __all__ but neither lazy nor bound {sorted(set(module.__all__) - (lazy | eager))}"
    )


def public_names() -> list[tuple[str, str]]:
    return [(p, name) for p in PACKAGES for name in importlib.import_module(p).__all__]


@pytest.mark.parametrize(("package_name", "name"), public_names())
def test_every_public_name_resolves_a_lazy_one_to_its_modules(package_name: str, name: str) -> None:
    module = importlib.import_module(package_name)
    value = getattr(module, name)  # an AttributeError or ImportError here: it does not resolve
    table = lazy_table(module)
    if name in table:
        assert value is getattr(importlib.import_module(table[name]), name)


def test_no_public_name_is_also_a_submodule(package: tuple[ModuleType, ast.Module]) -> None:
    """Importing a submodule sets the package's attribute of its name to the module, so a public
    name spelled like a submodule resolves to the module once anything loaded it (as
    ``replay.resource_state`` did, the function of ``replay/resource_state.py``)."""
    module, _ = package
    submodules = {info.name for info in pkgutil.iter_modules(module.__path__)}
    assert not submodules & set(module.__all__), f"{module.__name__}: {sorted(submodules & set(module.__all__))}"


def test_an_unknown_name_is_an_attribute_error(package: tuple[ModuleType, ast.Module]) -> None:
    module, _ = package
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        module.Nope  # noqa: B018


def test_type_checkers_see_exactly_the_lazy_names_from_their_modules(package: tuple[ModuleType, ast.Module]) -> None:
    module, tree = package
    assert type_checking_imports(module, tree) == lazy_table(module)
