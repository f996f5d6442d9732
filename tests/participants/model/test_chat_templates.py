"""Real chat templates and token-in-token-out prompts: every family renders exactly as
transformers' apply_chat_template does (tools, tool calls, tool results), and the next prompt
is the previous prompt + the sampled ids + what the template adds, whatever was sampled."""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest

from rollout_journal.journal.events import ChatMessage
from rollout_journal.participants.model.chat import (
    ChatTemplate,
    ContinuationError,
    PromptBuilder,
    TemplateRewritesHistory,
)
from rollout_journal.participants.model.tokenizer import ChatTokenizer
from tests.support.template_models import CONVERSATION, FAMILY_NAMES, TOOLS, model_folder


@cache
def tokenizer(family: str) -> ChatTokenizer:
    return ChatTokenizer.from_folder(model_folder(family))


@cache
def hf_tokenizer(family: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_folder(family))


def as_dicts(messages: list[ChatMessage]) -> list[dict]:
    return [m.as_template_dict() for m in messages]


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_every_family_renders_as_transformers_apply_chat_template(family: str) -> None:
    """Every prefix of an 8-message conversation with tools, with and without the generation
    prompt: the same text and the same ids as transformers."""
    tok, hf = tokenizer(family), hf_tokenizer(family)
    for k in range(1, len(CONVERSATION) + 1):
        for gen in (False, True):
            messages = CONVERSATION[:k]
            expected = hf.apply_chat_template(
                as_dicts(messages), tools=TOOLS, add_generation_prompt=gen, tokenize=False
            )
            ids = hf.apply_chat_template(
                as_dicts(messages), tools=TOOLS, add_generation_prompt=gen, tokenize=True, return_dict=False
            )
            assert tok.render(messages, TOOLS, gen) == expected, (k, gen)
            assert tok.render_ids(messages, TOOLS, gen).tolist() == list(ids), (k, gen)


def test_the_templates_write_tools_and_tool_calls_in_their_own_formats() -> None:
    chatml = tokenizer("chatml").render(CONVERSATION[:4], TOOLS, False)
    assert "<tools>\n" + '{"type": "function", "function": {"name": "mail.send"' in chatml
    assert (
        '<tool_call>\n{"name": "mail.send", "arguments": {"to": "alice", "subject": "meeting"}}\n</tool_call>' in chatml
    )
    assert "<|im_start|>user\n<tool_response>\nok, message sent, id 318\n</tool_response><|im_end|>\n" in chatml
    llama = tokenizer("llama3").render(CONVERSATION[:4], TOOLS, False)
    assert llama.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n")
    assert '{"name": "mail.send", "parameters": {"to": "alice", "subject": "meeting"}}<|eot_id|>' in llama
    assert "<|start_header_id|>ipython<|end_header_id|>\n\nok, message sent, id 318<|eot_id|>" in llama
    assert '    "type": "function",' in llama  # tojson(indent=4)


def test_the_eos_ids_include_the_generation_configs() -> None:
    llama = tokenizer("llama3")
    assert {llama.chat_ids(t)[0] for t in ("<|eot_id|>", "<|end_of_text|>", "<|eom_id|>")} == llama.eos_ids


def sample(tok: ChatTokenizer, text: str, *, fragments: bool = True, special: str | None = None) -> np.ndarray:
    """What a model might sample for ``text``: a byte fragment pair that decodes to U+FFFD, a
    special token inside the text, then ``text`` (non-canonically split), then its EOS."""
    parts: list[int] = []
    if fragments:
        parts += tok.encode("é").tolist()[:1] * 2  # half a character, twice: invalid UTF-8
    if special is not None:
        parts += tok.chat_ids(special).tolist()
    parts += [t for ch in text for t in tok.encode(ch).tolist()]  # one character at a time: not canonical
    return np.asarray([*parts, tok.eos_id], dtype=np.int32)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_the_next_prompt_is_the_previous_prompt_and_the_sampled_ids_exactly(family: str) -> None:
    tok = tokenizer(family)
    builder = PromptBuilder(tok, tools=TOOLS)
    conversation = CONVERSATION[:2]
    first = builder.prompt_for(np.zeros(0, np.int32), None, conversation)
    assert first.continuation == "first" and first.prefix_len == 0 and first.check.agrees
    assert first.ids.tolist() == tok.render_ids(conversation, TOOLS, True).tolist()
    special = {"tiny": "<|tool|>", "llama3": "<|python_tag|>"}.get(family, "<|im_start|>")
    output = sample(tok, "mail.send(to=alice)", special=special)
    head = np.concatenate([first.ids, output])
    assert tok.encode(tok.decode(output)).tolist() != output.tolist()  # text would not give these ids back
    reply = ChatMessage("assistant", tok.decode(output), call_id="r/a1/t0/c0")
    result = ChatMessage("tool", "ok, message sent, id 318", tool_call_id="c0")
    sampled = np.zeros(len(head), bool)
    sampled[len(first.ids) :] = True
    second = builder.prompt_for(head, "r/a1/t0/c0", [*conversation, reply, result], sampled=sampled)
    assert second.continuation == "extend" and second.prefix_len == len(head)
    assert second.ids[: len(head)].tolist() == head.tolist()
    rest = tok.render_ids([*conversation, reply, result], TOOLS, True)[
        len(tok.render_ids([*conversation, reply], TOOLS, False)) :
    ]
    assert second.delta[second.inserted :].tolist() == rest.tolist()
    close = {"tiny": "", "chatml": "\n", "chatml-think": "\n", "llama3": ""}[family]  # what follows the EOS
    assert tok.decode(second.delta[: second.inserted], skip_special_tokens=False) == close
    # the template would tokenize the sampled turn otherwise: said, not silently re-encoded
    assert not second.check.agrees and second.check.sampled_turns_differing == 1
    assert second.check.rendered_turns_differing == 0


