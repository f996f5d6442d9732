"""A resume's restore time is the whole restore: reading the journal, folding its events,
rebuilding environments and writing the fences, each reported (RunReport.restore).

Reading is the cheap part; a restart-only sandbox starts a new interpreter for every
resumed rollout. The figure once timed the read alone (a few ms while the sandboxes took
hundreds), so these tests time the real work from outside the runner and check that the
reported phases hold it.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

import participants.runner as runner_module
from participants.config import WorkloadConfig
from participants.environments import Environment
from participants.rollout_state import RolloutSpec
from participants.runner import Runner, RunReport, workload_specs
from participants.workload import build_backend, open_workload_journal, run_workload


class EnvironmentsTimed(Runner):
    """The runner, with the time each environment took to build recorded from outside."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.environment_seconds: list[float] = []

    def _new_environment(self, spec: RolloutSpec, *, fresh: bool = False) -> Environment:
        started = time.perf_counter()
        env = super()._new_environment(spec, fresh=fresh)
        self.environment_seconds.append(time.perf_counter() - started)
        return env


def resume(config: WorkloadConfig) -> tuple[RunReport, EnvironmentsTimed]:
    async def go() -> tuple[RunReport, EnvironmentsTimed]:
        backend = build_backend(config)
        with open_workload_journal(config) as journal:
            runner = EnvironmentsTimed(config, journal, backend, backend.tokenizer)
            return await runner.run(resume=True), runner

    return asyncio.run(go())


@pytest.mark.parametrize("environment", ["sandbox", "counter"])
def test_restore_time_holds_folding_and_rebuilding_environments(tmp_path: Path, environment: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    config = WorkloadConfig(name="rt", groups=2, siblings=2, max_turns=4, environment=environment, seed=2,
                            allow_early_submit=False, journal=str(tmp_path / "journal"), snapshot_every_turns=3)
    run_workload(config, resume=False, stop_after={s.rollout_id: 2 for s in workload_specs(config)})

    folds: list[float] = []
    real_fold = runner_module.restore_state

    def timed_fold(*args, **kwargs):
        started = time.perf_counter()
        try:
            return real_fold(*args, **kwargs)
        finally:
            folds.append(time.perf_counter() - started)

    monkeypatch.setattr(runner_module, "restore_state", timed_fold)
    report, runner = resume(config)

    assert len(runner.environment_seconds) == len(folds) == 4  # every rollout resumed: each folded and rebuilt
    restore = report.restore
    assert restore.fold_s >= sum(folds)
    assert restore.rebuild_s >= sum(runner.environment_seconds)  # a sandbox's interpreter start is rebuilding
    assert report.restore_seconds == restore.read_s + restore.fold_s + restore.rebuild_s + restore.fence_s
    assert report.restore_seconds >= sum(folds) + sum(runner.environment_seconds)
    assert all(row.restarted_from_zero == (environment == "sandbox") for row in report.rollouts.values())


def test_a_fresh_run_reports_no_rebuild_and_no_fence(tmp_path: Path) -> None:
    config = WorkloadConfig(name="rt", groups=1, siblings=2, max_turns=2, environment="sandbox", seed=2,
                            allow_early_submit=False, journal=str(tmp_path / "journal"))
    report = run_workload(config, resume=False)
    assert (report.restore.fold_s, report.restore.rebuild_s, report.restore.fence_s) == (0.0, 0.0, 0.0)
