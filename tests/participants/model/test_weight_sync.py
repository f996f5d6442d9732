"""Weights swapped into a running backend mid-rollout: every call, and every run of tokens
inside a call continued across the swap, names the weights that sampled it, and its logprobs
are those weights' (recomputed with transformers from the folder each record names)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Callable
from pathlib import Path

import numpy as np
import pytest

from rollout_journal.journal.events import ModelCall, OutputSegment
from rollout_journal.journal.open import open_journal
from rollout_journal.participants.model.folders import policy_version_of
from rollout_journal.participants.model.gate import ModelParticipant
from rollout_journal.participants.model.generation import GenerationRequest, TokenChunk
from rollout_journal.participants.model.tiny_model import model_folder, tiny_model_dir
from rollout_journal.participants.model.torch_backend import TorchPolicy
from rollout_journal.participants.model.training_check import LogprobRecompute, journal_samples
from rollout_journal.participants.workload.config import ModelConfig, WorkloadConfig
from rollout_journal.participants.workload.run import build_backend, open_workload_journal
from rollout_journal.participants.workload.runner import Runner
from tests.support.vllm_fixtures import SERVED_NAME

SEED0, SEED1 = policy_version_of(tiny_model_dir(0)), policy_version_of(tiny_model_dir(1))


def workload(journal: Path, model: ModelConfig, **overrides) -> WorkloadConfig:
    base = dict(
        name="ws",
        groups=1,
        siblings=2,
        max_turns=3,
        environment="workplace",
        seed=5,
        allow_early_submit=False,
        journal=str(journal),
        model=model,
    )
    return WorkloadConfig(**(base | overrides))


def swap_to(backend, folder: Path):
    """The backend's own swap (vLLM: reload_weights on the engine or server), or the torch
    backend's in-place load."""
    if hasattr(backend, "reload_swap"):
        return backend.reload_swap(folder)

    async def load() -> None:
        backend.load_weights(folder)

    return load


class SwapsMidCall(TorchPolicy):
    """The torch backend, calling ``trigger`` once while the call named ``during`` streams (after
    its second chunk), then letting the event loop run it before the next chunk."""

    def __init__(self, folder: Path, during: str) -> None:
        super().__init__(folder)
        self.during = during
        self.trigger: Callable[[], None] | None = None

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[TokenChunk, None]:
        chunks = 0
        async for chunk in super().stream(request):
            yield chunk
            chunks += 1
            if chunks == 2 and self.during in request.request_id and self.trigger is not None:
                trigger, self.trigger = self.trigger, None
                trigger()
                await asyncio.sleep(0)  # the sync closes the gate and aborts this call now


def run_with_a_swap(
    config: WorkloadConfig, *, after_turn: int | None = None, during: str | None = None, in_flight: str = "finish"
) -> None:
    """Run the workload; once turn ``after_turn`` of its first rollout is durable (or while its
    call ``during`` streams), sync the seed-1 weights in (named by their folder's version); at the
    end, put the seed-0 weights back (the vLLM engine and server are shared by the test session)."""
    with open_workload_journal(config) as journal:
        backend = build_backend(config) if during is None else SwapsMidCall(model_folder(config.model), during)
        swaps: list[asyncio.Future] = []

        def sync() -> None:
            swap = runner.model.sync_weights(SEED1, swap_to(backend, tiny_model_dir(1)), in_flight=in_flight)
            swaps.append(asyncio.ensure_future(swap))

        def on_durable(rollout_id: str, turn: int) -> None:
            if rollout_id.endswith("-s0") and turn == after_turn and not swaps:
                sync()

        if isinstance(backend, SwapsMidCall):
            backend.trigger = sync
        runner = Runner(config, journal, backend, backend.tokenizer, progress=on_durable)

        async def run() -> None:
            try:
                await runner.run(resume=False)
                await asyncio.gather(*swaps)
            finally:
                await swap_to(backend, tiny_model_dir(0))()
                backend.set_policy_version(SEED0)
                await backend.aclose()

        asyncio.run(run())
        assert swaps, "the swap never ran"


def calls_of(config: WorkloadConfig) -> list[ModelCall]:
    with open_journal(config.journal, writer="audit", read_only=True) as journal:
        return [item.event for item in journal.scan() if isinstance(item.event, ModelCall)]


