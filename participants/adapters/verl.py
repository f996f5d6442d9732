"""verl's agent loop (``verl.experimental.agent_loop.AgentLoopBase``, verl 0.9.1) on the session API.

:func:`session_agent_loop` builds (and registers with verl, as ``rollout_journal_session``) an
``AgentLoopBase`` whose every model call is a :meth:`RolloutSession.model_call`: token ids in, the
sampled ids and their logprobs out, journaled, and answered from the journal when a restarted
trainer re-drives the same rollout. Its ``run(sampling_params, **row)`` is a multi-turn chat:
the row's ``raw_prompt`` rendered with the model's template, then per turn a model call and the
environment's reply (``observe``; override it), closed by ``reward`` (override it too). It returns
verl's ``AgentLoopOutput`` built from the ids as sampled (prompt ids, response ids, a response mask
of 1 on sampled tokens, their logprobs), the way verl's continuous-token builder would.

Stable ids: ``{run}.s{global_step}.{uid}.{sibling}`` from the row (verl's ``uid`` names the prompt
group, ``index`` or ``sibling`` the sample): the same trainer step re-driven asks for the same ids.

The model: ``SessionFactory`` decides (any ``GenerationBackend``). :class:`VerlServerBackend` puts
verl's own ``server_manager`` (``LLMServerClient.generate``) behind it, so in a Ray job the calls still
go to verl's inference servers, through the session. verl is imported only when called: this module
runs in verl's environment (``make venv-verl``), where rollout_journal is installed too.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import Any

import numpy as np

from rollout_journal.journal.events import LOGPROB_UNKNOWN, Message, SamplingParams
from rollout_journal.participants.model.generation import FINISH_LENGTH, FINISH_STOP, GenerationRequest, TokenChunk
from rollout_journal.participants.model.tokenizer import ChatTokenizer
from rollout_journal.participants.session.api import ModelRequest, RolloutRef, SessionFactory

__all__ = ["VerlServerBackend", "rollout_id", "session_agent_loop"]


def rollout_id(run: str, global_step: int, uid: str, sibling: int = 0) -> str:
    return f"{run}.s{global_step}.{uid}.{sibling}"


class VerlServerBackend:
    """verl's ``LLMServerClient`` as a ``GenerationBackend`` (one chunk per call: verl's generate is
    not streamed). Its servers batch other requests, so it is not deterministic: the session journals
    every answer before the loop sees it."""

    deterministic = False
    resumes_constrained = False
    logprob_mode = LOGPROB_UNKNOWN  # verl's servers do not say which logprobs they return

    def __init__(self, server_manager: Any, tokenizer: ChatTokenizer, policy_version: str) -> None:
        self.server_manager = server_manager
        self.tokenizer = tokenizer
        self.policy_version = policy_version

    def set_policy_version(self, version: str) -> None:
        """Name the weights from the next call on (verl's trainer syncs them between steps)."""
        self.policy_version = version

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[TokenChunk, None]:
        p = request.params
        out = await self.server_manager.generate(
            request.request_id,
            prompt_ids=[int(t) for t in np.concatenate([request.prompt_ids, request.prefix_ids])],
            sampling_params={"temperature": p.temperature, "top_p": p.top_p, "max_tokens": request.remaining_tokens,
                             "logprobs": True},
        )  # fmt: skip
        ids = np.asarray(out.token_ids, dtype=np.int32)
        logprobs = np.asarray(out.log_probs or [0.0] * len(ids), dtype=np.float32)
        ended = len(ids) and int(ids[-1]) == self.tokenizer.eos_id
        yield TokenChunk(ids, logprobs, FINISH_STOP if ended or len(ids) < request.remaining_tokens else FINISH_LENGTH)

    async def aclose(self) -> None:
        return None


def _ids(encoded: Any) -> list[int]:
    """``apply_chat_template(tokenize=True)``'s ids, whether it returns a list or a BatchEncoding."""
    if isinstance(encoded, Mapping):
        encoded = encoded["input_ids"]
    return [int(t) for t in encoded]


def session_agent_loop(
    factory: SessionFactory, *, run: str, max_turns: int = 3, name: str = "rollout_journal_session"
) -> type:
    """The agent-loop class over ``factory`` (registered with verl under ``name``)."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register

    @register(name)
    class SessionAgentLoop(AgentLoopBase):  # type: ignore[misc]  # verl ships no types
        sessions = factory

        def observe(self, turn: int, text: str, row: Mapping[str, Any]) -> str:
            """The environment's reply to the model's ``text`` (a user message)."""
            return f"turn {turn + 1}: go on"

        def reward(self, transcript: Sequence[Mapping[str, str]], row: Mapping[str, Any]) -> float:
            return float(sum(1 for m in transcript if m["role"] == "assistant"))

        def _render(self, messages: Sequence[Mapping[str, str]], generation: bool) -> list[int]:
            return _ids(
                self.tokenizer.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=generation)
            )

        async def run(self, sampling_params: dict[str, Any], **row: Any) -> Any:
            step = int(row.get("global_step", 0))
            uid, sibling = str(row.get("uid", row.get("index", 0))), int(row.get("sibling", 0))
            rid = rollout_id(run, step, uid, sibling)
            session = await self.sessions.open(
                RolloutRef(rid, f"{run}.s{step}.{uid}", sibling, int(row.get("group_size", 1)))
            )
            params = SamplingParams(
                float(sampling_params.get("temperature", 1.0)),
                float(sampling_params.get("top_p", 1.0)),
                int(sampling_params.get("max_tokens", sampling_params.get("response_length", 32))),
                sampling_params.get("seed"),
            )
            messages = [dict(m) for m in row["raw_prompt"]]
            prompt_ids = self._render(messages, True)
            ids, mask, logprobs = list(prompt_ids), [], []
            eos = self.tokenizer.eos_token_id
            for turn in range(max_turns):
                answer = await session.model_call(
                    ModelRequest(np.asarray(ids, dtype=np.int32), params, describe="verl")
                )
                out = [int(t) for t in answer.output_ids]
                ids += out
                mask += [1] * len(out)
                logprobs += [float(v) for v in answer.logprobs]
                text = self.tokenizer.decode(out, skip_special_tokens=True)
                messages.append({"role": "assistant", "content": text})
                if turn + 1 == max_turns:
                    break
                reply = {"role": "user", "content": self.observe(turn, text, row)}
                history = self._render(messages, False)
                extended = self._render([*messages, reply], True)
                if extended[: len(history)] != history:
                    raise ValueError(f"rollout {rid}: the chat template rewrites the history; see issue 16's policy")
                tail = [] if out and out[-1] == eos else [eos]  # close a reply cut by max_tokens
                follow = tail + extended[len(history) :]
                ids += follow
                mask += [0] * len(follow)
                logprobs += [0.0] * len(follow)
                messages.append(reply)
                await session.end_turn([Message("assistant", text), Message("user", reply["content"])])
            reward = self.reward(messages, row)
            await session.finish(reward, messages=[Message("assistant", messages[-1]["content"])])
            return AgentLoopOutput(
                prompt_ids=prompt_ids,
                response_ids=ids[len(prompt_ids) :],
                response_mask=mask,
                response_logprobs=logprobs,
                reward_score=reward,
                num_turns=len(messages),
                metrics={},
            )

    return SessionAgentLoop
