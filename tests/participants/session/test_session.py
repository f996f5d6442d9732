"""The session API: an agent re-driven on a new attempt is answered from the journal, checked
against its requests; attempt N is fenced; a cut-short call continues; a refused write fails the
call and loses nothing committed. Real file journals, a real HTTP model upstream."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from rollout_journal.journal import Journal, ModelCall, ModelCallProgress, SamplingParams, TurnCompleted, open_journal
from rollout_journal.journal.file.backend import FileBackend
from rollout_journal.participants.model.chat import Prompt
from rollout_journal.participants.model.gate import ModelParticipant
from rollout_journal.participants.model.tiny_model import tiny_model_dir
from rollout_journal.participants.remote.gateway.upstream import GenerateUpstream
from rollout_journal.participants.resources.records import verify_chain
from rollout_journal.participants.rollout.state import mutation_record
from rollout_journal.participants.session import (
    EffectNotDurableError,
    ModelRequest,
    NondeterminismError,
    RolloutRef,
    SessionFactory,
    StaleAttemptError,
    StateRequest,
    ToolOutcome,
    ToolRequest,
    Unrouted,
)
from tests.support.fixed_rate_upstream import FixedRateUpstream

GREEDY = SamplingParams(0.0, 1.0, 8)


def factory(journal: Journal, upstream: FixedRateUpstream, **options: object) -> SessionFactory:
    f = SessionFactory(
        journal, ModelParticipant(GenerateUpstream(upstream.url, tiny_model_dir())), writer="t", **options
    )
    f.start()
    return f


def prompt(turn: int, variant: int = 0) -> np.ndarray:
    """A token-native agent's prompt of a turn (ids of the embedded vocabulary)."""
    return np.asarray([1, 5, 40 + turn, 60 + variant, 6], dtype=np.int32)


async def agent(f: SessionFactory, rollout: str, turns: int, *, variant_at: int = -1, tools: bool = True) -> list:
    """Open, then per turn a model call, a tool call and the turn's end; returns what it was answered."""
    session = await f.open(RolloutRef(rollout, "g"))
    seen = []
    for turn in range(turns):
        answer = await session.model_call(ModelRequest(prompt(turn, 1 if turn == variant_at else 0), GREEDY))
        seen.append(("model", answer.output_ids.tolist(), answer.replayed))
        if tools:

            async def run(ctx):  # a counter tool: its result depends on the revision it applies to
                return ToolOutcome({"count": ctx.prev_revision + 1})

            tool = await session.tool_call(ToolRequest("counter", "increment", {"by": 1}), run)
            seen.append(("tool", tool.result, tool.replayed))
        await session.end_turn([])
    return seen


def test_a_redriven_agent_gets_every_journaled_call_without_calling_the_model(tmp_path: Path, upstream) -> None:
    journal = open_journal(str(tmp_path / "j"))
    first = asyncio.run(agent(factory(journal, upstream), "r", 3))
    journal.close()
    generated = upstream.upstream.completions

    journal = open_journal(str(tmp_path / "j"))
    again = asyncio.run(agent(factory(journal, upstream), "r", 3))
    journal.close()

    assert [s[:2] for s in again] == [s[:2] for s in first]
    assert all(replayed for *_, replayed in again) and not any(replayed for *_, replayed in first)
    assert upstream.upstream.completions == generated  # nothing regenerated


def test_the_first_call_past_the_journal_goes_live_and_links_to_the_last_journaled_one(
    tmp_path: Path, upstream
) -> None:
    journal = open_journal(str(tmp_path / "j"))
    asyncio.run(agent(factory(journal, upstream), "r", 2, tools=False))
    journal.close()
    journal = open_journal(str(tmp_path / "j"))
    f = factory(journal, upstream)
    again = asyncio.run(agent(f, "r", 3, tools=False))
    journal.close()
    assert [replayed for *_, replayed in again] == [True, True, False]
    calls = [
        e.event
        for e in open_journal(str(tmp_path / "j"), read_only=True).read_rollout("r")
        if isinstance(e.event, ModelCall)
    ]
    assert len(calls) == 3  # the journaled two were not written again
    assert calls[2].parent_call_id == calls[1].call_id and calls[2].header.attempt == 2


