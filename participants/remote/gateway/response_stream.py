"""The server-sent events of one streamed Responses answer, in the order and shape OpenAI's
clients accumulate (``client.responses.stream`` builds the response from them).

The answer is known only at the end: the call is journaled once it is whole, and tool calls are
parsed from its text then. So the stream announces what it knows as it learns it: the response
(under an id minted now, kept to the end), the message item when its first visible text arrives
(with its content part, before any delta), and the function-call items at the end, after the
message. Every event carries its ``sequence_number``; the closing ``response.completed`` holds the
same ids the stream announced.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Mapping
from typing import Any

from rollout_journal.participants.remote.gateway.openai_shapes import (
    TOKEN_ID_FIELDS,
    StreamIds,
    response_object,
    response_shell,
    sse,
)
from rollout_journal.participants.session.chat import ChatAnswer

__all__ = ["ResponseStream"]


class ResponseStream:
    """Numbers and shapes the events of one streamed response (see the module docstring)."""

    def __init__(self, request: Mapping[str, Any], model: str) -> None:
        self.request, self.model = request, model
        self.ids = StreamIds(f"resp_{uuid.uuid4().hex}", int(time.time()))
        self._next = 0
        self._text = ""  # the message's text sent so far

    def _event(self, kind: str, **data: Any) -> str:
        number, self._next = self._next, self._next + 1
        return sse(kind, {"type": kind, "sequence_number": number, **data})

    def created(self) -> list[str]:
        shell = response_shell(self.request, self.model, self.ids.response_id, self.ids.created_at, "in_progress")
        return [self._event("response.created", response=shell), self._event("response.in_progress", response=shell)]

    def text(self, delta: str) -> list[str]:
        """A delta of the message's text: the message item and its content part first, once."""
        if not delta:
            return []
        events = self._open_message()
        self._text += delta
        events.append(self._event("response.output_text.delta", **self._part_of_message(), delta=delta, logprobs=[]))
        return events

    def _open_message(self) -> list[str]:
        if self.ids.message_id is not None:
            return []
        self.ids = dataclasses.replace(self.ids, message_id=f"msg_{uuid.uuid4().hex}")
        item: dict[str, Any] = {
            "id": self.ids.message_id,
            "type": "message",
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }
        return [
            self._event("response.output_item.added", output_index=0, item=item),
            self._event("response.content_part.added", **self._part_of_message(), part=_text_part("")),
        ]

    def _part_of_message(self) -> dict[str, Any]:
        return {"item_id": self.ids.message_id, "output_index": 0, "content_index": 0}

    def closing(self, answer: ChatAnswer, *, token_ids: bool) -> list[str]:
        """The rest of the message's text, each item's closing events, then the response's."""
        events: list[str] = []
        if answer.content or not answer.tool_calls:  # the answer has a message: open it if no text did
            events += self._open_message()
        if self.ids.message_id is not None:
            rest = answer.content[len(self._text) :] if answer.content.startswith(self._text) else ""
            events += self.text(rest)
        final = response_object(answer, self.request, self.model, token_ids=token_ids, streamed=self.ids)
        for index, item in enumerate(final["output"]):
            if item["type"] == "message":
                part = item["content"][0]
                where = {"item_id": item["id"], "output_index": index, "content_index": 0}
                events.append(self._event("response.output_text.done", **where, text=part["text"], logprobs=[]))
                events.append(self._event("response.content_part.done", **where, part=part))
            else:
                # Announced before its arguments: in progress, without the training fields (they
                # come once, with the finished item and the response).
                started = {k: v for k, v in item.items() if k not in TOKEN_ID_FIELDS}
                started |= {"arguments": "", "status": "in_progress"}
                events.append(self._event("response.output_item.added", output_index=index, item=started))
                where = {"item_id": item["id"], "output_index": index}
                events.append(self._event("response.function_call_arguments.delta", **where, delta=item["arguments"]))
                events.append(
                    self._event("response.function_call_arguments.done", **where, arguments=item["arguments"])
                )
            events.append(self._event("response.output_item.done", output_index=index, item=item))
        done = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        events.append(self._event(done, response=final))
        return events

    def failed(self, error: Mapping[str, Any]) -> list[str]:
        """For the OpenAI-shaped error body ``error``: an ``error`` event naming it, then
        ``response.failed``, the terminal status a client waits for (the answer is not journaled:
        a rerun asks again)."""
        found = error["error"]
        code = found.get("code") or found.get("type")
        shell = response_shell(self.request, self.model, self.ids.response_id, self.ids.created_at, "failed")
        shell["error"] = {"code": "server_error", "message": f"{code}: {found['message']}"}
        return [
            self._event("error", code=code, message=found["message"], param=found.get("param")),
            self._event("response.failed", response=shell),
        ]


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}
