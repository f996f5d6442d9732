"""Model calls on the event loop: a slow model server never blocks the other rollouts, a
coordinated checkpoint aborts a call that outlasts it (the call continues afterwards), and
a redone turn on a server that is not bit-deterministic replays its journaled call rather
than sampling another action under the same idempotency keys."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import numpy as np

from rollout_journal.journal.events import AttemptStarted, Header, ModelCall, ResourceMutation, RolloutFailed
from rollout_journal.journal.journal import ReadReport
from rollout_journal.journal.open import open_journal
from rollout_journal.participants.environments import Environment
from rollout_journal.participants.model.generation import GenerationRequest, SamplingParams, TokenChunk
from rollout_journal.participants.model.tiny_model import tiny_model_dir
from rollout_journal.participants.model.torch_backend import TorchPolicy
from rollout_journal.participants.resources import canonical_json
from rollout_journal.participants.rollout.state import RolloutState
from rollout_journal.participants.workload.config import WorkloadConfig
from rollout_journal.participants.workload.runner import Runner, workload_specs
from rollout_journal.participants.workload.specs import RolloutSpec


class UnsteadyServer:
    """A real model (the torch backend) that, like a GPU server batching other requests, is not
    bit-deterministic: each instance ("a server after a restart") samples with its own salt."""

    deterministic = False
    resumes_constrained = True
    logprob_mode = "processed"

    def __init__(self, salt: int) -> None:
        self.inner = TorchPolicy(tiny_model_dir())
        self.tokenizer, self.policy_version = self.inner.tokenizer, self.inner.policy_version
        self.salt = salt

    async def stream(self, request: GenerationRequest) -> AsyncIterator[TokenChunk]:
        p = request.params
        salted = dataclasses.replace(request, params=dataclasses.replace(p, seed=(p.seed or 0) ^ self.salt))
        async for chunk in self.inner.stream(salted):
            yield chunk

    async def aclose(self) -> None:
        await self.inner.aclose()


class SharedEnvironments(Runner):
    """A runner whose environments live outside it, as a resource server's state outlives a
    crashed worker: the next runner finds them as the crash left them."""

    def __init__(self, *args, environments: dict[str, Environment], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kept = environments

    def _new_environment(self, spec: RolloutSpec, **kwargs) -> Environment:
        if spec.rollout_id not in self.kept:
            self.kept[spec.rollout_id] = super()._new_environment(spec, **kwargs)
        return self.kept[spec.rollout_id]

    @staticmethod
    def _rebuild(spec: RolloutSpec, state, env: Environment) -> None:
        """Nothing to import: the resources kept their state (and idempotency keys) through the crash."""


def config_for(tmp_path: Path, durable: str) -> WorkloadConfig:
    # seed 22: the first server sends a mail (mail.send), the restarted one would delete one (mail.delete):
    # two different operations on one resource under the same idempotency key
    return WorkloadConfig(
        name="dc",
        groups=1,
        siblings=1,
        max_turns=1,
        environment="workplace",
        seed=22,
        allow_early_submit=False,
        journal=str(tmp_path / f"journal-{durable}"),
        turn_delay_ms=300,
        durable_model_calls=durable,
    )


async def crash_after_the_first_tool_call(config: WorkloadConfig, environments: dict[str, Environment]):
    """Run until the first turn's tool call has changed the (external) resource, then stop dead
    before the turn commits, as a SIGKILL would. Returns the action the lost turn took."""
    (spec,) = workload_specs(config)
    journal = open_journal(config.journal, writer=config.writer)
    backend = UnsteadyServer(salt=1)
    runner = SharedEnvironments(config, journal, backend, backend.tokenizer, environments=environments)
    run = asyncio.create_task(runner.run(resume=False))
    while not (
        spec.rollout_id in environments and any(r.revision for r in environments[spec.rollout_id].resources.values())
    ):
        assert not run.done(), "the rollout ended without its tool call changing a resource"
        await asyncio.sleep(0.005)
    run.cancel()
    await asyncio.gather(run, return_exceptions=True)
    journal.close()
    mutated = [r for r in environments[spec.rollout_id].resources.values() if r.revision]
    return mutated[0].applied_record(f"{spec.rollout_id}/t0/m0")


async def resume(config: WorkloadConfig, environments: dict[str, Environment]):
    with open_journal(config.journal, writer=config.writer) as journal:
        backend = UnsteadyServer(salt=2)  # the server restarted: it samples differently now
        return await SharedEnvironments(config, journal, backend, backend.tokenizer, environments=environments).run(
            resume=True
        )


def journaled(config: WorkloadConfig) -> list:
    report = ReadReport()
    with open_journal(config.journal, writer="reader", read_only=True) as journal:
        return [item.event for item in journal.scan(report)]


def test_a_redone_turn_replays_its_journaled_call_so_the_resource_sees_the_same_action(tmp_path: Path) -> None:
    config = config_for(tmp_path, "auto")  # auto: the backend says it is not bit-deterministic
    environments: dict[str, Environment] = {}
    lost = asyncio.run(crash_after_the_first_tool_call(config, environments))
    report = asyncio.run(resume(config, environments))

    (row,) = report.rollouts.values()
    assert row.failed is None and row.outcome is not None
    calls = [e for e in journaled(config) if isinstance(e, ModelCall)]
    first_turn = [c for c in calls if c.header.turn == 0]
    assert len(first_turn) == 1 and first_turn[0].header.attempt == 1  # replayed, never sampled again
    assert all(c.request_sha256 for c in calls)  # session effects: each journaled with its request's digest
    (mutation,) = [
        e for e in journaled(config) if isinstance(e, ResourceMutation) and e.idempotency_key == lost.idempotency_key
    ]
    assert (mutation.op, mutation.args_json) == (lost.op, canonical_json(lost.args))  # what the resource applied


def test_a_resume_that_changed_the_sampling_on_purpose_keeps_the_call_its_turn_already_made(
    tmp_path: Path,
) -> None:
    """The agent's calls are session effects, replayed by position; a resume with another seed (a
    topology override: the user's choice) keeps the journaled call of the turn under way (what the
    resource saw) instead of failing it as nondeterministic, and so does every resume after it
    (the override is in the journal by then: no further resume names it)."""
    config = config_for(tmp_path, "auto")
    environments: dict[str, Environment] = {}
    lost = asyncio.run(crash_after_the_first_tool_call(config, environments))
    reseeded = config.model_copy(update={"seed": 23, "max_turns": 1})

    async def resume_reseeded(override: str | None, stop_after: dict[str, int] | None = None):
        with open_journal(config.journal, writer=config.writer) as journal:
            backend = UnsteadyServer(salt=2)
            runner = SharedEnvironments(
                reseeded, journal, backend, backend.tokenizer, environments=environments, topology_override=override
            )
            return await runner.run(resume=True, stop_after=stop_after)

    # The overriding resume stops before it redoes the turn (its fence is journaled, naming the new
    # topology); the next resume names no override, and finds the call of attempt 1 in the turn under way.
    asyncio.run(resume_reseeded("seed 23", stop_after={lost.rollout_id: 0}))
    (row,) = asyncio.run(resume_reseeded(None)).rollouts.values()
    assert row.failed is None and row.outcome is not None
    assert not [e for e in journaled(config) if isinstance(e, RolloutFailed)]
    first_turn = [e for e in journaled(config) if isinstance(e, ModelCall) and e.header.turn == 0]
    assert [c.header.attempt for c in first_turn] == [1]
    (mutation,) = [
        e for e in journaled(config) if isinstance(e, ResourceMutation) and e.idempotency_key == lost.idempotency_key
    ]
    assert mutation.op == lost.op


def test_without_it_the_resource_refuses_the_other_action_under_the_same_key(tmp_path: Path) -> None:
    """The caveat itself: the same crash with calls journaled only at the turn's end. The redone
    turn samples another action on the restarted server, and the resource, which applied the lost
    turn's action under that idempotency key, refuses it: the rollout fails, in every retry, and is
    given up."""
    config = config_for(tmp_path, "never")
    environments: dict[str, Environment] = {}
    asyncio.run(crash_after_the_first_tool_call(config, environments))
    report = asyncio.run(resume(config, environments))

    (row,) = report.rollouts.values()
    assert row.given_up is not None and "IdempotencyKeyReuseError" in row.given_up
    failures = [e for e in journaled(config) if isinstance(e, RolloutFailed)]
    assert len(failures) == config.failure_policy.max_failures


class GatheringServer(UnsteadyServer):
    """A server that holds every call until ``expected`` calls are inside it at once (``bound_s``
    at most): only calls admitted together all get there, however slowly the machine runs.
    ``gate_when_all_in`` is the runner's gate count at that moment."""

    def __init__(self, expected: int, bound_s: float = 60.0) -> None:
        super().__init__(salt=0)
        self.expected, self.bound_s = expected, bound_s
        self.inside = self.most_inside = 0
        self.gate_count: Callable[[], int] = lambda: -1
        self.gate_when_all_in: int | None = None
        self._all_in: asyncio.Event | None = None

    async def stream(self, request: GenerationRequest) -> AsyncIterator[TokenChunk]:
        all_in = self._all_in = self._all_in or asyncio.Event()
        self.inside += 1
        self.most_inside = max(self.most_inside, self.inside)
        try:
            if self.inside == self.expected:
                self.gate_when_all_in = self.gate_count()
                all_in.set()
            try:
                await asyncio.wait_for(all_in.wait(), self.bound_s)
            except TimeoutError:  # never all in (the test's assertions say so): the others need not wait too
                all_in.set()
            async for chunk in super().stream(request):
                yield chunk
        finally:
            self.inside -= 1


