"""NeMo Gym's protocol through both gateways: an agent loop written to NeMo Gym's simple agent
(tests/support/nemo_gym_protocol.py, each line cited) talks Responses to the model gateway and
seed_session / tools / verify to a counter resources server behind the tool gateway. Every call is
journaled; a re-run episode is answered from the journal; a resources server that lost its
sessions is rebuilt from the journaled calls (event_sourced), refused when it answers otherwise
on re-apply, or the rollout restarts from turn 0 (restart_only)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from rollout_journal.journal import ResourceMutation, open_journal
from rollout_journal.journal.restore import load_rollouts
from rollout_journal.participants.model.tiny_model import tiny_model_dir
from rollout_journal.participants.remote.gateway.cookies import attempt_cookie
from rollout_journal.participants.remote.gateway.tools import ToolGateway, ToolServer
from rollout_journal.participants.remote.serving import ThreadedServer
from rollout_journal.participants.rollout.effects import TOOL, Effect
from rollout_journal.participants.session.api import RolloutRef, ToolContext
from tests.support.fixed_rate_upstream import FixedRateUpstream
from tests.support.nemo_gym_protocol import (
    COUNTER_TOOLS,
    CounterServer,
    ServerCookies,
    cookieless_client,
    counter_app,
    simple_agent_loop,
)

SCRIPT = [
    '<tool_call>{"name": "increment_counter", "arguments": {"count": 2}}</tool_call>',
    '<tool_call>{"name": "increment_counter", "arguments": {"count": 3}}</tool_call>',
    "The counter is at 5.",
]


@pytest.fixture
def upstream() -> Iterator[FixedRateUpstream]:
    """A model that calls increment_counter twice, then answers (overrides the plain one)."""
    server = FixedRateUpstream(tiny_model_dir(), chunk=4, script=SCRIPT)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def counter() -> Iterator[CounterServer]:
    server = CounterServer()
    try:
        yield server
    finally:
        server.close()


def episode(gateway_url: str, rollout: str, **options) -> dict | None:
    body = {
        "responses_create_params": {"input": "Add 2, then 3.", "tools": COUNTER_TOOLS, "max_output_tokens": 64},
        "initial_count": 0,
        "expected_count": 5,
    }
    base = f"{gateway_url}/r/{rollout}"
    return simple_agent_loop(f"{base}", f"{base}/tools/counter", body, **options)


def mutations(journal: Path, rollout: str) -> list[ResourceMutation]:
    return [
        e.event
        for e in open_journal(str(journal), read_only=True).read_rollout(rollout)
        if isinstance(e.event, ResourceMutation)
    ]


def test_an_episode_through_both_gateways_is_journaled_call_by_call(tmp_path: Path, counter, start_gateway) -> None:
    gateway = start_gateway(tools=[f"counter={counter.url}"])
    verified = episode(gateway.url, "ng-0")
    assert verified is not None and verified["reward"] == 1.0
    status = httpx.get(gateway.url + "/r/ng-0/status").json()
    assert status["finished"] and status["reward"] == 1.0  # /verify finished the rollout
    gateway.close()
    ops = [(m.op, m.revision, m.idempotency_key) for m in mutations(tmp_path / "journal", "ng-0")]
    assert ops == [
        ("seed_session", 1, "ng-0/t0/s0"),
        ("increment_counter", 2, "ng-0/t0/s2"),
        ("increment_counter", 3, "ng-0/t1/s1"),
        ("verify", 4, "ng-0/t2/s1"),
    ]


def test_two_rollouts_through_one_gateway_get_a_server_session_each(counter, start_gateway) -> None:
    """Each rollout's calls carry its own session cookie, and a rollout's first call none: the
    gateway's HTTP client must not keep the server's cookies itself, or a second rollout's
    ``seed_session`` arrives with the first one's session and the two share one counter."""
    gateway = start_gateway(tools=[f"counter={counter.url}"])
    try:
        for rollout in ("ng-a", "ng-b"):
            verified = episode(gateway.url, rollout)
            assert verified is not None and verified["reward"] == 1.0, f"{rollout}: {verified}"
    finally:
        gateway.close()
    assert sorted(counter.state.values()) == [5, 5]