def test_another_request_at_a_journaled_position_is_a_nondeterminism_error_naming_both(
    tmp_path: Path, upstream
) -> None:
    journal = open_journal(str(tmp_path / "j"))
    asyncio.run(agent(factory(journal, upstream), "r", 3, tools=False))
    journal.close()
    journal = open_journal(str(tmp_path / "j"))
    with pytest.raises(NondeterminismError) as caught:
        asyncio.run(agent(factory(journal, upstream), "r", 3, variant_at=1, tools=False))
    journal.close()
    error = caught.value
    assert error.position == (1, 0)
    text = str(error)
    assert "rollout r attempt 2" in text and "turn 1, step 0" in text
    assert "journaled (attempt 1, r/a1/t1/c0)" in text and "prompt token 3 (journaled 60, now 61)" in text
    assert error.journaled is not None and error.journaled.digest != error.now.digest


def test_a_tool_call_where_the_journal_holds_a_model_call_is_named_as_such(tmp_path: Path, upstream) -> None:
    journal = open_journal(str(tmp_path / "j"))
    f = factory(journal, upstream)
    asyncio.run(agent(f, "r", 1, tools=False))

    async def redrive() -> None:
        session = await f.open(RolloutRef("r"))

        async def run(ctx):
            return ToolOutcome({})

        await session.tool_call(ToolRequest("counter", "increment", {}), run)

    with pytest.raises(NondeterminismError, match="journaled a model call, now a tool call"):
        asyncio.run(redrive())
    journal.close()


def test_tool_calls_are_mutations_with_revisions_and_a_hash_chain_that_verifies(tmp_path: Path, upstream) -> None:
    journal = open_journal(str(tmp_path / "j"))
    seen = asyncio.run(agent(factory(journal, upstream), "r", 3))
    journal.close()
    assert [s[1] for s in seen if s[0] == "tool"] == [{"count": 1}, {"count": 2}, {"count": 3}]
    events = [e.event for e in open_journal(str(tmp_path / "j"), read_only=True).read_rollout("r")]
    records = [mutation_record(e) for e in events if type(e).__name__ == "ResourceMutation"]
    assert [r.idempotency_key for r in records] == ["r/t0/s1", "r/t1/s1", "r/t2/s1"]
    assert [r.revision for r in records] == [1, 2, 3]
    verify_chain("r/counter", records)  # raises if a link does not verify


def test_a_session_whose_partition_is_lost_is_fenced_by_the_epoch_the_next_owner_takes(
    tmp_path: Path, upstream
) -> None:
    journal = open_journal(str(tmp_path / "j"))
    f = factory(journal, upstream)

    async def scenario() -> None:
        session = await f.open(RolloutRef("r"))
        await session.model_call(ModelRequest(prompt(0), GREEDY))
        f.ownership.fenced("another process took the namespace")  # every partition lost at once
        fenced = "attempt 1 \\(epoch 1\\) was fenced by epoch 2 \\(by the owner that took its partition\\)"
        with pytest.raises(StaleAttemptError, match=fenced):
            await session.model_call(ModelRequest(prompt(1), GREEDY))

    asyncio.run(scenario())
    journal.close()


def test_attempt_n_is_fenced_once_n_plus_1_opens(tmp_path: Path, upstream) -> None:
    journal = open_journal(str(tmp_path / "j"))
    f = factory(journal, upstream)

    async def scenario() -> None:
        old = await f.open(RolloutRef("r"))
        await old.model_call(ModelRequest(prompt(0), GREEDY))
        new = await f.open(RolloutRef("r"))
        with pytest.raises(StaleAttemptError, match="attempt 1 \\(epoch 1\\) was fenced by epoch 2"):
            await old.model_call(ModelRequest(prompt(1), GREEDY))
        answer = await new.model_call(ModelRequest(prompt(0), GREEDY))
        assert answer.replayed

    asyncio.run(scenario())
    journal.close()
    events = [e.event for e in open_journal(str(tmp_path / "j"), read_only=True).read_rollout("r")]
    assert [type(e).__name__ for e in events] == ["AttemptStarted", "ModelCall", "AttemptStarted", "AttemptFenced"]