def assert_each_run_is_the_named_weights(config: WorkloadConfig) -> None:
    """Every sampled run's logprobs equal those of the folder its version names, and the
    training records label the runs as the calls do."""
    recompute = LogprobRecompute(tiny_model_dir(0), weights={SEED0: tiny_model_dir(0), SEED1: tiny_model_dir(1)})
    for record, chain in journal_samples(config.journal):
        for sample in chain:
            if sample.call.constrained:
                continue  # the recompute's constraint mask needs the action list; unconstrained calls say enough
            assert recompute.max_error(sample) <= 1e-4, sample.call.call_id
        runs = [(s.call_id, s.attempt, s.policy_version, s.end - s.start) for s in record.token_segments if s.generated]
        expected = [
            (c.call.call_id, r.attempt, r.policy_version, r.tokens) for c in chain for r in c.call.output_segments()
        ]
        assert runs == expected


def test_a_weight_sync_between_calls_names_the_new_weights_from_the_next_call_on(tmp_path: Path) -> None:
    config = workload(tmp_path / "journal", ModelConfig(backend="torch", temperature=0.7, reasoning_tokens=24))
    run_with_a_swap(config, after_turn=0)
    calls = calls_of(config)
    versions = [c.policy_version for c in calls]
    assert SEED0 in versions and SEED1 in versions
    first_new = versions.index(SEED1)
    assert set(versions[:first_new]) == {SEED0} and set(versions[first_new:]) == {SEED1}  # never back
    assert all(c.policy_version == SEED0 for c in calls if c.header.turn == 0 and c.call_id.startswith("ws-g0-s0"))
    assert_each_run_is_the_named_weights(config)


def test_a_weight_sync_cancelled_mid_swap_names_the_weights_the_swap_loaded() -> None:
    """A swap whose work cannot be stopped (a reload on vLLM's engine thread, a load in a thread)
    goes on when the sync's caller gives up (a timeout, a shutdown). It used to reopen the gate at
    once under the old name while the new weights loaded: every token after that was labelled
    with weights that did not sample it. The gate now stays closed until the swap is done, and
    opens under the name of the weights it loaded."""
    backend = TorchPolicy(tiny_model_dir(0))
    model = ModelParticipant(backend)
    started, release = threading.Event(), threading.Event()

    def load_slowly() -> None:
        started.set()
        assert release.wait(60), "the test never let the load finish"
        backend.load_weights(tiny_model_dir(1))

    async def swap() -> None:
        await asyncio.to_thread(load_slowly)

    async def scenario() -> None:
        sync = asyncio.create_task(model.sync_weights(SEED1, swap))
        while not started.is_set():
            await asyncio.sleep(0.01)
        sync.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sync
        admitted = asyncio.create_task(model.gate.admit())
        await asyncio.sleep(0.2)
        assert not admitted.done(), "a call was admitted while the new weights were loading"
        release.set()
        ticket = await asyncio.wait_for(admitted, 60)
        model.gate.release(ticket)
        assert backend.policy_version == SEED1, "the weights loaded are seed 1's; they must be named so"

    try:
        asyncio.run(scenario())
    finally:
        release.set()
        backend.load_weights(tiny_model_dir(0))


def test_a_weight_sync_retried_after_a_cancel_waits_for_the_swap_still_loading() -> None:
    """The usual answer to a timed-out sync is to try again. The retry must not load beside the
    swap its predecessor left running, nor let that swap's end open the gate while its own still
    loads: every token sampled meanwhile would be labelled with weights that did not sample it.
    Each closer of the gate opens only its own closing (a checkpoint may overlap a swap too)."""
    backend = TorchPolicy(tiny_model_dir(0))
    model = ModelParticipant(backend)
    started = {"first": threading.Event(), "retry": threading.Event()}
    release = {"first": threading.Event(), "retry": threading.Event()}
    loading: list[str] = []
    overlaps: list[list[str]] = []

    def swap(name: str, folder: Path):
        def load() -> None:
            loading.append(name)
            if len(loading) > 1:
                overlaps.append(list(loading))
            started[name].set()
            assert release[name].wait(60), f"the test never let the {name} load finish"
            backend.load_weights(folder)
            loading.remove(name)

        async def run() -> None:
            await asyncio.to_thread(load)

        return run

    async def scenario() -> None:
        first = asyncio.create_task(model.sync_weights(SEED1, swap("first", tiny_model_dir(1))))
        while not started["first"].is_set():
            await asyncio.sleep(0.01)
        first.cancel()  # timed out: the load goes on
        with pytest.raises(asyncio.CancelledError):
            await first
        retry = asyncio.create_task(model.sync_weights(SEED0, swap("retry", tiny_model_dir(0))))
        await asyncio.sleep(0.2)
        assert not started["retry"].is_set(), "the retry began loading beside the swap still under way"
        release["first"].set()
        while not started["retry"].is_set():
            await asyncio.sleep(0.01)
        admitted = asyncio.create_task(model.gate.admit())
        await asyncio.sleep(0.2)
        assert not admitted.done(), "the first swap's end opened the gate while the retry's swap loaded"
        release["retry"].set()
        await asyncio.wait_for(retry, 60)
        model.gate.release(await asyncio.wait_for(admitted, 60))
        assert backend.policy_version == SEED0 and not overlaps

    try:
        asyncio.run(scenario())
    finally:
        for event in release.values():
            event.set()
        backend.load_weights(tiny_model_dir(0))


