"""One rollout's failure never stops the others: a generation that spells no action is an
invalid-action observation, and an infrastructure failure (a sandbox process killed) fails that
rollout alone, journaled as ``RolloutFailed`` (never a reward), reported, and retried on resume."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import sys
from pathlib import Path

import pytest

from journal.events import RolloutFailed, RolloutFinished, TurnCompleted
from journal.open import open_journal
from participants.config import WorkloadConfig
from participants.runner import Runner, workload_specs
from participants.workload import build_backend, run_workload
from replay.cli import main
from replay.exit_codes import EXIT_ROLLOUTS_FAILED
from tests.processes import children_of
from tests.recovery_support import assert_identical, reference_outcomes


def events_of(config: WorkloadConfig, rollout_id: str) -> list:
    with open_journal(config.journal, writer="audit", read_only=True) as journal:
        return [item.event for item in journal.read_rollout(rollout_id)]


def test_a_generation_cut_short_by_max_tokens_is_an_invalid_action_not_the_end_of_the_workload(
        tmp_path: Path) -> None:
    config = WorkloadConfig(name="short", groups=2, siblings=2, max_turns=3, environment="workplace,counter",
                            seed=2, allow_early_submit=False, journal=str(tmp_path / "journal"),
                            model={"max_tokens": 2})
    reference = reference_outcomes(config)
    specs = workload_specs(config)
    run_workload(config, resume=False, stop_after={s.rollout_id: 1 for s in specs})  # a crash at turn 1

    resumed = run_workload(config, resume=True)

    assert not resumed.failed and not resumed.set_aside
    assert_identical(resumed, reference)  # invalid-action turns replay like any other
    turns = [e for s in specs for e in events_of(config, s.rollout_id) if isinstance(e, TurnCompleted)]
    assert len(turns) == len(specs) * config.max_turns
    assert any(e.messages[1].content.startswith("Invalid action") for e in turns)


def sandbox_workload(tmp_path: Path) -> WorkloadConfig:
    # One turn in flight: turn t+1 starts only once turn t is durable, so a kill at that point
    # lands before the rollout's next step.
    return WorkloadConfig(name="infra", groups=3, siblings=1, max_turns=4, environment="sandbox", seed=6,
                          allow_early_submit=False, turns_in_flight=1, journal=str(tmp_path / "journal"))


def test_a_killed_sandbox_fails_its_rollout_alone_journaled_and_retried_on_resume(tmp_path: Path) -> None:
    config = sandbox_workload(tmp_path)
    reference = reference_outcomes(config)
    victim = workload_specs(config)[1].rollout_id

    async def scenario():
        backend = build_backend(config)
        with open_journal(config.journal) as journal:
            runner = None

            def on_turn(rollout_id: str, turn: int) -> None:
                if rollout_id == victim and turn == 0:  # the infrastructure dies under the rollout
                    os.kill(runner.live[victim].env.python.pid, signal.SIGKILL)

            runner = Runner(config, journal, backend, backend.tokenizer, progress=on_turn)
            return await runner.run(resume=False)

    report = asyncio.run(scenario())

    assert set(report.failed) == {victim} and report.failed[victim].startswith("SandboxCrashedError")
    assert victim not in report.outcomes()
    assert_identical(report, {rid: o for rid, o in reference.items() if rid != victim})
    events = events_of(config, victim)
    assert isinstance(events[-1], RolloutFailed) and events[-1].error == "SandboxCrashedError"
    assert not any(isinstance(e, RolloutFinished) for e in events)  # a failure is no result
    assert all(e.reward is None for e in events if isinstance(e, TurnCompleted))

    resumed = run_workload(config, resume=True)

    assert not resumed.failed
    assert resumed.rollouts[victim].restarted_from_zero  # restart_only: the sandbox's state died with it
    assert_identical(resumed, reference)


def _sandbox_children() -> list[int]:
    """Pids of the sandbox interpreters this process started (their parent is us)."""
    return sorted(children_of(os.getpid(), cmdline_holds=b"proto_in"))


class KillOneSandboxOnFirstTurn(io.TextIOBase):
    """stdout for ``--progress-lines``: at the first committed turn, one sandbox process dies."""

    def __init__(self) -> None:
        self.text = ""
        self.killed: int | None = None

    def write(self, text: str) -> int:
        self.text += text
        if self.killed is None and "turn-committed" in text:
            self.killed = _sandbox_children()[0]
            os.kill(self.killed, signal.SIGKILL)
        return len(text)


def test_the_cli_names_the_failed_rollout_on_one_line_and_exits_1(tmp_path: Path, monkeypatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    config = sandbox_workload(tmp_path)
    path = tmp_path / "infra.yaml"
    path.write_text(config.model_dump_json())  # JSON is YAML
    capsys.readouterr()
    stdout = KillOneSandboxOnFirstTurn()
    monkeypatch.setattr(sys, "stdout", stdout)

    code = main(["run", str(path), "--progress-lines"])

    err = capsys.readouterr().err.splitlines()
    assert code == EXIT_ROLLOUTS_FAILED and stdout.killed is not None
    failed = [line for line in err if " failed " in line]
    assert len(failed) == 1, err
    assert any(s.rollout_id in failed[0] for s in workload_specs(config)) and "SandboxCrashedError" in failed[0]


@pytest.mark.timeout(120)
def test_an_environment_whose_verify_returns_none_fails_its_rollouts_alone_and_ends(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user environment's easy mistake: ``verify()`` without a ``return``. Each rollout on it
    fails alone with an error that says so; none runs on past ``max_turns``."""
    from participants.environments.counter import CounterEnvironment

    monkeypatch.setattr(CounterEnvironment, "verify", lambda self: None)
    config = WorkloadConfig(name="noverdict", groups=2, siblings=1, max_turns=2, environment="workplace,counter",
                            seed=2, allow_early_submit=False, journal=str(tmp_path / "journal"))
    report = run_workload(config, resume=False)

    on_counter = {s.rollout_id for s in workload_specs(config) if s.environment == "counter"}
    assert on_counter and set(report.failed) == on_counter
    assert all("verify() returned None" in why for why in report.failed.values()), report.failed
    for spec in workload_specs(config):
        turns = [e for e in events_of(config, spec.rollout_id) if isinstance(e, TurnCompleted)]
        assert len(turns) <= config.max_turns, spec.rollout_id