def test_a_rerun_episode_is_answered_from_the_journal(tmp_path: Path, upstream, counter, start_gateway) -> None:
    gateway = start_gateway(tools=[f"counter={counter.url}"])
    assert episode(gateway.url, "ng-0", stop_after_calls=3) is None  # the job dies after its first tool call
    gateway.close()
    seen = len(counter.requests)

    gateway = start_gateway(tools=[f"counter={counter.url}"])  # the job and the gateway restart
    generated = upstream.upstream.completions
    verified = episode(gateway.url, "ng-0")
    assert verified is not None and verified["reward"] == 1.0
    # the replayed model call and tool calls reached neither the model nor the server; the first live
    # tool call rebuilt the server session first (seed + the journaled increment), then went on
    assert upstream.upstream.completions - generated == 2
    assert counter.requests[seen:] == ["seed_session", "increment_counter", "increment_counter", "verify"]


def test_a_resources_server_that_lost_its_sessions_is_rebuilt_from_the_journal(
    tmp_path: Path, counter, start_gateway
) -> None:
    gateway = start_gateway(tools=[f"counter={counter.url}"])
    assert episode(gateway.url, "ng-0", stop_after_calls=4) is None
    counter.stop()  # the server goes down with every session
    refused = httpx.post(gateway.url + "/r/ng-0/tools/counter/get_counter_value", json={})
    assert refused.status_code == 502 and refused.json()["error"]["type"] == "tool_server_unavailable"
    counter.start()  # back, empty: it would silently answer a count of 0
    value = httpx.post(gateway.url + "/r/ng-0/tools/counter/get_counter_value", json={})
    assert value.status_code == 200 and value.json() == {"count": 2}
    assert httpx.get(gateway.url + "/metrics").json()["tool_sessions_rebuilt"] == 1
    gateway.close()
    gateway = start_gateway(tools=[f"counter={counter.url}"])  # and when the gateway restarts as well
    counter.restart()
    again = httpx.post(gateway.url + "/r/ng-0/tools/counter/get_counter_value", json={})  # a retry: the journal's
    assert again.json() == {"count": 2} and counter.requests[-1] == "get_counter_value"
    value = httpx.post(gateway.url + "/r/ng-0/tools/counter/increment_counter", json={"count": 3})
    assert value.status_code == 200 and counter.state and list(counter.state.values()) == [5]


def test_a_server_that_answers_otherwise_on_reapply_is_refused(tmp_path: Path, start_gateway) -> None:
    noisy = CounterServer(noisy=True)
    try:
        gateway = start_gateway(tools=[f"counter={noisy.url}"])
        assert episode(gateway.url, "ng-0", stop_after_calls=4) is None
        gateway.close()
        gateway = start_gateway(tools=[f"counter={noisy.url}"])  # a new gateway: the server session is rebuilt
        answer = httpx.post(gateway.url + "/r/ng-0/tools/counter/get_counter_value", json={})
        assert answer.status_code == 502 and answer.json()["error"]["type"] == "tool_replay_diverged"
        assert "restart_only" in answer.json()["error"]["message"]
        gateway.close()
        assert [m.op for m in mutations(tmp_path / "journal", "ng-0")] == ["seed_session", "increment_counter"]
    finally:
        noisy.close()