def test_a_call_aborted_by_a_weight_sync_is_continued_and_its_runs_name_each_weights(tmp_path: Path) -> None:
    """in_flight="abort": the long reasoning call under way stops at the swap and continues from
    its tokens under the new weights; its output is two runs, each labelled and scored by its own."""
    model = ModelConfig(backend="torch", temperature=1.0, reasoning_tokens=300)
    config = workload(tmp_path / "journal", model, siblings=1, progress_every_tokens=16, progress_min_interval_ms=0)
    run_with_a_swap(config, during="-s0/a1/t1/c0", in_flight="abort")
    split = [c for c in calls_of(config) if len({s.policy_version for s in c.output_segments()}) == 2]
    assert split, "no call was under way at the swap"
    runs = split[0].output_segments()
    assert [r.policy_version for r in runs] == [SEED0, SEED1] and all(r.tokens > 0 for r in runs)
    assert sum(r.tokens for r in runs) == len(split[0].output_ids)
    assert_each_run_is_the_named_weights(config)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["vllm", "openai"])
def test_weights_swapped_into_vllm_mid_rollout_are_named_on_each_side(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """vLLM cannot say which weights answered: the side that syncs names them. In process, and
    on the server (dev mode: reload_weights, reset_prefix_cache)."""
    if backend == "vllm":
        request.getfixturevalue("vllm_engine")
        model = ModelConfig(backend="vllm", temperature=0.7, reasoning_tokens=24)
    else:
        url = request.getfixturevalue("vllm_server")
        model = ModelConfig(backend="openai", url=url, served_model=SERVED_NAME, temperature=0.7, reasoning_tokens=24)
    config = workload(tmp_path / "journal", model)
    run_with_a_swap(config, after_turn=0)
    versions = [c.policy_version for c in calls_of(config)]
    assert SEED0 in versions and SEED1 in versions
    first_new = versions.index(SEED1)
    assert set(versions[first_new:]) == {SEED1}
    assert_each_run_is_the_named_weights(config)


def test_output_runs_label_the_training_record_token_by_token() -> None:
    """A call continued across a crash and a weight change (176 tokens by attempt 1 under seed0,
    80 by attempt 2 under seed1): the record's sampled runs, and its per-token attempts, split there."""
    from rollout_journal.journal.events import AttemptStarted, Header, SamplingParams
    from rollout_journal.participants.rollout.state import RolloutState

    state = RolloutState("r", "g")
    state.apply(AttemptStarted(Header("r", "g", 2, 2, 0, 0, 0, "w"), 0, "topo", "test"))
    prompt, output = np.arange(10, dtype="<i4"), np.arange(256, dtype="<i4") % 50
    call = ModelCall(
        Header("r", "g", 2, 2, 0, 1, 0, "w"),
        "r/a2/t0/c0",
        None,
        "seed1",
        SamplingParams(0.7, 0.9, 256, 3, 20),
        0,
        prompt,
        output,
        np.full(256, -0.5, dtype="<f4"),
        "length",
        1.0,
        [OutputSegment(1, "seed0", 176), OutputSegment(2, "seed1", 80)],
        logprob_mode="processed",
        continuation="first",
    )
    state.apply(call)
    header = state.header("w")
    record = state.training_record(header, 1)
    runs = [(s.start, s.end, s.attempt, s.policy_version) for s in record.token_segments if s.generated]
    assert runs == [(10, 186, 1, "seed0"), (186, 266, 2, "seed1")]
    assert all(
        s.renormalized and s.logprob_mode == "processed" and s.top_k == 20 for s in record.token_segments if s.generated
    )
    tensors = record.tensors()
    assert tensors["token_attempt"][10:186].eq(1).all() and tensors["token_attempt"][186:].eq(2).all()
    restored = RolloutState.from_bytes(state.to_bytes())
    assert restored.training_record(header, 1) == record  # snapshots keep the labels