def test_a_slow_server_does_not_serialize_the_rollouts(tmp_path: Path) -> None:
    """Twelve rollouts whose calls wait on the server until twelve are there: with twelve calls
    admitted at once, their first turns are all in flight together (no timing asserted: the
    server's count and the gate's)."""
    config = WorkloadConfig(
        name="cc",
        groups=4,
        siblings=3,
        max_turns=1,
        environment="workplace",
        seed=1,
        journal=str(tmp_path / "j"),
        concurrency=12,
        journaling=False,
    )
    config = config.model_copy(update={"model": config.model.model_copy(update={"max_concurrent_calls": 12})})
    backend = GatheringServer(expected=12)
    runner = Runner(config, None, backend, backend.tokenizer)
    backend.gate_count = lambda: runner.model.gate.in_flight
    asyncio.run(runner.run(resume=False))
    assert backend.most_inside == 12 and backend.gate_when_all_in == 12


class PacedPolicy:
    """The torch backend streaming a chunk every ``pause_s`` at most: a model server's pace."""

    deterministic = True
    resumes_constrained = True

    def __init__(self, pause_s: float) -> None:
        self.inner = TorchPolicy(tiny_model_dir())
        self.tokenizer, self.policy_version = self.inner.tokenizer, self.inner.policy_version
        self.pause_s = pause_s

    async def stream(self, request: GenerationRequest) -> AsyncIterator[TokenChunk]:
        async for chunk in self.inner.stream(request):
            await asyncio.sleep(self.pause_s)
            yield chunk

    async def aclose(self) -> None:
        await self.inner.aclose()