def test_a_restart_only_server_starts_the_rollout_over(tmp_path: Path, upstream, counter, start_gateway) -> None:
    tools = [f"counter={counter.url},recovery=restart_only"]
    gateway = start_gateway(tools=tools)
    assert episode(gateway.url, "ng-0", stop_after_calls=4) is None
    gateway.close()
    gateway = start_gateway(tools=tools)
    generated = upstream.upstream.completions
    verified = episode(gateway.url, "ng-0")
    assert verified is not None and verified["reward"] == 1.0
    assert upstream.upstream.completions - generated == 3  # a new life: every call went live again
    status = httpx.get(gateway.url + "/r/ng-0/status").json()
    assert status["attempt"] == 2 and status["replayed_calls"] == 0
    gateway.close()
    state_restarts = [
        e.event.resumed_from_turn
        for e in open_journal(str(tmp_path / "journal"), read_only=True).read_rollout("ng-0")
        if type(e.event).__name__ == "AttemptStarted"
    ]
    assert state_restarts == [0, 0]


def test_responses_answers_validate_as_openai_responses(start_gateway, counter) -> None:
    from openai.types.responses import Response as OpenAIResponse

    gateway = start_gateway(tools=[f"counter={counter.url}"])
    body = {"input": "Add 2.", "tools": COUNTER_TOOLS, "max_output_tokens": 64}
    answer = httpx.post(gateway.url + "/r/v/v1/responses", json=body, headers={"X-RJ-Token-Ids": "1"}).json()
    parsed = OpenAIResponse.model_validate(answer)
    [call] = [o for o in parsed.output if o.type == "function_call"]
    assert call.name == "increment_counter" and call.arguments == '{"count": 2}'
    assert answer["output"][-1]["generation_token_ids"]  # NeMo Gym's training fields, when asked for
    with httpx.stream("POST", gateway.url + "/r/v/v1/responses", json={**body, "stream": True}) as stream:
        kinds = [line[len("event: ") :] for line in stream.iter_lines() if line.startswith("event: ")]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.done" in kinds


def test_nemo_gyms_own_rollout_prefix_reaches_both_gateways(start_gateway, counter) -> None:
    """With observability on, NeMo Gym's ServerClient prefixes every call with its capture id, which
    carries ``-a<n>`` on a re-dispatch (``nemo_gym/rollout_correlation.py:41-77``). The journal names
    the rollout without it, as ``adapters.nemo_gym.rollout_id`` does: a re-dispatch re-drives the
    journaled rollout, never starts a second one beside it."""
    from rollout_journal.participants.adapters.nemo_gym import rollout_id

    gateway = start_gateway(tools=[f"counter={counter.url}"], ng_resources="counter")
    assert rollout_id({"_ng_rollout_id": "7-2-a1"}) == "7-2"
    body = {
        "responses_create_params": {"input": "Add 2, then 3.", "tools": COUNTER_TOOLS, "max_output_tokens": 64},
        "initial_count": 0,
        "expected_count": 5,
    }
    first = simple_agent_loop(f"{gateway.url}/ng-rollout/7-2", f"{gateway.url}/ng-rollout/7-2", body)
    redispatched = f"{gateway.url}/ng-rollout/7-2-a1"  # the capture id of its first re-dispatch
    again = simple_agent_loop(redispatched, redispatched, body)

    assert first is not None and first["reward"] == 1.0 and again == first  # re-driven: answered from the journal
    status = httpx.get(f"{gateway.url}/r/7-2/status").json()
    assert status["finished"] and status["committed_turns"] == 3
    assert httpx.get(f"{gateway.url}/r/7-2-a1/status").status_code == 404


class OneRolloutsToolCalls:
    """A rollout's tool calls made straight through a tool gateway, the session's part played by the
    list of effects journaled so far (what a rebuild re-applies): for faults the HTTP path cannot
    time, such as a request cancelled between two re-applied calls."""

    def __init__(self, gateway: ToolGateway, server: str, rollout_id: str) -> None:
        self.gateway = gateway
        self.server = gateway.server(server)
        self.rollout = SimpleNamespace(rollout_id=rollout_id)  # the one attribute the tool gateway reads of a session
        self.journaled: list[Effect] = []

    async def call(self, op: str, args: dict, *, attempt: int = 1, journal: bool = True) -> dict:
        """The call's answer body; journaled (as the session would) unless ``journal`` is False."""
        rid, done = self.rollout.rollout_id, len(self.journaled)
        ctx = ToolContext(rid, attempt, attempt, f"k{done}", done, list(self.journaled))
        outcome = await self.gateway._live_call(self.rollout, self.server, op, args, ctx)  # type: ignore[arg-type]
        if journal:
            result = json.dumps(outcome.result)
            effect = Effect(0, done, TOOL, "", "", attempt, op=op, args_json=json.dumps(args), result_json=result)
            self.journaled.append(dataclasses.replace(effect, resource_id=f"{rid}/{self.server.name}"))
        return json.loads(outcome.result["body"])