def test_a_sample_cut_by_max_tokens_gets_the_whole_close_inserted() -> None:
    tok = tokenizer("chatml")
    builder = PromptBuilder(tok)
    first = builder.prompt_for(np.zeros(0, np.int32), None, CONVERSATION[:2])
    output = tok.encode("Let me think about")  # no <|im_end|>: max_tokens ran out
    head = np.concatenate([first.ids, output])
    reply = ChatMessage("assistant", tok.decode(output), call_id="c0")
    second = builder.prompt_for(head, "c0", [*CONVERSATION[:2], reply])
    assert second.continuation == "extend"
    assert tok.decode(second.delta, skip_special_tokens=False) == "<|im_end|>\n<|im_start|>assistant\n"
    assert second.inserted == len(tok.chat_ids("<|im_end|>\n"))


def test_the_action_after_a_reasoning_call_continues_it_with_the_generation_prompt_only() -> None:
    tok = tokenizer("tiny")
    builder = PromptBuilder(tok)
    first = builder.prompt_for(np.zeros(0, np.int32), None, CONVERSATION[:2])
    thought = sample(tok, "first mail, then the record", fragments=True)
    head = np.concatenate([first.ids, thought])
    action = builder.prompt_for(
        head, "c0", [*CONVERSATION[:2], ChatMessage("assistant", tok.decode(thought), call_id="c0")]
    )
    assert action.ids[: len(head)].tolist() == head.tolist()
    assert tok.decode(action.delta, skip_special_tokens=False) == "<|assistant|>"


def reasoning_then_user(family: str) -> tuple[np.ndarray, list[ChatMessage]]:
    """A first call that sampled a think block, then a user message: Qwen3's template drops
    the earlier think from its render."""
    tok = tokenizer(family)
    first = PromptBuilder(tok).prompt_for(np.zeros(0, np.int32), None, CONVERSATION[:2])
    text = "<think>\nalice first\n</think>\n\nDone."
    output = np.concatenate([tok.chat_ids(text), [tok.eos_id]]).astype(np.int32)
    messages = [*CONVERSATION[:2], ChatMessage("assistant", text, call_id="c0"), ChatMessage("user", "And Bob?")]
    return np.concatenate([first.ids, output]).astype(np.int32), messages


