"""One rollout's failure never stops the others, and the policy's own mistakes are no failures.

A generation that spells no action is an invalid-action observation; code that runs too long or
ends the interpreter is an observation too, and the rollout is scored. An infrastructure failure
(a sandbox process killed) fails that rollout's attempt alone, journaled as ``RolloutFailed``
(never a reward), and is retried at once as a new attempt until its failures reach the workload's
``failure_policy.max_failures``; then the rollout is given up (``RolloutGivenUp``) with a given-up
record on the results stream, and never run again."""

from __future__ import annotations

import io
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from rollout_journal.journal.events import (
    AttemptStarted,
    Header,
    ResourceMutation,
    RolloutFailed,
    RolloutFinished,
    RolloutGivenUp,
    TurnCompleted,
)
from rollout_journal.journal.open import open_journal
from rollout_journal.participants.environments.sandbox import SandboxEnvironment
from rollout_journal.participants.workload.config import FailurePolicy, WorkloadConfig
from rollout_journal.participants.workload.run import run_workload
from rollout_journal.participants.workload.runner import workload_specs
from rollout_journal.replay.cli.main import main
from rollout_journal.replay.exit_codes import EXIT_ROLLOUTS_FAILED
from rollout_journal.replay.listing import list_rollouts
from rollout_journal.replay.source import open_replay
from rollout_journal.replay.status import fleet_status
from rollout_journal.replay.timeline import build_timeline
from rollout_journal.replay.training import training_records
from tests.support.failures import published, run_killing
from tests.support.processes import children_of
from tests.support.recovery_support import assert_identical, reference_outcomes


def events_of(config: WorkloadConfig, rollout_id: str) -> list:
    with open_journal(config.journal, writer="audit", read_only=True) as journal:
        return [item.event for item in journal.read_rollout(rollout_id)]


def test_a_generation_cut_short_by_max_tokens_is_an_invalid_action_not_the_end_of_the_workload(tmp_path: Path) -> None:
    config = WorkloadConfig(
        name="short",
        groups=2,
        siblings=2,
        max_turns=3,
        environment="workplace,counter",
        seed=2,
        allow_early_submit=False,
        journal=str(tmp_path / "journal"),
        model={"max_tokens": 2},
    )
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
    return WorkloadConfig(
        name="infra",
        groups=3,
        siblings=1,
        max_turns=4,
        environment="sandbox",
        seed=6,
        allow_early_submit=False,
        turns_in_flight=1,
        journal=str(tmp_path / "journal"),
    )


def test_a_killed_sandbox_fails_its_attempt_journaled_and_is_retried_at_once_from_turn_0(tmp_path: Path) -> None:
    config = sandbox_workload(tmp_path)
    reference = reference_outcomes(config)
    victim = workload_specs(config)[1].rollout_id

    report = run_killing(config, {victim}, attempts=1)

    assert not report.failed and not report.given_up  # retried in this run: no resume needed
    assert report.rollouts[victim].restarted_from_zero  # restart_only: the sandbox's state died with it
    assert_identical(report, reference)  # the retry ends as an uninterrupted run does
    events = events_of(config, victim)
    [failed] = [e for e in events if isinstance(e, RolloutFailed)]
    assert failed.error == "SandboxCrashedError" and failed.header.attempt == 1
    retry = next(e for e in events if isinstance(e, AttemptStarted) and e.header.attempt == 2)
    assert retry.resumed_from_turn == 0 and "retry after infrastructure failure 1 of 3" in retry.reason
    with open_replay(config.journal) as source:  # replay show tells a failure from a crash
        shown = list(build_timeline(source, victim, catalog=None).text())
    assert any(
        line.startswith("!! FAILED: attempt 1 (epoch 1) failed on its infrastructure during turn 1 (Sandbox")
        for line in shown
    )
    assert set(published(config.journal)) == {s.rollout_id for s in workload_specs(config)}