def test_a_rebuild_cut_short_is_done_again_not_half_kept(counter) -> None:
    """A rebuild of a lost server session re-applies the rollout's journaled calls one by one. Cut
    off half way (its request cancelled: the agent gave up waiting), the half-rebuilt session must
    not be kept: the next call of the same attempt would run against a server session missing the
    rest of the journaled calls (here: a counter at 2 where the journal says 5)."""

    async def scenario() -> dict:
        gateway = ToolGateway({"counter": ToolServer("counter", counter.url)})
        calls = OneRolloutsToolCalls(gateway, "counter", "r-rebuild")
        try:
            await calls.call("seed_session", {"initial_count": 0})
            await calls.call("increment_counter", {"count": 2})
            await calls.call("increment_counter", {"count": 3})
            await asyncio.to_thread(counter.restart)  # the server lost every session
            posts = 0
            post = gateway._post

            async def post_then_give_up(*args: object) -> tuple[int, str, str, dict[str, str]]:
                nonlocal posts
                answer = await post(*args)  # type: ignore[arg-type]
                posts += 1
                if posts == 2:  # the seed and the first increment re-applied: the agent goes away
                    raise asyncio.CancelledError
                return answer

            gateway._post = post_then_give_up  # type: ignore[method-assign]
            cut = asyncio.create_task(calls.call("get_counter_value", {}, attempt=2, journal=False))
            await asyncio.gather(cut, return_exceptions=True)
            gateway._post = post  # type: ignore[method-assign]
            return await calls.call("get_counter_value", {}, attempt=2, journal=False)
        finally:
            await gateway.aclose()

    assert asyncio.run(scenario()) == {"count": 5}


def test_a_call_the_server_did_not_answer_in_time_moves_the_rollout_to_a_rebuilt_session() -> None:
    """A tool server that applied a call but answered too late (a timeout) left the rollout's
    live session ahead of the journal: the agent's retry applied the call a second time there (a
    counter at 4 where the journal holds one increment of 2). A call not answered in time now
    counts as the server gone: the rollout moves to a session rebuilt from the journal and the call
    is made there, once."""
    inner = counter_app({}, [])
    late = {"increment_counter": 1}  # answers owed late: the first increment, after applying it

    async def slow_once(scope, receive, send) -> None:
        op = scope.get("path", "").strip("/")
        if scope["type"] != "http" or not late.get(op):
            await inner(scope, receive, send)
            return
        late[op] -= 1

        async def send_late(message) -> None:
            if message["type"] == "http.response.start":
                await asyncio.sleep(2.0)
            await send(message)

        await inner(scope, receive, send_late)

    server = ThreadedServer(lambda: slow_once, name="slow-counter")

    async def scenario() -> dict:
        gateway = ToolGateway({"counter": ToolServer("counter", server.url)}, timeout_s=0.5, backoff_s=0.05)
        calls = OneRolloutsToolCalls(gateway, "counter", "r-late")
        try:
            await calls.call("seed_session", {"initial_count": 0})
            try:
                await calls.call("increment_counter", {"count": 2})
            except Exception:  # before: the timeout reached the agent, which retried
                await calls.call("increment_counter", {"count": 2})
            return await calls.call("get_counter_value", {})
        finally:
            await gateway.aclose()

    try:
        assert asyncio.run(scenario()) == {"count": 2}
    finally:
        server.close()


