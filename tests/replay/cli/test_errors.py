"""What a user can get wrong at the command line ends as one line on stderr, a documented exit
code, and nothing created: a bad journal location, a bad workload file, a name the journal cannot
key, an unknown environment, a Kafka URL with a port that is no number."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_journal.journal.file.backend import FileBackend
from rollout_journal.replay.cli.main import build_parser, main
from rollout_journal.replay.exit_codes import EXIT_INPUT, EXIT_OK, EXIT_USAGE, EXIT_WRITER_TAKEN, exit_code_for
from tests.support.paths import REPO_ROOT

SMALL = "name: cli\ngroups: 1\nsiblings: 1\nmax_turns: 1\nenvironment: counter\n"


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty current directory, so that anything a refused command creates shows."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)  # it would replace the URL's servers
    return work


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def refused(capsys: pytest.CaptureFixture[str], argv: list[str], code: int, *names: str) -> str:
    """Run the CLI; assert it exits ``code`` with exactly one stderr line naming each of ``names``."""
    assert main(argv) == code
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{err}"
    assert lines[0].startswith("rollout-journal: ")
    for name in names:
        assert name in lines[0], f"{name!r} is not named in: {lines[0]}"
    return lines[0]


def created(workdir: Path, config_file: str) -> list[str]:
    return sorted(p.name for p in workdir.iterdir() if p.name != Path(config_file).name)


def test_an_empty_journal_location_is_refused_not_the_current_directory(workdir, capsys) -> None:
    config = write(workdir / "w.yaml", SMALL)
    refused(capsys, ["run", config, "--journal", ""], EXIT_INPUT, "journal")
    assert created(workdir, config) == []


def test_a_journal_that_is_a_regular_file_is_refused(workdir, capsys) -> None:
    config = write(workdir / "w.yaml", SMALL)
    (workdir / "taken").write_text("a file")
    refused(capsys, ["run", config, "--journal", "taken"], EXIT_INPUT, "taken", "not a directory")
    refused(capsys, ["run", config, "--journal", "taken/deeper/j"], EXIT_INPUT, "taken", "not a directory")
    assert (workdir / "taken").read_text() == "a file"


def test_a_journal_that_cannot_be_written_is_refused(workdir, capsys) -> None:
    config = write(workdir / "w.yaml", SMALL)
    locked = workdir / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        # Permission bits do not bind root; /proc refuses new entries to everyone.
        target = str(locked / "j") if not os.access(locked, os.W_OK) else "/proc/rollout-journal-test"
        refused(capsys, ["run", config, "--journal", target], EXIT_INPUT, target)
        assert not os.path.exists(target)
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o700)


def test_an_empty_workload_file_is_refused_not_run_as_the_default(workdir, capsys) -> None:
    config = write(workdir / "empty.yaml", "")
    refused(capsys, ["run", config, "--journal", "j"], EXIT_INPUT, "empty.yaml", "empty")
    assert created(workdir, config) == []


@pytest.mark.parametrize("text", ["- name: a\n- name: b\n", "just a string\n", "42\n"])
def test_a_workload_whose_top_level_is_not_a_mapping_is_refused(workdir, capsys, text: str) -> None:
    config = write(workdir / "w.yaml", text)
    refused(capsys, ["run", config, "--journal", "j"], EXIT_INPUT, "w.yaml", "mapping")
    assert created(workdir, config) == []


def test_an_unknown_environment_is_refused_before_the_journal_is_created(workdir, capsys) -> None:
    config = write(workdir / "w.yaml", SMALL.replace("counter", "wrokplace"))
    refused(capsys, ["run", config, "--journal", "j"], EXIT_INPUT, "wrokplace", "workplace")
    assert created(workdir, config) == []


@pytest.mark.parametrize("value", ['","', '" , "', '""'])
def test_an_environment_list_naming_nothing_is_refused(workdir, capsys, value: str) -> None:
    config = write(workdir / "w.yaml", SMALL.replace("environment: counter", f"environment: {value}"))
    refused(capsys, ["run", config, "--journal", "j"], EXIT_INPUT, "environment")
    assert created(workdir, config) == []


def test_a_kafka_port_that_is_no_number_is_refused_at_once(workdir, capsys) -> None:
    config = write(workdir / "w.yaml", SMALL)
    refused(capsys, ["run", config, "--journal", "kafka://localhost:9O92/ns"], EXIT_INPUT, "9O92", "port")


@pytest.mark.parametrize("name", ["team/exp1", "a b", "workload:x", ""])
def test_a_workload_name_the_journal_cannot_key_is_refused(workdir, capsys, name: str) -> None:
    config = write(workdir / "w.yaml", SMALL.replace("name: cli", f"name: {name!r}"))
    refused(capsys, ["run", config, "--journal", "j"], EXIT_INPUT, "name")
    assert created(workdir, config) == []


def test_a_typo_in_a_setting_is_one_line_naming_it(workdir, capsys) -> None:
    config = write(workdir / "w.yaml", SMALL + "grops: 2\nmodel:\n  max_tokens: 0\n")
    line = refused(capsys, ["run", config, "--journal", "j"], EXIT_INPUT, "grops", "model.max_tokens")
    assert "errors.pydantic.dev" not in line
    assert "'grops': no such setting; did you mean 'groups'?" in line


def test_a_typo_in_a_model_setting_gets_the_setting_it_meant(workdir, capsys) -> None:
    config = write(workdir / "w.yaml", SMALL + "model:\n  temprature: 0.7\n  xyzzy: 1\n")
    line = refused(capsys, ["run", config, "--journal", "j"], EXIT_INPUT, "model.temprature", "model.xyzzy")
    assert "did you mean 'temperature'?" in line and "the settings here: backend, path" in line


def test_unreadable_or_broken_workload_files_are_one_line(workdir, capsys) -> None:
    refused(capsys, ["run", "missing.yaml"], EXIT_INPUT, "missing.yaml")
    refused(capsys, ["run", str(workdir)], EXIT_INPUT, str(workdir))
    broken = write(workdir / "broken.yaml", "name: [unclosed\n")
    refused(capsys, ["run", broken], EXIT_INPUT, "broken.yaml", "line")
    assert created(workdir, broken) == []


def test_a_journal_held_by_another_writer_is_its_own_exit_code(workdir, capsys) -> None:
    config = write(workdir / "w.yaml", SMALL)
    holder = FileBackend(workdir / "j")
    try:
        refused(capsys, ["resume", config, "--journal", "j"], EXIT_WRITER_TAKEN, "locked")
    finally:
        holder.close()


def test_demo_refuses_an_empty_journal_location(workdir, capsys) -> None:
    refused(capsys, ["demo", "--journal", ""], EXIT_INPUT, "journal")
    assert list(workdir.iterdir()) == []


def test_the_exit_codes_are_documented_in_help_and_distinct() -> None:
    text = build_parser().format_help()
    assert "exit codes (" in text
    from rollout_journal.replay import exit_codes

    codes = {
        name: value for name, value in vars(exit_codes).items() if name.startswith("EXIT_") and isinstance(value, int)
    }
    assert len(set(codes.values())) == len(codes), codes
    for code in codes.values():
        assert f"\n  {code} " in text, f"exit code {code} is not documented in --help"


def test_every_error_class_maps_to_a_documented_code() -> None:
    from rollout_journal.journal.errors import CorruptRecordError, RecordLocation, WriterLockedError
    from rollout_journal.participants.workload.config import TopologyChangedError
    from rollout_journal.replay import exit_codes

    assert exit_code_for(WriterLockedError("x")) == EXIT_WRITER_TAKEN
    assert exit_code_for(CorruptRecordError(RecordLocation("t", 0, 1), "bad")) == exit_codes.EXIT_JOURNAL_DAMAGED
    assert exit_code_for(TopologyChangedError("x")) == exit_codes.EXIT_TOPOLOGY_CHANGED
    assert exit_code_for(PermissionError(13, "Permission denied")) == exit_codes.EXIT_JOURNAL_FAILED


def test_the_installed_entry_point_prints_one_line_and_the_code(tmp_path: Path) -> None:
    config = write(tmp_path / "w.yaml", SMALL.replace("counter", "nope"))
    env = {k: v for k, v in os.environ.items() if k != "KAFKA_BOOTSTRAP_SERVERS"} | {"PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "rollout_journal.replay.cli.main", "run", config, "--journal", str(tmp_path / "j")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    assert done.returncode == EXIT_INPUT
    assert done.stderr.count("\n") == 1 and "nope" in done.stderr, done.stderr
    assert not (tmp_path / "j").exists()


def test_a_good_workload_still_runs(workdir, capsys) -> None:
    config = write(workdir / "w.yaml", SMALL)
    assert main(["run", config, "--journal", "j", "--json"]) == EXIT_OK
    assert (workdir / "j" / "log").is_dir()
    assert main(["resume", config, "--journal", "j", "--json"]) == EXIT_OK
    assert EXIT_USAGE == 2  # argparse's own


def test_crash_drill_options_are_checked_before_anything_runs(workdir, capsys) -> None:
    config = write(workdir / "w.yaml", SMALL)
    with pytest.raises(SystemExit) as exited:
        main(["run", config, "--crash-after", "0"])
    assert exited.value.code == EXIT_USAGE and "--crash-after: 0 is not a positive number" in capsys.readouterr().err
    refused(capsys, ["run", config, "--crash-delay", "1"], EXIT_USAGE, "--crash-delay needs --crash-after")
    assert created(workdir, config) == []


def test_a_replay_without_a_journal_and_a_fork_of_an_unknown_rollout_are_refused(workdir, capsys) -> None:
    """Issue 17 (7): both exited 8 (any other error); the table says 2 for no journal named (a usage
    error) and 3 for a rollout the journal does not hold."""
    refused(capsys, ["replay", "list", ""], EXIT_USAGE, "--journal")
    config = write(workdir / "w.yaml", SMALL)
    assert main(["run", config, "--journal", "j", "--json"]) == EXIT_OK
    capsys.readouterr()
    refused(capsys, ["fork", "--journal", "j", "no-such-rollout", "--at-turn", "1"], EXIT_INPUT, "no-such-rollout")