def progress_marks(interval_s: float, pause_s: float = 0.01) -> list[tuple[float, int, int]]:
    """(when, start, end) of each progress mark of one 160-token free-form call, a mark due every 16 tokens."""
    from rollout_journal.participants.model.gate import ModelParticipant

    backend = PacedPolicy(pause_s)
    state = RolloutState("pm-g0-s0", "pm-g0")
    state.apply(AttemptStarted(Header("pm-g0-s0", "pm-g0", 1, 1, 0, 0, 0, "test"), 0, "topology", "new"))
    prompt = backend.tokenizer.encode("Write a long report on the quarterly numbers.")
    marks: list[tuple[float, int, int]] = []

    def on_progress(event) -> None:
        marks.append((time.monotonic(), event.start, event.start + len(event.output_ids)))
        state.apply(event)

    async def call() -> None:
        try:
            await ModelParticipant(backend).call(
                state,
                prompt,
                SamplingParams(0.0, 1.0, 160, 1),
                None,
                "pm/c0",
                writer="test",
                on_progress=on_progress,
                progress_every=16,
                progress_interval_s=interval_s,
            )
        finally:
            await backend.aclose()

    asyncio.run(call())
    return marks


def test_progress_marks_come_every_n_tokens_and_no_sooner_than_the_floor() -> None:
    """Without a floor a mark follows every 16 tokens; with one, marks still end on a 16-token
    boundary (all tokens since the last mark), never sooner than the floor after the last; with a
    floor longer than the call, none."""
    exact = progress_marks(0.0)
    assert [end for _, _, end in exact] == list(range(16, 16 * (len(exact) + 1), 16)) and len(exact) >= 5
    floored = progress_marks(0.05)
    assert len(floored) <= len(exact)  # how many depends on the machine's pace; their spacing does not
    assert all(end % 16 == 0 for _, _, end in floored)
    assert all(start == previous_end for (_, start, _), (_, _, previous_end) in zip(floored[1:], floored))
    assert all(later - earlier >= 0.05 for (earlier, _, _), (later, _, _) in zip(floored, floored[1:]))
    assert progress_marks(3600.0) == []