def test_a_long_lived_gateway_lets_go_of_finished_rollouts(counter, start_gateway) -> None:
    """Per-rollout state beyond the finished rollouts the factory keeps is dropped: a gateway that
    serves rollouts for days holds their locks and server sessions while they matter, not one of
    each for every rollout it ever served."""
    gateway = start_gateway(tools=[f"counter={counter.url}"])
    try:
        gateway.gateway.factory.keep_finished = 4
        for i in range(20):
            base = f"{gateway.url}/r/fin-{i}/tools/counter"
            assert httpx.post(base + "/seed_session", json={"initial_count": 0}).status_code == 200
            assert httpx.post(base + "/verify", json={"expected_count": 0}).json()["reward"] == 1.0
        held = gateway.gateway
        sizes = {
            "chats": len(held.chats),
            "locks": len(held._locks),
            "server sessions": len(held.tools._live),
            "attempt keys": len(held.attempt_keys),
        }
    finally:
        gateway.close()
    assert all(size <= 5 for size in sizes.values()), sizes


def test_a_nemo_gym_agent_of_an_older_run_is_fenced_by_its_cookie(tmp_path: Path, counter, start_gateway) -> None:
    """A NeMo Gym agent sends no attempt key, so a zombie of the first run (its job was re-dispatched
    while it still ran) made tool calls into the second run's attempt: its increment was journaled
    there and the new run's verify rewarded 0. The gateway now names each run by a cookie: a
    seed_session starts a run and gets a new key, and every answer, errors included, gives a
    request's key back, which the agent sends on as NeMo Gym's agents do (the last answer's
    cookies only, none kept by the client). A call with an older run's cookie is refused (409
    stale_attempt), again after a refusal, and after a restart of the gateway."""
    gateway = start_gateway(tools=[f"counter={counter.url}"])
    asked = {"input": "Add 2, then 3.", "tools": COUNTER_TOOLS, "max_output_tokens": 16}
    with cookieless_client(30) as client:
        old = ServerCookies(client, f"{gateway.url}/r/zomb/tools/counter")  # two runs of the agent
        new = ServerCookies(client, f"{gateway.url}/r/zomb/tools/counter")
        try:
            assert old.post("seed_session", {"initial_count": 0}).status_code == 200
            assert old.post("increment_counter", {"count": 2}).status_code == 200
            assert new.post("seed_session", {"initial_count": 0}).status_code == 200  # run 2
            assert new.post("increment_counter", {"count": 2}).status_code == 200  # from the journal
            model = ServerCookies(client, f"{gateway.url}/r/zomb/v1")  # run 2's model calls: two turns
            first = model.post("responses", asked).json()["output"]
            user = [{"role": "user", "content": "Add 2, then 3.", "type": "message"}]
            more = [{"role": "user", "content": "Go on.", "type": "message"}]
            assert model.post("responses", {**asked, "input": user + first + more}).status_code == 200
            kept = dict(old.cookies)
            for zombie in (old.post("increment_counter", {"count": 3}), old.post("get_counter_value", {})):
                assert zombie.status_code == 409 and zombie.json()["error"]["type"] == "stale_attempt", zombie.text
            assert old.cookies == kept, "a refusal gives the request's key back: its next call is refused too"
            assert new.post("get_counter_value", {}).json() == {"count": 2}
            gateway.close()
            gateway = start_gateway(tools=[f"counter={counter.url}"])  # the gateway restarts
            old.url = new.url = f"{gateway.url}/r/zomb/tools/counter"
            # The zombie first: a restarted gateway knows the runs from the journal, not from memory
            # (it used to take the first key it saw as the current run's, and refuse the real one).
            zombie = old.post("increment_counter", {"count": 3})
            assert zombie.status_code == 409, zombie.text
            assert new.post("get_counter_value", {}).json() == {"count": 2}
            verified = new.post("verify", {"expected_count": 2}).json()
            assert verified["reward"] == 1.0, verified
        finally:
            gateway.close()
    increments = [m.args_json for m in mutations(tmp_path / "journal", "zomb") if m.op == "increment_counter"]
    assert [json.loads(args)["count"] for args in increments] == [2], increments  # the zombie's 3 never landed


