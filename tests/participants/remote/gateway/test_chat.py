"""The journaling gateway's Chat Completions, driven by an unmodified OpenAI-SDK agent: answers are
journaled before they are given, a re-driven agent is answered from the journal (none
regenerated), and every bad input or fault gets its own HTTP error. A real gateway on a real file
journal in front of a real HTTP model server."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from rollout_journal.journal import AttemptStarted, ModelCall, TrainingRecord, TurnCompleted, open_journal
from tests.support.gateway_fixtures import chat_agent


def events(journal_dir: Path, rollout: str) -> list:
    return [e.event for e in open_journal(str(journal_dir), read_only=True).read_rollout(rollout)]


def post(url: str, body: object, **headers: str) -> httpx.Response:
    return httpx.post(url, json=body, headers=headers, timeout=60)


def test_a_rerun_agent_gets_every_committed_turn_from_the_journal(tmp_path: Path, upstream, start_gateway) -> None:
    gateway = start_gateway()
    first = chat_agent(gateway.base_url("r1"), 3)
    gateway.close()

    gateway = start_gateway()  # the job and its gateway restarted
    generated = upstream.upstream.completions  # (a gateway asks the upstream once as it starts)
    again = chat_agent(gateway.base_url("r1"), 4)
    assert again[:3] == first
    assert upstream.upstream.completions == generated + 1  # turn 4 only
    status = httpx.get(gateway.url + "/r/r1/status").json()
    assert status["attempt"] == 2 and status["replayed_calls"] == 3 and status["live_calls"] == 1
    gateway.close()
    calls = [e for e in events(tmp_path / "journal", "r1") if isinstance(e, ModelCall)]
    assert len(calls) == 4 and [c.header.attempt for c in calls] == [1, 1, 1, 2]
    # token in, token out: each call's prompt extends its parent's prompt and sampled ids
    assert all(c.prefix_len > 0 and c.parent_call_id == p.call_id for p, c in zip(calls, calls[1:]))


def test_streaming_and_plain_answers_agree_and_a_replay_is_byte_identical(upstream, start_gateway) -> None:
    gateway = start_gateway()
    plain = chat_agent(gateway.base_url("a"), 3)
    streamed = chat_agent(gateway.base_url("b"), 3, stream=True)
    assert plain == streamed  # the same prompts give the same deterministic answers
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}
    live = post(gateway.url + "/r/c/v1/chat/completions", body)
    replayed = post(gateway.url + "/r/c/v1/chat/completions", body)  # a client's retry of the same call
    assert live.status_code == replayed.status_code == 200 and live.content == replayed.content


def test_an_agent_that_outlived_its_gateway_continues_where_it_was(upstream, start_gateway) -> None:
    from openai import OpenAI

    gateway = start_gateway()
    client = OpenAI(base_url=gateway.base_url("r"), api_key="x", max_retries=0)
    messages: list = [{"role": "user", "content": "hi"}]
    for _ in range(2):
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": "more"},
        ]
    gateway.close()
    gateway = start_gateway()  # the agent lives on with its history; only the gateway restarted
    client = OpenAI(base_url=gateway.base_url("r"), api_key="x", max_retries=0)
    client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    status = httpx.get(gateway.url + "/r/r/status").json()
    assert status["committed_turns"] == 2 and status["live_calls"] == 1 and status["replayed_calls"] == 0


def test_a_changed_request_on_a_rerun_is_a_409_naming_both_requests(upstream, start_gateway) -> None:
    gateway = start_gateway()
    chat_agent(gateway.base_url("r"), 2)
    other = post(
        gateway.url + "/r/r/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "temperature": 0},
    )
    assert other.status_code == 409
    body = other.json()
    assert body["error"]["type"] == "nondeterministic_request" and body["position"] == [0, 0]
    assert body["journaled"]["digest"] != body["request"]["digest"] and "rollout r attempt" in body["error"]["message"]


def test_an_edited_assistant_message_is_unknown_history(upstream, start_gateway) -> None:
    gateway = start_gateway()
    [reply] = chat_agent(gateway.base_url("r"), 1)
    edited = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": reply + " (edited)"},
        {"role": "user", "content": "turn 1: go on"},
    ]
    answer = post(gateway.url + "/r/r/v1/chat/completions", {"model": "tiny", "messages": edited, "max_tokens": 8})
    assert answer.status_code == 409 and answer.json()["error"]["type"] == "unknown_history"


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "kind"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, {}, 400, "rollout_required"),
        (
            "/r/bad id!/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}]},
            {},
            400,
            "invalid_rollout_id",
        ),
        ("/r/r/v1/chat/completions", b"{not json", {}, 400, "invalid_request"),
        ("/r/r/v1/chat/completions", {"messages": []}, {}, 400, "invalid_request"),
        (
            "/r/r/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "n": 2},
            {},
            400,
            "unsupported_parameter",
        ),
        (
            "/r/r/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "stop": ["\n"]},
            {},
            400,
            "unsupported_parameter",
        ),
        (
            "/r/r/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x" * 70_000}]},
            {},
            413,
            "request_too_large",
        ),
        ("/r/r/v1/nowhere", {}, {}, 404, "not_found"),
    ],
)
def test_bad_input_gets_a_clear_error_and_journals_nothing(
    tmp_path: Path, start_gateway, path: str, body: object, headers: dict, status: int, kind: str
) -> None:
    gateway = start_gateway(max_body_bytes=64 * 1024)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    answer = httpx.post(gateway.url + path, content=content, headers={"content-type": "application/json", **headers})
    assert answer.status_code == status and answer.json()["error"]["type"] == kind
    assert answer.json()["error"]["message"]
    gateway.close()
    assert not list(open_journal(str(tmp_path / "journal"), read_only=True).scan())


@pytest.mark.parametrize("value", [b"\xb2", b"9" * 5000], ids=["superscript-two", "5000-digits"])
def test_a_header_number_int_refuses_is_no_number_not_a_crash(upstream, start_gateway, value: bytes) -> None:
    """'²' passes ``str.isdigit()`` and 5,000 digits pass it too; ``int()`` refuses both: a
    group size that is no number the gateway reads is left aside, as any other (before: 500). (A
    content length like it never reaches the gateway: the HTTP server refuses it.)"""
    gateway = start_gateway()
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    answer = httpx.post(
        gateway.url + "/r/r/v1/chat/completions",
        content=json.dumps(body).encode(),
        headers={"content-type": "application/json", "x-rollout-group-size": value},
    )
    assert answer.status_code == 200, answer.text


def test_an_unopened_rollout_is_refused_when_opening_is_required(start_gateway) -> None:
    gateway = start_gateway(require_open=True)
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    assert post(gateway.url + "/r/r/v1/chat/completions", body).json()["error"]["type"] == "unknown_rollout"
    assert post(gateway.url + "/r/r/open", {"group_id": "g", "group_size": 2}).status_code == 200
    assert post(gateway.url + "/r/r/v1/chat/completions", body).status_code == 200


def test_a_finished_rollout_replays_and_refuses_calls_past_its_end(tmp_path: Path, start_gateway) -> None:
    gateway = start_gateway()
    replies = chat_agent(gateway.base_url("r"), 2)
    assert post(gateway.url + "/r/r/finish", {"reward": 1.0}).json()["finished"]
    assert chat_agent(gateway.base_url("r"), 2) == replies  # a re-run is answered from the journal
    past = post(
        gateway.url + "/r/r/v1/chat/completions",
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": replies[0]},
                {"role": "user", "content": "turn 1: go on"},
                {"role": "assistant", "content": replies[1]},
                {"role": "user", "content": "turn 2: go on"},
            ],
            "max_tokens": 8,
            "temperature": 0,
        },
    )
    assert past.status_code == 409 and past.json()["error"]["type"] == "rollout_finished"
    gateway.close()
    journal = open_journal(str(tmp_path / "journal"), read_only=True)
    [stored] = [r for p in range(journal.backend.partitions) for r in journal.backend.read_results(p)]
    record = journal.codec.decode(stored.value, stored.location)
    assert isinstance(record, TrainingRecord) and record.reward == 1.0 and int(record.loss_mask.sum()) == 16
    turns = [e for e in events(tmp_path / "journal", "r") if isinstance(e, TurnCompleted)]
    assert [len(t.call_ids) for t in turns] == [1, 1] and turns[-1].reward == 1.0


def given_up_as_readers_see_it(location: Path, rollout: str) -> dict[str, object]:
    """What ``replay list``, the training export, the results stream and the trainer feed say of a
    rollout that was given up."""
    from rollout_journal.journal import open_backend
    from rollout_journal.participants.trainer import TrainerFeed
    from rollout_journal.replay.listing import list_rollouts
    from rollout_journal.replay.source import open_replay
    from rollout_journal.replay.training import training_rows

    source = open_replay(str(location))
    [row] = [r for r in list_rollouts(source).rows if r.rollout_id == rollout]
    left_out: dict[str, str] = {}
    exported = [r.record.rollout_id for r in training_rows(source, left_out=left_out)]
    journal = open_journal(str(location), read_only=True)
    [stored] = [r for p in range(journal.backend.partitions) for r in journal.backend.read_results(p)]
    record = journal.codec.decode(stored.value, stored.location)
    assert isinstance(record, TrainingRecord)
    with TrainerFeed(open_backend(str(location), read_only=True)) as feed:
        handed_on = list(feed.groups(idle_timeout_s=1, poll_s=0.2))
        dropped = [(d.group_id, d.given_up) for d in feed.dropped()]
    return {
        "listed": row.status,
        "exported": exported,
        "left_out": left_out,
        "record": (record.rollout_id, record.group_id, record.status, record.group_policy, record.reward),
        "feed": (handed_on, dropped),
    }


def test_a_rollout_given_up_over_http_reads_as_one_given_up_through_the_session_api(
    tmp_path: Path, upstream, start_gateway
) -> None:
    """``POST /r/<id>/give-up`` is ``RolloutSession.give_up``: the same rollout given up either way
    lists as given up, is left out of the training export, publishes a
    given-up record and is dropped by the trainer feed; it stays given up across a restart."""
    import asyncio

    import numpy as np

    from rollout_journal.journal import SamplingParams
    from rollout_journal.participants.model.gate import ModelParticipant
    from rollout_journal.participants.model.tiny_model import tiny_model_dir
    from rollout_journal.participants.remote.gateway.upstream import GenerateUpstream
    from rollout_journal.participants.session import ModelRequest, RolloutRef, SessionFactory

    async def give_up_in_python(location: Path) -> None:
        journal = open_journal(str(location))
        factory = SessionFactory(
            journal, ModelParticipant(GenerateUpstream(upstream.url, tiny_model_dir())), writer="t"
        )
        factory.start()
        session = await factory.open(RolloutRef("r1", "g", group_size=1))
        await session.model_call(ModelRequest(np.asarray([1, 5, 40, 6], dtype=np.int32), SamplingParams(0.0, 1.0, 8)))
        await session.give_up("ToolServerGone", "the tool host went away for good")
        journal.close()

    asyncio.run(give_up_in_python(tmp_path / "python"))

    gateway = start_gateway()
    assert post(gateway.url + "/r/r1/open", {"group_id": "g", "group_size": 1}).status_code == 200
    [reply] = chat_agent(gateway.base_url("r1"), 1)
    give_up = {"error": "ToolServerGone", "reason": "the tool host went away for good"}
    for _ in range(2):  # giving it up again answers the same
        answer = post(gateway.url + "/r/r1/give-up", give_up)
        assert answer.status_code == 200 and answer.json()["given_up"] and not answer.json()["finished"]
    gateway.close()

    gateway = start_gateway()  # the job and its gateway restarted: the rollout is still given up
    assert httpx.get(gateway.url + "/r/r1/status").json()["given_up"]
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": reply}]
    past = post(
        gateway.url + "/r/r1/v1/chat/completions",
        {"messages": [*history, {"role": "user", "content": "turn 1: go on"}], "max_tokens": 8, "temperature": 0},
    )
    assert past.status_code == 409 and past.json()["error"]["type"] == "rollout_finished"
    gateway.close()
    assert [type(e).__name__ for e in events(tmp_path / "journal", "r1")].count("AttemptStarted") == 1

    over_http, in_python = (
        given_up_as_readers_see_it(tmp_path / "journal", "r1"),
        given_up_as_readers_see_it(tmp_path / "python", "r1"),
    )
    assert over_http == in_python
    assert over_http["listed"] == "given up"
    assert over_http["exported"] == [] and "given up" in str(over_http["left_out"])
    assert over_http["record"] == ("r1", "g", "given_up", "drop", None)
    assert over_http["feed"] == ([], [("g", ("r1",))])


def test_give_up_refuses_a_bad_body_and_a_finished_rollout(start_gateway) -> None:
    gateway = start_gateway()
    for body, field in (([], "body"), ({}, "error"), ({"error": "X", "group_policy": "wait"}, "group_policy")):
        answer = post(gateway.url + "/r/r/give-up", body)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == field, answer.json()
    chat_agent(gateway.base_url("r"), 1)
    assert post(gateway.url + "/r/r/finish", {"reward": 1.0}).status_code == 200
    refused = post(gateway.url + "/r/r/give-up", {"error": "X"})
    assert refused.status_code == 409 and refused.json()["error"]["type"] == "rollout_finished"


def test_an_upstream_503_is_retried_and_a_dead_upstream_is_a_502_with_nothing_journaled(
    tmp_path: Path, upstream, start_gateway
) -> None:
    gateway = start_gateway(upstream_retries=2)
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    upstream.set_faults(status=503, count=2)  # two refusals, then an answer
    assert post(gateway.url + "/r/ok/v1/chat/completions", body).status_code == 200
    upstream.set_faults(status=503, count=10)
    down = post(gateway.url + "/r/down/v1/chat/completions", body)
    assert down.status_code == 502 and down.json()["error"]["type"] == "upstream_unavailable"
    assert "after 3 tries" in down.json()["error"]["message"]
    gateway.close()
    assert not [e for e in events(tmp_path / "journal", "down") if isinstance(e, ModelCall)]


def test_a_newer_run_of_the_job_fences_the_older_one(upstream, start_gateway) -> None:
    gateway = start_gateway()
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "temperature": 0}
    assert post(gateway.url + "/r/r/v1/chat/completions", body, **{"X-RJ-Attempt-Key": "run-1"}).status_code == 200
    assert post(gateway.url + "/r/r/v1/chat/completions", body, **{"X-RJ-Attempt-Key": "run-2"}).status_code == 200
    stale = post(gateway.url + "/r/r/v1/chat/completions", body, **{"X-RJ-Attempt-Key": "run-1"})
    assert stale.status_code == 409 and stale.json()["error"]["type"] == "stale_attempt"


def test_a_restarted_gateway_fences_an_older_run_that_comes_back_first(tmp_path: Path, upstream, start_gateway) -> None:
    """The runs a gateway knew lived in its memory: after a restart the first key to come was taken
    as the current run's, so a zombie of run 1 fenced run 2. Each attempt now journals the run it
    serves; the restarted gateway refuses run 1 and serves run 2 where it was."""
    gateway = start_gateway()
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "temperature": 0}
    url = gateway.url + "/r/rs/v1/chat/completions"
    assert post(url, body, **{"X-RJ-Attempt-Key": "run-1"}).status_code == 200
    assert post(url, body, **{"X-RJ-Attempt-Key": "run-2"}).status_code == 200
    gateway.close()
    gateway = start_gateway()
    url = gateway.url + "/r/rs/v1/chat/completions"
    stale = post(url, body, **{"X-RJ-Attempt-Key": "run-1"})
    assert stale.status_code == 409 and stale.json()["error"]["type"] == "stale_attempt", stale.text
    generated = upstream.upstream.completions
    again = post(url, body, **{"X-RJ-Attempt-Key": "run-2"})
    assert again.status_code == 200 and upstream.upstream.completions == generated  # its call, from the journal
    stale = post(url, body, **{"X-RJ-Attempt-Key": "run-1"})  # after the current run: memory agrees
    assert stale.status_code == 409, stale.text
    assert post(url, body, **{"X-RJ-Attempt-Key": "run-3"}).status_code == 200  # a new run still starts
    gateway.close()
    runs = [e.run for e in events(tmp_path / "journal", "rs") if isinstance(e, AttemptStarted)]
    assert len(set(runs)) == 3 and None not in runs and "run-1" not in runs  # digests, never the keys


def test_an_opened_rollout_driven_by_one_run_keeps_one_attempt(tmp_path: Path, upstream, start_gateway) -> None:
    """An orchestrator opens the rollout (no key), then the agent's run drives it with its key: one
    attempt, as before runs were journaled (a second would count a re-drive that never happened)."""
    gateway = start_gateway()
    assert post(gateway.url + "/r/op/open", {"group_id": "g", "group_size": 1}).status_code == 200
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "temperature": 0}
    assert post(gateway.url + "/r/op/v1/chat/completions", body, **{"X-Session-ID": "s1"}).status_code == 200
    gateway.close()
    assert [type(e).__name__ for e in events(tmp_path / "journal", "op")].count("AttemptStarted") == 1


def test_a_run_that_takes_over_a_keyless_session_is_journaled(tmp_path: Path, upstream, start_gateway) -> None:
    """After a restart a keyless request opened the rollout's session, and run 2's key took it over
    in the gateway's memory only: after the next restart the journal's newest run was still run 1's,
    which was served again. A run that takes over a session whose attempt names another opens one
    that names it."""
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "temperature": 0}
    gateway = start_gateway()
    assert post(gateway.url + "/r/kl/v1/chat/completions", body, **{"X-RJ-Attempt-Key": "run-1"}).status_code == 200
    gateway.close()
    gateway = start_gateway()
    url = gateway.url + "/r/kl/v1/chat/completions"
    assert post(url, body).status_code == 200  # keyless: an orchestrator, a zombie's model call
    assert post(url, body, **{"X-RJ-Attempt-Key": "run-2"}).status_code == 200
    gateway.close()
    gateway = start_gateway()
    stale = post(gateway.url + "/r/kl/v1/chat/completions", body, **{"X-RJ-Attempt-Key": "run-1"})
    assert stale.status_code == 409, stale.text
    gateway.close()


def test_a_client_gone_mid_stream_leaves_its_call_journaled_for_the_rerun(upstream, start_gateway) -> None:
    gateway = start_gateway()
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 64, "temperature": 0, "stream": True}
    with httpx.stream("POST", gateway.url + "/r/r/v1/chat/completions", json=body) as response:
        for line in response.iter_lines():
            if '"content"' in line:
                break  # the agent process dies here
    generated = upstream.upstream.completions
    body["stream"] = False
    again = post(gateway.url + "/r/r/v1/chat/completions", body)  # the re-run waits behind the call, then replays
    assert again.status_code == 200 and upstream.upstream.completions == generated
    status = httpx.get(gateway.url + "/r/r/status").json()
    assert status["live_calls"] == 1 and status["replayed_calls"] == 1


def test_a_journal_that_refuses_the_write_fails_the_call_and_the_agent_never_sees_the_answer(
    tmp_path: Path, upstream
) -> None:
    from rollout_journal.journal import Journal
    from rollout_journal.journal.file.backend import FileBackend
    from rollout_journal.participants.remote.gateway import GatewayConfig, GatewayServer

    # A journal taking no event over 900 bytes: a long answer's ModelCall is refused, a short one is not.
    journal = Journal(FileBackend(str(tmp_path / "journal")), max_record_bytes=880, max_event_bytes=900)
    gateway = GatewayServer(
        GatewayConfig(upstream=upstream.url, journal=str(tmp_path / "journal"), port=0, upstream_logprobs="processed"),
        journal,
    )
    try:
        short = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8, "temperature": 0}
        long = {**short, "max_tokens": 200}
        refused = post(gateway.url + "/r/big/v1/chat/completions", long)
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "journal_unavailable"
        assert "OversizedEventError" in refused.json()["cause"]
        with httpx.stream("POST", gateway.url + "/r/big2/v1/chat/completions", json={**long, "stream": True}) as s:
            lines = list(s.iter_lines())
        assert not any(line == "data: [DONE]" for line in lines)  # a stream ends in an error, never [DONE]
        assert any("journal_unavailable" in line for line in lines)
        assert post(gateway.url + "/r/small/v1/chat/completions", short).status_code == 200  # the others go on
    finally:
        gateway.close()
        journal.close()
    assert not [e for e in events(tmp_path / "journal", "big") if isinstance(e, ModelCall)]


def test_token_native_calls_and_the_model_list(upstream, start_gateway) -> None:
    gateway = start_gateway()
    assert httpx.get(gateway.url + "/r/t/v1/models").json()["data"][0]["id"] == "tiny"
    body = {"token_ids": [1, 5, 40, 6], "sampling_params": {"max_tokens": 6, "temperature": 0}}
    first = [post(gateway.url + "/r/t/inference/v1/generate", body).json() for _ in range(2)]
    assert all(len(f["choices"][0]["token_ids"]) == 6 for f in first)
    generated = upstream.upstream.completions
    again = [post(gateway.url + "/r/t/inference/v1/generate", body, **{"X-RJ-Attempt": "new"}).json()]
    again.append(post(gateway.url + "/r/t/inference/v1/generate", body).json())
    assert [a["choices"] for a in again] == [f["choices"] for f in first] and upstream.upstream.completions == generated
    assert httpx.get(gateway.url + "/r/t/status").json()["attempt"] == 2


def test_both_token_id_endpoints_are_asked_the_same_call(tmp_path: Path, upstream, start_gateway) -> None:
    """``/inference/v1/generate`` and ``/v1/completions`` get one call's ids and sampling, each in
    its own shape (one builder), and so give the agent the same answers."""
    import numpy as np

    from rollout_journal.journal import SamplingParams
    from rollout_journal.participants.model.generation import GenerationRequest
    from rollout_journal.participants.model.openai_backend import completions_body, generate_body, sampling_fields

    call = GenerationRequest(
        np.asarray([1, 5, 40], dtype=np.int32),
        SamplingParams(0.7, 0.9, 12, seed=3, top_k=20),
        prefix_ids=np.asarray([41, 42], dtype=np.int32),
    )
    sampling = {"max_tokens": 10, "temperature": 0.699999988079071, "top_p": 0.8999999761581421, "top_k": 20}
    assert sampling_fields(call) == {**sampling, "logprobs": 0, "seed": 3}
    generate, completions = generate_body(call, "tiny", "v1"), completions_body(call, "tiny", "v1")
    assert generate["token_ids"] == completions["prompt"] == [1, 5, 40, 41, 42]
    assert generate["sampling_params"] == {k: completions[k] for k in sampling_fields(call)}
    assert generate["cache_salt"] == completions["cache_salt"] and completions["return_token_ids"]

    replies = {
        api: chat_agent(start_gateway(upstream_api=api, journal=str(tmp_path / api)).base_url("r"), 2)
        for api in ("generate", "completions")
    }
    assert replies["generate"] == replies["completions"]


def test_finished_rollouts_leave_memory_and_come_back_from_the_journal(start_gateway) -> None:
    gateway = start_gateway()
    assert gateway.gateway is not None
    gateway.gateway.factory.keep_finished = 1
    replies = {r: chat_agent(gateway.base_url(r), 2) for r in ("a", "b")}
    for r in ("a", "b"):
        assert post(gateway.url + f"/r/{r}/finish", {"reward": 1.0}).status_code == 200
    assert "a" not in gateway.gateway.factory.sessions and "a" not in gateway.gateway.chats
    assert chat_agent(gateway.base_url("a"), 2) == replies["a"]  # read back, answered from the journal


def test_a_retry_racing_its_original_is_answered_once(upstream, start_gateway) -> None:
    from concurrent.futures import ThreadPoolExecutor

    gateway = start_gateway()
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8, "temperature": 0}
    generated = upstream.upstream.completions
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: post(gateway.url + "/r/race/v1/chat/completions", body), range(4)))
    assert {a.status_code for a in answers} == {200} and len({a.content for a in answers}) == 1
    assert upstream.upstream.completions == generated + 1


def test_a_prompt_over_the_models_length_and_an_invented_answer_are_refused(tmp_path: Path, start_gateway) -> None:
    gateway = start_gateway()
    long = {"messages": [{"role": "user", "content": "word " * 3000}], "max_tokens": 8}
    refused = post(gateway.url + "/r/long/v1/chat/completions", long)
    assert refused.status_code == 400 and refused.json()["error"]["type"] == "context_length_exceeded"
    assert "maximum context length" in refused.json()["error"]["message"]
    invented = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "an answer this rollout never gave"},
            {"role": "user", "content": "go on"},
        ],
        "max_tokens": 8,
    }
    answer = post(gateway.url + "/r/fresh/v1/chat/completions", invented)
    assert answer.status_code == 409 and answer.json()["error"]["type"] == "unknown_history"
    gateway.close()
    assert not [e for e in events(tmp_path / "journal", "long") if isinstance(e, ModelCall)]


def test_every_chunk_of_a_stream_has_the_stream_s_one_id(upstream, start_gateway) -> None:
    """Chunks sent before the call was journaled carried a placeholder id, the same in every stream
    of every rollout, and the later ones the call's: a client that groups chunks by id (as SSE
    aggregators do) split one answer in two, or merged the starts of unrelated answers."""
    gateway = start_gateway()
    ids = []
    for rollout in ("s1", "s2"):
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}
        with httpx.stream("POST", f"{gateway.url}/r/{rollout}/v1/chat/completions", json=body, timeout=60) as reply:
            chunks = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
        assert len(chunks) >= 2
        ids.append({chunk["id"] for chunk in chunks})
    assert [len(one) for one in ids] == [1, 1] and ids[0] != ids[1], ids
