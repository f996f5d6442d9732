"""What a rollout works on: a :class:`Task`, drawn from a seed or read from a dataset file.

A dataset is a JSONL file, one task per line::

    {"id": "move-acme", "prompt": "Move the Acme meeting to Tuesday 10:00.", "task": {"customer": "acme"}}

``prompt`` (required) is the user's instruction; ``task`` (an object, default ``{}``)
holds whatever the environment needs to set the task up and to verify it; ``id``
names the row (default ``row<N>``) and ``seed`` fixes the randomness an environment
may draw (default: derived from the workload's seed and the row). Blank lines and
lines starting with ``#`` are skipped. Group ``g`` of a workload takes row
``g mod N``, so every sibling of a group works on the same task.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from journal.errors import ConfigurationError

__all__ = ["Task", "TaskFileError", "load_tasks", "tasks_digest"]


class TaskFileError(ConfigurationError):
    """A dataset file cannot be read, or one of its lines is no task; the message names the line."""


@dataclass(frozen=True)
class Task:
    """One task. Environments of the seed kind (the built-ins) draw everything from ``seed``;
    dataset environments read ``prompt`` and ``fields`` (the row's ``task`` object)."""

    seed: int
    prompt: str | None = None
    fields: Mapping[str, Any] = field(default_factory=dict)
    task_id: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The task as plain JSON (a resource server builds the same environment from it)."""
        return {"seed": self.seed, "prompt": self.prompt, "fields": dict(self.fields), "task_id": self.task_id}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Task:
        return cls(int(data["seed"]), data.get("prompt"), dict(data.get("fields") or {}), data.get("task_id"))


class _Row(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1)
    task: dict[str, Any] = Field(default_factory=dict)
    id: str | None = None
    seed: int | None = None


def _row_seed(workload_seed: int, index: int) -> int:
    digest = hashlib.sha256(f"{workload_seed}/task-row/{index}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def load_tasks(path: str | Path, workload_seed: int = 0) -> list[Task]:
    """Every task of a JSONL dataset, in file order; :class:`TaskFileError` names the first bad line."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise TaskFileError(f"tasks file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TaskFileError(f"tasks file {path} cannot be read: {exc}") from None
    tasks: list[Task] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            row = _Row.model_validate(json.loads(line))
        except ValueError as exc:  # json's and pydantic's (ValidationError is a ValueError)
            raise TaskFileError(f"tasks file {path} line {number}: {_problem(exc)}; each line is "
                                '{"prompt": "...", "task": {...}} (optional "id", "seed")') from None
        index = len(tasks)
        seed = row.seed if row.seed is not None else _row_seed(workload_seed, index)
        tasks.append(Task(seed, row.prompt, row.task, row.id or f"row{index}"))
    if not tasks:
        raise TaskFileError(f"tasks file {path} holds no task; write one JSON object per line")
    return tasks


def tasks_digest(path: str | Path) -> str:
    """sha256 of a dataset file's bytes: part of a workload's topology (other tasks, other rollouts)."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError as exc:
        raise TaskFileError(f"tasks file {path} cannot be read: {exc}") from None


def _problem(exc: ValueError) -> str:
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "line"
        return f"{where}: {first['msg']}"
    return f"not JSON ({exc})"
