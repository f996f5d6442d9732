"""A notebook the agent fills from a dataset task, through JSON tool calls.

Task row: ``{"prompt": "...", "task": {"words": ["alpha", "beta"], "distractors": ["gamma"]}}``.
The agent must add each word of ``words`` as a note, in order, and nothing else.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from rollout_journal.participants.environments import Environment, ToolCall
from rollout_journal.participants.environments.base import SUBMIT, StepMutations
from rollout_journal.participants.environments.tool_calls import ToolCallError
from rollout_journal.participants.resources import OperationRejectedError, Recovery, Resource


class Notebook(Resource):
    """Ordered notes. Ops: add(text), erase(index). Query: read."""

    kind = "notebook"
    recovery = Recovery.EXPORTABLE
    supports_export = True

    def __init__(self, resource_id: str) -> None:
        super().__init__(resource_id)
        self._notes: list[str] = []

    def _apply(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        if op == "add":
            text = self._arg(op, args, "text")
            if not text.strip():
                raise OperationRejectedError(f"notebook {self.resource_id!r}: a note needs text")
            self._notes.append(text)
            return {"index": len(self._notes) - 1, "text": text}
        if op == "erase":
            index = self._arg(op, args, "index", int)
            if not 0 <= index < len(self._notes):
                raise OperationRejectedError(f"notebook {self.resource_id!r} has no note {index}")
            return {"erased": self._notes.pop(index)}
        raise self._unknown(op, ("add", "erase"))

    def _query(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        if op == "read":
            return {"notes": list(self._notes)}
        raise self._unknown(op, ("read",))

    def _canonical_state(self) -> object:
        return {"notes": self._notes}

    def _load_state(self, state: Any) -> None:
        self._notes = [str(n) for n in state["notes"]]

    def _reset(self) -> None:
        self._notes = []


class NotesEnvironment(Environment):
    """Write the task's words as notes. Actions are JSON tool calls."""

    name = "notes"

    def __init__(self, rollout_id: str, task: Any) -> None:
        super().__init__(rollout_id, task)
        fields = self.task.fields
        self.words = [str(w) for w in fields.get("words", [])]
        self.distractors = [str(w) for w in fields.get("distractors", [])]
        self.notebook = Notebook(self.resource_id("notebook"))
        self._add_resource(self.notebook)

    def task_prompt(self) -> str:
        return self.task.prompt or f"Add the notes {', '.join(self.words)} in this order, then submit."

    def action_space(self) -> list[str]:
        calls = [ToolCall("notes.add", {"text": w}) for w in self.words + self.distractors]
        calls.append(ToolCall("notes.read", {}))
        if self.notebook._notes:
            calls.append(ToolCall("notes.erase", {"index": len(self.notebook._notes) - 1}))
        return [c.to_json() for c in calls] + [SUBMIT]

    def _perform(self, action: str, mutations: StepMutations) -> str:
        call = json.loads(action)
        return self._call_tool(ToolCall(call["name"], call["arguments"]), mutations)

    def _call_tool(self, call: ToolCall, mutations: StepMutations) -> str:
        # Free-form: any text may be added, any index erased; the notebook refuses what is wrong.
        if call.name == "notes.add":
            result = mutations.apply(self.notebook, "add", {"text": call.arguments["text"]})
            return f"note {result['index']}: {result['text']}"
        if call.name == "notes.erase":
            result = mutations.apply(self.notebook, "erase", {"index": call.arguments["index"]})
            return f"erased {result['erased']}"
        if call.name == "notes.read":
            return "; ".join(self.notebook.query("read")["notes"]) or "no notes"
        raise ToolCallError(f"there is no tool {call.name!r}; tools: notes.add, notes.erase, notes.read, submit")

    def verify(self) -> float:
        notes = copy.copy(self.notebook._notes)
        matched = sum(1 for a, b in zip(notes, self.words) if a == b)
        return matched / max(len(self.words), len(notes), 1)
