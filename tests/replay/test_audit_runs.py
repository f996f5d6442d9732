"""Audit and verify on journals of real runs with a crash and a resume, on both backends:
clean chains, anchored and verifying heads, a restart-only sandbox's chain split into
its lives, and event-sourced resources that rebuild to the journaled digests."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from rollout_journal.journal import ReadReport, ResourceMutation, open_journal
from rollout_journal.journal.anchoring import SIGNING_KEY_ENV, HeadSigner, HeadVerifier
from rollout_journal.participants.workload.config import WorkloadConfig
from rollout_journal.participants.workload.run import run_workload
from rollout_journal.participants.workload.runner import workload_specs
from rollout_journal.replay.audit import audit_events
from rollout_journal.replay.cli.main import main as cli_main
from rollout_journal.replay.exit_codes import EXIT_INPUT
from rollout_journal.replay.verify import verify_journal
from tests.support.journal_tamper import TamperedLog
from tests.support.recovery_support import run_child_and_kill
from tests.support.replay_journals import crashed_and_resumed


def test_a_crashed_and_resumed_run_audits_clean_anchored_and_verifies(
    journal_location: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    signer = HeadSigner.generate()
    config = crashed_and_resumed(
        journal_location, signer, environment="workplace,sandbox", groups=2, siblings=2, max_turns=4, crash_at=2
    )
    report = ReadReport()
    with open_journal(journal_location, read_only=True) as journal:
        rows, summary = audit_events(journal.scan(report), report, HeadVerifier(signer.public_key))

    assert summary.chain_ok, [str(p) for p in summary.problems]
    assert (summary.anchored, summary.anchors_verified) == ("yes", True)
    assert summary.checkpoints == summary.checkpoints_verified > 0
    assert {r.attempt for r in rows} == {1, 2}
    lives: dict[str, list[int]] = {}
    for life in summary.resources:
        lives.setdefault(life["resource_id"], []).append(life["life"])
    for spec in workload_specs(config):
        if spec.environment == "sandbox":  # restart-only: the resumed attempt started a second chain
            assert lives[f"{spec.rollout_id}/python"] == [0, 1]
        else:
            assert all(found == [0] for rid, found in lives.items() if rid.startswith(spec.rollout_id + "/"))
    if journal_location.startswith("kafka://"):
        assert rows[0].location.startswith("topic ") and " partition " in rows[0].location

    verified, _ = verify_journal(journal_location)
    assert verified.ok, [str(d) for d in verified.divergences]
    workplace = sum(1 for r in rows if not r.resource_id.endswith("/python"))
    assert verified.mutations_replayed == workplace > 0
    assert all(why.startswith("restart_only") for why in verified.skipped.values())

    public = tmp_path / "verify.pem"
    public.write_bytes(signer.public_pem())
    assert cli_main(["audit", "--journal", journal_location, "--public-key", str(public)]) == 0
    assert "chain ok" in capsys.readouterr().out
    assert cli_main(["verify", "--journal", journal_location, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["first_divergence"] is None


@pytest.mark.slow
def test_a_sigkilled_signed_run_resumed_audits_clean_and_anchored(
    journal_location: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL lands mid-commit, wherever it lands: what is journaled is whole, anchored and verifying."""
    signer = HeadSigner.generate()
    config = WorkloadConfig(
        name="kill",
        groups=2,
        siblings=2,
        max_turns=5,
        environment="workplace,sandbox",
        seed=4,
        allow_early_submit=False,
        journal=journal_location,
        snapshot_every_turns=2,
        turn_delay_ms=10,
    )
    key = {SIGNING_KEY_ENV: signer.private_pem().decode()}
    assert run_child_and_kill(
        config,
        resume=False,
        kill_after_turns=4,
        extra_delay_s=0.005,
        progress_path=tmp_path / "progress.txt",
        environ=key,
    )
    monkeypatch.setenv(SIGNING_KEY_ENV, key[SIGNING_KEY_ENV])
    resumed = run_workload(config, resume=True)
    assert any(r.turns_committed_before for r in resumed.rollouts.values())

    report = ReadReport()
    with open_journal(journal_location, read_only=True) as journal:
        _, summary = audit_events(journal.scan(report), report, HeadVerifier(signer.public_key))
    assert summary.chain_ok, [str(p) for p in summary.problems]
    assert (summary.anchored, summary.anchors_verified) == ("yes", True)
    verified, _ = verify_journal(journal_location)
    assert verified.ok, [str(d) for d in verified.divergences]


def test_verify_names_the_first_record_that_rebuilds_differently(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    crashed_and_resumed(str(tmp_path / "journal"), None)
    log = TamperedLog(tmp_path / "journal")
    by_resource: dict[str, list[ResourceMutation]] = {}
    for event in log.events():
        if isinstance(event, ResourceMutation):
            by_resource.setdefault(event.resource_id, []).append(event)
    resource, mutations = max(by_resource.items(), key=lambda kv: len(kv[1]))
    changed = dataclasses.replace(mutations[1], args_json=json.dumps({"id": "e0"}))  # another event cancelled
    log.replace(mutations[1], changed)
    log.rechain(resource)  # the chain verifies: only re-applying shows the state is not what was journaled
    where = log.save()
    rechained = next(
        e for e in log.events() if isinstance(e, ResourceMutation) and e.idempotency_key == changed.idempotency_key
    )

    report, _ = verify_journal(str(tmp_path / "journal"))
    first = report.divergences[0]
    assert (first.resource_id, first.revision, first.location) == (resource, changed.revision, where[id(rechained)])
    assert cli_main(["verify", "--journal", str(tmp_path / "journal")]) == 1
    assert f"first divergence: {resource} r{changed.revision} at {where[id(rechained)]}" in capsys.readouterr().out


def test_verify_an_unknown_resource_is_one_line_and_an_input_exit_code(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    crashed_and_resumed(str(tmp_path / "journal"), None, max_turns=2, crash_at=1)
    assert cli_main(["verify", "nobody/mail", "--journal", str(tmp_path / "journal")]) == EXIT_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'nobody/mail'" in err
