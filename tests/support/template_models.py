"""The chat-template families' model folders (built once per test session into its model
cache) and a conversation that exercises what templates do with tools."""

from __future__ import annotations

from pathlib import Path

from rollout_journal.journal.events import ChatMessage, ToolCallRef
from rollout_journal.participants.model.families import FAMILIES, family_model_dir
from rollout_journal.participants.model.tiny_model import tiny_model_dir

FAMILY_NAMES = ("tiny", *FAMILIES)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "mail.send",
            "description": "Send one message",
            "parameters": {
                "type": "object",
                "properties": {"to": {"type": "string"}, "subject": {"type": "string"}},
                "required": ["to", "subject"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "records.get",
            "description": "Look up a record",
            "parameters": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]},
        },
    },
]

# system, user, assistant with one tool call (dict arguments), its result, assistant with a
# think block and two calls (dict and string arguments), two results, a user message with padding
CONVERSATION = [
    ChatMessage("system", "You act only through tool calls."),
    ChatMessage("user", "Mail Alice about the meeting, then look up record 42."),
    ChatMessage("assistant", "", [ToolCallRef("c0", "mail.send", '{"to": "alice", "subject": "meeting"}')]),
    ChatMessage("tool", "ok, message sent, id 318", tool_call_id="c0", name="mail.send"),
    ChatMessage(
        "assistant",
        "<think>\nnow the record\n</think>\n\nLooking it up.",
        [ToolCallRef("c1", "records.get", '{"id": 42}'), ToolCallRef("c2", "records.get", '"{\\"id\\": 43}"')],
    ),
    ChatMessage("tool", '{"id": 42, "name": "Acme Corp"}', tool_call_id="c1", name="records.get"),
    ChatMessage("tool", "error, no such customer, id 43", tool_call_id="c2", name="records.get"),
    ChatMessage("user", "  Thanks. Now submit.  "),
]


def model_folder(family: str) -> Path:
    """The folder of a family (``tiny``: the embedded model's)."""
    return tiny_model_dir() if family == "tiny" else family_model_dir(family)
