"""A resume with other weights, sampling or max_turns than the journal's rollouts ran with is
refused with a readable diff, unless the user overrides it on purpose: then the override is
recorded in the journal, in each resumed attempt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rollout_journal.journal.events import AttemptStarted
from rollout_journal.journal.open import open_journal
from rollout_journal.participants.workload.config import FailurePolicy, TopologyChangedError, WorkloadConfig
from rollout_journal.participants.workload.run import run_workload
from rollout_journal.participants.workload.runner import workload_specs
from rollout_journal.replay.cli.main import main
from rollout_journal.replay.exit_codes import EXIT_OK, EXIT_TOPOLOGY_CHANGED


def crashed_workload(tmp_path: Path) -> WorkloadConfig:
    """Two rollouts stopped after two of their four turns (a crash at a turn boundary)."""
    config = WorkloadConfig(
        name="topo",
        groups=1,
        siblings=2,
        max_turns=4,
        environment="workplace",
        seed=4,
        allow_early_submit=False,
        journal=str(tmp_path / "journal"),
    )
    run_workload(config, resume=False, stop_after={s.rollout_id: 2 for s in workload_specs(config)})
    return config


def attempts(config: WorkloadConfig) -> list[AttemptStarted]:
    with open_journal(config.journal, writer="audit", read_only=True) as journal:
        return [item.event for item in journal.scan() if isinstance(item.event, AttemptStarted)]


def changed(config: WorkloadConfig) -> WorkloadConfig:
    model = config.model.model_copy(update={"weights_seed": 1, "temperature": 0.7})
    return config.model_copy(update={"model": model, "max_turns": 6})


def test_a_resume_with_other_weights_sampling_and_max_turns_is_refused_with_the_diff(tmp_path: Path) -> None:
    config = crashed_workload(tmp_path)
    before = attempts(config)

    with pytest.raises(TopologyChangedError) as refused:
        run_workload(changed(config), resume=True)

    message = str(refused.value)
    for difference in ("model.weights_seed 0 -> 1", "model.temperature 1.0 -> 0.7", "max_turns 4 -> 6"):
        assert difference in message, message
    assert "--allow-topology-change" in message and "\n" not in message
    assert attempts(config) == before, "a refused resume must write nothing"


def test_an_override_resumes_and_is_recorded_in_each_resumed_attempt(tmp_path: Path) -> None:
    config = crashed_workload(tmp_path)
    other = changed(config)

    report = run_workload(other, resume=True, topology_override="policy v2 from step 1200")

    assert all(r.turns_committed_before == 2 for r in report.rollouts.values())
    resumed = [a for a in attempts(config) if a.header.attempt == 2]
    assert len(resumed) == 2
    for attempt in resumed:
        assert attempt.topology == other.topology()
        assert attempt.override.startswith("policy v2 from step 1200")
        assert "model.weights_seed 0 -> 1" in attempt.override
    first = [a for a in attempts(config) if a.header.attempt == 1]
    assert all(a.override is None and a.topology == config.topology() for a in first)
    # The workload now runs with the new settings: a later resume with them needs no override.
    run_workload(other, resume=True)


def test_the_same_topology_resumes_without_an_override(tmp_path: Path) -> None:
    config = crashed_workload(tmp_path)
    report = run_workload(config, resume=True)
    assert all(r.turns_committed_before == 2 for r in report.rollouts.values())
    assert all(a.override is None for a in attempts(config))


def test_the_cli_refuses_with_one_line_and_takes_the_override(tmp_path: Path, capsys) -> None:
    config = crashed_workload(tmp_path)
    path = tmp_path / "topo.yaml"
    document = changed(config).model_dump(mode="json")
    path.write_text(yaml.safe_dump(document))

    assert main(["resume", str(path), "--json"]) == EXIT_TOPOLOGY_CHANGED
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "model.weights_seed 0 -> 1" in err[0], err

    assert main(["resume", str(path), "--json", "--allow-topology-change", "new weights"]) == EXIT_OK
    assert any((a.override or "").startswith("new weights") for a in attempts(config))


def test_the_failure_policy_is_no_topology_old_journals_resume_under_any(tmp_path: Path) -> None:
    """It acts between attempts, never inside one: a journal written before it existed, or with
    another budget, resumes without an override."""
    config = crashed_workload(tmp_path)
    other = config.model_copy(
        update={"failure_policy": FailurePolicy(max_failures=7, group="redispatch", max_redispatches=2)}
    )
    assert other.topology() == config.topology() and other.topology_diff(config.model_dump_json()) == []
    report = run_workload(other, resume=True)
    assert all(r.turns_committed_before == 2 for r in report.rollouts.values())
    assert all(a.override is None for a in attempts(config))


def test_settings_added_for_training_data_leave_old_fingerprints_alone() -> None:
    """top_k, history_policy and server_logprobs join the fingerprint only when set: a journal
    written before they existed resumes (the values pinned here are what 0.3 computed)."""
    plain = WorkloadConfig(journal="/tmp/unused")
    sampled = WorkloadConfig(
        journal="/tmp/unused",
        model={"backend": "vllm", "temperature": 0.7, "top_p": 0.9, "server_logprobs": "processed"},
    )
    assert plain.topology() == "e52dff486ba1c39e"
    assert sampled.topology() == "7aef8104f26b2849"
    for setting in ({"top_k": 20}, {"history_policy": "new_sequence"}, {"server_logprobs": "accept_raw"}):
        changed = plain.model_copy(update={"model": plain.model.model_copy(update=setting)})
        assert changed.topology() != plain.topology(), setting
        ((key, value),) = setting.items()
        assert changed.topology_diff(plain.model_dump_json()) == [f'model.{key} "(unset)" -> {json.dumps(value)}']