class CountingServer:
    """A stand-in model server: token i is i, a chunk of ``chunk_tokens`` every ``pause_s``."""

    deterministic = True
    resumes_constrained = True
    policy_version = "counting-v1"

    def __init__(self, pause_s: float) -> None:
        self.pause_s = pause_s
        self.streamed = 0  # tokens handed out, over every call

    async def stream(self, request: GenerationRequest) -> AsyncIterator[TokenChunk]:
        position, size = len(request.prefix_ids), request.chunk_tokens or 1
        while position < request.params.max_tokens:
            await asyncio.sleep(self.pause_s)
            end = min(position + size, request.params.max_tokens)
            self.streamed += end - position
            yield TokenChunk(
                np.arange(position, end, dtype=np.int32),
                np.zeros(end - position, dtype=np.float32),
                "length" if end == request.params.max_tokens else None,
            )
            position = end

    async def aclose(self) -> None:
        pass


def test_an_aborted_call_journals_its_unmarked_tokens_before_it_waits() -> None:
    """A call the gate aborts while the time floor holds its next mark back journals the tokens
    it has before it waits out the checkpoint: a crash during the pause loses none of them, and
    no mark spans the abort (one mark names one policy version for all its tokens)."""
    from rollout_journal.participants.model.gate import ModelParticipant

    state = RolloutState("ab-g0-s0", "ab-g0")
    state.apply(AttemptStarted(Header("ab-g0-s0", "ab-g0", 1, 1, 0, 0, 0, "test"), 0, "topology", "new"))
    server = CountingServer(0.005)
    model = ModelParticipant(server)
    marks: list[tuple[int, int]] = []

    def on_progress(event) -> None:
        marks.append((event.start, event.start + len(event.output_ids)))
        state.apply(event)

    async def until(condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 60  # bounded; on a loaded machine the chunks come late, not never
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.005)

    async def scenario() -> tuple[list[tuple[int, int]], np.ndarray]:
        call = asyncio.create_task(
            model.call(
                state,
                np.arange(8, dtype=np.int32),
                SamplingParams(0.0, 1.0, 160, 1),
                None,
                "ab/c0",
                writer="test",
                on_progress=on_progress,
                progress_every=16,
                progress_interval_s=3600.0,
            )
        )
        # Several chunks streamed, none marked (the floor holds them back). The server hands out a
        # chunk only once the call asked for the next: at 48 handed out, the call holds 32 or more.
        await until(lambda: server.streamed >= 48, "three chunks")
        assert model.gate.in_flight == 1 and marks == []
        model.gate.close()
        assert model.gate.abort_in_flight() == 1
        await model.gate.drained()
        await until(lambda: bool(marks), "the aborted call's mark")
        await asyncio.sleep(0.02)  # a second mark during the pause would be a defect: give it a chance to show
        during_pause = list(marks)
        model.gate.open()
        result = await call
        return during_pause, result.event.output_ids

    during_pause, output = asyncio.run(scenario())
    assert np.array_equal(output, np.arange(160))
    assert len(during_pause) == 1 and during_pause[0][0] == 0 and during_pause[0][1] >= 32
    assert all(start == end for (_, end), (start, _) in zip(marks, marks[1:]))  # contiguous
    assert np.array_equal(state.partial.output_ids, np.arange(marks[-1][1]))


