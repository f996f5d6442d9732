"""Free-form JSON tool calls: ``{"name": "calendar.create", "arguments": {"day": "tue", "hour": 10}}``.

Besides the short action strings of a constrained action list, a model may answer
with a JSON function call as chat models do. :func:`parse_tool_call` reads the
common spellings:

- ``{"name": ..., "arguments": {...}}`` (``arguments`` may also be a JSON string,
  as OpenAI's API sends it; ``parameters`` is accepted for ``arguments``);
- ``{"type": "function", "function": {"name": ..., "arguments": ...}}``;
- either one wrapped in ``<tool_call>...</tool_call>`` or a fenced code block.

Anything else raises :class:`ToolCallError`, which the environment turns into an
observation for the model, never an exception out of a turn.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ToolCall", "ToolCallError", "argument_text", "looks_like_tool_call", "parse_tool_call"]

_WRAPPERS = (
    re.compile(r"^<tool_call>\s*(.*?)\s*</tool_call>$", re.DOTALL),
    re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL),
)


class ToolCallError(ValueError):
    """A tool call cannot be parsed or executed; its message is shown to the model."""


@dataclass(frozen=True)
class ToolCall:
    """A function name and its JSON arguments."""

    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        """The call as compact JSON, keys in a fixed order (what a constrained action list offers)."""
        return json.dumps(
            {"name": self.name, "arguments": dict(self.arguments)}, separators=(",", ":"), ensure_ascii=False
        )

    def as_action(self) -> str:
        """``name(k=v, ...)``: the action-string spelling of the same call."""
        return f"{self.name}({', '.join(f'{k}={argument_text(v)}' for k, v in self.arguments.items())})"


def looks_like_tool_call(text: str) -> bool:
    """Whether ``text`` is meant as a JSON tool call (so a parse failure is worth explaining)."""
    return _unwrap(text.strip()).startswith("{")


def parse_tool_call(text: str) -> ToolCall:
    """The tool call ``text`` spells; :class:`ToolCallError` says what is wrong with it."""
    body = _unwrap(text.strip())
    try:
        doc = json.loads(body)
    except ValueError as exc:
        raise ToolCallError(f"the tool call is not valid JSON ({exc.args[0] if exc.args else exc})") from None
    if not isinstance(doc, dict):
        raise ToolCallError(f"a tool call is a JSON object, not {type(doc).__name__}")
    if isinstance(doc.get("function"), dict):
        doc = doc["function"]
    name = doc.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ToolCallError('the tool call has no "name" (a string naming the function)')
    arguments = doc.get("arguments", doc.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise ToolCallError(f"the arguments of {name!r} are a string that is not JSON") from None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise ToolCallError(f'the "arguments" of {name!r} must be a JSON object, not {type(arguments).__name__}')
    return ToolCall(name.strip(), arguments)


def _unwrap(text: str) -> str:
    for wrapper in _WRAPPERS:
        match = wrapper.match(text)
        if match:
            return match.group(1)
    return text


def argument_text(value: Any) -> str:
    """A JSON argument as an action string spells it: strings bare, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)
