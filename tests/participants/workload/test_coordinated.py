"""Coordinated checkpoints: a consistent cut for resource state that lives outside the journal,
here in a real resource server process (fault injection on) reached over HTTP."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout_journal.journal.events import ResourceMutation
from rollout_journal.journal.open import open_journal
from rollout_journal.participants.workload.config import WorkloadConfig
from rollout_journal.participants.workload.run import build_backend, run_workload
from rollout_journal.participants.workload.runner import Runner, workload_specs
from tests.support.recovery_support import assert_identical, reference_outcomes
from tests.support.resource_servers import ServerProcess, token_in_environment


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """One counter server for the module, started with --fault-injection."""
    process = ServerProcess("counter", faults=True).start()
    try:
        with token_in_environment():
            yield process
    finally:
        process.stop()


def coordinated(tmp_path: Path, server: ServerProcess | None = None, **overrides) -> WorkloadConfig:
    base = dict(
        name="co",
        groups=2,
        siblings=2,
        max_turns=5,
        environment="counter",
        seed=5,
        allow_early_submit=False,
        journal=str(tmp_path / "journal"),
        checkpoint_mode="coordinated",
        coordinated_every_s=3600.0,
        turn_delay_ms=15.0,
    )
    if server is not None:
        base["resource_servers"] = {"counter": server.url}
    return WorkloadConfig(**(base | overrides))


def runner_for(config: WorkloadConfig, journal, **kwargs) -> Runner:
    backend = build_backend(config)
    return Runner(config, journal, backend, backend.tokenizer, **kwargs)


def inject(server: ServerProcess, count: int, status: int = 500, body: str = "injected failure") -> None:
    answer = server.post("/v1/faults", {"route": "prepare", "count": count, "status": status, "body": body})
    assert answer.status_code == 200, answer.text


async def until(predicate, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def test_an_http_500_during_prepare_is_retried_and_the_checkpoint_restores(tmp_path: Path, server) -> None:
    config = coordinated(tmp_path, server, name="co500")
    reference = reference_outcomes(config)
    specs = workload_specs(config)

    async def scenario() -> None:
        with open_journal(config.journal) as journal:
            runner = runner_for(config, journal)
            run = asyncio.create_task(runner.run(resume=False, stop_after={s.rollout_id: 3 for s in specs}))
            await until(lambda: sum(l.state.next_turn for l in runner.live.values()) >= 4)
            inject(server, 2, status=500)
            called = asyncio.get_running_loop().time()
            report = await runner.checkpointer.checkpoint(runner.live.values())
            returned = asyncio.get_running_loop().time()
            await run
        assert report.retries == 2
        assert set(report.included) == {s.rollout_id for s in specs} and not report.skipped
        assert 0 < report.pause_ms / 1000 <= returned - called
        stats = server.stats()
        assert stats["resumes"] >= len(specs)  # every prepared session was let go after the commit

    asyncio.run(scenario())
    resumed = run_workload(config, resume=True)  # a crash after the checkpoint: restore from it
    assert_identical(resumed, reference)


def test_a_rollout_not_at_a_turn_boundary_in_time_is_skipped_not_fatal(tmp_path: Path) -> None:
    config = coordinated(tmp_path, turn_delay_ms=400.0, prepare_timeout_s=0.05)

    async def scenario() -> None:
        with open_journal(config.journal) as journal:
            runner = runner_for(config, journal)
            run = asyncio.create_task(runner.run(resume=False))
            await until(lambda: runner.live and all(not l.at_boundary.is_set() for l in runner.live.values()))
            turns = {rid: live.state.next_turn for rid, live in runner.live.items()}
            report = await runner.checkpointer.checkpoint(runner.live.values())
            assert set(report.skipped) == set(runner.live) and not report.included
            assert all("turn boundary" in why for why in report.skipped.values())
            # bounded by the prepare timeout, not by the slow turns: it ended before any of them did
            assert {rid: live.state.next_turn for rid, live in runner.live.items()} == turns
            await run

    asyncio.run(scenario())


def test_a_checkpoint_cancelled_at_any_step_ends_cancelled(tmp_path: Path) -> None:
    """A run's end cancels its periodic checkpoints and waits for them. Python 3.11's
    ``asyncio.wait_for`` returns the awaited result when it is cancelled just as that completed;
    a checkpoint that swallowed its cancellation so went on to the next one, and the run's end
    waited for it for ever (the services bench hung so). Cancelled after any number of loop steps,
    a checkpoint ends cancelled or had already returned."""
    config = coordinated(tmp_path, name="cocancel")

    async def scenario() -> None:
        with open_journal(config.journal) as journal:
            checkpointer = runner_for(config, journal).checkpointer
            assert checkpointer is not None
            cancelled_while_running = 0
            gate = checkpointer.model.gate
            for steps in range(12):
                call = await gate.admit()  # a model call in flight: the checkpoint waits for it
                task = asyncio.create_task(checkpointer.checkpoint([]))
                await asyncio.sleep(0)
                gate.release(call)  # the call ends; the run ends a few steps later
                for _ in range(steps):
                    await asyncio.sleep(0)
                if not task.cancel():
                    continue  # it had returned already
                cancelled_while_running += 1
                done, _ = await asyncio.wait([task], timeout=30)
                assert done, f"cancelled after {steps} loop steps, the checkpoint did not end"
                assert task.cancelled(), f"cancelled after {steps} loop steps, it returned {task.result()}"
            assert cancelled_while_running, "no step cancelled the checkpoint while it ran"

    asyncio.run(scenario())


def test_an_export_given_up_on_does_not_hold_up_the_end_of_the_run(tmp_path: Path) -> None:
    """A local export stuck past the prepare timeout is skipped and left running. It ran on
    asyncio's default executor, whose threads ``asyncio.run`` waits for at its end with no
    bound: the run that gave up on the export waited for it anyway. Exports now run on daemon
    threads of their own, so the run ends while the stuck export still waits."""
    config = coordinated(tmp_path, name="costuck", prepare_timeout_s=0.2)
    stuck, release, export_ended = threading.Event(), threading.Event(), threading.Event()

    def stuck_export() -> bytes:
        stuck.set()
        release.wait(60)
        export_ended.set()
        return b""

    async def scenario() -> None:
        with open_journal(config.journal) as journal:
            runner = runner_for(config, journal)
            run = asyncio.create_task(runner.run(resume=False))
            await until(lambda: bool(runner.live) and all(l.state.next_turn >= 1 for l in runner.live.values()))
            live = next(iter(runner.live.values()))
            resource = next(r for r in live.env.resources.values() if r.supports_export)
            original, resource.export_state = resource.export_state, stuck_export  # type: ignore[method-assign]
            report = await runner.checkpointer.checkpoint(runner.live.values())
            assert live.spec.rollout_id in report.skipped, report
            # The next round skips it at once: a stuck export holds one thread, not one more a round.
            again = await runner.checkpointer.checkpoint(runner.live.values())
            assert "still runs" in again.skipped[live.spec.rollout_id], again
            assert [t.name for t in threading.enumerate()].count(f"export {resource.resource_id}") == 1
            resource.export_state = original  # type: ignore[method-assign]  # only that export is stuck
            await run

    try:
        asyncio.run(scenario())
        assert stuck.is_set()
        assert not export_ended.is_set(), "the run's end waited for the export it had given up on"
    finally:
        release.set()


def _seed_with_an_early_finisher() -> int:
    for seed in range(60):
        config = WorkloadConfig(
            name="ack", groups=1, siblings=3, max_turns=6, environment="counter", seed=seed, journaling=False
        )
        turns = [o["turns"] for o in run_workload(config, resume=False).outcomes().values()]
        if min(turns) < max(turns):
            return seed
    raise AssertionError("no seed gives a sibling that finishes early")


def test_a_finished_sibling_waiting_for_its_acknowledgement_does_not_deadlock_prepare(tmp_path: Path) -> None:
    seed = _seed_with_an_early_finisher()
    config = coordinated(
        tmp_path, name="ack", groups=1, siblings=3, max_turns=6, seed=seed, allow_early_submit=True, turn_delay_ms=60.0
    )

    async def scenario() -> None:
        with open_journal(config.journal) as journal:
            runner = runner_for(config, journal, hold_until_acknowledged=True)
            run = asyncio.create_task(runner.run(resume=False))
            await until(
                lambda: (
                    any(l.state.finished for l in runner.live.values())
                    and not all(l.state.finished for l in runner.live.values())
                )
            )
            finished = [rid for rid, l in runner.live.items() if l.state.finished]
            report = await asyncio.wait_for(runner.checkpointer.checkpoint(runner.live.values()), 10)
            assert set(finished) <= set(report.included)
            await until(lambda: all(l.state.finished for l in runner.live.values()))
            assert not run.done(), "the group is held until the trainer acknowledges it"
            await runner.acknowledge(list(runner.live))
            await asyncio.wait_for(run, 10)
            await runner.checkpointer.checkpoint(runner.live.values())  # must not bring them back
            # acknowledged rollouts leave the snapshot stream; the workload's registration stays
            index = journal.snapshots()
            assert set(index.snapshots) == set()
            assert set(index.workloads) == {"ack"}

    asyncio.run(scenario())
    again = run_workload(config, resume=True)  # a resume after the trainer took everything
    assert all(row.acknowledged and row.turns_run_here == 0 for row in again.rollouts.values())


# The checkpoints below start after 2 of 16 turns: every rollout still has turns to run, so the
# run cannot end (and close its clients) while the checkpoint holds the turn boundary.
def test_every_parked_rollout_is_prepared_at_once(tmp_path: Path, server) -> None:
    config = coordinated(tmp_path, server, name="coall")
    specs = workload_specs(config)

    async def scenario() -> None:
        with open_journal(config.journal) as journal:
            runner = runner_for(config, journal)
            run = asyncio.create_task(runner.run(resume=False, stop_after={s.rollout_id: 4 for s in specs}))
            await until(lambda: sum(l.state.next_turn for l in runner.live.values()) >= 2)
            # Each prepare waits until every rollout's prepare has begun, then goes over HTTP: only
            # prepares that run at once get through (bounded, so a regression fails, not hangs).
            barrier = asyncio.Barrier(len(specs))
            for live in runner.live.values():

                async def at_once(epoch: int, *args, _prepare=live.env.aprepare_checkpoint):
                    await asyncio.wait_for(barrier.wait(), 0.9)
                    return await _prepare(epoch, *args)

                live.env.aprepare_checkpoint = at_once
            report = await runner.checkpointer.checkpoint(runner.live.values())
            await run
        assert set(report.included) == {s.rollout_id for s in specs} and not report.skipped

    asyncio.run(scenario())


def test_a_server_that_keeps_failing_holds_the_pause_for_one_prepare_timeout_not_one_per_rollout(
    tmp_path: Path, server
) -> None:
    # Long enough that some rollout reaches a turn boundary within it on a loaded machine (it
    # must, for the parked case below); the claim is one timeout in all, whatever its length.
    config = coordinated(tmp_path, server, name="cofail", prepare_timeout_s=2.0)
    specs = workload_specs(config)

    async def scenario() -> None:
        with open_journal(config.journal) as journal:
            runner = runner_for(config, journal)
            runner.checkpointer.max_retries = 10_000  # it never gives up: only the prepare timeout ends it
            run = asyncio.create_task(runner.run(resume=False, stop_after={s.rollout_id: 4 for s in specs}))
            await until(lambda: sum(l.state.next_turn for l in runner.live.values()) >= 2)
            inject(server, 10_000, status=500)
            try:
                report = await runner.checkpointer.checkpoint(runner.live.values())
            finally:
                server.post("/v1/faults", {"route": "prepare", "clear": True})
            await run
        assert set(report.skipped) == {s.rollout_id for s in specs} and not report.included
        # A rollout whose model call outlasted the prepare timeout was not parked (its call was
        # aborted); every parked one waited for its exports one prepare timeout, not five tries.
        export_late = [rid for rid, why in report.skipped.items() if why == "exports not done within 2.0s"]
        assert export_late, report.skipped
        assert all(
            why in ("exports not done within 2.0s", "not at a turn boundary within 2.0s")
            for why in report.skipped.values()
        ), report.skipped

    asyncio.run(scenario())


def test_an_error_page_served_with_http_200_is_never_snapshotted(tmp_path: Path, server) -> None:
    config = coordinated(tmp_path, server, name="co200")
    reference = reference_outcomes(config)
    specs = workload_specs(config)

    async def scenario() -> None:
        with open_journal(config.journal) as journal:
            runner = runner_for(config, journal)
            run = asyncio.create_task(runner.run(resume=False, stop_after={s.rollout_id: 3 for s in specs}))
            await until(lambda: sum(l.state.next_turn for l in runner.live.values()) >= 4)
            inject(server, 1, status=200, body="<html><body>502 Bad Gateway</body></html>")
            report = await runner.checkpointer.checkpoint(runner.live.values())
            await run
        ((skipped, why),) = report.skipped.items()
        assert "<html>" in why and "export" in why
        assert set(report.included) == {s.rollout_id for s in specs} - {skipped}

    asyncio.run(scenario())
    resumed = run_workload(config, resume=True)  # a crash after that checkpoint
    assert not resumed.set_aside
    assert_identical(resumed, reference)


async def _checkpoint_then_stop(config: WorkloadConfig, journal, turns: int) -> Runner:
    """Run to ``turns`` committed turns per rollout with a good coordinated checkpoint on the way."""
    specs = workload_specs(config)
    runner = runner_for(config, journal)
    run = asyncio.create_task(runner.run(resume=False, stop_after={s.rollout_id: turns for s in specs}))
    await until(lambda: sum(l.state.next_turn for l in runner.live.values()) >= 3)
    report = await runner.checkpointer.checkpoint(runner.live.values())
    assert not report.skipped
    await run
    return runner


def _snapshot_with_unusable_exports(runner: Runner, journal, rollout_id: str) -> None:
    """What an older version wrote when the server answered an error page with HTTP 200."""
    live = runner.live[rollout_id]
    exports = {
        rid: b"<html>503 Service Unavailable</html>" for rid, r in live.env.resources.items() if r.supports_export
    }
    journal.append([], runner.agent.snapshot_draft(live, exports)).result()


def test_a_snapshot_that_does_not_import_falls_back_to_the_previous_one(tmp_path: Path) -> None:
    config = coordinated(tmp_path)
    reference = reference_outcomes(config)
    victim = workload_specs(config)[1].rollout_id

    async def scenario() -> None:
        with open_journal(config.journal) as journal:
            runner = await _checkpoint_then_stop(config, journal, turns=3)
            _snapshot_with_unusable_exports(runner, journal, victim)

    asyncio.run(scenario())
    resumed = run_workload(config, resume=True)

    assert not resumed.set_aside
    assert resumed.rollouts[victim].turns_committed_before == 3  # a longer replay, nothing redone
    assert any(victim in note and "does not restore its resources" in note for note in resumed.read_errors)
    assert_identical(resumed, reference)


def test_when_no_snapshot_and_no_replay_restores_a_rollout_it_alone_is_set_aside(tmp_path: Path) -> None:
    config = coordinated(tmp_path)
    reference = reference_outcomes(config)
    victim = workload_specs(config)[1].rollout_id

    async def scenario() -> None:
        with open_journal(config.journal) as journal:
            runner = await _checkpoint_then_stop(config, journal, turns=3)
            _snapshot_with_unusable_exports(runner, journal, victim)
            state = runner.live[victim].state  # a journaled mutation that no replay reproduces
            resource_id, resource = next(iter(runner.live[victim].env.resources.items()))
            journal.append(
                [
                    ResourceMutation(
                        state.header("vandal"),
                        resource_id,
                        resource.kind,
                        "set",
                        '{"name":"a","value":1}',
                        f"{victim}/forged",
                        resource.revision,
                        resource.revision + 1,
                        "{}",
                        "0" * 64,
                        "0" * 64,
                    )
                ]
            ).result()

    asyncio.run(scenario())
    resumed = run_workload(config, resume=True)

    assert set(resumed.set_aside) == {victim}
    assert_identical(resumed, {rid: o for rid, o in reference.items() if rid != victim})


def test_a_checkpoint_cancelled_mid_prepare_leaves_no_prepare_running(tmp_path: Path) -> None:
    """A run that ends cancels its periodic checkpoint; its prepares must end with it, or they talk
    to resource servers through clients the run is closing (seen as ReadErrors and retries)."""
    config = coordinated(tmp_path, name="cocancel")
    specs = workload_specs(config)

    async def scenario() -> None:
        with open_journal(config.journal) as journal:
            runner = runner_for(config, journal)
            run = asyncio.create_task(runner.run(resume=False, stop_after={s.rollout_id: 4 for s in specs}))
            await until(lambda: sum(l.state.next_turn for l in runner.live.values()) >= 2)
            started, cancelled = asyncio.Event(), []
            for live in runner.live.values():

                async def hung(epoch: int, *args, _rid=live.spec.rollout_id):
                    started.set()
                    try:
                        await asyncio.sleep(60)
                    except asyncio.CancelledError:
                        cancelled.append(_rid)
                        raise

                live.env.aprepare_checkpoint = hung
            checkpoint = asyncio.create_task(runner.checkpointer.checkpoint(runner.live.values()))
            await started.wait()
            await asyncio.sleep(0.01)  # every prepare has begun
            checkpoint.cancel()
            with pytest.raises(asyncio.CancelledError):
                await checkpoint
            assert sorted(cancelled) == sorted(runner.live)  # each prepare ended with the checkpoint
            await run

    asyncio.run(scenario())
