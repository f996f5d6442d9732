"""A package's names, loaded from their modules on first use (PEP 562's module ``__getattr__``).

The rooms' ``__init__`` files name their public API without importing it: importing
``rollout_journal.participants.model`` loads no torch, and the remote room no uvicorn, until a
name that needs them is used. One implementation serves every room; each keeps its own
``TYPE_CHECKING`` imports, which are what type checkers and IDEs see."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, whose ``exports`` map each name to the module
    that defines it; a name loaded once is stored in ``namespace`` (the package's globals), so
    later lookups skip the hook."""

    def getattr_(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(module, package), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return getattr_, dir_
