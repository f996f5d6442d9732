"""Message-native agents on the session API: chat messages in, token ids to the model.

:class:`ChatSession` wraps a :class:`RolloutSession` for an agent that speaks in messages (an
OpenAI client behind the gateway, verifiers, NeMo Gym). It keeps token-in-token-out: the first
call's prompt is the conversation rendered with the model's own chat template; every later call's
prompt is the previous prompt + the ids the model sampled (+ the end-of-turn ids the template
needs when the model did not sample them) + the rendered messages added since. Sampled ids are
never decoded and encoded again.

Positions (``conversation`` mode): a request's place is the number of assistant messages it
carries, each one an answer this rollout gave. ``k`` assistant messages = model call ``k`` = turn
``k``; the messages after the previous answer close turn ``k - 1`` (its ``TurnCompleted``). A
request behind the cursor is a re-driven agent (:class:`Redrive`: the caller opens the next
attempt and asks again); a request ahead of it is answered only as far as the journal holds it.

The prompt builder is a seam: :class:`TemplatePrompts` renders with the folder's template in
token space (the rule of issue 16's ``participants/model/chat.py``, which replaces it once merged).
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from rollout_journal.journal.events import Message, SamplingParams
from rollout_journal.participants.model.gate import TokenSink
from rollout_journal.participants.model.tokenizer import ChatTokenizer
from rollout_journal.participants.resources.canonical import canonical_json
from rollout_journal.participants.rollout.effects import MODEL, Effect
from rollout_journal.participants.session.api import ModelAnswer, ModelRequest, RolloutSession
from rollout_journal.participants.session.errors import SessionError

__all__ = [
    "ChatAnswer",
    "ChatSession",
    "HistoryMismatchError",
    "PromptBuilder",
    "Redrive",
    "TemplatePrompts",
    "ToolCallParser",
    "assistant_messages",
]


class Redrive(SessionError):
    """The request is behind the session's cursor: the agent started over. Open the next attempt
    and ask again (the journal answers every call it holds)."""

    def __init__(self, rollout_id: str, position: int, cursor: int) -> None:
        super().__init__(
            f"rollout {rollout_id}: a request at call {position} is behind the session (call {cursor}): re-driven"
        )
        self.position = position


class HistoryMismatchError(SessionError):
    """The request's history is not the conversation this rollout produced: an assistant message it
    never answered, or an earlier message changed (``unknown_history``)."""

    def __init__(self, rollout_id: str, detail: str) -> None:
        super().__init__(
            f"rollout {rollout_id}: the request's messages are not this rollout's conversation: {detail}. Send "
            "back every assistant message unchanged and only append after it (the determinism contract)"
        )
        self.rollout_id = rollout_id
        self.detail = detail


class PromptBuilder(Protocol):
    """Token-in-token-out prompts from messages."""

    eos_id: int

    def first(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> np.ndarray:
        """The first call's prompt: the conversation rendered, ending in the generation prompt."""
        ...

    def extend(
        self,
        head: np.ndarray,
        history: Sequence[Mapping[str, Any]],
        new: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
    ) -> np.ndarray:
        """The next prompt: ``head`` (the previous prompt + its sampled ids), the end-of-turn ids the
        template closes an assistant message with if the model did not sample them, then ``new``
        rendered after ``history`` (which ends with that assistant message)."""
        ...


