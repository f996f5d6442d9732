"""Your own environment and tasks: a class named as module:Class (or by an entry point), tasks from
a JSONL dataset, JSON tool calls, and the same crash recovery as the built-ins."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from rollout_journal.participants.environments import (
    ENTRY_POINT_GROUP,
    StepContext,
    Task,
    TaskFileError,
    ToolCall,
    UnknownEnvironmentError,
    environment_class,
    load_tasks,
    make_environment,
    parse_tool_call,
)
from rollout_journal.participants.environments.tool_calls import ToolCallError
from rollout_journal.participants.workload.config import WorkloadConfig
from rollout_journal.participants.workload.run import run_workload
from rollout_journal.participants.workload.runner import workload_specs
from tests.support.paths import TESTS_DIR
from tests.support.recovery_support import (
    assert_identical,
    assert_no_mutation_applied_twice,
    journal_turns,
    reference_outcomes,
    run_child_and_kill,
)
from tests.support.resource_servers import TOKEN, resource_servers, token_in_environment
from tests.support.user_envs.notes import NotesEnvironment

NOTES = "tests.support.user_envs.notes:NotesEnvironment"
TASKS = TESTS_DIR / "support" / "user_envs" / "notes_tasks.jsonl"


def ctx(turn: int, epoch: int = 1) -> StepContext:
    return StepContext("r1", epoch, epoch, f"r1/t{turn}")


def notes_env(row: int = 0) -> NotesEnvironment:
    return make_environment(NOTES, "r1", load_tasks(TASKS)[row])  # type: ignore[return-value]


# -- naming an environment -----------------------------------------------------------------


def test_a_module_class_name_loads_the_users_environment_without_editing_the_project() -> None:
    assert environment_class(NOTES) is NotesEnvironment
    with pytest.raises(UnknownEnvironmentError, match="cannot be imported"):
        environment_class("no_such_package.envs:Env")
    with pytest.raises(UnknownEnvironmentError, match="has no 'Nope'"):
        environment_class("tests.support.user_envs.notes:Nope")
    with pytest.raises(UnknownEnvironmentError, match="not a subclass"):
        environment_class("tests.support.user_envs.notes:Notebook")
    with pytest.raises(ValueError, match="cannot be imported"):  # pydantic's report of the setting
        WorkloadConfig(environment="no_such_package.envs:Env")


def test_an_installed_distributions_entry_point_names_an_environment(tmp_path: Path) -> None:
    """A real (if tiny) installed distribution: a .dist-info folder on sys.path declaring the entry point."""
    dist = tmp_path / "my_notes-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-notes\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nnotes = {NOTES}\n")
    sys.path.insert(0, str(tmp_path))
    try:
        assert environment_class("notes") is NotesEnvironment
        config = WorkloadConfig(environment="notes", journaling=False)
        assert config.environments == ["notes"]
    finally:
        sys.path.remove(str(tmp_path))
    with pytest.raises(UnknownEnvironmentError, match="no environment named 'notes'"):
        environment_class("notes")


# -- tasks from a dataset ----------------------------------------------------------------------


def test_tasks_come_from_the_jsonl_rows_and_every_sibling_of_a_group_shares_one(tmp_path: Path) -> None:
    rows = load_tasks(TASKS)
    assert [t.task_id for t in rows] == ["greek", "colours", "one"]
    assert rows[1].prompt == "Add the notes red and blue, then submit." and rows[1].fields["words"] == ["red", "blue"]
    assert rows[2].seed == 11
    config = WorkloadConfig(name="ds", groups=4, siblings=2, environment=NOTES, tasks=str(TASKS), journaling=False)
    specs = workload_specs(config)
    assert [s.task.task_id for s in specs] == ["greek", "greek", "colours", "colours", "one", "one", "greek", "greek"]
    env = make_environment(NOTES, specs[2].rollout_id, specs[2].environment_task())
    assert env.task_prompt() == rows[1].prompt


def test_a_bad_dataset_line_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "tasks.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": "", "task": {}}\n')
    with pytest.raises(TaskFileError, match="line 2"):
        load_tasks(bad)
    bad.write_text('{"prompt": "fine"}\nnot json\n')
    with pytest.raises(TaskFileError, match="line 2: not JSON"):
        load_tasks(bad)
    with pytest.raises(ValueError, match="does not exist"):
        WorkloadConfig(environment=NOTES, tasks=str(tmp_path / "missing.jsonl"))


def test_another_dataset_is_another_topology(tmp_path: Path) -> None:
    other = tmp_path / "tasks.jsonl"
    other.write_text(TASKS.read_text().replace("alpha", "omega"))
    base = WorkloadConfig(environment=NOTES, journaling=False)
    assert base.topology() == WorkloadConfig(environment=NOTES, journaling=False, constrained_actions=True).topology()
    with_tasks = base.model_copy(update={"tasks": str(TASKS)})
    assert len({base.topology(), with_tasks.topology(), base.model_copy(update={"tasks": str(other)}).topology()}) == 3


# -- JSON tool calls ---------------------------------------------------------------------------------


def test_tool_calls_parse_in_the_common_spellings() -> None:
    expected = ToolCall("notes.add", {"text": "hi"})
    for text in (
        '{"name": "notes.add", "arguments": {"text": "hi"}}',
        '{"name": "notes.add", "arguments": "{\\"text\\": \\"hi\\"}"}',
        '{"type": "function", "function": {"name": "notes.add", "parameters": {"text": "hi"}}}',
        '<tool_call>{"name": "notes.add", "arguments": {"text": "hi"}}</tool_call>',
        '```json\n{"name": "notes.add", "arguments": {"text": "hi"}}\n```',
    ):
        assert parse_tool_call(text) == expected, text
    for text, why in (
        ('{"name": "x", "arguments": [1]}', "must be a JSON object"),
        ('{"arguments": {}}', 'no "name"'),
        ('{"name": "notes.add", ', "not valid JSON"),
        ("[1, 2]", "JSON object"),
    ):
        with pytest.raises(ToolCallError, match=why):
            parse_tool_call(text)


def test_a_call_the_environment_cannot_parse_or_execute_is_an_observation_never_a_crash() -> None:
    env = notes_env()
    cases = [
        ('{"name": "notes.add", "arguments": {"text": "alpha"}', "could not parse the tool call"),
        ('{"name": "notes.fly", "arguments": {}}', "there is no tool 'notes.fly'"),
        ('{"name": "notes.add", "arguments": {}}', "KeyError"),  # the environment's code choked: still an answer
        ('{"name": "notes.add", "arguments": {"text": "   "}}', "needs text"),  # the resource refused
        ('{"name": "notes.erase", "arguments": {"index": 5}}', "has no note 5"),
        ("draw a picture", "Invalid action"),
    ]
    for turn, (said, why) in enumerate(cases):
        observation, records = env.step(said, ctx(turn))
        assert why in observation.text and not observation.done and records == [], said
    assert env.notebook.revision == 0
    observation, records = env.step(
        '{"name": "notes.add", "arguments": {"text": "free text, not in any list"}}', ctx(9)
    )
    assert records[0].op == "add" and records[0].idempotency_key == "r1/t9/m0"
    assert env.step('{"name": "submit", "arguments": {}}', ctx(10))[0].done


def test_a_json_call_of_a_builtin_runs_the_listed_action_with_those_arguments() -> None:
    env = make_environment("counter", "r1", 4)
    listed = env.step("counter.incr(name=b, by=5)", ctx(0))
    again = make_environment("counter", "r1", 4)
    as_json = again.step(ToolCall("counter.incr", {"by": 5, "name": "b"}), ctx(0))  # any argument order
    assert as_json == listed
    observation, records = again.step('{"name": "counter.incr", "arguments": {"name": "b", "by": 7}}', ctx(1))
    assert "other arguments" in observation.text and not records


def test_a_free_form_model_never_crashes_a_rollout(tmp_path: Path) -> None:
    """Unconstrained, the tiny policy writes noise: every turn is answered, none fails."""
    config = WorkloadConfig(
        name="free",
        groups=2,
        siblings=2,
        max_turns=3,
        environment=f"{NOTES},counter",
        tasks=str(TASKS),
        constrained_actions=False,
        allow_early_submit=False,
        journal=str(tmp_path / "journal"),
    )
    report = run_workload(config, resume=False)
    assert not report.failed and not report.set_aside
    assert all(o["turns"] == 3 for o in report.outcomes().values())


# -- recovery like the built-ins ---------------------------------------------------------------------


def _dataset_workload(location: str, **overrides) -> WorkloadConfig:
    base = dict(
        name="usr",
        groups=3,
        siblings=2,
        max_turns=6,
        environment=NOTES,
        tasks=str(TASKS),
        seed=2,
        allow_early_submit=False,
        journal=location,
        snapshot_every_turns=2,
        turn_delay_ms=10.0,
    )
    return WorkloadConfig(**(base | overrides))


@pytest.mark.slow
@pytest.mark.parametrize("where", ["in_process", "resource_server"])
def test_the_users_environment_recovers_across_sigkill_like_the_builtins(tmp_path: Path, where: str) -> None:
    config = _dataset_workload(str(tmp_path / "journal"))
    reference = reference_outcomes(config)
    assert any(o["reward"] > 0 for o in reference.values()), "the dataset's tasks should be reachable"
    progress = tmp_path / "progress"
    # On a server, the class is hosted by its module:Class name and the workload names that server.
    with resource_servers(*([NOTES] if where == "resource_server" else [])) as servers, token_in_environment():
        config = config.model_copy(update={"resource_servers": {name: s.url for name, s in servers.items()}})
        killed = run_child_and_kill(
            config,
            resume=False,
            kill_after_turns=12,
            extra_delay_s=0.01,
            progress_path=progress,
            environ={"ROLLOUT_JOURNAL_RESOURCE_TOKEN": TOKEN},
        )
        assert killed, "the workload finished before the kill"
        at_crash = journal_turns(config)
        assert any(0 < turns < 6 for turns, _ in at_crash.values())
        resumed = run_workload(config, resume=True)
        if where == "resource_server":
            stats = servers[NOTES].stats()
            # the server outlived the worker: each resumed rollout was reconciled or imported there
            assert stats.get("reconciled", 0) + stats.get("imported", 0) >= sum(
                1 for turns, done in at_crash.values() if turns and not done
            )
    rows = resumed.rollouts
    for rid, (turns, _finished) in at_crash.items():
        assert rows[rid].turns_committed_before == turns and not rows[rid].restarted_from_zero
    assert_identical(resumed, reference)
    assert_no_mutation_applied_twice(config)
    assert json.loads(json.dumps(resumed.outcomes()))  # plain JSON, as the CLI prints it


def test_the_task_travels_to_a_resource_server_as_json() -> None:
    task = Task(5, "p", {"words": ["a"]}, "t1")
    assert Task.from_json(json.loads(json.dumps(task.to_json()))) == task