def test_a_nemo_gym_run_seeded_on_a_reopened_rollout_is_the_current_one_after_a_restart(
    tmp_path: Path, counter, start_gateway
) -> None:
    """An orchestrator re-opened the rollout (keyless) after a gateway restart, and run 2 seeded on
    that session: its key was kept in memory only, so after the next restart the journal still named
    run 1 as current: run 2 was refused and the zombie's increment journaled."""
    gateway = start_gateway(tools=[f"counter={counter.url}"])
    try:
        with cookieless_client(30) as client:
            old = ServerCookies(client, f"{gateway.url}/r/ng/tools/counter")
            new = ServerCookies(client, f"{gateway.url}/r/ng/tools/counter")
            assert old.post("seed_session", {"initial_count": 0}).status_code == 200
            assert old.post("increment_counter", {"count": 2}).status_code == 200
            gateway.close()
            gateway = start_gateway(tools=[f"counter={counter.url}"])
            old.url = new.url = f"{gateway.url}/r/ng/tools/counter"
            assert httpx.post(f"{gateway.url}/r/ng/open", json={}).status_code == 200
            assert new.post("seed_session", {"initial_count": 0}).status_code == 200  # run 2
            gateway.close()
            gateway = start_gateway(tools=[f"counter={counter.url}"])
            old.url = new.url = f"{gateway.url}/r/ng/tools/counter"
            zombie = old.post("increment_counter", {"count": 3})
            assert zombie.status_code == 409, zombie.text
            assert new.post("get_counter_value", {}).json() == {"count": 2}
    finally:
        gateway.close()
    increments = [m.args_json for m in mutations(tmp_path / "journal", "ng") if m.op == "increment_counter"]
    assert [json.loads(args)["count"] for args in increments] == [2], increments


def test_what_a_gateway_knew_of_a_rollout_s_runs_ends_when_its_partition_leaves(counter, start_gateway) -> None:
    """Under group ownership a rollout's partition can move to another gateway and back. The runs
    this gateway knew from before are stale then: the run that started at the other owner (its
    seed_session went there) must be served here, not refused as a zombie because this gateway
    still held the older run's key."""
    gateway = start_gateway(tools=[f"counter={counter.url}"])
    try:
        with cookieless_client(30) as client:
            first = ServerCookies(client, f"{gateway.url}/r/mv/tools/counter")
            assert first.post("seed_session", {"initial_count": 0}).status_code == 200
            assert first.post("increment_counter", {"count": 2}).status_code == 200
            factory = gateway.gateway.factory
            partition = factory.journal.partition_of("mv")  # it moves away, and comes back:
            factory._taken(partition, load_rollouts(factory.journal, partitions={partition}))
            # The run that seeded at the other owner meanwhile: its attempt names it in the journal.
            gateway.call(lambda: factory.open(RolloutRef("mv", ""), reason="seeded elsewhere", run_key="k-run-2"))
            other = ServerCookies(client, first.url)
            other.cookies = {attempt_cookie("mv"): "k-run-2"}  # that run, back here
            assert other.post("get_counter_value", {}).json() == {"count": 2}
            stale = first.post("increment_counter", {"count": 3})
            assert stale.status_code == 409 and stale.json()["error"]["type"] == "stale_attempt", stale.text
    finally:
        gateway.close()


