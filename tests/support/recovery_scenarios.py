"""The recovery scenarios, as plain functions of a journal location and a model: the torch
policy runs them in tests/participants/workload/test_recovery.py (on the file journal and on Kafka),
vLLM in process and over its server in tests/participants/model/test_vllm.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from rollout_journal.journal.backend import OutRecord, Stream
from rollout_journal.journal.errors import FencedWriteError
from rollout_journal.journal.events import Message, TurnCompleted
from rollout_journal.journal.journal import ReadReport
from rollout_journal.journal.open import open_journal
from rollout_journal.participants.resources import StaleEpochError
from rollout_journal.participants.workload.config import ModelConfig, WorkloadConfig
from rollout_journal.participants.workload.run import build_backend, run_workload
from rollout_journal.participants.workload.runner import Runner, workload_specs
from tests.support.recovery_support import (
    assert_identical,
    assert_no_mutation_applied_twice,
    journal_turns,
    reference_outcomes,
)


def workload(location: str, model: ModelConfig | None = None, **overrides) -> WorkloadConfig:
    """The recovery tests' workload on ``location``, on the embedded torch model unless ``model``."""
    base = dict(
        name="wl",
        groups=1,
        siblings=3,
        max_turns=5,
        environment="workplace",
        seed=3,
        allow_early_submit=False,
        journal=location,
        snapshot_every_turns=2,
    )
    config = WorkloadConfig(**(base | overrides))
    return config if model is None else config.model_copy(update={"model": model})


def a_finished_b_at_two_c_at_four_nothing_is_thrown_away(
    journal_location: str, model: ModelConfig | None = None
) -> None:
    config = workload(journal_location, model)
    a, b, c = (s.rollout_id for s in workload_specs(config))
    reference = reference_outcomes(config)
    run_workload(config, resume=False, stop_after={a: 5, b: 2, c: 4})  # the crash
    assert journal_turns(config) == {a: (5, True), b: (2, False), c: (4, False)}

    resumed = run_workload(config, resume=True)

    rows = resumed.rollouts
    assert rows[a].reused_result and rows[a].turns_run_here == 0  # offered again, not recomputed
    assert (rows[b].turns_run_here, rows[c].turns_run_here) == (3, 1)  # B and C keep their turns
    assert not any(r.restarted_from_zero for r in rows.values())
    thrown_away = sum(r.turns_committed_before for r in rows.values() if r.restarted_from_zero)
    naive = sum(r.turns_committed_before for r in rows.values() if not r.reused_result)
    assert (thrown_away, naive) == (0, 6)
    assert_identical(resumed, reference)
    assert_no_mutation_applied_twice(config)


def only_rollouts_on_the_restart_only_sandbox_start_over(
    journal_location: str, model: ModelConfig | None = None
) -> None:
    config = workload(journal_location, model, groups=2, siblings=2, max_turns=4, environment="workplace,sandbox")
    specs = workload_specs(config)
    reference = reference_outcomes(config)
    run_workload(config, resume=False, stop_after={s.rollout_id: 2 for s in specs})

    resumed = run_workload(config, resume=True)

    for spec in specs:
        row = resumed.rollouts[spec.rollout_id]
        if spec.environment == "sandbox":
            assert row.restarted_from_zero and row.turns_run_here == 4
        else:
            assert not row.restarted_from_zero and row.turns_run_here == 2
    assert_identical(resumed, reference)
    assert_no_mutation_applied_twice(config)


def a_corrupt_snapshot_falls_back_to_the_previous_one_and_a_longer_replay(
    journal_location: str, model: ModelConfig | None = None
) -> None:
    config = workload(journal_location, model, siblings=1, max_turns=6, snapshot_every_turns=1)
    (rid,) = (s.rollout_id for s in workload_specs(config))
    reference = reference_outcomes(config)
    run_workload(config, resume=False, stop_after={rid: 4})
    with open_journal(config.journal, writer="vandal") as journal:
        journal.backend.commit([OutRecord(Stream.SNAPSHOTS, rid, b"\xc3\x01not a snapshot at all", rid)])

    resumed = run_workload(config, resume=True)

    assert resumed.read_errors, "the corrupt snapshot should be reported"
    assert resumed.rollouts[rid].turns_committed_before == 4 and resumed.rollouts[rid].turns_run_here == 2
    assert_identical(resumed, reference)


