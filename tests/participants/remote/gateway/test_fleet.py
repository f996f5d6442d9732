"""Several gateways on one Kafka namespace never journal one rollout twice. With single ownership
a gateway writes the namespace as one writer slot (``SingleWriter``), so a second gateway on it
fences the first with Kafka's own producer fencing; the first then refuses every call (421
``not_owner``) instead of answering what it cannot make durable. With group ownership the gateways
are members of the namespace's consumer group, each writing the rollouts of the partitions assigned
to it, and a request for another member's rollout is forwarded to it. A killed gateway's rollouts go
on through the next one, answered from the journal. Real broker, real gateways (SIGKILLed child
processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from rollout_journal.journal import (
    AttemptStarted,
    ConfigurationError,
    ModelCall,
    RolloutAcknowledged,
    open_backend,
    open_journal,
    partition_for,
)
from rollout_journal.journal.deadlines import Deadline
from rollout_journal.journal.errors import JournalError
from rollout_journal.journal.kafka.config import KafkaSettings
from rollout_journal.journal.kafka.group import client_id, member_identity
from rollout_journal.participants.remote.gateway import GatewayConfig, GatewayServer, build_gateway
from rollout_journal.participants.trainer import TrainerFeed
from tests.support.gateway_fixtures import chat_agent

ROLLOUTS = [f"fleet-{i}" for i in range(4)]


def gateway_child(upstream: str, journal: str, log: Path, *options: str) -> tuple[subprocess.Popen, str]:
    out = log.open("w")
    child = subprocess.Popen(
        [sys.executable, "-m", "rollout_journal.replay.cli.main", "gateway", "--upstream", upstream,
         "--journal", journal, "--port", "0", "--upstream-logprobs", "processed", *options],  # processed: the
        stdout=out, stderr=subprocess.STDOUT, start_new_session=True,  # fixed-rate upstream's logprobs
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if line.startswith("serving gateway at"):
                return child, line.split()[-1]
        assert child.poll() is None, log.read_text()
        time.sleep(0.1)
    raise AssertionError(log.read_text())


@pytest.mark.slow
@pytest.mark.kafka
def test_two_gateways_and_a_killed_one_journal_each_call_once(
    tmp_path: Path, upstream, kafka_bootstrap: str, kafka_namespace: str
) -> None:
    journal = f"kafka://{kafka_bootstrap}/{kafka_namespace}?partitions=4"
    first, first_url = gateway_child(upstream.url, journal, tmp_path / "a.log")
    try:
        replies = {r: chat_agent(f"{first_url}/r/{r}/v1", 2) for r in ROLLOUTS}
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the sidecar dies with its rollouts mid-way
        first.wait()

    second = GatewayServer(GatewayConfig(upstream=upstream.url, journal=journal, port=0, upstream_logprobs="processed"))
    third: GatewayServer | None = None
    try:
        generated = upstream.upstream.completions
        for r in ROLLOUTS:  # each agent re-runs through the next gateway: two turns replayed, one live
            assert chat_agent(second.base_url(r), 3)[:2] == replies[r]
        assert upstream.upstream.completions == generated + len(ROLLOUTS)

        # A third gateway on the namespace takes it over: the second may no longer write, and says so.
        third = GatewayServer(
            GatewayConfig(upstream=upstream.url, journal=journal, port=0, upstream_logprobs="processed")
        )
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "temperature": 0}
        refused = httpx.post(second.url + "/r/late/v1/chat/completions", json=body, timeout=60)
        assert refused.status_code == 421 and refused.json()["error"]["type"] == "not_owner"
        assert httpx.post(second.url + "/r/late/v1/chat/completions", json=body).status_code == 421
        assert httpx.post(third.url + "/r/late/v1/chat/completions", json=body).status_code == 200
    finally:
        if third is not None:
            third.close()
        second.close()

    reader = open_journal(journal, read_only=True)
    for r in [*ROLLOUTS, "late"]:
        events = [e.event for e in reader.read_rollout(r)]
        calls = [(c.header.turn, c.header.attempt) for c in events if isinstance(c, ModelCall)]
        turns = [t for t, _ in calls]
        assert len(turns) == len(set(turns)), f"{r}: a turn journaled twice: {calls}"
        if r != "late":
            assert calls == [(0, 1), (1, 1), (2, 2)]
            starts = [e.header.writer for e in events if isinstance(e, AttemptStarted)]
            assert len(starts) == 2


@pytest.mark.slow
def test_a_gateway_killed_mid_stream_leaves_a_prefix_the_next_one_continues(tmp_path: Path) -> None:
    from rollout_journal.participants.model.tiny_model import tiny_model_dir
    from tests.support.fixed_rate_upstream import FixedRateUpstream

    slow = FixedRateUpstream(tiny_model_dir(), rate=100, chunk=4)  # a long call: 200 tokens, 2 s
    journal = str(tmp_path / "journal")
    try:
        out = (tmp_path / "a.log").open("w")
        child = subprocess.Popen(
            [sys.executable, "-m", "rollout_journal.replay.cli.main", "gateway", "--upstream", slow.url,
             "--journal", journal, "--port", "0", "--progress-every-tokens", "16", "--upstream-logprobs", "processed"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        while not (tmp_path / "a.log").read_text().startswith("serving gateway at"):
            assert child.poll() is None, (tmp_path / "a.log").read_text()
            time.sleep(0.1)
        url = (tmp_path / "a.log").read_text().split()[3]
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 200, "temperature": 0, "stream": True}
        seen = 0
        with httpx.stream("POST", url + "/r/long/v1/chat/completions", json=body, timeout=60) as stream:
            for line in stream.iter_lines():
                seen += line.count('"content"')
                if seen >= 20:  # some 80 tokens in: the gateway dies mid-stream
                    os.killpg(child.pid, signal.SIGKILL)
                    break
        child.wait()
        generated = slow.upstream.tokens
        gateway = GatewayServer(
            GatewayConfig(upstream=slow.url, journal=journal, port=0, upstream_logprobs="processed")
        )
        try:
            generated = slow.upstream.tokens  # (after the new gateway's probe)
            body["stream"] = False
            answer = httpx.post(gateway.base_url("long") + "/chat/completions", json=body, timeout=120)
            assert answer.status_code == 200
            metrics = httpx.get(gateway.url + "/metrics").json()
        finally:
            gateway.close()
        assert metrics["tokens_continued"] >= 48  # the progress marks the killed gateway made durable
        assert slow.upstream.tokens - generated == 200 - metrics["tokens_continued"]
    finally:
        slow.close()


def health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=30).json()


def wait_for(what: str, condition, deadline_s: float, logs: list[Path]) -> None:
    """Until ``condition()`` holds; the deadline is a bound on behaviour (the group's session timeout,
    generously multiplied), never a measurement."""
    deadline = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {deadline_s:.0f} s\n" + "\n".join(p.read_text() for p in logs))
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.kafka
def test_gateways_of_one_group_write_each_rollout_through_its_partition_owner(
    tmp_path: Path, upstream, kafka_bootstrap: str, kafka_namespace: str
) -> None:
    partitions = 4
    journal = f"kafka://{kafka_bootstrap}/{kafka_namespace}?partitions={partitions}"
    bound_s = 20 * KafkaSettings.from_url(journal).group_session_timeout_ms / 1000 + 60
    names = {p: [f"shared-{i}" for i in range(64) if partition_for(f"shared-{i}", partitions) == p][:2]
             for p in range(partitions)}  # fmt: skip
    rollouts = [r for p in range(partitions) for r in names[p]]  # two on every partition
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    a, a_url = gateway_child(upstream.url, journal, logs[0], "--ownership", "group", "--writer", "gw-a")
    b, b_url = gateway_child(upstream.url, journal, logs[1], "--ownership", "group", "--writer", "gw-b")
    urls = {"gw-a": a_url, "gw-b": b_url}
    try:

        def settled() -> bool:  # each owns some partitions, and knows where the others' are served
            views = {name: health(url) for name, url in urls.items()}
            ready = {name: set(view["ready"]) for name, view in views.items()}
            if not all(ready.values()) or set().union(*ready.values()) != set(range(partitions)):
                return False
            return all(
                view["owners"].get(str(p), {}).get("address") == urls[other]
                for name, view in views.items()
                for other in urls
                if other != name
                for p in ready[other]
            )

        wait_for("two gateways sharing the partitions", settled, bound_s, logs)
        owner = {p: name for name, url in urls.items() for p in health(url)["ready"]}

        # Every agent drives its rollout through one of the two gateways, whichever owns it (some stream).
        replies = {
            r: chat_agent(f"{[a_url, b_url][i % 2]}/r/{r}/v1", 2, stream=i % 4 == 1) for i, r in enumerate(rollouts)
        }
        forwarded = sum(httpx.get(url + "/metrics").json().get("forwarded", 0) for url in urls.values())
        assert forwarded > 0  # some agents asked the gateway that does not own their rollout

        os.killpg(a.pid, signal.SIGKILL)  # a sidecar dies with its rollouts mid-way
        a.wait()
        probe = next(f"probe-{i}" for i in range(64) if owner[partition_for(f"probe-{i}", partitions)] == "gw-a")
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}
        early = httpx.post(f"{b_url}/r/{probe}/v1/chat/completions", json=body, timeout=60)
        if early.status_code == 421:  # the group still lists the dead gateway: its address, nothing sent
            assert early.json()["owner"] == a_url
        elif early.status_code == 503:  # the group noticed: its partition is being taken
            assert early.json()["error"]["type"] == "owner_moving" and early.headers["retry-after"]
        else:  # (already taken: a new rollout there)
            assert early.status_code == 200, early.text
        wait_for("the survivor taking every partition", lambda: health(b_url)["ready"] == list(range(partitions)),
                 bound_s, logs)  # fmt: skip

        generated = upstream.upstream.completions
        for r in rollouts:  # each agent re-runs through the survivor: two turns replayed, one live
            assert chat_agent(f"{b_url}/r/{r}/v1", 3)[:2] == replies[r]
        assert upstream.upstream.completions == generated + len(rollouts)  # nothing committed regenerated
    finally:
        for child in (a, b):
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGTERM)
                child.wait(60)

    reader = open_journal(journal, read_only=True)
    for r in rollouts:
        events = [e.event for e in reader.read_rollout(r)]
        calls = [(c.header.turn, c.header.attempt) for c in events if isinstance(c, ModelCall)]
        assert calls == [(0, 1), (1, 1), (2, 2)], f"{r}: each turn journaled once"
        writers = {(e.header.attempt, e.header.writer) for e in events}
        first = owner[partition_for(r, partitions)]
        later = "gw-b"  # the survivor: every partition is its own after the kill
        assert writers == {(1, first), (2, later)}, f"{r} (owned by {first}): written by {writers}"
        starts = [e.header.writer for e in events if isinstance(e, AttemptStarted)]
        assert starts == [first, later]


@pytest.mark.slow
@pytest.mark.kafka
def test_a_group_gateway_applies_the_trainer_s_acknowledgement_while_it_lives(
    tmp_path: Path, upstream, kafka_bootstrap: str, kafka_namespace: str
) -> None:
    """The trainer acknowledges a rollout a living gateway owns: the gateway applies it in its own
    transaction as a fleet worker would, not only when a later take finds it waiting."""
    journal = f"kafka://{kafka_bootstrap}/{kafka_namespace}?partitions=2"
    bound_s = 20 * KafkaSettings.from_url(journal).group_session_timeout_ms / 1000 + 60
    log = tmp_path / "gw.log"
    gateway, url = gateway_child(upstream.url, journal, log, "--ownership", "group", "--writer", "gw-a")
    try:
        wait_for("the gateway taking both partitions", lambda: health(url)["ready"] == [0, 1], bound_s, [log])
        assert httpx.post(f"{url}/r/acked/open", json={"group_id": "g", "group_size": 1}).status_code == 200
        chat_agent(f"{url}/r/acked/v1", 1)
        assert httpx.post(f"{url}/r/acked/finish", json={"reward": 1.0}, timeout=60).json()["finished"]
        acknowledger = open_journal(journal, mode="plain", writer="trainer")
        try:
            with TrainerFeed(open_backend(journal, read_only=True), acknowledger=acknowledger) as feed:
                (group,) = feed.groups(limit=1, idle_timeout_s=bound_s)
                assert group.rollout_ids == ["acked"]
                for future in feed.acknowledge(group):
                    future.result()  # on <ns>.acks: the owner applies it
        finally:
            acknowledger.close()

        def acknowledged() -> bool:
            with open_journal(journal, read_only=True) as reader:
                return any(isinstance(e.event, RolloutAcknowledged) for e in reader.read_rollout("acked"))

        wait_for("the gateway applying the acknowledgement", acknowledged, bound_s, [log])
        assert gateway.poll() is None and health(url)["ready"] == [0, 1]  # no take since: the owner applied it

        # A re-driven agent: told the rollout is finished, and nothing more is written of it.
        with open_journal(journal, read_only=True) as reader:
            before = [type(e.event).__name__ for e in reader.read_rollout("acked")]
        reopened = httpx.post(f"{url}/r/acked/open", json={"group_id": "g", "group_size": 1})
        assert reopened.status_code == 200 and reopened.json()["finished"], reopened.text
        again = httpx.post(f"{url}/r/acked/finish", json={"reward": 0.0}, timeout=60)
        assert again.status_code >= 400 and "finished" in again.text, again.text
        with open_journal(journal, read_only=True) as reader:
            assert [type(e.event).__name__ for e in reader.read_rollout("acked")] == before
    finally:
        os.killpg(gateway.pid, signal.SIGTERM)
        gateway.wait(60)


@pytest.mark.kafka
def test_a_gateway_whose_take_failed_leaves_the_group_so_another_takes_its_partitions(
    upstream, kafka_bootstrap: str, kafka_namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member the journal failed under (here its take, made to raise: the fault is injected into
    our own take, the broker is real) writes nothing more. Before, it stayed in the group holding
    its partitions, and their rollouts were refused everywhere until someone restarted it; now it
    leaves, the other gateway takes every partition, and the failed one forwards to it."""
    from rollout_journal.journal import takeover

    real_take = takeover.take_and_restore

    def take(journal, partition, token, *args, **kwargs):  # type: ignore[no-untyped-def]
        if journal.backend.member == "gw-broken":
            raise JournalError(f"injected: the journal failed under the take of partition {partition}")
        return real_take(journal, partition, token, *args, **kwargs)

    monkeypatch.setattr(takeover, "take_and_restore", take)
    journal = f"kafka://{kafka_bootstrap}/{kafka_namespace}?partitions=2"
    bound_s = 20 * KafkaSettings.from_url(journal).group_session_timeout_ms / 1000 + 60

    def config(writer: str) -> GatewayConfig:
        return GatewayConfig(
            upstream=upstream.url, journal=journal, port=0, upstream_logprobs="processed", ownership="group",
            writer=writer,
        )  # fmt: skip

    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}
    broken = GatewayServer(config("gw-broken"))
    healthy: GatewayServer | None = None
    try:
        deadline = Deadline(bound_s)
        while health(broken.url)["ok"]:
            assert not deadline.passed(), "the injected take failure never stopped the gateway"
            deadline.sleep(0.1)
        healthy = GatewayServer(config("gw-healthy"))
        deadline = Deadline(bound_s)
        while health(healthy.url)["ready"] != [0, 1]:
            assert not deadline.passed(), f"the healthy gateway holds {health(healthy.url)['ready']} of [0, 1]"
            deadline.sleep(0.1)
        view = health(broken.url)
        assert not view["ok"] and view["ready"] == [] and "injected" in view["stopped"]
        # Until the failed gateway's view of the group names the new owner, it answers 503 owner_moving
        # (the partition is changing hands), then forwards.
        deadline = Deadline(bound_s)
        while True:
            answer = httpx.post(f"{broken.url}/r/sent-on/v1/chat/completions", json=body, timeout=60)
            if answer.status_code != 503:
                break
            assert answer.json()["error"]["type"] == "owner_moving" and answer.headers["retry-after"]
            assert not deadline.passed(), "the failed gateway never learned who owns its partitions now"
            deadline.sleep(0.2)
        assert answer.status_code == 200, answer.text  # forwarded to the owner
        assert answer.json()["choices"][0]["message"]["content"] is not None
    finally:
        for server in (healthy, broken):
            if server is not None:
                server.close()


def test_a_gateway_member_names_where_it_serves_in_its_client_id() -> None:
    url = "http://10.0.0.5:8100"
    assert member_identity(client_id("gateway", "gw-a", url)) == ("gateway", "gw-a", url)
    assert member_identity(client_id("worker", "host-1")) == ("worker", "host-1", None)
    assert member_identity(client_id("run", "w0")) == ("run", "w0", None)


def test_group_ownership_refuses_a_file_journal(tmp_path: Path) -> None:
    config = GatewayConfig(upstream="http://127.0.0.1:9", journal=str(tmp_path / "journal"), ownership="group")
    with pytest.raises(ConfigurationError, match="--ownership single"):
        build_gateway(config)
