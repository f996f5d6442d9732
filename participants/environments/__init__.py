"""Environments: the protocol (:mod:`.base`), tasks (:mod:`.tasks`), JSON tool calls
(:mod:`.tool_calls`), how a name finds its class (:mod:`.registry`), and three worked
examples: ``workplace`` (event-sourced), ``counter`` (exportable), ``sandbox`` (restart-only).

``make_environment("workplace", rollout_id, task)`` builds one for a rollout."""

from __future__ import annotations

from rollout_journal.participants.environments.base import (
    Environment,
    Observation,
    StepContext,
    StepMutations,
)
from rollout_journal.participants.environments.registry import (
    ENTRY_POINT_GROUP,
    ENVIRONMENTS,
    UnknownEnvironmentError,
    environment_class,
    make_environment,
)
from rollout_journal.participants.environments.tasks import Task, TaskFileError, load_tasks
from rollout_journal.participants.environments.tool_calls import (
    ToolCall,
    ToolCallError,
    parse_tool_call,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "ENVIRONMENTS",
    "Environment",
    "Observation",
    "StepContext",
    "StepMutations",
    "Task",
    "TaskFileError",
    "ToolCall",
    "ToolCallError",
    "UnknownEnvironmentError",
    "environment_class",
    "load_tasks",
    "make_environment",
    "parse_tool_call",
]