READ_ONLY_TOOLS = ("mail.list", "mail.search", "calendar.list", "calendar.free", "crm.lookup", "submit")


def seed_whose_turn_mutates(config: WorkloadConfig, turn: int) -> tuple[WorkloadConfig, dict[str, dict]]:
    """The first seed from 4 on whose single rollout's ``turn`` (0-based) calls a workplace tool
    that mutates, with that seed's uninterrupted outcomes."""
    for seed in range(4, 24):
        candidate = config.model_copy(update={"seed": seed})
        reference = reference_outcomes(candidate)
        (outcome,) = reference.values()
        if len(outcome["actions"]) > turn and not outcome["actions"][turn].startswith(READ_ONLY_TOOLS):
            return candidate, reference
    raise AssertionError("no seed from 4 to 23 mutates a resource at that turn")


def a_zombie_attempt_is_refused_by_the_journal_and_by_resources(
    journal_location: str, model: ModelConfig | None = None
) -> None:
    # The zombie's third turn must mutate a resource, which the resource must refuse; which seed
    # gives such a turn depends on the model (torch and vLLM differ), so it is looked for.
    config, reference = seed_whose_turn_mutates(workload(journal_location, model, siblings=1, max_turns=6), turn=2)
    (rid,) = (s.rollout_id for s in workload_specs(config))
    kafka = journal_location.startswith("kafka://")

    async def scenario() -> None:
        zombie_journal = open_journal(config.journal, writer="worker-0")
        zombie = Runner(config, zombie_journal, build_backend(config), build_backend(config).tokenizer)
        await zombie.run(resume=False, stop_after={rid: 2})  # attempt 1 stalls (a network partition, say)
        zombie_live = zombie.live[rid]
        if not kafka:
            zombie_journal.close()  # the file journal's lock admits one writer: a zombie process would block attempt 2
            zombie.agent.durable_calls = False  # so nothing of its turn reaches the closed journal before the resource

        # Attempt 2 takes over on another worker slot.
        successor_config = config.model_copy(update={"writer": "worker-1"})
        journal = open_journal(config.journal, writer="worker-1")
        successor = Runner(successor_config, journal, build_backend(config), build_backend(config).tokenizer)
        await successor.run(resume=True, stop_after={rid: 3})
        live = successor.live[rid]
        assert live.state.epoch == zombie_live.state.epoch + 1

        # The zombie wakes up and keeps going against the same resource server...
        zombie_live.env = live.env
        with pytest.raises(StaleEpochError):
            await zombie.agent.run_turn(zombie_live)
        # ...and its journal writes: refused outright by a journal that knows the fence,
        stale = TurnCompleted(
            zombie_live.state.header("worker-0"), [Message("assistant", "zombie")], [], {}, None, ["zombie()"]
        )
        with pytest.raises(FencedWriteError):
            journal.append([stale])
        # ...and dropped by every reader when written from a process that does not know it.
        if kafka:
            zombie_journal.append_sync([stale])
            zombie_journal.close()
        final = await successor.run(resume=True)
        journal.close()
        assert_identical(final, reference)
        if kafka:
            report = ReadReport()
            with open_journal(config.journal, writer="audit", read_only=True) as reader:
                list(reader.read_rollout(rid, report=report))
            assert [d.record for d in report.fenced] == ["TurnCompleted"]

    asyncio.run(scenario())


Scenario = Callable[[str, ModelConfig | None], None]
SCENARIOS: dict[str, Scenario] = {
    "a-b-c": a_finished_b_at_two_c_at_four_nothing_is_thrown_away,
    "restart-only": only_rollouts_on_the_restart_only_sandbox_start_over,
    "corrupt-snapshot": a_corrupt_snapshot_falls_back_to_the_previous_one_and_a_longer_replay,
    "zombie": a_zombie_attempt_is_refused_by_the_journal_and_by_resources,
}