def test_a_sandbox_killed_in_every_attempt_is_given_up_once_its_failures_reach_the_budget(tmp_path: Path) -> None:
    config = sandbox_workload(tmp_path).model_copy(update={"failure_policy": FailurePolicy(max_failures=2)})
    reference = reference_outcomes(config)
    victim = workload_specs(config)[1].rollout_id

    report = run_killing(config, {victim})

    assert set(report.given_up) == {victim} and report.given_up[victim].startswith("SandboxCrashedError")
    assert not report.failed and victim not in report.outcomes()
    assert_identical(report, {rid: o for rid, o in reference.items() if rid != victim})
    events = events_of(config, victim)
    assert [type(e) for e in events if isinstance(e, (RolloutFailed, RolloutGivenUp))] == [
        RolloutFailed,
        RolloutFailed,
        RolloutGivenUp,
    ]
    given_up = events[-1]
    assert isinstance(given_up, RolloutGivenUp) and (given_up.failures, given_up.error) == (2, "SandboxCrashedError")
    assert not any(isinstance(e, RolloutFinished) for e in events)  # a failure is no result
    record = published(config.journal)[victim]  # the trainer learns of it: its group is not left waiting
    assert not record.finished and record.reward is None and len(record.input_ids) == 0
    assert record.header == given_up.header and record.group_size == config.siblings
    with open_replay(config.journal) as source:
        rows = {r.rollout_id: r for r in list_rollouts(source).rows}
        summary = build_timeline(source, victim, catalog=None).summary()
        left_out: dict[str, str] = {}
        list(training_records(source, left_out=left_out))
    assert rows[victim].status == "given up" and rows[victim].as_json()["failures"] == 2
    assert rows[victim].crashes == 0  # two failures, one retried: no crash
    assert "given up after 2 infrastructure failures (the last: SandboxCrashedError" in summary
    assert left_out[victim].startswith("given up after 2 infrastructure failures")  # export-training
    assert {r.status for rid, r in rows.items() if rid != victim} == {"finished"}
    status = fleet_status(config.journal)
    assert {r.rollout_id: r.status for r in status.rollouts}[victim] == "given up"
    [workload] = status.workloads
    assert (workload.given_up, workload.finished) == (1, len(rows) - 1) and workload.done  # nothing left to run

    resumed = run_workload(config, resume=True)  # given up is terminal: never run again

    assert set(resumed.given_up) == {victim} and resumed.rollouts[victim].turns_run_here == 0
    assert events_of(config, victim) == events
    assert_identical(resumed, {rid: o for rid, o in reference.items() if rid != victim})


@pytest.mark.parametrize("group", ["drop", "redispatch"])
def test_a_rollout_failed_for_the_last_time_before_a_crash_is_given_up_on_resume(tmp_path: Path, group: str) -> None:
    """The process died between a rollout's last failure and its RolloutGivenUp: the resume gives
    it up (it never runs another attempt), and redispatches its group if asked; ``replay list``
    shows it failed until then."""
    policy = FailurePolicy(max_failures=1, group=group)  # type: ignore[arg-type]
    config = sandbox_workload(tmp_path).model_copy(update={"failure_policy": policy})
    victim = workload_specs(config)[1].rollout_id
    with open_journal(config.journal) as journal:  # what the crashed run left: attempt 1 failed, nothing after
        first = AttemptStarted(Header(victim, "infra-g1", 1, 1, 0, 0, 1, "worker-0"), 0, config.topology(), "new")
        journal.append_sync(
            [first, RolloutFailed(Header(victim, "infra-g1", 1, 1, 0, 1, 2, "worker-0"), "SandboxCrashedError", "gone")]
        )
    with open_replay(config.journal) as source:
        [row] = list_rollouts(source).rows
    assert row.status == "failed" and row.as_json()["failure"] == "SandboxCrashedError: gone"

    report = run_workload(config, resume=True)

    assert set(report.given_up) == {victim} and report.rollouts[victim].turns_run_here == 0
    assert not any(isinstance(e, AttemptStarted) and e.header.attempt > 1 for e in events_of(config, victim))
    assert not published(config.journal)[victim].finished
    others = {s.rollout_id for s in workload_specs(config)} - {victim}
    replacement = {"infra-g1r1-s0"} if group == "redispatch" else set()
    assert set(report.outcomes()) == others | replacement


