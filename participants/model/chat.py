"""The next prompt from token ids, never from re-encoded text (token-in-token-out).

A rollout's prompt for its next model call is the previous call's prompt and sampled ids
(the lineage *head*), the tokens the chat template puts after an assistant message to close
it (those the sample lacks), and the tokenized new messages::

    prompt = head + close + delta
    close  = render(history[:-1] + [assistant ""]) - render(history[:-1], generation prompt)
             (ChatML ``<|im_end|>\\n``, Llama 3 ``<|eot_id|>``); only what follows its EOS when
             the sample ended in an end-of-turn id, all of it when ``max_tokens`` cut the sample
    delta  = render(history + new, generation prompt) - render(history), at token level

``history`` is the conversation up to the assistant message made from the head call (it names
the call: ``ChatMessage.call_id``), ``new`` what came after it (tool results, a user message, or
nothing: the action call after a reasoning call). ``render`` is the model folder's own chat
template, rendered as ``transformers.apply_chat_template`` renders it (with ``tools``). The
sampled ids are never decoded and encoded again: byte fragments, special tokens sampled
inside text and non-canonical tokenizations (a grammar's choice) stay exactly as sampled, and
the training record's loss mask covers every one of them.

A template that rewrites history (Qwen3 drops the ``<think>`` of earlier turns once a user
message follows) makes ``render(history)`` no token prefix of ``render(history + new)``. That
is detected per call and handled by the rollout's ``history_policy``, never silently:

``keep_sampled`` (default)
    NeMo RL's EOS-boundary splice (PR #1337): keep the head as sampled, append only a missing
    EOS, then what ``render(history + new)`` has after its N-th end-of-turn token, N the number
    of end-of-turn tokens in ``render(history)``. Continuation ``eos_splice``.
``new_sequence``
    The template's full render; the lineage starts a new token sequence (the training record
    holds two). Continuation ``new_sequence``.
``fail``
    :class:`TemplateRewritesHistory`: the rollout fails (an infrastructure failure: the
    configuration does not fit the model).

Every call is also checked against a full re-render of the conversation, turn by turn
(:class:`TemplateCheck`): turns of sampled tokens a re-render would tokenize otherwise (what a
re-encoding trainer would lose), turns of template text that differ (a history rewrite the
delta check cannot see, e.g. Qwen3's with tool results only), a different number of turns.

The builder is a pure function of (head tokens, head call, messages, tools, tokenizer,
policy): a turn redone after a crash builds the same prompt, so a call cut short continues
from its journaled prefix and the crash drill's records stay bit-equal.

Interface for callers that speak messages (the agent; a session API or gateway)::

    builder = PromptBuilder(tokenizer, history_policy="keep_sampled")
    prompt = builder.prompt(state, new_messages, tools=tools, sampled=state.lineage.loss_mask())
    prompt.ids, prompt.prefix_len, prompt.continuation, prompt.inserted, prompt.check
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np

from rollout_journal.journal.errors import ConfigurationError, RolloutJournalError
from rollout_journal.journal.events import (
    CONTINUATION_EOS_SPLICE,
    CONTINUATION_EXTEND,
    CONTINUATION_FIRST,
    CONTINUATION_NEW_SEQUENCE,
    ChatMessage,
    TemplateCheck,
)
from rollout_journal.participants.model.tokenizer import ChatTokenizer

__all__ = [
    "HISTORY_POLICIES",
    "ChatTemplate",
    "ContinuationError",
    "ConversationView",
    "HistoryPolicy",
    "Prompt",
    "PromptBuilder",
    "TemplateRewritesHistory",
]

HistoryPolicy = Literal["keep_sampled", "new_sequence", "fail"]
HISTORY_POLICIES: tuple[str, ...] = ("keep_sampled", "new_sequence", "fail")
Tools = Sequence[Mapping[str, Any]] | None


class TemplateRewritesHistory(ConfigurationError):
    """The chat template renders earlier turns differently once messages are added, and the
    workload's ``model.history_policy`` is ``fail``."""


class ContinuationError(RolloutJournalError):
    """The conversation has no assistant message for the lineage head's call: the next prompt
    cannot continue the head's tokens."""


class ConversationView(Protocol):
    """What the builder reads of a rollout (``RolloutState`` has it)."""

    head_call_id: str | None
    head_tokens: np.ndarray
    messages: list[ChatMessage]


@dataclass(frozen=True)
class Prompt:
    """A call's prompt and how it continues the head.

    ``ids[:prefix_len]`` is the head (all of it, except for ``first`` and ``new_sequence``,
    where ``prefix_len`` is 0); ``ids[prefix_len:prefix_len + inserted]`` close the head's turn
    (template tokens, never sampled); the rest renders the new messages."""

    ids: np.ndarray
    prefix_len: int
    continuation: str  # first | extend | eos_splice | new_sequence
    inserted: int = 0
    check: TemplateCheck | None = None

    @property
    def delta(self) -> np.ndarray:
        return self.ids[self.prefix_len :]


