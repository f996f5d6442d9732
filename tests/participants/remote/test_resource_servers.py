"""Resource servers as real subprocesses over real HTTP: the resource contract at the server itself
(epoch, compare-and-set, idempotency, token), and SIGKILLed servers during a run and during a
coordinated checkpoint: only the rollouts that depend on them notice."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rollout_journal.journal.open import open_journal
from rollout_journal.participants.environments import StepContext, make_environment
from rollout_journal.participants.remote.client import RemoteEnvironment, ResourceServiceClient
from rollout_journal.participants.remote.protocol import (
    ControlError,
    ResourceAuthError,
    ResourceSessionLostError,
    ServiceToken,
)
from rollout_journal.participants.resources import (
    IdempotencyKeyReuseError,
    MutationRequest,
    Recovery,
    RevisionConflictError,
    StaleEpochError,
)
from rollout_journal.participants.workload.config import WorkloadConfig
from rollout_journal.participants.workload.run import build_backend
from rollout_journal.participants.workload.runner import Runner, workload_specs
from tests.support.recovery_support import (
    assert_identical,
    assert_no_mutation_applied_twice,
    reference_outcomes,
)
from tests.support.resource_servers import (
    TOKEN,
    ServerProcess,
    resource_servers,
    token_in_environment,
)


@pytest.fixture(scope="module")
def counter_server() -> Iterator[ServerProcess]:
    server = ServerProcess("counter").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def client(counter_server: ServerProcess) -> Iterator[ResourceServiceClient]:
    client = ResourceServiceClient(counter_server.url, ServiceToken(TOKEN), wait_s=5.0)
    yield client
    client.close()


def remote_counter(client: ResourceServiceClient, rollout_id: str, seed: int = 4) -> RemoteEnvironment:
    return RemoteEnvironment(client, "counter", rollout_id, seed)


def ctx(rollout_id: str, turn: int, epoch: int = 1) -> StepContext:
    return StepContext(rollout_id, epoch, epoch, f"{rollout_id}/t{turn}")


# -- the contract at the server -------------------------------------------------------------------


def test_a_step_over_http_journals_what_the_same_step_in_process_does(client: ResourceServiceClient) -> None:
    remote, local = remote_counter(client, "same-1"), make_environment("counter", "same-1", 4)
    assert remote.task_prompt() == local.task_prompt() and remote.action_space() == local.action_space()
    assert remote.recovery is Recovery.EXPORTABLE
    for turn, action in enumerate(["counter.incr(name=a, by=5)", "counter.get(name=a)", "counter.decr(name=b, by=1)"]):
        assert remote.step(action, ctx("same-1", turn)) == local.step(action, ctx("same-1", turn))
    assert remote.revisions() == local.revisions() == {"same-1/counters": 2}
    assert remote.state_digests() == local.state_digests()
    assert remote.verify() == local.verify()
    remote.close()


def test_a_mutation_carries_epoch_revision_and_key_and_the_server_checks_all_three(
    client: ResourceServiceClient,
) -> None:
    env = remote_counter(client, "mut-1")
    store = env.resources["mut-1/counters"]
    record = store.mutate(MutationRequest("mut-1", 1, 1, "mut-1/k0", 0), "incr", {"name": "a", "by": 2})
    assert (record.prev_revision, record.revision, record.epoch) == (0, 1, 1) and store.revision == 1

    with pytest.raises(RevisionConflictError, match="expected revision 0 but the resource is at revision 1"):
        store.mutate(MutationRequest("mut-1", 1, 1, "mut-1/k1", 0), "incr", {"name": "a"})
    again = store.mutate(MutationRequest("mut-1", 1, 1, "mut-1/k0", 0), "incr", {"name": "a", "by": 2})
    assert again == record and store.revision == 1  # the stored result, not a second apply
    with pytest.raises(IdempotencyKeyReuseError):
        store.mutate(MutationRequest("mut-1", 1, 1, "mut-1/k0", 1), "decr", {"name": "a"})

    env.fence("mut-1", 2)  # attempt 2 took over
    with pytest.raises(StaleEpochError, match="fenced at epoch 2"):
        store.mutate(MutationRequest("mut-1", 1, 1, "mut-1/k2", 1), "incr", {"name": "a"})
    with pytest.raises(StaleEpochError):
        env.step("counter.incr(name=a, by=1)", ctx("mut-1", 5, epoch=1))  # a zombie's whole step, too
    assert (
        store.revision == 1
        and store.query("get", {"name": "a"})["value"] == make_environment("counter", "mut-1", 4).start["a"] + 2
    )
    env.close()


def test_a_repeated_step_key_is_answered_from_the_store_and_a_wrong_revision_refused(
    client: ResourceServiceClient, counter_server: ServerProcess
) -> None:
    env = remote_counter(client, "rep-1")
    before = counter_server.stats()
    first = env.step("counter.incr(name=c, by=5)", ctx("rep-1", 0))
    retried = counter_server.post(
        "/v1/rollouts/rep-1/step",
        {  # the retry of a request whose answer was lost
            "action": "counter.incr(name=c, by=5)",
            "attempt": 1,
            "epoch": 1,
            "key": "rep-1/t0",
            "expected_revisions": {"rep-1/counters": 0},
        },
    )
    assert retried.status_code == 200 and retried.json()["records"] == [r.to_dict() for r in first[1]]
    after = counter_server.stats()
    assert after["steps"] - before["steps"] == 1 and after["step_replays"] - before.get("step_replays", 0) == 1
    assert env.revisions() == {"rep-1/counters": 1}

    stale = counter_server.post(
        "/v1/rollouts/rep-1/step",
        {
            "action": "counter.incr(name=c, by=1)",
            "attempt": 1,
            "epoch": 1,
            "key": "rep-1/t1",
            "expected_revisions": {"rep-1/counters": 0},
        },
    )
    assert stale.status_code == 409 and stale.json()["error"] == "revision_conflict"
    reused = counter_server.post(
        "/v1/rollouts/rep-1/step",
        {
            "action": "counter.decr(name=c, by=1)",
            "attempt": 1,
            "epoch": 1,
            "key": "rep-1/t0",
            "expected_revisions": {"rep-1/counters": 1},
        },
    )
    assert reused.status_code == 409 and reused.json()["error"] == "key_reuse"
    start = make_environment("counter", "rep-1", 4).start["c"]
    assert env.resources["rep-1/counters"].query("get", {"name": "c"})["value"] == start + 5  # applied once
    env.close()


def test_without_the_token_or_with_a_wrong_one_every_call_is_401(counter_server: ServerProcess) -> None:
    body = {"task": {"seed": 1}}
    assert counter_server.post("/v1/rollouts/auth-1/open", body, token=None).status_code == 401
    assert counter_server.post("/v1/rollouts/auth-1/open", body, token="wrong").status_code == 401
    for route in ("step", "prepare", "restore", "resume", "abort", "export", "fence"):
        assert counter_server.post(f"/v1/rollouts/auth-1/{route}", {}, token=None).status_code == 401, route
    assert httpx.delete(f"{counter_server.url}/v1/rollouts/auth-1").status_code == 401
    assert httpx.get(f"{counter_server.url}/v1/stats").status_code == 401
    assert httpx.get(f"{counter_server.url}/health").json()["environment"] == "counter"  # liveness needs none
    wrong = ResourceServiceClient(counter_server.url, ServiceToken("not-the-token"))
    with pytest.raises(ResourceAuthError, match="refused the token"):
        RemoteEnvironment(wrong, "counter", "auth-1", 1)
    wrong.close()


def test_the_token_never_shows_in_reprs_logs_or_journals(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    token = ServiceToken(TOKEN)
    assert TOKEN not in repr(token) and TOKEN not in str(token)
    config = WorkloadConfig(
        name="tok", groups=1, siblings=2, max_turns=3, environment="counter", journal=str(tmp_path / "journal")
    )
    with resource_servers("counter") as servers, token_in_environment():
        config = config.model_copy(update={"resource_servers": {"counter": servers["counter"].url}})
        runner = Runner(config, None, *_backend(config))
        assert TOKEN not in repr(runner.environments.clients["counter"]) and TOKEN not in repr(config)
        from rollout_journal.participants.workload.run import run_workload

        run_workload(config, resume=False)
        servers["counter"].stop()
        server_output = servers["counter"].output()
    assert TOKEN not in server_output
    assert TOKEN not in caplog.text
    for path in (tmp_path / "journal").rglob("*"):
        if path.is_file():
            assert TOKEN.encode() not in path.read_bytes(), path


def test_restore_reconciles_by_revision_or_imports_the_journals_state(client: ResourceServiceClient) -> None:
    env = remote_counter(client, "rec-1")
    records = []
    for turn, action in enumerate(["counter.incr(name=a, by=5)", "counter.incr(name=b, by=1)"]):
        records += env.step(action, ctx("rec-1", turn))[1]
    exported = env.export_now(["rec-1/counters"])["rec-1/counters"]
    env.step("counter.set(name=a, value=0)", ctx("rec-1", 2))  # applied here, never journaled (the worker died)

    attached = RemoteEnvironment(client, "counter", "rec-1", 4, fresh=False)
    attached.restore({}, records, fence_epoch=2)  # the journal: the first two mutations
    assert attached.last_restore == "imported" and attached.revisions() == {"rec-1/counters": 2}
    attached.restore({"rec-1/counters": exported}, [], fence_epoch=2)  # the same point, as a snapshot
    assert attached.last_restore == "reconciled"
    with pytest.raises(StaleEpochError):  # a zombie's restore cannot roll the resource back
        attached.restore({}, records[:1], fence_epoch=1)
    attached.close()
    with pytest.raises(ResourceSessionLostError):
        env.step("counter.list()", ctx("rec-1", 3, epoch=2))  # closed: the server holds no session


def _backend(config: WorkloadConfig):
    backend = build_backend(config)
    return backend, backend.tokenizer


def test_a_resource_server_on_a_thread_serves_the_same_contract_and_closes_its_sessions() -> None:
    """``ResourceServer`` (tests, notebooks) runs the app ``serve-resources`` runs: a step over
    HTTP is the step in process, and closing it closes every session it holds."""
    from rollout_journal.participants.remote.server import ResourceServer

    with ResourceServer("counter", token=ServiceToken(TOKEN)) as server:
        client = ResourceServiceClient(server.url, ServiceToken(TOKEN), wait_s=5.0)
        remote, local = remote_counter(client, "thread-1"), make_environment("counter", "thread-1", 4)
        action = "counter.incr(name=a, by=3)"
        assert remote.step(action, ctx("thread-1", 0)) == local.step(action, ctx("thread-1", 0))
        assert server.host is not None and list(server.host.sessions) == ["thread-1"]
        client.close()
    assert server.host.sessions == {}
    with pytest.raises(ControlError, match="resource server for 'nope' did not start"):
        ResourceServer("nope", token=ServiceToken(TOKEN))


# -- SIGKILLed servers ------------------------------------------------------------------------------


def mixed(tmp_path: Path, environment: str, journal: str | None = None, **overrides) -> WorkloadConfig:
    base = dict(
        name="svc",
        groups=2,
        siblings=2,
        max_turns=8,
        environment=environment,
        seed=9,
        allow_early_submit=False,
        journal=journal or str(tmp_path / "journal"),
        snapshot_every_turns=3,
        turn_delay_ms=15.0,
        resource_server_wait_s=60.0,
    )
    return WorkloadConfig(**(base | overrides))


def in_background(fn) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


async def until(predicate, timeout_s: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def _run_with_kill(
    config: WorkloadConfig, server: ServerProcess, *, kill_at_turns: int, during_checkpoint: bool = False
) -> tuple[Runner, object]:
    """Run ``config`` here; SIGKILL ``server`` once ``kill_at_turns`` turns are durable (or, with
    ``during_checkpoint``, inside a coordinated checkpoint taken then), and restart it."""

    async def scenario():
        with open_journal(config.journal) as journal:
            runner = Runner(config, journal, *_backend(config))
            run = asyncio.create_task(runner.run(resume=False))
            await until(lambda: sum(l.state.next_turn for l in runner.live.values()) >= kill_at_turns)
            if not during_checkpoint:
                server.kill()
                restarting = in_background(server.restart)
                report = await run
                restarting.join()
                return runner, report
            victims = [l for l in runner.live.values() if isinstance(l.env, RemoteEnvironment)]
            prepare = victims[0].env.aprepare_checkpoint

            async def killed_first(epoch: int, *args):  # the kill lands after the agents are parked
                if not server.kills:
                    server.kill()
                return await prepare(epoch, *args)

            victims[0].env.aprepare_checkpoint = killed_first  # type: ignore[method-assign]
            checkpoint = await runner.checkpointer.checkpoint(runner.live.values())
            restarting = in_background(server.restart)
            report = await run
            restarting.join()
            return runner, (report, checkpoint)

    return asyncio.run(scenario())


@pytest.mark.slow
def test_a_sigkilled_exportable_server_its_rollouts_restore_and_replay_the_others_never_notice(
    tmp_path: Path, journal_location: str
) -> None:
    config = mixed(tmp_path, "counter,workplace", journal_location)
    reference = reference_outcomes(config)
    with resource_servers("counter") as servers, token_in_environment():
        config = config.model_copy(update={"resource_servers": {"counter": servers["counter"].url}})
        runner, report = _run_with_kill(config, servers["counter"], kill_at_turns=10)
        imported = servers["counter"].stats().get("imported", 0)
    on_server = {s.rollout_id for s in workload_specs(config) if s.environment == "counter"}
    lost = {rid for rid in on_server if runner.live[rid].resource_restores}
    assert lost, "no rollout was running on the killed server"
    assert imported == len(lost)  # each from its last snapshot, with the mutations since re-applied
    for rid, live in runner.live.items():
        assert live.state.attempt == 1 and live.state.restarts == 0, rid  # nobody started over
        if rid not in on_server:
            assert live.resource_restores == 0, rid
    assert not report.failed and not report.set_aside
    assert_identical(report, reference)
    assert_no_mutation_applied_twice(config)


@pytest.mark.slow
def test_a_server_sigkilled_during_a_coordinated_checkpoint(tmp_path: Path, journal_location: str) -> None:
    config = mixed(
        tmp_path,
        "counter,workplace",
        journal_location,
        checkpoint_mode="coordinated",
        coordinated_every_s=3600.0,
        prepare_timeout_s=1.0,
    )
    reference = reference_outcomes(config)
    with resource_servers("counter") as servers, token_in_environment():
        config = config.model_copy(update={"resource_servers": {"counter": servers["counter"].url}})
        runner, (report, checkpoint) = _run_with_kill(
            config, servers["counter"], kill_at_turns=6, during_checkpoint=True
        )
    on_server = {s.rollout_id for s in workload_specs(config) if s.environment == "counter"}
    others = set(runner.live) - on_server
    assert set(checkpoint.skipped) == on_server and set(checkpoint.included) == others  # the others were saved
    assert all(runner.live[rid].resource_restores == 1 for rid in on_server)
    assert all(runner.live[rid].resource_restores == 0 and runner.live[rid].state.attempt == 1 for rid in others)
    assert not report.failed
    assert_identical(report, reference)
    assert_no_mutation_applied_twice(config)


@pytest.mark.slow
def test_a_sigkilled_restart_only_server_restarts_only_its_dependents(tmp_path: Path) -> None:
    config = mixed(tmp_path, "sandbox,counter", max_turns=6)
    reference = reference_outcomes(config)
    with resource_servers("sandbox") as servers, token_in_environment():
        config = config.model_copy(update={"resource_servers": {"sandbox": servers["sandbox"].url}})
        runner, report = _run_with_kill(config, servers["sandbox"], kill_at_turns=8)
    on_server = {s.rollout_id for s in workload_specs(config) if s.environment == "sandbox"}
    restarted = {rid for rid, live in runner.live.items() if live.state.restarts}
    assert restarted and restarted <= on_server
    for rid in restarted:
        assert runner.live[rid].state.attempt == 2  # a new attempt from turn 0, the old one fenced
    for rid in set(runner.live) - on_server:
        assert runner.live[rid].state.attempt == 1 and runner.live[rid].resource_restores == 0
    assert not report.failed
    assert_identical(report, reference)  # from turn 0 with the same seeds: the same rollout
    assert_no_mutation_applied_twice(config)