def test_a_call_cut_short_continues_from_its_journaled_prefix(tmp_path: Path, upstream) -> None:
    journal = open_journal(str(tmp_path / "j"))
    f = factory(journal, upstream, progress_every_tokens=2)
    long = SamplingParams(0.0, 1.0, 12)

    async def first() -> None:
        session = await f.open(RolloutRef("r"))
        upstream.set_faults(drop_after=6, count=1)  # the connection breaks after 6 tokens
        with pytest.raises(Exception, match="broke after tokens flowed"):
            await session.model_call(ModelRequest(prompt(0), long))

    asyncio.run(first())
    journal.close()
    marked = sum(
        len(e.event.output_ids)
        for e in open_journal(str(tmp_path / "j"), read_only=True).read_rollout("r")
        if isinstance(e.event, ModelCallProgress)
    )
    assert marked >= 2

    journal = open_journal(str(tmp_path / "j"))
    f = factory(journal, upstream)
    before = upstream.upstream.tokens

    async def second():
        session = await f.open(RolloutRef("r"))
        return await session.model_call(ModelRequest(prompt(0), long))

    answer = asyncio.run(second())
    journal.close()
    assert answer.continued_from == marked and not answer.replayed
    assert upstream.upstream.tokens - before == 12 - marked  # only the rest was generated
    assert len(answer.output_ids) == 12


def test_a_write_the_journal_refuses_fails_the_call_and_loses_nothing_committed(tmp_path: Path, upstream) -> None:
    journal = open_journal(str(tmp_path / "j"))
    asyncio.run(agent(factory(journal, upstream), "r", 2, tools=False))
    journal.close()
    # The same journal, now refusing any event over 600 bytes (a call's answer with its prompt delta).
    journal = Journal(FileBackend(str(tmp_path / "j")), max_record_bytes=580, max_event_bytes=600)
    f = factory(journal, upstream)

    async def redrive() -> None:
        session = await f.open(RolloutRef("r"))
        for turn in range(2):
            assert (await session.model_call(ModelRequest(prompt(turn), GREEDY))).replayed
            await session.end_turn([])
        big = np.concatenate([prompt(2), np.full(400, 50, dtype=np.int32)])
        with pytest.raises(EffectNotDurableError, match="could not be made durable"):
            await session.model_call(ModelRequest(big, GREEDY))

    asyncio.run(redrive())
    journal.close()
    state = factory(open_journal(str(tmp_path / "j")), upstream).state_of("r")
    assert state is not None and state.next_turn == 2 and state.model_calls == 2


def test_the_effect_log_comes_back_from_a_snapshot(tmp_path: Path, upstream) -> None:
    journal = open_journal(str(tmp_path / "j"))
    first = asyncio.run(agent(factory(journal, upstream, snapshot_every_turns=1), "r", 3))
    journal.close()
    journal = open_journal(str(tmp_path / "j"))
    f = factory(journal, upstream)
    state = f.state_of("r")
    assert state is not None and state.effects.known and len(state.effects) == 6
    again = asyncio.run(agent(f, "r", 3))
    journal.close()
    assert [s[:2] for s in again] == [s[:2] for s in first]