class ChatTemplate:
    """A model folder's chat template as token ids: renders, closes, deltas, splices, checks."""

    def __init__(self, tokenizer: ChatTokenizer, **template_kwargs: Any) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = tokenizer.eos_ids
        self.template_kwargs = template_kwargs

    def render(self, messages: Sequence[ChatMessage], tools: Tools, add_generation_prompt: bool) -> np.ndarray:
        return self.tokenizer.render_ids(list(messages), tools, add_generation_prompt, **self.template_kwargs)

    def close(self, history: Sequence[ChatMessage], tools: Tools) -> np.ndarray:
        """What the template writes after an assistant message's content (its end-of-turn tokens):
        an empty assistant message's render after the generation prompt, or, for a template whose
        generation prompt is no prefix of it (one that opens an empty think block, say), the text
        the template writes after a marker content, tokenized on its own."""
        before = list(history[:-1])
        opened = self.render(before, tools, True)
        closed = self.render([*before, ChatMessage("assistant", "")], tools, False)
        if len(closed) >= len(opened) and np.array_equal(closed[: len(opened)], opened):
            return closed[len(opened) :]
        marker = "\x00rollout-journal-close\x00"
        text = self.tokenizer.render([*before, ChatMessage("assistant", marker)], tools, False, **self.template_kwargs)
        if marker not in text:
            raise TemplateRewritesHistory(
                f"chat template of {self.tokenizer.source or 'the model'} drops an assistant message's content "
                "from its render; the template's end-of-turn tokens cannot be told"
            )
        return self.tokenizer.chat_ids(text.rsplit(marker, 1)[1])

    def tail(self, head: np.ndarray, close: np.ndarray, *, eos_only: bool = False) -> np.ndarray:
        """The close tokens the head still needs: after the close's EOS if the head (the sample)
        ends in an end-of-turn id, else all of them (``eos_only``: at most its EOS)."""
        eos_at = next((i for i, t in enumerate(close.tolist()) if t in self.eos_ids), None)
        ended = len(head) > 0 and int(head[-1]) in self.eos_ids
        if eos_only:
            return close[:0] if ended or eos_at is None else close[eos_at : eos_at + 1]
        if ended:
            return close[eos_at + 1 :] if eos_at is not None else close[:0]
        return close

    @staticmethod
    def delta(base: np.ndarray, full: np.ndarray) -> np.ndarray | None:
        """``full`` (``render(history + new, generation prompt)``) after ``base`` (``render(history)``);
        None when ``base`` is no token prefix of ``full`` (the template rewrites history)."""
        if len(full) < len(base) or not np.array_equal(full[: len(base)], base):
            return None
        return full[len(base) :]

    def splice(self, base: np.ndarray, full: np.ndarray) -> np.ndarray:
        """NeMo RL's EOS-boundary splice: what ``full`` (``render(history + new, generation
        prompt)``) has after its N-th end-of-turn token, N the end-of-turn tokens of ``base``
        (``render(history)``)."""
        n = int(np.isin(base, list(self.eos_ids)).sum())
        ends = np.flatnonzero(np.isin(full, list(self.eos_ids)))
        if len(ends) < n:
            raise TemplateRewritesHistory(
                f"chat template of {self.tokenizer.source or 'the model'}: the conversation renders {len(ends)} "
                f"end-of-turn tokens, its history alone {n}; no EOS boundary to splice the new messages at"
            )
        return full[ends[n - 1] + 1 :] if n else full

    def check(self, prompt: np.ndarray, sampled: np.ndarray, rendered: np.ndarray) -> TemplateCheck:
        """``prompt`` against the template's full render of the same conversation, turn by turn
        (turns end at end-of-turn tokens); ``sampled`` marks the prompt's sampled tokens."""
        ours, theirs = self._turns(prompt), self._turns(rendered)
        sampled_turns = rendered_turns = 0
        for (s0, e0), (s1, e1) in zip(ours, theirs):
            if not np.array_equal(prompt[s0:e0], rendered[s1:e1]):
                if sampled[s0:e0].any():
                    sampled_turns += 1
                else:
                    rendered_turns += 1
        return TemplateCheck(
            bool(np.array_equal(prompt, rendered)), sampled_turns, rendered_turns, len(ours) != len(theirs)
        )

    def _turns(self, ids: np.ndarray) -> list[tuple[int, int]]:
        ends = np.flatnonzero(np.isin(ids, list(self.eos_ids))) + 1
        starts = np.concatenate([[0], ends])
        stops = np.concatenate([ends, [len(ids)]])
        return [(int(a), int(b)) for a, b in zip(starts, stops)]


