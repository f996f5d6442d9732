"""Coordinated checkpoints: a consistent cut for resource state that lives outside the journal."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from journal.events import ResourceMutation
from journal.open import open_journal
from participants.config import WorkloadConfig
from participants.resource_server import HttpStateExporter, ResourceServer
from participants.resources import Resource
from participants.runner import Runner, workload_specs
from participants.workload import build_backend, run_workload
from tests.recovery_support import assert_identical, reference_outcomes


def coordinated(tmp_path: Path, **overrides) -> WorkloadConfig:
    base = dict(name="co", groups=2, siblings=2, max_turns=5, environment="counter", seed=5,
                allow_early_submit=False, journal=str(tmp_path / "journal"), checkpoint_mode="coordinated",
                coordinated_every_s=3600.0, turn_delay_ms=15.0)
    return WorkloadConfig(**(base | overrides))


def runner_with_server(config: WorkloadConfig, journal, **kwargs) -> tuple[Runner, ResourceServer]:
    holder: dict[str, Runner] = {}

    def lookup(resource_id: str):
        live = holder["runner"].live.get(resource_id.split("/", 1)[0])
        return live.env.resources.get(resource_id) if live else None

    server = ResourceServer(lookup=lookup)
    backend = build_backend(config)
    runner = Runner(config, journal, backend, backend.tokenizer, exporter=HttpStateExporter(server.url), **kwargs)
    holder["runner"] = runner
    return runner, server


class ExportsTimed(HttpStateExporter):
    """Records when each export try began and ended: exports run while the agents are parked."""

    def __init__(self, base_url: str) -> None:
        super().__init__(base_url)
        self.spans: list[tuple[float, float]] = []

    def export(self, resource: Resource) -> bytes:
        started = time.perf_counter()
        try:
            return super().export(resource)
        finally:
            self.spans.append((started, time.perf_counter()))


async def until(predicate, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def test_an_http_500_during_export_is_retried_and_the_checkpoint_restores(tmp_path: Path) -> None:
    config = coordinated(tmp_path)
    reference = reference_outcomes(config)
    specs = workload_specs(config)

    async def scenario() -> None:
        with open_journal(config.journal) as journal:
            runner, server = runner_with_server(config, journal)
            exporter = runner.checkpointer.exporter = ExportsTimed(server.url)
            with server:
                run = asyncio.create_task(runner.run(resume=False, stop_after={s.rollout_id: 3 for s in specs}))
                await until(lambda: sum(l.state.next_turn for l in runner.live.values()) >= 4)
                server.fail_next(2, status=500)
                called = time.perf_counter()
                report = await runner.checkpointer.checkpoint(runner.live.values())
                returned = time.perf_counter()
                await run
        assert report.retries == 2
        assert set(report.included) == {s.rollout_id for s in specs} and not report.skipped
        # The agents stay parked from before the first export try to after the last (the two
        # retries' backoff included): the pause holds that whole span, and no more than the call.
        parked_span = max(end for _, end in exporter.spans) - min(start for start, _ in exporter.spans)
        assert len(exporter.spans) == len(specs) + 2
        assert parked_span <= report.pause_ms / 1000 <= returned - called

    asyncio.run(scenario())
    resumed = run_workload(config, resume=True)  # a crash after the checkpoint: restore from it
    assert_identical(resumed, reference)


def test_a_rollout_not_at_a_turn_boundary_in_time_is_skipped_not_fatal(tmp_path: Path) -> None:
    config = coordinated(tmp_path, turn_delay_ms=400.0, prepare_timeout_s=0.05)

    async def scenario() -> None:
        with open_journal(config.journal) as journal:
            runner, server = runner_with_server(config, journal)
            with server:
                run = asyncio.create_task(runner.run(resume=False))
                await until(lambda: runner.live and all(not l.at_boundary.is_set() for l in runner.live.values()))
                report = await runner.checkpointer.checkpoint(runner.live.values())
                assert set(report.skipped) == set(runner.live) and not report.included
                assert all("turn boundary" in why for why in report.skipped.values())
                assert report.pause_ms < 1000  # bounded by the prepare timeout, not by the slow turns
                await run

    asyncio.run(scenario())


def _seed_with_an_early_finisher() -> int:
    for seed in range(60):
        config = WorkloadConfig(name="ack", groups=1, siblings=3, max_turns=6, environment="counter", seed=seed,
                                journaling=False)
        turns = [o["turns"] for o in run_workload(config, resume=False).outcomes().values()]
        if min(turns) < max(turns):
            return seed
    raise AssertionError("no seed gives a sibling that finishes early")


def test_a_finished_sibling_waiting_for_its_acknowledgement_does_not_deadlock_prepare(tmp_path: Path) -> None:
    seed = _seed_with_an_early_finisher()
    config = coordinated(tmp_path, name="ack", groups=1, siblings=3, max_turns=6, seed=seed,
                         allow_early_submit=True, turn_delay_ms=60.0)

    async def scenario() -> None:
        with open_journal(config.journal) as journal:
            runner, server = runner_with_server(config, journal, hold_until_acknowledged=True)
            with server:
                run = asyncio.create_task(runner.run(resume=False))
                await until(lambda: any(l.state.finished for l in runner.live.values())
                            and not all(l.state.finished for l in runner.live.values()))
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


class Rendezvous:
    """Each export waits until every rollout's export has begun, then exports over HTTP: only
    exports that run at once get through (the wait is bounded so a regression fails, not hangs)."""

    def __init__(self, inner: HttpStateExporter, parties: int) -> None:
        self.inner = inner
        self.barrier = threading.Barrier(parties, timeout=30)

    def export(self, resource):
        self.barrier.wait()
        return self.inner.export(resource)


def test_the_exports_of_every_parked_rollout_run_at_once(tmp_path: Path) -> None:
    config = coordinated(tmp_path)
    specs = workload_specs(config)

    async def scenario() -> None:
        with open_journal(config.journal) as journal:
            runner, server = runner_with_server(config, journal)
            runner.checkpointer.exporter = Rendezvous(HttpStateExporter(server.url), parties=len(specs))
            with server:
                run = asyncio.create_task(runner.run(resume=False, stop_after={s.rollout_id: 2 for s in specs}))
                await until(lambda: sum(l.state.next_turn for l in runner.live.values()) >= 2)
                report = await runner.checkpointer.checkpoint(runner.live.values())
                await run
        assert set(report.included) == {s.rollout_id for s in specs} and not report.skipped

    asyncio.run(scenario())


def test_a_server_that_keeps_failing_holds_the_pause_for_one_prepare_timeout_not_one_per_rollout(
        tmp_path: Path) -> None:
    # Five tries with backoff take about 0.6 s per export; the whole export phase gets 0.2 s.
    config = coordinated(tmp_path, prepare_timeout_s=0.2)
    specs = workload_specs(config)

    async def scenario() -> None:
        with open_journal(config.journal) as journal:
            runner, server = runner_with_server(config, journal)
            with server:
                run = asyncio.create_task(runner.run(resume=False, stop_after={s.rollout_id: 2 for s in specs}))
                await until(lambda: sum(l.state.next_turn for l in runner.live.values()) >= 2)
                server.fail_next(10_000, status=500)
                report = await runner.checkpointer.checkpoint(runner.live.values())
                await run
        assert set(report.skipped) == {s.rollout_id for s in specs} and not report.included
        # A rollout whose model call outlasted the prepare timeout was not parked (its call was
        # aborted); every parked one waited for its exports one prepare timeout, not five tries.
        export_late = [rid for rid, why in report.skipped.items() if why == "exports not done within 0.2s"]
        assert export_late, report.skipped
        assert all(why in ("exports not done within 0.2s", "not at a turn boundary within 0.2s")
                   for why in report.skipped.values()), report.skipped

    asyncio.run(scenario())


def test_an_error_page_served_with_http_200_is_never_snapshotted(tmp_path: Path) -> None:
    config = coordinated(tmp_path)
    reference = reference_outcomes(config)
    specs = workload_specs(config)

    async def scenario() -> None:
        with open_journal(config.journal) as journal:
            runner, server = runner_with_server(config, journal)
            with server:
                run = asyncio.create_task(runner.run(resume=False, stop_after={s.rollout_id: 3 for s in specs}))
                await until(lambda: sum(l.state.next_turn for l in runner.live.values()) >= 4)
                server.fail_next(1, status=200, body=b"<html><body>502 Bad Gateway</body></html>")
                report = await runner.checkpointer.checkpoint(runner.live.values())
                await run
        (skipped, why), = report.skipped.items()
        assert "<html>" in why and "export" in why
        assert set(report.included) == {s.rollout_id for s in specs} - {skipped}

    asyncio.run(scenario())
    resumed = run_workload(config, resume=True)  # a crash after that checkpoint
    assert not resumed.set_aside
    assert_identical(resumed, reference)


async def _checkpoint_then_stop(config: WorkloadConfig, journal, turns: int) -> Runner:
    """Run to ``turns`` committed turns per rollout with a good coordinated checkpoint on the way."""
    specs = workload_specs(config)
    runner, server = runner_with_server(config, journal)
    with server:
        run = asyncio.create_task(runner.run(resume=False, stop_after={s.rollout_id: turns for s in specs}))
        await until(lambda: sum(l.state.next_turn for l in runner.live.values()) >= 3)
        report = await runner.checkpointer.checkpoint(runner.live.values())
        assert not report.skipped
        await run
    return runner


def _snapshot_with_unusable_exports(runner: Runner, journal, rollout_id: str) -> None:
    """What an older version wrote when the server answered an error page with HTTP 200."""
    live = runner.live[rollout_id]
    exports = {rid: b"<html>503 Service Unavailable</html>" for rid, r in live.env.resources.items()
               if r.supports_export}
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
            journal.append([ResourceMutation(state.header("vandal"), resource_id, resource.kind, "set",
                                             '{"name":"a","value":1}', f"{victim}/forged", resource.revision,
                                             resource.revision + 1, "{}", "0" * 64, "0" * 64)]).result()

    asyncio.run(scenario())
    resumed = run_workload(config, resume=True)

    assert set(resumed.set_aside) == {victim}
    assert_identical(resumed, {rid: o for rid, o in reference.items() if rid != victim})