def test_finish_publishes_the_training_record_and_a_finished_rollout_only_replays(tmp_path: Path, upstream) -> None:
    journal = open_journal(str(tmp_path / "j"))
    f = factory(journal, upstream)

    async def run():
        session = await f.open(RolloutRef("r", "g", group_size=2))
        await session.model_call(ModelRequest(prompt(0), GREEDY))
        record = await session.finish(1.0)
        again = await f.open(RolloutRef("r"))
        replayed = await again.model_call(ModelRequest(prompt(0), GREEDY))
        return record, replayed, again

    record, replayed, again = asyncio.run(run())
    assert record is not None and record.reward == 1.0 and record.group_size == 2
    assert int(record.loss_mask.sum()) == 8
    assert replayed.replayed and again.attempt == 1  # no new attempt for a finished rollout

    async def past_the_end():
        await again.model_call(ModelRequest(prompt(1), GREEDY))

    with pytest.raises(Exception, match="is finished"):
        asyncio.run(past_the_end())
    journal.close()


def test_a_restart_from_turn_zero_begins_a_new_life_whose_calls_go_live(tmp_path: Path, upstream) -> None:
    journal = open_journal(str(tmp_path / "j"))
    f = factory(journal, upstream)
    asyncio.run(agent(f, "r", 2, tools=False))

    async def restart():
        session = await f.open(RolloutRef("r"), restart_from_zero=True, reason="restart_only server lost it")
        return await session.model_call(ModelRequest(prompt(0), GREEDY)), session

    answer, session = asyncio.run(restart())
    journal.close()
    assert not answer.replayed and session.state.restarts == 1


def test_a_cut_short_call_asked_again_with_other_sampling_never_continues_its_prefix(tmp_path: Path) -> None:
    """The journal holds 6 tokens of a call sampled at T=0.7 (progress marks, then the agent's
    process died). The re-driven agent asks the same prompt at T=1.0: a different request at the
    same position. Continuing the prefix would label tokens sampled at 0.7 as sampled at 1.0 (a
    trainer's ratio over them is then wrong); the session must refuse it (a nondeterminism error)
    or sample the call afresh. Real torch tiny model."""
    from rollout_journal.participants.model.torch_backend import TorchPolicy
    from rollout_journal.replay.source import open_replay
    from rollout_journal.replay.training import training_rows

    def torch_factory(journal: Journal) -> SessionFactory:
        f = SessionFactory(
            journal, ModelParticipant(TorchPolicy(tiny_model_dir())), writer="t", progress_every_tokens=2
        )
        f.start()
        return f

    class Died(Exception):
        pass

    location = str(tmp_path / "j")
    journal = open_journal(location)
    f = torch_factory(journal)

    async def first() -> None:
        session = await f.open(RolloutRef("r"))
        seen = 0

        async def die_after_six(chunk) -> None:
            nonlocal seen
            seen += len(chunk.ids)
            if seen >= 6:
                raise Died

        with pytest.raises(Died):
            await session.model_call(ModelRequest(prompt(0), SamplingParams(0.7, 1.0, 12, 3)), on_tokens=die_after_six)

    asyncio.run(first())
    journal.close()
    marked = sum(
        len(e.event.output_ids)
        for e in open_journal(location, read_only=True).read_rollout("r")
        if isinstance(e.event, ModelCallProgress)
    )
    assert marked >= 2

    journal = open_journal(location)
    f = torch_factory(journal)

    async def second():
        session = await f.open(RolloutRef("r"))
        try:
            answer = await session.model_call(ModelRequest(prompt(0), SamplingParams(1.0, 1.0, 12, 3)))
        except NondeterminismError:
            return None
        await session.finish(0.0)
        return answer

    answer = asyncio.run(second())
    journal.close()
    if answer is None:
        return  # refused: fine
    assert answer.continued_from == 0, f"{answer.continued_from} tokens sampled at T=0.7 continued as T=1.0"
    (row,) = training_rows(open_replay(location))
    assert {s.temperature for s in row.record.token_segments if s.generated} == {1.0}