class TemplatePrompts:
    """The folder's chat template, in token space (see the module docstring)."""

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_id
        self._template = tokenizer._template  # the same compiled template its chat_prompt renders with
        self._tok = tokenizer._tok
        self._close: dict[str, np.ndarray] = {}
        # Text ending in a special token: tokenization never merges across it, so the ids of what
        # follows are the ids of its text alone (no need to encode the whole conversation again).
        self._specials = tuple(
            t.content for t in tokenizer._tok.get_added_tokens_decoder().values() if getattr(t, "special", False)
        )

    def text(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None, generation: bool
    ) -> str:
        rendered: str = self._template.render(
            messages=[_template_message(m) for m in messages],
            tools=list(tools) if tools else None,
            add_generation_prompt=generation,
            bos_token=self.tokenizer.bos_token or "",
            eos_token=self.tokenizer.eos_token,
        )
        return rendered

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def render(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None, generation: bool
    ) -> np.ndarray:
        return self.encode(self.text(messages, tools, generation))

    def first(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> np.ndarray:
        return self.render(messages, tools, True)

    def close_ids(self, tools: Sequence[Mapping[str, Any]] | None) -> np.ndarray:
        """What the template writes after an assistant message's content (``<|end|>``, ``<|im_end|>\\n``),
        worked out once per tool list on a one-message conversation."""
        key = canonical_json(list(tools)) if tools else ""
        close = self._close.get(key)
        if close is None:
            history = [{"role": "user", "content": "x"}]
            before = self.render(history, tools, True)
            closed = self.render([*history, {"role": "assistant", "content": ""}], tools, False)
            same = np.array_equal(closed[: len(before)], before)
            close = self._close[key] = closed[len(before) :] if same else np.zeros(0, np.int32)
        return close

    def extend(
        self,
        head: np.ndarray,
        history: Sequence[Mapping[str, Any]],
        new: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
    ) -> np.ndarray:
        close = self.close_ids(tools)
        tail = np.zeros(0, np.int32)
        if not (len(head) and int(head[-1]) == self.eos_id):  # cut by max_tokens: close the message
            tail = close
        elif len(close) and int(close[0]) == self.eos_id:  # the model sampled the eos: what follows it
            tail = close[1:]
        before, after = self.text(history, tools, False), self.text([*history, *new], tools, True)
        if after.startswith(before) and before.endswith(self._specials):
            fast: np.ndarray = np.concatenate([head, tail, self.encode(after[len(before) :])]).astype(np.int32)
            return fast
        rendered, full = self.encode(before), self.encode(after)
        if np.array_equal(full[: len(rendered)], rendered):
            delta = full[len(rendered) :]
        else:  # a template whose text of the history changes with what follows: the text after it
            text_before = self._tok.decode([int(i) for i in rendered], skip_special_tokens=False)
            text_full = self._tok.decode([int(i) for i in full], skip_special_tokens=False)
            delta = np.asarray(
                self._tok.encode(text_full[len(text_before) :], add_special_tokens=False).ids, dtype=np.int32
            )
        prompt: np.ndarray = np.concatenate([head, tail, delta]).astype(np.int32)
        return prompt


def _template_message(m: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(m)
    content = out.get("content")
    if content is None:
        out["content"] = ""
    elif isinstance(content, list):  # OpenAI content parts: their text, in order
        out["content"] = "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return out


class ToolCallParser:
    """Tool calls in a completion's text: ChatML's ``<tool_call>{"name", "arguments"}</tool_call>``
    (the Hermes/Qwen spelling; the text around them is the message's content)."""

    _CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)

    def parse(self, text: str, call_id: str) -> tuple[str, list[dict[str, Any]]]:
        calls: list[dict[str, Any]] = []
        for i, match in enumerate(self._CALL.finditer(text)):
            try:
                body = json.loads(match.group(1))
            except ValueError:
                continue
            name = body.get("name") if isinstance(body, dict) else None
            if not isinstance(name, str):
                continue
            args = body.get("arguments", body.get("parameters", {}))
            arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            # Deterministic ids: a replayed answer is byte-identical to the live one.
            digest = hashlib.sha256(f"{call_id}#{i}".encode()).hexdigest()[:24]
            calls.append(
                {"id": f"call_{digest}", "type": "function", "function": {"name": name, "arguments": arguments}}
            )
        content = self._CALL.sub("", text) if calls else text
        return content, calls


@dataclass(frozen=True)
class ChatAnswer:
    """An assistant message and the model answer it was made from."""

    content: str
    tool_calls: list[dict[str, Any]]
    answer: ModelAnswer
    finish_reason: str  # "stop", "length", or "tool_calls"

    @property
    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


def assistant_messages(messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """Indexes of the assistant messages."""
    return [i for i, m in enumerate(messages) if m.get("role") == "assistant"]


@dataclass
class ChatSession:
    """One attempt of a rollout driven in chat messages (see the module docstring)."""

    session: RolloutSession
    prompts: PromptBuilder
    tokenizer: ChatTokenizer
    parser: ToolCallParser = field(default_factory=ToolCallParser)
    # A request's position and its call are one step: two requests of one rollout at once (a client's
    # retry racing the original) are placed one after the other, so the second is the retry it is.
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock, init=False, repr=False)
    # The last answer's text and tool calls, by its call id and ids: the next request carries that
    # answer back, and checking it needs them again (decoding them twice was a few per cent of a call's CPU).
    _decoded: tuple[tuple[str, bytes], tuple[str, list[dict[str, Any]]]] | None = field(
        default=None, init=False, repr=False
    )

    @property
    def rollout_id(self) -> str:
        return self.session.rollout_id

    def answer_of(self, effect: Effect, prompt: np.ndarray | None = None) -> ChatAnswer:
        """The assistant message a journaled call answered (``prompt``: its prompt ids, if known here)."""
        ids, logprobs = effect.answer
        return self._chat_answer(
            ModelAnswer(
                effect.ref,
                ids,
                logprobs,
                effect.finish_reason,
                prompt if prompt is not None else np.zeros(0, np.int32),
                (effect.turn, effect.step),
                True,
                ts_ms=effect.ts_ms,
            )
        )

    def _chat_answer(self, answer: ModelAnswer) -> ChatAnswer:
        key = (answer.call_id, np.asarray(answer.output_ids, dtype=np.int32).tobytes())
        if self._decoded is not None and self._decoded[0] == key:
            content, calls = self._decoded[1]
            calls = copy.deepcopy(calls) if calls else []  # each answer owns its tool calls
        else:
            text = self.tokenizer.decode(answer.output_ids, skip_special_tokens=True)
            content, calls = self.parser.parse(text, answer.call_id)
            self._decoded = (key, (content, copy.deepcopy(calls) if calls else []))
        finish = "tool_calls" if calls else answer.finish_reason
        return ChatAnswer(content, calls, answer, finish)

    def position_of(self, messages: Sequence[Mapping[str, Any]]) -> int:
        return len(assistant_messages(messages))

    async def complete(
        self,
        messages: Sequence[Mapping[str, Any]],
        params: SamplingParams,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        on_tokens: TokenSink | None = None,
        describe: str = "chat",
    ) -> ChatAnswer:
        """The answer to ``messages``: from the journal when it holds this call, else live (durable
        before it returns). Raises :class:`Redrive` for a request behind the cursor."""
        async with self._lock:
            return await self._complete(messages, params, tools, on_tokens, describe)

    async def _complete(
        self,
        messages: Sequence[Mapping[str, Any]],
        params: SamplingParams,
        tools: Sequence[Mapping[str, Any]] | None,
        on_tokens: TokenSink | None,
        describe: str,
    ) -> ChatAnswer:
        session = self.session
        k = self.position_of(messages)
        turn, made = session.turn, session.model_index
        if made and k == turn and self._last_effect_is_model(turn):  # a retry of the call just answered
            effect = self._model_effect(turn)
            prompt = self._check_same_request(effect, messages, params, tools, describe)
            answer = self.answer_of(effect, prompt)
            session.replayed_calls += 1
            if on_tokens is not None:
                await on_tokens(_chunk(answer.answer))
            return answer
        expected = turn + 1 if made else turn
        if k < expected:
            raise Redrive(self.rollout_id, k, expected)
        await self._close_turns(messages, k)
        prompt = self._prompt(messages, k, tools)
        request = ModelRequest(prompt, params, describe=f"{describe} {len(messages)} messages")
        return self._chat_answer(await session.model_call(request, on_tokens=on_tokens))

    async def end(self, messages: Sequence[Mapping[str, Any]] = ()) -> None:
        """Close the turn under way with the messages after its answer (the agent's last words)."""
        await self.session.end_turn([_journal_message(m) for m in messages])

    async def finish(self, reward: float, messages: Sequence[Mapping[str, Any]] | None = None) -> None:
        """Finish the rollout. The turn under way ends with ``messages``, by default its answer."""
        session = self.session
        if messages is None:
            models = [e for e in session.state.effects.in_turn(session.turn) if e.kind == MODEL]
            live = session.turn >= session.state.next_turn
            messages = [self.answer_of(models[-1]).message] if models and live else []
        await session.finish(reward, messages=[_journal_message(m) for m in messages])

    def _last_effect_is_model(self, turn: int) -> bool:
        effects = self.session.state.effects.in_turn(turn)
        return bool(effects) and self.session.step == len(effects) and effects[-1].kind == MODEL

    def _model_effect(self, turn: int) -> Effect:
        effects = [e for e in self.session.state.effects.in_turn(turn) if e.kind == MODEL]
        if not effects:
            raise HistoryMismatchError(self.rollout_id, f"turn {turn} holds no model call")
        return effects[-1]

    def _check_same_request(
        self,
        effect: Effect,
        messages: Sequence[Mapping[str, Any]],
        params: SamplingParams,
        tools: Sequence[Mapping[str, Any]] | None,
        describe: str,
    ) -> np.ndarray:
        prompt = self._prompt(messages, effect.turn, tools)
        request = ModelRequest(prompt, params, describe=f"{describe} {len(messages)} messages")
        self.session._check_same(effect, MODEL, request.summary(), lambda: "a retry with another request")
        return prompt

    async def _close_turns(self, messages: Sequence[Mapping[str, Any]], k: int) -> None:
        """Step the cursor to turn ``k``: each turn before it closes with the messages after its answer
        (a turn the journal holds is only stepped over, once its answer is the request's)."""
        session = self.session
        assistants = assistant_messages(messages)
        known = session.state.messages
        while session.turn < k:
            turn = session.turn
            if session.model_index == 0:
                # The agent did not ask for this turn's call of this session (it outlived a gateway that
                # restarted): the journal must hold it, and the request must carry its answer.
                if not any(e.kind == MODEL for e in session.state.effects.in_turn(turn)):
                    raise HistoryMismatchError(
                        self.rollout_id, f"assistant message {turn} answers no call this rollout journaled"
                    )
                session.skip_journaled()
            effect = self._model_effect(turn)
            self._check_answer(messages[assistants[turn]], effect, turn)
            upto = assistants[turn + 1] if turn + 1 < len(assistants) else len(messages)
            if turn < session.state.next_turn:
                await session.end_turn([])
                continue
            start = len(known)
            for i, (mine, theirs) in enumerate(zip(known, messages[:start])):
                if mine != _journal_message(theirs):
                    raise HistoryMismatchError(self.rollout_id, f"message {i} ({mine.role}) differs from the journal's")
            await session.end_turn([_journal_message(m) for m in messages[start:upto]])

    def _check_answer(self, message: Mapping[str, Any], effect: Effect, turn: int) -> None:
        mine = self.answer_of(effect)
        content = _text(message.get("content"))
        theirs_calls = [
            (c.get("function", {}).get("name"), _canonical_args(c.get("function", {}).get("arguments")))
            for c in message.get("tool_calls") or []
        ]
        my_calls = [(c["function"]["name"], _canonical_args(c["function"]["arguments"])) for c in mine.tool_calls]
        if content != mine.content or theirs_calls != my_calls:
            raise HistoryMismatchError(
                self.rollout_id,
                f"assistant message {turn} is not the answer of call {effect.ref} "
                f"(journaled {mine.content[:80]!r}, sent {content[:80]!r})",
            )

    def _prompt(
        self, messages: Sequence[Mapping[str, Any]], k: int, tools: Sequence[Mapping[str, Any]] | None
    ) -> np.ndarray:
        if k == 0:
            return self.prompts.first(messages, tools)
        effect = self._model_effect(k - 1)
        ids, _ = effect.answer
        head_tokens = self.session.state.head_tokens
        if len(head_tokens) < effect.prompt_len:
            raise HistoryMismatchError(self.rollout_id, f"the lineage no longer holds call {effect.ref}'s prompt")
        head = np.concatenate([head_tokens[: effect.prompt_len], ids]).astype(np.int32)
        last = assistant_messages(messages)[k - 1]
        return self.prompts.extend(head, messages[: last + 1], messages[last + 1 :], tools)


def _chunk(answer: ModelAnswer) -> Any:
    from rollout_journal.participants.model.generation import TokenChunk

    return TokenChunk(answer.output_ids, answer.logprobs, answer.finish_reason)


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return str(content)


def _canonical_args(arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            return canonical_json(json.loads(arguments))
        except ValueError:
            return arguments
    return canonical_json(arguments)


def _journal_message(m: Mapping[str, Any]) -> Message:
    """A chat message as today's journal keeps it (role and text; tool calls in the text until the
    journal's ChatMessage carries them)."""
    content = _text(m.get("content"))
    calls = m.get("tool_calls") or []
    if calls:
        content += "".join(
            f"<tool_call>{json.dumps({'name': c.get('function', {}).get('name'), 'arguments': c.get('function', {}).get('arguments')})}</tool_call>"
            for c in calls
        )
    return Message(str(m.get("role", "user")), content)
