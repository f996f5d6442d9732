"""vLLM as the policy, in process (the engine API) and over its OpenAI-compatible server:
lineage equals what the engine returned, SIGKILLed workloads resume identical to an
uninterrupted run, a long generation killed midway continues from its journaled prefix,
and the recovery scenarios hold on both backends. One engine and one server per session."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from rollout_journal.journal.events import ModelCall, ModelCallProgress, TurnCompleted
from rollout_journal.journal.journal import ReadReport
from rollout_journal.journal.open import open_journal
from rollout_journal.journal.restore import load_rollouts
from rollout_journal.participants.model.generation import GenerationRequest, SamplingParams
from rollout_journal.participants.model.tiny_model import model_folder
from rollout_journal.participants.rollout.state import full_prompt, restore_state
from rollout_journal.participants.workload.config import ModelConfig, WorkloadConfig
from rollout_journal.participants.workload.run import run_workload
from rollout_journal.participants.workload.runner import workload_specs
from tests.support.recovery_scenarios import SCENARIOS
from tests.support.recovery_support import (
    _CTX,
    _child,
    assert_identical,
    assert_no_mutation_applied_twice,
    committed_by_progress,
    journal_turns,
    reference_outcomes,
    run_child_and_kill,
)
from tests.support.vllm_fixtures import SERVED_NAME

pytestmark = pytest.mark.slow
BACKENDS = ["vllm", "openai"]


@pytest.fixture(params=BACKENDS)
def model(request) -> ModelConfig:
    """The model settings of a workload on each vLLM backend (greedy)."""
    if request.param == "vllm":
        request.getfixturevalue("vllm_engine")
        return ModelConfig(backend="vllm", temperature=0.0)
    return ModelConfig(
        backend="openai", url=request.getfixturevalue("vllm_server"), served_model=SERVED_NAME, temperature=0.0
    )


def workload(journal: str, model: ModelConfig, **overrides) -> WorkloadConfig:
    base = dict(
        name="wl",
        groups=1,
        siblings=2,
        max_turns=3,
        environment="workplace",
        seed=3,
        allow_early_submit=False,
        journal=journal,
        snapshot_every_turns=2,
        model=model,
    )
    return WorkloadConfig(**(base | overrides))


def journal_events(config: WorkloadConfig) -> list:
    report = ReadReport()
    with open_journal(config.journal, writer="reader", read_only=True) as journal:
        events = [item.event for item in journal.scan(report)]
    assert not report.errors, report.errors
    return events


async def engine_output(
    model: ModelConfig, prompt: np.ndarray, params: SamplingParams, choices: list[str] | None
) -> tuple[list[int], list[float]]:
    """What the engine returns for one request, asked directly (not through the agent)."""
    if model.backend == "vllm":
        from vllm.sampling_params import RequestOutputKind

        from rollout_journal.participants.model.constraints import ActionTrie
        from rollout_journal.participants.model.tokenizer import ChatTokenizer
        from rollout_journal.participants.model.vllm_backend import VllmEngine, sampled_logprobs, sampling_params

        engine = VllmEngine.shared(model_folder(model))
        tokenizer = ChatTokenizer.from_folder(model_folder(model))
        constraint = ActionTrie.from_strings(tokenizer, choices) if choices else None
        request = GenerationRequest(prompt, params, constraint, request_id="direct")
        out: asyncio.Queue = asyncio.Queue()
        request_id = engine.request_id("direct")
        engine.submit(request_id, prompt.tolist(), sampling_params(request, RequestOutputKind.FINAL_ONLY), out)
        result = await out.get()
        completion = result.outputs[0]
        return list(completion.token_ids), sampled_logprobs(completion.token_ids, completion.logprobs, request_id)
    body = {
        "model": SERVED_NAME,
        "prompt": prompt.tolist(),
        "max_tokens": params.max_tokens,
        "temperature": float(np.float32(params.temperature)),
        "top_p": float(np.float32(params.top_p)),
        "seed": params.seed,
        "logprobs": 0,
        "return_token_ids": True,
    }
    if choices:
        body["structured_outputs"] = {"choice": choices}
    async with httpx.AsyncClient(timeout=300) as client:
        answer = (await client.post(model.url + "/completions", json=body)).json()
    choice = answer["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def action_space_at(config: WorkloadConfig, events: list, turn: int) -> list[str]:
    """The actions the agent offered at ``turn``: the environment brought to that turn by the
    journaled actions, with submit() held back before the last turn (allow_early_submit off)."""
    from rollout_journal.participants.environments import make_environment
    from rollout_journal.participants.resources import MutationRequest

    spec = workload_specs(config)[0]
    env = make_environment(spec.environment, spec.rollout_id, spec.task_seed)
    try:
        for done in [e for e in events if isinstance(e, TurnCompleted) and e.header.turn < turn]:
            counter = iter(range(100))
            env.step(
                done.actions[0],
                lambda r: MutationRequest(spec.rollout_id, 1, 1, f"k{done.header.turn}/m{next(counter)}", r.revision),  # noqa: B023
            )
        actions = env.action_space()
    finally:
        env.close()
    return [a for a in actions if a != "submit()"] if turn + 1 < config.max_turns else actions


def test_lineage_is_what_the_engine_returned(model: ModelConfig, tmp_path: Path) -> None:
    """Every journaled call (a free-form reasoning segment and a constrained tool call per turn):
    its ids and logprobs are the engine's own answer to the same prompt, asked directly."""
    config = workload(
        str(tmp_path / "journal"), model.model_copy(update={"reasoning_tokens": 24}), siblings=1, max_turns=2
    )
    run_workload(config, resume=False)
    events = journal_events(config)
    calls = [e for e in events if isinstance(e, ModelCall)]
    assert len(calls) == 4 and {c.header.attempt for c in calls} == {1}
    head = np.zeros(0, dtype=np.int32)
    for call in calls:
        prompt = full_prompt(head, call)
        turn_actions = None
        if call.call_id.endswith("/c1"):  # the tool call: the engine is given the turn's action list
            turn_actions = action_space_at(config, events, call.header.turn)
        ids, logprobs = asyncio.run(engine_output(model, prompt, call.sampling, turn_actions))
        assert call.output_ids.tolist() == ids, call.call_id
        assert call.logprobs.tolist() == pytest.approx(logprobs, abs=0), call.call_id  # float32 both ways
        assert call.policy_version.startswith("tiny-llama-v1-seed0@")
        head = np.concatenate([prompt, call.output_ids]).astype(np.int32)