def test_a_rollout_given_up_through_its_session_never_pins_the_trainer(tmp_path: Path, upstream) -> None:
    """A framework's rollout that fails for good: given up, its group is dropped by the trainer
    feed (not waited for), and the rollout takes no effect any more."""
    from rollout_journal.journal import open_backend
    from rollout_journal.participants.trainer import TrainerFeed

    journal = open_journal(str(tmp_path / "j"))
    f = factory(journal, upstream)

    async def run():
        kept = await f.open(RolloutRef("r0", "g", group_size=2))
        await kept.model_call(ModelRequest(prompt(0), GREEDY))
        await kept.finish(1.0)
        lost = await f.open(RolloutRef("r1", "g", group_size=2))
        await lost.model_call(ModelRequest(prompt(0), GREEDY))
        await lost.fail("ToolServerGone", "the tool host went away")
        record = await lost.give_up("ToolServerGone", "the tool host went away for good")
        again = await lost.give_up("ToolServerGone", "twice")
        return record, again, lost

    record, again, lost = asyncio.run(run())
    assert record is not None and record.status == "given_up" and record.group_policy == "drop" and again is None
    with pytest.raises(Exception, match="is finished"):
        asyncio.run(lost.model_call(ModelRequest(prompt(1), GREEDY)))
    # its last snapshot is final, as the agent's are: restore reads no event after it
    assert journal.snapshots().snapshots["r1"].snapshot.status == "given_up"
    journal.close()
    with TrainerFeed(open_backend(str(tmp_path / "j"), read_only=True)) as feed:
        assert list(feed.groups(idle_timeout_s=1, poll_s=0.2)) == []
        [dropped] = feed.dropped()
        assert (dropped.group_id, dropped.given_up) == ("g", ("r1",)) and feed.waiting() == []


def test_a_fence_during_an_effect_is_a_stale_attempt_and_an_outside_cancellation_stays_one(
    tmp_path: Path, upstream
) -> None:
    """A fence cancels the effect under way and the agent gets ``StaleAttemptError``, with no
    cancellation left pending on its task (an ``asyncio.timeout`` after it would misread one).
    A cancellation from outside (the loop's shutdown) that meets a fence stays a cancellation:
    it used to be turned into the stale-attempt error and lost."""
    journal = open_journal(str(tmp_path / "j"))
    f = factory(journal, upstream)

    async def holding_tool(session, entered: asyncio.Event) -> str:
        async def run(ctx):
            entered.set()
            await asyncio.Event().wait()  # a tool that takes long: the fence comes while it runs
            return ToolOutcome({})

        try:
            await session.tool_call(ToolRequest("counter", "increment", {"by": 1}), run)
        except StaleAttemptError:
            return f"stale, cancellations pending: {asyncio.current_task().cancelling()}"
        return "answered"

    async def scenario() -> None:
        for rollout, from_outside in (("fenced", False), ("shut-down", True)):
            session = await f.open(RolloutRef(rollout))
            entered = asyncio.Event()
            task = asyncio.create_task(holding_tool(session, entered))
            await entered.wait()
            session.fence(session.epoch + 1, by="a test")
            if from_outside:
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            else:
                assert await task == "stale, cancellations pending: 0"

    asyncio.run(scenario())
    journal.close()


# -- a client that builds its own turns (the project's Agent is one) ----------------------------
def test_held_answers_reach_the_journal_only_with_the_callers_commit(tmp_path: Path, upstream) -> None:
    """``durable_answers=False``: a live call's answer is applied and held, journaled with the turn
    the caller commits (with the request's digest, as every session call is), in one append."""
    journal = open_journal(str(tmp_path / "j"))
    f = factory(journal, upstream, durable_answers=False)

    def in_journal() -> list:
        return [i.event for i in open_journal(str(tmp_path / "j"), read_only=True).read_rollout("r")]

    async def turn() -> tuple[ModelRequest, list, list]:
        session = await f.open(RolloutRef("r"))
        request = ModelRequest(prompt(0), GREEDY)
        answer = await session.model_call(request)
        assert not answer.replayed and [type(e) for e in session.held] == [ModelCall]
        before = in_journal()
        session.end_turn_with(TurnCompleted(session.state.header("t"), [], [answer.call_id], {}, None, []))
        session.commit(turn=0)
        done: list[int] = []
        await session.settle(on_durable=done.append)
        return request, before, done

    request, before, done = asyncio.run(turn())
    after = in_journal()
    journal.close()
    assert not any(isinstance(e, ModelCall) for e in before)  # held: not journaled before the commit
    (call,) = [e for e in after if isinstance(e, ModelCall)]
    assert call.request_sha256 == request.digest() and isinstance(after[-1], TurnCompleted) and done == [0]


