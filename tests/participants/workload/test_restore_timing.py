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

import rollout_journal.participants.workload.restore as restore_module
from rollout_journal.journal.restore import load_rollouts
from rollout_journal.participants.environments import Environment
from rollout_journal.participants.workload.config import WorkloadConfig
from rollout_journal.participants.workload.run import build_backend, open_workload_journal, run_workload
from rollout_journal.participants.workload.runner import Runner, RunReport, workload_specs
from rollout_journal.participants.workload.specs import RolloutSpec


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


def timed_folds(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The seconds of every trusted-snapshot fold from here on, timed from outside the runner."""
    folds: list[float] = []
    real_fold = restore_module.trusted_restore

    def timed_fold(*args, **kwargs):
        started = time.perf_counter()
        try:
            return real_fold(*args, **kwargs)
        finally:
            folds.append(time.perf_counter() - started)

    monkeypatch.setattr(restore_module, "trusted_restore", timed_fold)
    return folds


def resume(config: WorkloadConfig) -> tuple[RunReport, EnvironmentsTimed]:
    async def go() -> tuple[RunReport, EnvironmentsTimed]:
        backend = build_backend(config)
        with open_workload_journal(config) as journal:
            runner = EnvironmentsTimed(config, journal, backend, backend.tokenizer)
            return await runner.run(resume=True), runner

    return asyncio.run(go())


@pytest.mark.parametrize("environment", ["sandbox", "counter"])
def test_restore_time_holds_folding_and_rebuilding_environments(
    tmp_path: Path, environment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = WorkloadConfig(
        name="rt",
        groups=2,
        siblings=2,
        max_turns=4,
        environment=environment,
        seed=2,
        allow_early_submit=False,
        journal=str(tmp_path / "journal"),
        snapshot_every_turns=3,
    )
    run_workload(config, resume=False, stop_after={s.rollout_id: 2 for s in workload_specs(config)})

    folds = timed_folds(monkeypatch)
    report, runner = resume(config)

    assert len(runner.environment_seconds) == len(folds) == 4  # every rollout resumed: each folded and rebuilt
    restore = report.restore
    assert restore.fold_s >= sum(folds)
    assert restore.rebuild_s >= sum(runner.environment_seconds)  # a sandbox's interpreter start is rebuilding
    assert report.restore_seconds == restore.read_s + restore.fold_s + restore.rebuild_s + restore.fence_s
    assert report.restore_seconds >= sum(folds) + sum(runner.environment_seconds)
    assert all(row.restarted_from_zero == (environment == "sandbox") for row in report.rollouts.values())


def test_a_fresh_run_reports_no_rebuild_and_no_fence(tmp_path: Path) -> None:
    config = WorkloadConfig(
        name="rt",
        groups=1,
        siblings=2,
        max_turns=2,
        environment="sandbox",
        seed=2,
        allow_early_submit=False,
        journal=str(tmp_path / "journal"),
    )
    report = run_workload(config, resume=False)
    assert (report.restore.fold_s, report.restore.rebuild_s, report.restore.fence_s) == (0.0, 0.0, 0.0)


def test_a_fleet_admission_reports_its_folding_and_rebuilding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fleet's worker never calls ``run``: it admits each partition's rollouts into its runner's
    report. The folding and rebuilding of those admissions once went to a timing no report held."""
    config = WorkloadConfig(
        name="rt",
        groups=1,
        siblings=2,
        max_turns=4,
        environment="sandbox",
        seed=2,
        allow_early_submit=False,
        journal=str(tmp_path / "journal"),
    )
    run_workload(config, resume=False, stop_after={s.rollout_id: 2 for s in workload_specs(config)})
    folds = timed_folds(monkeypatch)

    async def admit() -> tuple[RunReport, EnvironmentsTimed]:
        backend = build_backend(config)
        with open_workload_journal(config) as journal:
            runner = EnvironmentsTimed(config, journal, backend, backend.tokenizer)
            plan = load_rollouts(journal)
            admitted = await runner.admit(workload_specs(config), plan, plan.workloads.get(config.name))
            await runner.drop([live.spec.rollout_id for live in admitted], why=None)
            return runner.report, runner

    report, runner = asyncio.run(admit())
    assert len(folds) == len(runner.environment_seconds) == 2
    assert report.restore.fold_s >= sum(folds)
    assert report.restore.rebuild_s >= sum(runner.environment_seconds)