class PromptBuilder:
    """Builds each call's prompt by the token-in-token-out rule (see the module's docstring).

    ``tools``: JSON-schema functions rendered by the template (a call may pass its own);
    ``history_policy``: what to do when the template rewrites history; ``check_template``: also
    compare every prompt with the template's full re-render (one more render per call)."""

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        *,
        tools: Tools = None,
        history_policy: HistoryPolicy = "keep_sampled",
        check_template: bool = True,
        **template_kwargs: Any,
    ) -> None:
        if history_policy not in HISTORY_POLICIES:
            raise ConfigurationError(f"history_policy {history_policy!r}: use one of {', '.join(HISTORY_POLICIES)}")
        self.template = ChatTemplate(tokenizer, **template_kwargs)
        self.tools = tools
        self.history_policy = history_policy
        self.check_template = check_template

    def prompt(
        self,
        view: ConversationView,
        new: Sequence[ChatMessage] = (),
        *,
        tools: Tools = None,
        sampled: np.ndarray | None = None,
    ) -> Prompt:
        """The next call's prompt for a rollout whose state is ``view`` and whose conversation
        goes on with ``new`` (messages not yet in ``view.messages``: the turn's reasoning, a
        session's new messages). ``sampled``: the head's loss mask (which of its tokens the model
        sampled), for the template check."""
        return self.prompt_for(
            view.head_tokens, view.head_call_id, [*view.messages, *new], tools=tools, sampled=sampled
        )

    def prompt_for(
        self,
        head: np.ndarray,
        head_call_id: str | None,
        messages: Sequence[ChatMessage],
        *,
        tools: Tools = None,
        sampled: np.ndarray | None = None,
    ) -> Prompt:
        """The same from its parts: the head's tokens (prompt + output of ``head_call_id``;
        empty for a conversation's first call) and the whole conversation."""
        tools = self.tools if tools is None else tools
        t = self.template
        head = np.asarray(head, dtype=np.int32)
        if head_call_id is None or len(head) == 0:
            ids = t.render(messages, tools, True)
            return Prompt(ids, 0, CONTINUATION_FIRST, 0, self._check(ids, np.zeros(len(ids), bool), ids))
        split = self._split(head_call_id, messages)
        history, new = messages[: split + 1], messages[split + 1 :]
        close = t.close(history, tools)
        base, full = t.render(history, tools, False), t.render(messages, tools, True)
        delta = t.delta(base, full)
        continuation = CONTINUATION_EXTEND
        if delta is None:
            if self.history_policy == "fail":
                raise TemplateRewritesHistory(
                    f"chat template of {t.tokenizer.source or 'the model'} renders the conversation's earlier "
                    f"turns differently once {len(new)} message(s) follow call {head_call_id} "
                    "(model.history_policy: fail; keep_sampled splices at end-of-turn tokens, new_sequence "
                    "starts a new token sequence)"
                )
            if self.history_policy == "new_sequence":
                return Prompt(full, 0, CONTINUATION_NEW_SEQUENCE, 0, self._check(full, np.zeros(len(full), bool), full))
            tail, delta = t.tail(head, close, eos_only=True), t.splice(base, full)
            continuation = CONTINUATION_EOS_SPLICE
        else:
            tail = t.tail(head, close)
        ids = np.concatenate([head, tail, delta]).astype(np.int32)
        mask = np.zeros(len(ids), dtype=bool)
        if sampled is not None and len(sampled) == len(head):
            mask[: len(head)] = sampled
        return Prompt(ids, len(head), continuation, len(tail), self._check(ids, mask, full))

    def _check(self, ids: np.ndarray, sampled: np.ndarray, rendered: np.ndarray) -> TemplateCheck | None:
        return self.template.check(ids, sampled, rendered) if self.check_template else None

    @staticmethod
    def _split(head_call_id: str, messages: Sequence[ChatMessage]) -> int:
        """Index of the assistant message standing for the head call: the one naming it, else
        (a conversation journaled before messages named their calls) the last assistant message."""
        last = None
        for i in range(len(messages) - 1, -1, -1):
            m = messages[i]
            if m.role != "assistant":
                continue
            if m.call_id == head_call_id:
                return i
            if last is None:
                last = i
        if last is None or any(m.call_id is not None for m in messages if m.role == "assistant"):
            raise ContinuationError(
                f"no assistant message of the conversation stands for call {head_call_id} (the lineage head): "
                "an assistant message made from a model call names it in call_id"
            )
        return last