def test_an_infinite_time_floor_is_refused_not_a_silent_off_switch() -> None:
    """``progress_min_interval_ms: .inf`` would never let a mark through while
    ``progress_every_tokens`` says progress is journaled: the config refuses it."""
    import pytest
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="progress_min_interval_ms"):
        WorkloadConfig(name="floor", progress_min_interval_ms=float("inf"))
    assert WorkloadConfig(name="floor", progress_min_interval_ms=0).progress_min_interval_ms == 0


class CancelledAsItEnds:
    """A stream that ends at once, its caller cancelled in the same turn of the event loop: what a
    fenced worker's stop does to a call whose stream has just run out."""

    deterministic = True
    resumes_constrained = True
    policy_version = "ends-v1"

    def __init__(self) -> None:
        self.caller: asyncio.Task | None = None

    async def stream(self, request: GenerationRequest) -> AsyncIterator[TokenChunk]:
        assert self.caller is not None
        asyncio.get_running_loop().call_soon(self.caller.cancel)  # before the call sees the stream's end
        return
        yield  # an async generator

    async def aclose(self) -> None:
        pass


def test_a_call_cancelled_as_its_stream_ends_leaves_no_unretrieved_task_error() -> None:
    """CI saw "Task exception was never retrieved ... StopAsyncIteration" on stderr of a fenced
    `run`: the call was cancelled after its stream had ended and before it looked, and the step
    task holding the stream's end was never read."""
    from rollout_journal.participants.model.gate import ModelParticipant

    backend = CancelledAsItEnds()
    state = RolloutState("ce-g0-s0", "ce-g0")
    state.apply(AttemptStarted(Header("ce-g0-s0", "ce-g0", 1, 1, 0, 0, 0, "test"), 0, "topology", "new"))
    unretrieved: list[dict] = []

    async def scenario() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: unretrieved.append(context))
        call = asyncio.create_task(
            ModelParticipant(backend).call(
                state, np.arange(8, dtype=np.int32), SamplingParams(0.0, 1.0, 16, 1), None, "ce/c0", writer="test"
            )
        )
        backend.caller = call
        with contextlib.suppress(asyncio.CancelledError):
            await call
        gc.collect()  # a task's unretrieved error is reported when the task is collected
        await asyncio.sleep(0)

    asyncio.run(scenario())
    assert unretrieved == []