def test_a_state_request_is_built_only_live_and_checked_by_its_sampling_when_journaled(
    tmp_path: Path, upstream
) -> None:
    """A caller that derives its prompt from the rollout's state (whose head a journaled call has
    already moved) is asked for the prompt only when the call goes live; at a journaled position
    the call is checked by its sampling: another sampling is a nondeterminism error naming both,
    unless the caller says it changed it on purpose (``checked=False``)."""
    journal = open_journal(str(tmp_path / "j"))
    f = factory(journal, upstream)
    built: list[int] = []

    def build() -> Prompt:
        built.append(1)
        return Prompt(prompt(0), 0, "first")

    async def first() -> np.ndarray:
        session = await f.open(RolloutRef("r"))
        return (await session.model_call(StateRequest(GREEDY, build))).output_ids

    sampled = asyncio.run(first())  # the call is durable; its turn never ends (a crash)
    assert built == [1]

    def never() -> Prompt:
        raise AssertionError("a journaled call's prompt was built again")

    async def again(params: SamplingParams, checked: bool = True):
        session = await f.open(RolloutRef("r"))
        return await session.model_call(StateRequest(params, never, checked=checked))

    answer = asyncio.run(again(GREEDY))
    assert answer.replayed and answer.output_ids.tolist() == sampled.tolist()
    assert answer.prompt_ids.tolist() == prompt(0).tolist()  # read back from the head, never built again
    hotter = SamplingParams(0.7, 1.0, 8, seed=3)
    with pytest.raises(NondeterminismError, match="sampling") as caught:
        asyncio.run(again(hotter))
    assert '"temperature":0.0' in str(caught.value) and '"temperature":0.699999988079071' in str(caught.value)
    assert asyncio.run(again(hotter, checked=False)).output_ids.tolist() == sampled.tolist()
    journal.close()


def test_an_adopted_session_replays_the_turn_under_way_and_takes_over_what_the_last_one_held(
    tmp_path: Path, upstream
) -> None:
    """``adopt``: a session over a state its caller restored and fenced itself stands at the turn under
    way; a later attempt's session takes over what the earlier one held and had not seen durable."""
    journal = open_journal(str(tmp_path / "j"))
    f = factory(journal, upstream)

    async def journal_a_call() -> None:
        session = await f.open(RolloutRef("r"))
        await session.model_call(ModelRequest(prompt(0), GREEDY))  # durable; the turn never ends

    asyncio.run(journal_a_call())
    state = f.state_of("r")
    assert state is not None
    held = SessionFactory(None, f.model, writer="t", sink=f.sink, ownership=Unrouted(), durable_answers=False)

    async def adopted() -> tuple[bool, int]:
        session = held.adopt(RolloutRef("r"), state)
        replayed = (await session.model_call(ModelRequest(prompt(0), GREEDY))).replayed
        live = await session.model_call(ModelRequest(np.concatenate([state.head_tokens, [7, 8]]), GREEDY))
        assert not live.replayed and len(session.held) == 1
        state.start_attempt("t", resumed_from_turn=0, topology="", reason="the next attempt")
        successor = held.adopt(RolloutRef("r"), state)
        successor.carry_over(session)
        successor.commit()
        await successor.settle()
        return replayed, len(successor.held) + len(session.held)

    replayed, left = asyncio.run(adopted())
    calls = [i.event for i in journal.read_rollout("r") if isinstance(i.event, ModelCall)]
    journal.close()
    assert replayed and left == 0 and len(calls) == 2
    with pytest.raises(ValueError, match="no journal"):
        asyncio.run(held.open(RolloutRef("other")))
