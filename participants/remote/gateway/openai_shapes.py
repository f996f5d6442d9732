"""OpenAI's request and answer shapes, as the gateway reads and writes them (Chat Completions and
the Responses API): parsing with the field path in every error, and answers built from a
:class:`ChatAnswer` so a replayed answer is byte for byte the live one."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rollout_journal.journal.events import SamplingParams
from rollout_journal.participants.remote.gateway.errors import GatewayError
from rollout_journal.participants.session.chat import ChatAnswer

__all__ = [
    "ChatRequest",
    "chat_completion",
    "chat_request",
    "responses_request",
    "TOKEN_ID_FIELDS",
    "StreamIds",
    "response_object",
    "response_shell",
    "sse",
]

# Fields that change what is sampled but that a journaled call cannot reproduce: refused, not ignored.
_UNSUPPORTED = ("logit_bias", "best_of", "audio", "prediction", "suffix", "echo")
_MAX_TOKENS_DEFAULT = 256
# NeMo Gym's training fields of a Responses output item (TokenIDLogProbMixin).
TOKEN_ID_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, Any]]
    params: SamplingParams
    tools: list[dict[str, Any]] | None
    stream: bool
    include_usage: bool
    token_ids: bool  # answer with vLLM's prompt_token_ids / token_ids and logprobs
    model: str


def _invalid(message: str, param: str) -> GatewayError:
    return GatewayError(400, "invalid_request", message, param)


def _unsupported(name: str, why: str) -> GatewayError:
    return GatewayError(
        400, "unsupported_parameter", f"parameter {name!r} is not supported by the gateway: {why}", name
    )


def _number(body: Mapping[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise _invalid(f"{name} must be a number in [{low}, {high}], got {value!r}", name)
    return float(value)


def _sampling(body: Mapping[str, Any], *max_names: str, default_max_tokens: int) -> SamplingParams:
    for name in _UNSUPPORTED:
        if body.get(name) not in (None, False, {}, []):
            raise _unsupported(name, "a journaled call could not be checked against it")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise _unsupported(name, "penalties are not journaled with a call")
    if body.get("stop") not in (None, [], ""):
        raise _unsupported("stop", "stop strings are not journaled with a call; stop on the eos")
    n = body.get("n", 1)
    if n != 1:
        raise _unsupported("n", f"one choice per call (n={n!r}); make n calls")
    fmt = body.get("response_format")
    if fmt not in (None, {"type": "text"}):
        raise _unsupported("response_format", "structured output is not journaled with a call")
    max_tokens = default_max_tokens
    for name in max_names:
        value = body.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise _invalid(f"{name} must be a positive integer, got {value!r}", name)
            max_tokens = value
            break
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _invalid(f"seed must be an integer, got {seed!r}", "seed")
    return SamplingParams(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        max_tokens=max_tokens,
        seed=seed,
    )


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise _invalid("messages must be a non-empty array of messages", "messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _invalid(f"messages[{i}] must be an object with a role", f"messages[{i}]")
        content = m.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text"):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise _unsupported(f"messages[{i}].content[{j}]", f"{kind!r} parts (text only)")
        elif content is not None and not isinstance(content, str):
            raise _invalid(
                f"messages[{i}].content must be a string or an array of text parts", f"messages[{i}].content"
            )
        out.append(m)
    return out


def _tools(value: Any, param: str) -> list[dict[str, Any]] | None:
    if value in (None, []):
        return None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise _invalid("tools must be an array of objects", param)
    return value


def chat_request(body: Any, *, default_max_tokens: int = _MAX_TOKENS_DEFAULT) -> ChatRequest:
    if not isinstance(body, dict):
        raise _invalid("the body must be a JSON object", "body")
    params = _sampling(body, "max_completion_tokens", "max_tokens", default_max_tokens=default_max_tokens)
    options = body.get("stream_options") or {}
    return ChatRequest(
        _messages(body.get("messages")),
        params,
        _tools(body.get("tools"), "tools"),
        bool(body.get("stream")),
        bool(isinstance(options, dict) and options.get("include_usage")),
        bool(body.get("return_token_ids")),
        str(body.get("model") or ""),
    )


def _stable_id(prefix: str, call_id: str) -> str:
    return f"{prefix}-{hashlib.sha256(call_id.encode()).hexdigest()[:24]}"


def chat_completion(answer: ChatAnswer, model: str, *, token_ids: bool) -> dict[str, Any]:
    a = answer.answer
    message: dict[str, Any] = {
        "role": "assistant",
        "content": answer.content if not answer.tool_calls or answer.content else None,
    }
    if answer.tool_calls:
        message["tool_calls"] = answer.tool_calls
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": answer.finish_reason, "logprobs": None}
    body: dict[str, Any] = {
        "id": _stable_id("chatcmpl", a.call_id),
        "object": "chat.completion",
        "created": a.ts_ms // 1000,
        "model": model,
        "choices": [choice],
        "usage": _usage(a.prompt_ids, a.output_ids),
    }
    if token_ids:  # vLLM's shape (return_token_ids), what verifiers' chat client parses
        body["prompt_token_ids"] = np.asarray(a.prompt_ids).tolist()
        choice["token_ids"] = np.asarray(a.output_ids).tolist()
        choice["logprobs"] = {
            "content": [
                {"token": f"token_id:{int(t)}", "logprob": float(lp)} for t, lp in zip(a.output_ids, a.logprobs)
            ]
        }
    return body


def _usage(prompt: np.ndarray, output: np.ndarray) -> dict[str, int]:
    return {"prompt_tokens": len(prompt), "completion_tokens": len(output), "total_tokens": len(prompt) + len(output)}


def chunk(call_id: str, created: int, model: str, delta: dict[str, Any], finish: str | None = None) -> str:
    body = {
        "id": _stable_id("chatcmpl", call_id),
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
    }
    return "data: " + json.dumps(body, ensure_ascii=False) + "\n\n"


def usage_chunk(call_id: str, created: int, model: str, prompt: np.ndarray, output: np.ndarray) -> str:
    body = {
        "id": _stable_id("chatcmpl", call_id),
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [],
        "usage": _usage(prompt, output),
    }
    return "data: " + json.dumps(body) + "\n\n"


# -- the Responses API --------------------------------------------------------------------------
@dataclass(frozen=True)
class ResponsesRequest:
    chat: ChatRequest
    raw_tools: list[dict[str, Any]]
    token_ids: bool


def _input_text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise _unsupported(f"{param}[{j}]", f"{kind!r} parts (text only)")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise _invalid("content must be a string or an array of text parts", param)


def responses_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Responses ``instructions`` + ``input`` items as chat messages: a response's message and
    function-call items become one assistant message (one answer of the rollout)."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _invalid("input must be a string or a non-empty array of items", "input")
    open_assistant: dict[str, Any] | None = None
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise _invalid(f"input[{i}] must be an object", f"input[{i}]")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _invalid(f"input[{i}].role must be user, system, developer or assistant", f"input[{i}].role")
            text = _input_text(item.get("content"), f"input[{i}].content")
            if role == "assistant":
                if (
                    open_assistant is not None
                    and not open_assistant.get("tool_calls")
                    and not open_assistant["content"]
                ):
                    open_assistant["content"] = text
                else:
                    open_assistant = {"role": "assistant", "content": text}
                    messages.append(open_assistant)
                continue
            open_assistant = None
            messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            if open_assistant is None:
                open_assistant = {"role": "assistant", "content": ""}
                messages.append(open_assistant)
            open_assistant.setdefault("tool_calls", []).append(
                {
                    "id": str(item.get("call_id", "")),
                    "type": "function",
                    "function": {"name": str(item.get("name", "")), "arguments": str(item.get("arguments", ""))},
                }
            )
        elif kind == "function_call_output":
            open_assistant = None
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "content": output if isinstance(output, str) else json.dumps(output),
                    "tool_call_id": str(item.get("call_id", "")),
                }
            )
        elif kind == "reasoning":
            continue  # the reasoning text is in the sampled ids already
        else:
            raise _unsupported(f"input[{i}].type", f"{kind!r} items")
    return messages


def responses_request(body: Any, *, default_max_tokens: int = _MAX_TOKENS_DEFAULT) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise _invalid("the body must be a JSON object", "body")
    if body.get("previous_response_id"):
        raise _unsupported("previous_response_id", "send the whole input (the gateway stores no responses)")
    if body.get("background"):
        raise _unsupported("background", "responses are answered in the request")
    params = _sampling(body, "max_output_tokens", default_max_tokens=default_max_tokens)
    raw_tools = body.get("tools") or []
    if not isinstance(raw_tools, list):
        raise _invalid("tools must be an array", "tools")
    tools = [
        {
            "type": "function",
            "function": {k: t[k] for k in ("name", "description", "parameters") if k in t},
        }
        for t in raw_tools
        if isinstance(t, dict) and t.get("type") == "function"
    ]
    chat = ChatRequest(
        responses_messages(body),
        params,
        tools or None,
        bool(body.get("stream")),
        False,
        False,
        str(body.get("model") or ""),
    )
    return ResponsesRequest(chat, raw_tools, bool(body.get("return_token_ids")))


@dataclass(frozen=True)
class StreamIds:
    """What a streamed response announced before its answer was known: its id, its creation time
    and, where text went out, its message item's id. The closing events must keep them (a client
    accumulates the stream by them)."""

    response_id: str
    created_at: int
    message_id: str | None = None


def response_object(
    answer: ChatAnswer,
    request: Mapping[str, Any],
    model: str,
    *,
    token_ids: bool,
    status: str | None = None,
    streamed: StreamIds | None = None,
) -> dict[str, Any]:
    """The Responses API answer: a message item (unless the answer is only tool calls that no
    streamed text announced a message before) and one ``function_call`` item per tool call;
    ``incomplete`` on ``max_output_tokens``. Ids derive from the journaled call (a replay gets the
    same ones), or are those ``streamed`` announced."""
    a = answer.answer
    output: list[dict[str, Any]] = []
    message_id = streamed.message_id if streamed is not None else None
    if answer.content or not answer.tool_calls or message_id is not None:
        message: dict[str, Any] = {
            "id": message_id or _stable_id("msg", a.call_id),
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": answer.content, "annotations": []}],
        }
        output.append(message)
    for call in answer.tool_calls:
        output.append(
            {
                "id": "fc_" + call["id"].removeprefix("call_"),
                "type": "function_call",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
        )
    if token_ids and output:  # NeMo Gym's training fields on the last item
        prompt, generation, logprobs = TOKEN_ID_FIELDS
        output[-1][prompt] = np.asarray(a.prompt_ids).tolist()
        output[-1][generation] = np.asarray(a.output_ids).tolist()
        output[-1][logprobs] = np.asarray(a.logprobs, dtype=np.float64).tolist()
    incomplete = a.finish_reason == "length" and not answer.tool_calls
    if incomplete and output:  # the message was cut short, as OpenAI marks it
        output[0]["status"] = "incomplete"
    shell = response_shell(
        request,
        model,
        streamed.response_id if streamed is not None else _stable_id("resp", a.call_id),
        streamed.created_at if streamed is not None else a.ts_ms // 1000,
        status or ("incomplete" if incomplete else "completed"),
    )
    return shell | {
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "output": output,
        "usage": {
            "input_tokens": len(a.prompt_ids),
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": len(a.output_ids),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": len(a.prompt_ids) + len(a.output_ids),
        },
    }


def response_shell(
    request: Mapping[str, Any], model: str, response_id: str, created_at: int, status: str
) -> dict[str, Any]:
    """A Responses object without output: what ``response.created`` announces, and what the
    answer fills in."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "model": model,
        "status": status,
        "incomplete_details": None,
        "output": [],
        "parallel_tool_calls": bool(request.get("parallel_tool_calls", True)),
        "tool_choice": request.get("tool_choice", "auto"),
        "tools": request.get("tools") or [],
        "temperature": request.get("temperature"),
        "top_p": request.get("top_p"),
        "max_output_tokens": request.get("max_output_tokens"),
        "instructions": request.get("instructions"),
        "error": None,
        "metadata": {},
        "usage": None,
    }


def sse(event: str, data: Mapping[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def flat(values: Sequence[Any]) -> list[Any]:
    return list(values)