def test_a_streamed_response_is_one_the_openai_sdk_accumulates(start_gateway) -> None:
    """``client.responses.stream`` builds the response from its events: every event must name the
    items the created and added events announced (one response id, one item id each), and each
    text delta a content part that was added first. The gateway used to announce ``resp-pending``
    and a message item ``msg-pending`` before the answer was known, sent deltas into no part, and
    closed with other ids (and a function call at the message's index)."""
    from openai import OpenAI
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    gateway = start_gateway()
    client = OpenAI(base_url=gateway.base_url("sdk"), api_key="unused", max_retries=0)
    validate = TypeAdapter(ResponseStreamEvent).validate_python
    history: list = [{"role": "user", "content": "Add 2, then 3."}]
    kinds = []
    for _ in SCRIPT:  # two function calls, then text
        with client.responses.stream(model="m", input=history, tools=COUNTER_TOOLS, max_output_tokens=64) as stream:
            events = list(stream)
            final = stream.get_final_response()
        for event in events:
            validate(event.model_dump(warnings=False))  # every event as the SDK's own types define it
        assert {e.response.id for e in events if hasattr(e, "response")} == {final.id}
        announced = [e.item.id for e in events if e.type == "response.output_item.added"]
        assert announced == [item.id for item in final.output]  # each item announced once, under its id
        assert {e.item_id for e in events if hasattr(e, "item_id")} <= set(announced)
        kinds.append([item.type for item in final.output])
        streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert streamed == final.output_text  # a client that only joins the deltas reads the same text
        history += [item.model_dump(exclude_none=True) for item in final.output]
        history += [
            {"type": "function_call_output", "call_id": item.call_id, "output": "{}"}
            for item in final.output
            if item.type == "function_call"
        ]
    assert kinds == [["function_call"], ["function_call"], ["message"]]
    assert final.output_text == "The counter is at 5."


def test_a_streamed_function_call_carries_the_training_fields_once_it_is_done(start_gateway) -> None:
    """The token ids and logprobs go out with the finished item and the response, not also with
    the in-progress announcement (a long prompt's ids sent three times)."""
    gateway = start_gateway()
    body = {"input": "Add 2.", "tools": COUNTER_TOOLS, "max_output_tokens": 64, "stream": True}
    url = gateway.base_url("fields") + "/responses"
    with httpx.stream("POST", url, json=body, headers={"X-RJ-Token-Ids": "1"}) as stream:
        events = [json.loads(line[len("data: ") :]) for line in stream.iter_lines() if line.startswith("data: ")]
    carrying = [e["type"] for e in events if "generation_token_ids" in json.dumps(e)]
    assert carrying == ["response.output_item.done", "response.completed"]


def test_a_failed_stream_ends_with_an_error_event_as_openai_defines_it() -> None:
    """The error event used to spread the error object over its own ``type`` (``upstream_unavailable``
    where a client dispatches on ``error``)."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    from rollout_journal.participants.remote.gateway.response_stream import ResponseStream

    stream = ResponseStream({}, "m")
    body = {"error": {"message": "upstream down", "type": "upstream_unavailable", "param": None, "code": None}}
    events = [json.loads(e.split("data: ", 1)[1]) for e in stream.created() + stream.failed(body)]
    parsed = [TypeAdapter(ResponseStreamEvent).validate_python(e) for e in events]
    assert [e.type for e in parsed] == ["response.created", "response.in_progress", "error", "response.failed"]
    assert [e.sequence_number for e in parsed] == [0, 1, 2, 3]
    assert parsed[2].code == "upstream_unavailable" and parsed[2].message == "upstream down"
    assert parsed[3].response.status == "failed" and "upstream down" in parsed[3].response.error.message
    assert parsed[3].response.id == parsed[0].response.id


def test_a_response_cut_at_max_output_tokens_is_incomplete_down_to_its_message(start_gateway) -> None:
    from openai.types.responses import Response as OpenAIResponse

    gateway = start_gateway()
    body = {"input": "Add 2.", "max_output_tokens": 2}
    answer = OpenAIResponse.model_validate(httpx.post(gateway.base_url("cut") + "/responses", json=body).json())
    assert answer.status == "incomplete" and answer.incomplete_details.reason == "max_output_tokens"
    assert [(item.type, item.status) for item in answer.output] == [("message", "incomplete")]