def sandbox_tasks(tmp_path: Path, *rows: dict) -> str:
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_code_that_never_ends_or_ends_the_interpreter_is_an_observation_and_the_rollout_is_scored(
    tmp_path: Path,
) -> None:
    """The policy's own doing is no infrastructure failure: ``py(while True: pass)`` runs past the
    sandbox's timeout and ``py(import os; os._exit(3))`` ends the interpreter; each is answered
    with an observation, the interpreter starts again, and the rollout goes on to its reward."""
    tasks = sandbox_tasks(
        tmp_path,
        {"prompt": "loop", "task": {"timeout_s": 1, "actions": ["while True: pass"]}},
        {"prompt": "exit", "task": {"actions": ["import os; os._exit(3)"]}},
    )
    config = sandbox_workload(tmp_path).model_copy(update={"tasks": tasks, "groups": 2, "siblings": 2, "max_turns": 2})

    report = run_workload(config, resume=False)

    specs = workload_specs(config)
    assert not report.failed and not report.given_up and set(report.outcomes()) == {s.rollout_id for s in specs}
    for spec in specs:
        events = events_of(config, spec.rollout_id)
        assert not any(isinstance(e, RolloutFailed) for e in events)
        first = next(e for e in events if isinstance(e, TurnCompleted))
        expected = (
            "Timeout: the code ran longer than 1 s"
            if spec.task.prompt == "loop"
            else "Exited: the code ended the interpreter (exit code 3)"
        )
        assert first.messages[-1].content.startswith(expected), first.messages
        [mutation] = [e for e in events if isinstance(e, ResourceMutation) and e.header.turn == 0]
        assert json.loads(mutation.result_json)["reset"] is True  # journaled and hash-chained like any result
        fresh = SandboxEnvironment(spec.rollout_id, spec.task)  # x is back at the task's start: scored as such
        try:
            assert report.outcomes()[spec.rollout_id]["reward"] == fresh.verify()
        finally:
            fresh.close()
    assert all(r.finished for r in published(config.journal).values())  # every group reaches the trainer

    resumed = run_workload(config, resume=True)  # a finished result is offered again, never replayed

    assert all(r.reused_result for r in resumed.rollouts.values())


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


def test_the_cli_names_the_given_up_rollout_on_one_line_and_exits_1(
    tmp_path: Path, monkeypatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = sandbox_workload(tmp_path).model_copy(update={"failure_policy": FailurePolicy(max_failures=1)})
    path = tmp_path / "infra.yaml"
    path.write_text(config.model_dump_json())  # JSON is YAML
    capsys.readouterr()
    stdout = KillOneSandboxOnFirstTurn()
    monkeypatch.setattr(sys, "stdout", stdout)

    code = main(["run", str(path), "--progress-lines"])

    err = capsys.readouterr().err.splitlines()
    assert code == EXIT_ROLLOUTS_FAILED and stdout.killed is not None
    # when it happens: one log line for the failure, one for giving the rollout up; one line in
    # the run's closing report; no traceback without -v
    assert not any(line.startswith("Traceback") for line in err), err
    failed = [line for line in err if "level=error" in line and " failed at turn " in line]
    gave_up = [line for line in err if "level=error" in line and " given up after " in line]
    report = [line for line in err if line.startswith("rollout-journal: rollout ")]
    assert len(failed) == len(gave_up) == len(report) == 1, err
    assert " given up: " in report[0], err
    assert any(s.rollout_id in report[0] for s in workload_specs(config)) and "SandboxCrashedError" in report[0]


@pytest.mark.timeout(120)
def test_an_environment_whose_verify_returns_none_fails_its_rollouts_alone_and_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user environment's easy mistake: ``verify()`` without a ``return``. Each rollout on it
    fails alone with an error that says so, is retried up to the budget and given up; none runs
    on past ``max_turns``."""
    from rollout_journal.participants.environments.counter import CounterEnvironment

    monkeypatch.setattr(CounterEnvironment, "verify", lambda self: None)
    config = WorkloadConfig(
        name="noverdict",
        groups=2,
        siblings=1,
        max_turns=2,
        environment="workplace,counter",
        seed=2,
        allow_early_submit=False,
        journal=str(tmp_path / "journal"),
    )
    report = run_workload(config, resume=False)

    on_counter = {s.rollout_id for s in workload_specs(config) if s.environment == "counter"}
    assert on_counter and set(report.given_up) == on_counter and not report.failed
    assert all("verify() returned None" in why for why in report.given_up.values()), report.given_up
    for spec in workload_specs(config):
        turns = [e for e in events_of(config, spec.rollout_id) if isinstance(e, TurnCompleted)]
        assert len(turns) <= config.max_turns, spec.rollout_id