def test_a_template_that_rewrites_history_is_spliced_at_eos_boundaries_by_default() -> None:
    tok = tokenizer("chatml-think")
    head, messages = reasoning_then_user("chatml-think")
    prompt = PromptBuilder(tok).prompt_for(head, "c0", messages)
    assert prompt.continuation == "eos_splice" and prompt.prefix_len == len(head)
    assert prompt.ids[: len(head)].tolist() == head.tolist()  # the think the model sampled stays
    assert (
        tok.decode(prompt.delta, skip_special_tokens=False)
        == "\n<|im_start|>user\nAnd Bob?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert prompt.check.rendered_turns_differing + prompt.check.sampled_turns_differing >= 1
    # the same conversation on the template that keeps history: a plain extension
    kept_head, kept_messages = reasoning_then_user("chatml")
    assert PromptBuilder(tokenizer("chatml")).prompt_for(kept_head, "c0", kept_messages).continuation == "extend"


def test_new_sequence_and_fail_are_the_other_history_policies() -> None:
    tok = tokenizer("chatml-think")
    head, messages = reasoning_then_user("chatml-think")
    fresh = PromptBuilder(tok, history_policy="new_sequence").prompt_for(head, "c0", messages)
    assert fresh.continuation == "new_sequence" and fresh.prefix_len == 0
    assert fresh.ids.tolist() == tok.render_ids(messages, None, True).tolist()
    with pytest.raises(TemplateRewritesHistory, match="history_policy: fail"):
        PromptBuilder(tok, history_policy="fail").prompt_for(head, "c0", messages)


def test_a_conversation_without_the_heads_message_is_refused() -> None:
    tok = tokenizer("tiny")
    head, messages = reasoning_then_user("tiny")
    with pytest.raises(ContinuationError, match="call c9"):
        PromptBuilder(tok).prompt_for(head, "c9", messages)
    unnamed = [ChatMessage(m.role, m.content) for m in messages]  # journaled before messages named calls
    assert PromptBuilder(tok).prompt_for(head, "c9", unnamed).continuation == "extend"


def test_a_new_sequence_keeps_the_closed_one_in_the_training_record() -> None:
    """history_policy new_sequence on a template that rewrites history: the record holds both
    sequences (every sampled token of the first stays under the mask), says where the second
    starts, and a snapshot keeps them."""
    from rollout_journal.journal.events import AttemptStarted, Header, ModelCall, SamplingParams, TurnCompleted
    from rollout_journal.participants.rollout.state import RolloutState

    tok = tokenizer("chatml-think")
    builder = PromptBuilder(tok, history_policy="new_sequence")
    state = RolloutState("r", "g")
    state.apply(AttemptStarted(Header("r", "g", 1, 1, 0, 0, 0, "w"), 0, "topo", "test", CONVERSATION[:2]))
    seq = 1

    def call(prompt, output: np.ndarray, turn: int) -> ModelCall:
        nonlocal seq
        event = ModelCall(
            Header("r", "g", 1, 1, turn, seq, 0, "w"),
            f"r/a1/t{turn}/c0",
            state.head_call_id,
            "p",
            SamplingParams(1.0, 1.0, 32, 0),
            prompt.prefix_len,
            prompt.delta,
            output,
            np.full(len(output), -1.0, dtype="<f4"),
            logprob_mode="processed",
            continuation=prompt.continuation,
        )
        state.apply(event)
        seq += 1
        return event

    text = "<think>\nalice first\n</think>\n\nDone."
    output = np.concatenate([tok.chat_ids(text), [tok.eos_id]]).astype(np.int32)
    first = call(builder.prompt(state), output, 0)
    messages = [ChatMessage("assistant", text, call_id=first.call_id), ChatMessage("user", "And Bob?")]
    state.apply(TurnCompleted(Header("r", "g", 1, 1, 0, seq, 0, "w"), messages, [first.call_id], {}))
    seq += 1
    head = state.head_tokens.copy()
    second_prompt = builder.prompt(state)
    assert second_prompt.continuation == "new_sequence"
    second = call(second_prompt, output, 1)
    record = state.training_record(state.header("w"), 1)
    assert record.sequence_starts.tolist() == [len(head)] and record.new_sequences == 1
    assert record.input_ids[: len(head)].tolist() == head.tolist()
    assert int(record.loss_mask.sum()) == len(first.output_ids) + len(second.output_ids)
    assert record.sequence_bounds() == [(0, len(head)), (len(head), len(record.input_ids))]
    assert record.tensors()["sequence_id"][len(head) :].eq(1).all()
    assert RolloutState.from_bytes(state.to_bytes()).training_record(record.header, 1) == record


def test_a_dataset_row_gives_the_conversations_start_and_the_tools(tmp_path) -> None:
    """A row with system and user messages and tools: the rollout starts with those messages and
    the first prompt is the template's own rendering of them with the tools."""
    import json

    from rollout_journal.journal.events import AttemptStarted, ModelCall
    from rollout_journal.journal.open import open_journal
    from rollout_journal.participants.workload.config import ModelConfig, WorkloadConfig
    from rollout_journal.participants.workload.run import run_workload

    messages = [
        {"role": "system", "content": "Be brief; act through tools."},
        {"role": "user", "content": "Move the Acme meeting."},
    ]
    rows = tmp_path / "tasks.jsonl"
    rows.write_text(json.dumps({"messages": messages, "tools": TOOLS}) + "\n")
    folder = model_folder("chatml")
    config = WorkloadConfig(
        name="ds",
        groups=1,
        siblings=1,
        max_turns=1,
        tasks=str(rows),
        journal=str(tmp_path / "journal"),
        model=ModelConfig(path=str(folder), temperature=0.0, max_tokens=8),
        constrained_actions=False,
    )
    run_workload(config, resume=False)
    with open_journal(config.journal, writer="audit", read_only=True) as journal:
        events = [item.event for item in journal.scan()]
    started = next(e for e in events if isinstance(e, AttemptStarted))
    assert started.messages == [
        ChatMessage("system", messages[0]["content"]),
        ChatMessage("user", messages[1]["content"]),
    ]
    first = next(e for e in events if isinstance(e, ModelCall))
    assert first.continuation == "first" and first.template_check.agrees
    assert first.prompt_delta.tolist() == tokenizer("chatml").render_ids(started.messages, TOOLS, True).tolist()


def test_the_close_of_a_template_whose_generation_prompt_opens_a_think_block() -> None:
    """Qwen3 with thinking off writes an empty think block into the generation prompt only: the
    end-of-turn tokens are still what the template writes after an assistant's content."""
    tok = tokenizer("chatml")
    template = tok.chat_template.replace(
        "{{- '<|im_start|>assistant\\n' }}\n{%- endif %}",
        "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}\n{%- endif %}",
    )
    assert template != tok.chat_template
    thinking_off = ChatTokenizer(
        tok._tok.to_str(), tok._config, template, source="chatml-no-think", generation_eos=tok.eos_ids
    )
    close = ChatTemplate(thinking_off).close(CONVERSATION[:3], None)
    assert thinking_off.decode(close, skip_special_tokens=False) == "<|im_end|>\n"
