"""What saves a user typing: ``ROLLOUT_JOURNAL_URL`` as every command's journal, ``resume`` from the
journal's own registration without the YAML, and printed commands that paste into a shell as they
are, on real runs of the embedded model."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml

from rollout_journal.replay.cli.main import main
from rollout_journal.replay.exit_codes import EXIT_INPUT, EXIT_OK, EXIT_USAGE


def workload_file(tmp: Path, **settings: object) -> Path:
    path = tmp / "w.yaml"
    base = {"name": "cv", "groups": 1, "siblings": 1, "max_turns": 3, "environment": "workplace", "seed": 2}
    base["allow_early_submit"] = False
    path.write_text(yaml.safe_dump(base | settings))
    return path


def out_json(capsys: pytest.CaptureFixture, argv: list[str]) -> dict:
    capsys.readouterr()
    assert main([*argv, "--json"]) == EXIT_OK
    return json.loads(capsys.readouterr().out)


def test_rollout_journal_url_is_every_commands_default_journal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    journal = tmp_path / "from env"
    monkeypatch.setenv("ROLLOUT_JOURNAL_URL", str(journal))
    monkeypatch.chdir(tmp_path)
    done = out_json(capsys, ["run", str(workload_file(tmp_path))])  # the YAML names no journal
    assert done["journal"] == str(journal) and (journal / "log").is_dir()
    listed = out_json(capsys, ["replay", "list"])
    assert listed["journal"] == str(journal) and [r["rollout_id"] for r in listed["rollouts"]] == ["cv-g0-s0"]
    assert out_json(capsys, ["verify"])["first_divergence"] is None
    assert main(["export-training", "--out", str(tmp_path / "t.jsonl")]) == EXIT_OK
    # --journal and a journal the YAML names still win over the environment
    other = tmp_path / "other"
    assert out_json(capsys, ["run", str(workload_file(tmp_path, journal=str(other)))])["journal"] == str(other)
    monkeypatch.delenv("ROLLOUT_JOURNAL_URL")
    assert main(["replay", "list"]) == EXIT_USAGE
    assert "ROLLOUT_JOURNAL_URL" in capsys.readouterr().err


def test_resume_without_the_yaml_continues_the_registered_workload(tmp_path: Path, capsys) -> None:
    from rollout_journal.participants.workload.config import WorkloadConfig
    from rollout_journal.participants.workload.run import run_workload
    from rollout_journal.participants.workload.specs import workload_specs

    journal = str(tmp_path / "j")
    config = WorkloadConfig.load(workload_file(tmp_path), journal=journal)
    run_workload(config, resume=False, stop_after={s.rollout_id: 1 for s in workload_specs(config)})
    resumed = out_json(capsys, ["resume", "--journal", journal])
    assert resumed["turns_run"] == 2 and resumed["turns_reused"] == 1 and resumed["journal"] == journal
    assert main(["resume", "--journal", journal, "--workload", "nope"]) == EXIT_INPUT
    assert "holds no workload 'nope' (it holds cv)" in capsys.readouterr().err
    assert main(["resume", "--journal", str(tmp_path / "empty")]) == EXIT_INPUT
    assert "no file journal at" in capsys.readouterr().err  # nothing there to take a workload from


def test_a_printed_command_pastes_into_a_shell_as_it_is(tmp_path: Path, capsys) -> None:
    journal = str(tmp_path / "j")
    assert main(["run", str(workload_file(tmp_path)), "--journal", journal]) == EXIT_OK
    forks = str(tmp_path / "forks & more; $(x)")  # what a shell would split, background or expand
    capsys.readouterr()
    assert (
        main(["fork", "cv-g0-s0", "--at-turn", "0", "--seed", "3", "--journal", journal, "--journal-out", forks]) == 0
    )
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("continue it: "))
    argv = shlex.split(line.removeprefix("continue it: "))
    assert argv == ["rollout-journal", "resume", "--journal", forks]
    assert main(argv[1:]) == EXIT_OK  # and it continues the fork, from its journal's registration
    shown = out_json(capsys, ["replay", "show", "cv-g0-s0.fork-1", "--journal", forks])
    assert shown["finished"] and shown["committed_turns"] == 3
