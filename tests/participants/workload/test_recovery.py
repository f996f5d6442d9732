"""Turn-level recovery end to end, on the file journal and on a real Kafka broker. The scenarios
vLLM runs too are in tests/support/recovery_scenarios.py."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from rollout_journal.participants.workload.run import run_workload
from rollout_journal.participants.workload.runner import workload_specs
from tests.support import recovery_scenarios as scenarios
from tests.support.recovery_scenarios import workload
from tests.support.recovery_support import (
    assert_identical,
    assert_no_mutation_applied_twice,
    committed_by_progress,
    journal_turns,
    reference_outcomes,
    run_child_and_kill,
)


def test_a_finished_b_at_two_c_at_four_nothing_is_thrown_away(journal_location: str) -> None:
    scenarios.a_finished_b_at_two_c_at_four_nothing_is_thrown_away(journal_location)


def test_only_rollouts_on_the_restart_only_sandbox_start_over(journal_location: str) -> None:
    scenarios.only_rollouts_on_the_restart_only_sandbox_start_over(journal_location)


def test_a_corrupt_snapshot_falls_back_to_the_previous_one_and_a_longer_replay(journal_location: str) -> None:
    scenarios.a_corrupt_snapshot_falls_back_to_the_previous_one_and_a_longer_replay(journal_location)


def test_a_crash_while_a_snapshot_is_written_loses_only_that_uncommitted_turn(tmp_path: Path) -> None:
    # Each turn gets a commit of its own, so cutting the last commit cuts exactly one turn: no linger,
    # and no turn appended before the previous one is durable (with two turns in flight, a committer
    # slowed by a loaded machine could take turns 3 and 4 in one commit, and the cut would lose both).
    config = workload(
        str(tmp_path / "journal"),
        siblings=1,
        max_turns=6,
        snapshot_every_turns=2,
        journal_linger_ms=0,
        turns_in_flight=1,
    )
    (rid,) = (s.rollout_id for s in workload_specs(config))
    reference = reference_outcomes(config)
    run_workload(config, resume=False, stop_after={rid: 4})  # turn 4's commit carries a snapshot
    segment = sorted((tmp_path / "journal" / "log").glob("*.seg"))[-1]
    data = segment.read_bytes()
    segment.write_bytes(data[: len(data) - 200])  # the process died while writing that commit

    assert journal_turns(config) == {rid: (3, False)}
    resumed = run_workload(config, resume=True)
    assert resumed.rollouts[rid].turns_run_here == 3
    assert_identical(resumed, reference)


def test_a_zombie_attempt_is_refused_by_the_journal_and_by_resources(journal_location: str) -> None:
    scenarios.a_zombie_attempt_is_refused_by_the_journal_and_by_resources(journal_location)


def _crash_trials(journal_location: str, tmp_path: Path, trials: int, seed: int) -> None:
    rng = random.Random(seed)
    kills = 0
    for trial in range(trials):
        config = workload(
            journal_location,
            name=f"crash{trial}",
            groups=2,
            siblings=2,
            max_turns=4,
            environment="workplace,counter",
            snapshot_every_turns=rng.choice([1, 2, 3]),
            # Half the trials snapshot in blocks from the first turn (a tiny model's head fills 256 bytes).
            snapshot_block_bytes=rng.choice([256, 16 * 1024]),
        )
        if not journal_location.startswith("kafka://"):
            config = config.model_copy(update={"journal": str(tmp_path / f"journal-{trial}")})
        reference = reference_outcomes(config)
        progress = tmp_path / f"progress-{trial}.txt"
        total = config.groups * config.siblings * config.max_turns
        kills += run_child_and_kill(
            config,
            resume=False,
            kill_after_turns=rng.randrange(total),
            extra_delay_s=rng.random() * 0.02,
            progress_path=progress,
        )
        if rng.random() < 0.5:  # and crash again, during the resume (possibly during restore itself)
            kills += run_child_and_kill(
                config,
                resume=True,
                kill_after_turns=rng.randrange(total // 2),
                extra_delay_s=rng.random() * 0.02,
                progress_path=progress,
            )
        durable = committed_by_progress(progress)
        final = run_workload(config, resume=True)
        # What the final resume's restore found committed, not a reader's view: on Kafka a tool reads
        # to the last stable offset, which a killed child's open transaction holds back (until the broker
        # aborts it) below the turns a later child committed after it began; a restore reads past it to
        # the group's commit points.
        for rid, turns in durable.items():
            found = final.rollouts[rid].turns_committed_before
            assert found >= turns, f"trial {trial}: {rid} lost a committed turn ({turns} durable, {found} restored)"
        assert_identical(final, reference)
        assert_no_mutation_applied_twice(config)
    assert kills >= trials // 2, f"only {kills} SIGKILLs landed in {trials} trials: the workload finished first"


@pytest.mark.slow
def test_sigkill_at_random_points_loses_no_committed_turn(journal_location: str, tmp_path: Path) -> None:
    trials = int(os.environ.get("ROLLOUT_JOURNAL_CRASH_TRIALS", "20"))  # more: set it (the suite stays < 30 min)
    _crash_trials(journal_location, tmp_path, trials, seed=int(os.environ.get("ROLLOUT_JOURNAL_CRASH_SEED", "1")))
