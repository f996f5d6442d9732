"""What a rollout works on: a :class:`Task`, drawn from a seed or read from a dataset file.

A dataset is a JSONL file, one task per line::

    {"id": "move-acme", "prompt": "Move the Acme meeting to Tuesday 10:00.", "task": {"customer": "acme"}}

``prompt`` is the user's instruction; ``task`` (an object, default ``{}``)
holds whatever the environment needs to set the task up and to verify it. A row may
instead (or besides) give the conversation's start itself, ``messages`` (OpenAI's shape:
system, user, even assistant turns with ``tool_calls`` and ``tool`` results), and the
functions the model may call, ``tools`` (JSON schemas, rendered by the model's chat
template); one of ``prompt`` and ``messages`` is required. ``id``
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

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rollout_journal.journal.errors import ConfigurationError

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
    messages: tuple[dict[str, Any], ...] = ()  # the conversation's start, when the row gives it
    tools: tuple[dict[str, Any], ...] = ()  # JSON-schema functions for the chat template

    def to_json(self) -> dict[str, Any]:
        """The task as plain JSON (a resource server builds the same environment from it)."""
        out: dict[str, Any] = {
            "seed": self.seed,
            "prompt": self.prompt,
            "fields": dict(self.fields),
            "task_id": self.task_id,
        }
        if self.messages:
            out["messages"] = list(self.messages)
        if self.tools:
            out["tools"] = list(self.tools)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Task:
        return cls(
            int(data["seed"]),
            data.get("prompt"),
            dict(data.get("fields") or {}),
            data.get("task_id"),
            tuple(data.get("messages") or ()),
            tuple(data.get("tools") or ()),
        )


class _RowMessage(BaseModel):
    """One message of a row's ``messages``, as OpenAI's chat API writes it."""

    model_config = ConfigDict(extra="forbid")

    role: str = Field(pattern="^(system|user|assistant|tool)$")
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class _Row(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str | None = Field(None, min_length=1)
    task: dict[str, Any] = Field(default_factory=dict)
    id: str | None = None
    seed: int | None = None
    messages: list[_RowMessage] | None = Field(None, min_length=1)
    tools: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> _Row:
        if self.prompt is None and not self.messages:
            raise ValueError('a task needs "prompt" or "messages"')
        return self


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
            raise TaskFileError(
                f"tasks file {path} line {number}: {_problem(exc)}; each line is "
                '{"prompt": "...", "task": {...}} (optional "id", "seed", "messages", "tools")'
            ) from None
        index = len(tasks)
        seed = row.seed if row.seed is not None else _row_seed(workload_seed, index)
        messages = tuple(m.model_dump(exclude_none=True) for m in row.messages or ())
        prompt = row.prompt if row.prompt is not None else _last_user_text(messages)
        tasks.append(Task(seed, prompt, row.task, row.id or f"row{index}", messages, tuple(row.tools or ())))
    if not tasks:
        raise TaskFileError(f"tasks file {path} holds no task; write one JSON object per line")
    return tasks


def _last_user_text(messages: tuple[dict[str, Any], ...]) -> str | None:
    """A row without ``prompt``: its instruction is its last user message (what task_prompt() says)."""
    return next((str(m.get("content") or "") for m in reversed(messages) if m["role"] == "user"), None)


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