def test_a_sigkilled_workload_resumes_identical_with_no_committed_turn_lost(model: ModelConfig, tmp_path: Path) -> None:
    config = workload(str(tmp_path / "journal"), model, siblings=3, max_turns=4, turn_delay_ms=30)
    reference = reference_outcomes(config)
    progress = tmp_path / "progress.txt"
    killed = run_child_and_kill(
        config, resume=False, kill_after_turns=5, extra_delay_s=0.01, progress_path=progress, timeout_s=900
    )
    assert killed, "the workload finished before the kill"
    durable = committed_by_progress(progress)
    at_crash = journal_turns(config)
    assert all(at_crash[rid][0] >= n for rid, n in durable.items()), "a committed turn was lost"
    resumed = run_workload(config, resume=True)
    assert sum(r.turns_committed_before for r in resumed.rollouts.values()) >= 5
    assert_identical(resumed, reference)
    assert_no_mutation_applied_twice(config)


def _paced_child(config_json: str, progress_path: str, pause_s: float) -> None:
    """A workload whose model streams no faster than a chunk per ``pause_s``: a slow server.
    The tokens are the engine's own; only their pace changes, so a poll of the journal always
    sees the long call under way however fast the machine generates."""
    from rollout_journal.participants.model.gate import ModelParticipant

    stream = ModelParticipant._stream

    async def paced(self, request, ticket):
        async for chunk in stream(self, request, ticket):
            await asyncio.sleep(pause_s)
            yield chunk

    ModelParticipant._stream = paced
    _child(config_json, False, progress_path, {})


def _partial_tokens(config: WorkloadConfig) -> int:
    """Tokens of the call under way that the journal holds as progress (0 if none)."""
    if not (Path(config.journal) / "log").exists():
        return 0
    with open_journal(config.journal, writer="peek", read_only=True) as journal:
        plan = load_rollouts(journal)
    history = plan.rollouts.get(workload_specs(config)[0].rollout_id)
    if history is None:
        return 0
    state = restore_state(history)
    return len(state.partial.output_ids) if state.partial is not None else 0


