"""The session API: any agent loop's effects, journaled, and answered from the journal on resume.

Public API (import from here)::

    from rollout_journal.participants.session import SessionFactory, RolloutRef, ModelRequest, ToolRequest

See :mod:`rollout_journal.participants.session.api` for the record-and-replay rules and
:mod:`rollout_journal.participants.session.chat` for message-native agents.
"""

from __future__ import annotations

from rollout_journal.participants.session.api import (
    ModelAnswer,
    ModelRequest,
    RolloutRef,
    RolloutSession,
    SessionFactory,
    StateRequest,
    ToolAnswer,
    ToolContext,
    ToolOutcome,
    ToolRequest,
)
from rollout_journal.participants.session.chat import (
    ChatAnswer,
    ChatSession,
    HistoryMismatchError,
    PromptBuilder,
    Redrive,
    TemplatePrompts,
    ToolCallParser,
)
from rollout_journal.participants.session.errors import (
    EffectNotDurableError,
    NondeterminismError,
    NotOwnerError,
    OwnerMovingError,
    RequestSummary,
    RolloutFinishedError,
    RolloutNotFoundError,
    SessionError,
    StaleAttemptError,
)
from rollout_journal.participants.session.ownership import (
    GroupOwnership,
    Local,
    Moving,
    Remote,
    RolloutOwnership,
    Route,
    SingleWriter,
    Unrouted,
)
from rollout_journal.participants.session.sinks import JournalSink, NullSink, TurnSink, durable

__all__ = [
    "ChatAnswer",
    "ChatSession",
    "EffectNotDurableError",
    "GroupOwnership",
    "HistoryMismatchError",
    "JournalSink",
    "Local",
    "ModelAnswer",
    "ModelRequest",
    "Moving",
    "NondeterminismError",
    "NotOwnerError",
    "NullSink",
    "OwnerMovingError",
    "PromptBuilder",
    "Redrive",
    "Remote",
    "RequestSummary",
    "RolloutFinishedError",
    "RolloutNotFoundError",
    "RolloutOwnership",
    "RolloutRef",
    "RolloutSession",
    "Route",
    "SessionError",
    "SessionFactory",
    "StateRequest",
    "SingleWriter",
    "TurnSink",
    "Unrouted",
    "StaleAttemptError",
    "TemplatePrompts",
    "ToolAnswer",
    "ToolCallParser",
    "ToolContext",
    "ToolOutcome",
    "ToolRequest",
    "durable",
]
