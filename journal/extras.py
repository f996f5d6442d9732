"""Optional dependencies: which extra of the ``rollout-journal`` distribution brings which module.

``pip install rollout-journal`` is the core: read, replay, audit, export and consume the results
stream. What runs a rollout's model (torch, vLLM), serves resources over HTTP, or starts a broker
under Docker is an extra, imported only by the code that needs it. When such an import fails,
:func:`missing_extra` turns the ``ModuleNotFoundError`` into an error that names the extra to
install; the command line prints it as its one line. ``tests/test_packaging.py`` keeps
:data:`EXTRAS` equal to ``[project.optional-dependencies]`` in ``pyproject.toml``.
"""

from __future__ import annotations

from rollout_journal.journal.errors import RolloutJournalError

DISTRIBUTION = "rollout-journal"

# The importable top-level module -> the extra whose requirements bring it.
EXTRAS: dict[str, str] = {
    "torch": "torch",
    "transformers": "torch",
    "safetensors": "torch",
    "starlette": "serve",
    "uvicorn": "serve",
    "httpx": "serve",
    "aiohttp": "serve",
    "vllm": "vllm",
    "testcontainers": "docker",
}


class MissingExtraError(RolloutJournalError):
    """What was asked for needs a module of an extra that is not installed; says which to install."""

    def __init__(self, module: str, extra: str, needed_by: str) -> None:
        super().__init__(f"{needed_by} needs {module}, which is not installed: pip install '{DISTRIBUTION}[{extra}]'")
        self.module = module
        self.extra = extra


def missing_extra(exc: ImportError, needed_by: str) -> MissingExtraError | None:
    """The error naming the extra that brings the module ``exc`` failed to import, for a caller
    that wanted ``needed_by`` (a command, a backend); None if no extra brings it (a real bug, or
    a user's own module: let the original error stand)."""
    module = (exc.name or "").partition(".")[0]
    extra = EXTRAS.get(module)
    return None if extra is None else MissingExtraError(module, extra, needed_by)