@pytest.mark.parametrize("backend", ["torch", "openai"])
def test_a_long_generation_killed_midway_continues_from_its_journaled_prefix(
    backend: str, tmp_path: Path, request
) -> None:
    """SIGKILL while a 400-token reasoning call streams (progress every 16 tokens): the next
    attempt continues the call from the journaled prefix; its tokens equal the uninterrupted
    run's (greedy), and the prefix is never generated again (the segments say who made what)."""
    model = (
        ModelConfig(backend="torch", temperature=0.0, reasoning_tokens=400)
        if backend == "torch"
        else ModelConfig(
            backend="openai",
            url=request.getfixturevalue("vllm_server"),
            served_model=SERVED_NAME,
            temperature=0.0,
            reasoning_tokens=400,
        )
    )
    config = workload(str(tmp_path / "journal"), model, siblings=1, max_turns=2, progress_every_tokens=16)
    reference = reference_outcomes(config)
    # Paced at 20 ms a chunk the call takes 8 s or more: on a quiet machine the engine alone
    # streams 400 tokens faster than one poll of the journal (CI saw the workload end first).
    child = _CTX.Process(target=_paced_child, args=(config.model_dump_json(), str(tmp_path / "p.txt"), 0.02))
    child.start()
    try:
        deadline = time.monotonic() + 600
        while child.is_alive() and _partial_tokens(config) < 32 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert child.is_alive(), "the workload ended before 32 tokens of its long call were journaled as progress"
        os.kill(child.pid, signal.SIGKILL)
        child.join()
    finally:
        if child.is_alive():
            child.kill()
            child.join()
    prefix = _partial_tokens(config)
    # A mark covers every token that accrued, at least 16: a chunk may carry several tokens (vLLM
    # merges the deltas a slow reader has not taken yet), so the prefix need not be a multiple of 16.
    assert 32 <= prefix < 400

    resumed = run_workload(config, resume=True)

    assert_identical(resumed, reference)
    calls = [e for e in journal_events(config) if isinstance(e, ModelCall) and e.header.attempt == 2]
    continued = calls[0]
    first = continued.output_segments()
    assert first[0].attempt == 1 and first[0].tokens == prefix  # the journaled prefix, kept
    # the rest by attempt 2, to the call's end (the end of its turn, or all 400 tokens); the tokens
    # themselves equal the uninterrupted run's (assert_identical: the rollouts' token digests)
    assert first[1].attempt == 2 and sum(s.tokens for s in first) == len(continued.output_ids) > prefix
    progress = [e for e in journal_events(config) if isinstance(e, ModelCallProgress)]
    assert {p.header.attempt for p in progress} == {1, 2}
    assert min(p.start for p in progress if p.header.attempt == 2) == prefix  # never regenerated
    for key in {(p.header.attempt, p.call_id) for p in progress}:  # a call's marks: one after another, 16+ each
        marks = sorted((p for p in progress if (p.header.attempt, p.call_id) == key), key=lambda p: p.start)
        assert all(len(m.output_ids) >= 16 for m in marks)
        assert all(a.start + len(a.output_ids) == b.start for a, b in zip(marks, marks[1:]))
    resumed_at = min((p for p in progress if p.header.attempt == 2), key=lambda p: p.start)
    where = (resumed_at.header.turn, resumed_at.call_index)
    before = (p for p in progress if p.header.attempt == 1 and (p.header.turn, p.call_index) == where)
    assert sum(len(p.output_ids) for p in before) == prefix  # the prefix: the killed attempt's marks of that call
    assert (
        resumed.rollouts[continued.header.rollout_id].tokens_run_here == sum(len(c.output_ids) for c in calls) - prefix
    )


@pytest.mark.parametrize("scenario", list(SCENARIOS.values()), ids=list(SCENARIOS))
def test_the_recovery_scenarios_hold_on_vllm(scenario, model: ModelConfig, tmp_path: Path) -> None:
    scenario(str(tmp_path / "journal"), model)


def test_a_call_cancelled_before_the_engine_ran_it_is_skipped_and_the_engine_runs_on(vllm_engine) -> None:
    """A weight swap whose caller gave up (a timeout, a shutdown) cancels its call while the
    engine thread is busy. The engine thread used to run it anyway, fail to hand a result to the
    cancelled future, and die: every later model call waited for ever."""
    busy, release = threading.Event(), threading.Event()

    def hold(engine) -> str:
        busy.set()
        assert release.wait(60), "the test never released the engine thread"
        return "held"

    ran = []
    first = vllm_engine.call(hold)
    assert busy.wait(60), "the engine thread did not take the first call"
    given_up = vllm_engine.call(lambda engine: ran.append("given up"))
    assert given_up.cancel()
    release.set()
    assert first.result(60) == "held"
    assert vllm_engine.call(lambda engine: "alive").result(60) == "alive"
    assert ran == [], "a call cancelled before the engine got to it ran anyway"


def test_a_call_that_raises_a_base_exception_fails_alone_and_the_engine_runs_on(vllm_engine) -> None:
    """A call that raises what is not an ``Exception`` (a ``CancelledError`` from code it awaits
    on, a ``SystemExit`` of a library) is its caller's error: it used to end the engine thread, and
    every later model call of the process waited for ever."""

    def stops(engine) -> None:
        raise SystemExit("a library gave up")

    failed = vllm_engine.call(stops)
    with pytest.raises(SystemExit, match="a library gave up"):
        failed.result(60)
    assert vllm_engine.call(lambda engine: "alive").result(60) == "alive"