class FollowingServer:
    """The torch backend behind a weight follower, as examples/grpo's FollowingPolicy: new weights
    (here a new name) load when a call starts and none is in flight. ``ended`` is set as a stream
    ends, so the next rollout's call starts right then."""

    deterministic = True
    resumes_constrained = True

    def __init__(self) -> None:
        self.inner = TorchPolicy(tiny_model_dir())
        self.tokenizer = self.inner.tokenizer
        self.policy_version, self.published = "v1", "v1"
        self.in_flight = 0
        self.ended = asyncio.Event()

    async def stream(self, request: GenerationRequest) -> AsyncIterator[TokenChunk]:
        if self.in_flight == 0:
            self.policy_version = self.published  # the trainer's newest weights, between calls
        self.in_flight += 1
        try:
            async for chunk in self.inner.stream(request):
                yield chunk
        finally:
            self.in_flight -= 1
            self.ended.set()

    async def aclose(self) -> None:
        await self.inner.aclose()


def test_a_call_is_named_for_the_weights_that_sampled_it_not_those_loaded_after() -> None:
    """A sampled by v1; the trainer publishes v2 meanwhile; B starts as A's stream ends and loads
    v2. A's ModelCall (the training record's policy version, off-policy correction) says v1."""
    from rollout_journal.participants.model.gate import ModelParticipant

    backend = FollowingServer()
    model = ModelParticipant(backend)
    states = {}
    for name in ("a", "b"):
        states[name] = RolloutState(f"fw-g0-{name}", "fw-g0")
        states[name].apply(AttemptStarted(Header(f"fw-g0-{name}", "fw-g0", 1, 1, 0, 0, 0, "test"), 0, "t", "new"))
    prompt = backend.tokenizer.encode("Summarise the quarterly numbers.")
    params = SamplingParams(0.0, 1.0, 24, 1)

    async def later_call():
        await backend.ended.wait()
        return await model.call(states["b"], prompt, params, None, "fw-b/c0", writer="test")

    async def both():
        try:
            first = asyncio.ensure_future(model.call(states["a"], prompt, params, None, "fw-a/c0", writer="test"))
            second = asyncio.ensure_future(later_call())
            while backend.in_flight == 0:  # A's stream is open: the trainer publishes new weights
                await asyncio.sleep(0)
            backend.published = "v2"
            return await first, await second
        finally:
            await backend.aclose()

    a, b = asyncio.run(both())
    assert (a.event.policy_version, b.event.policy_version) == ("v1", "v2")


def test_a_call_whose_journaled_progress_is_all_of_it_keeps_naming_the_weights_that_sampled_it() -> None:
    """A call cut short after its progress marks held every token (a crash before its ModelCall),
    asked again once new weights are in: nothing is generated, and its tokens still name the old
    weights (folding the one run into the call's own label would name the new ones)."""
    from rollout_journal.participants.model.gate import ModelParticipant

    backend = TorchPolicy(tiny_model_dir(0))
    old = backend.policy_version
    prompt = backend.tokenizer.encode("Write a long report on the quarterly numbers.")
    params = SamplingParams(0.0, 1.0, 32, 1)
    start = AttemptStarted(Header("wv-g0-s0", "wv-g0", 1, 1, 0, 0, 0, "test"), 0, "topology", "new")
    first, again = RolloutState("wv-g0-s0", "wv-g0"), RolloutState("wv-g0-s0", "wv-g0")
    first.apply(start)
    again.apply(start)

    def on_progress(event) -> None:
        first.apply(event)
        again.apply(event)  # what a crashed attempt's journal holds: the marks, no ModelCall

    def call(state: RolloutState, **progress) -> ModelCall:
        return asyncio.run(
            ModelParticipant(backend).call(state, prompt, params, None, "wv/c0", writer="test", **progress)
        ).event

    try:
        whole = call(first, on_progress=on_progress, progress_every=8)
        assert again.partial is not None and len(again.partial.output_ids) == len(whole.output_ids) == 32
        backend.set_policy_version("new-weights")
        redone = call(again)
    finally:
        asyncio.run(backend.aclose())
    assert np.array_equal(redone.output_ids, whole.output_ids)
    assert [(r.policy_version, r.tokens) for r in redone.output_segments()] == [(old, 32)]
