"""The README's exit-code table is true: every example failure it lists is run here, and the code
it ends with is the one the table gives. A row added to the table needs its failure added here."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from rollout_journal.journal.events import AttemptStarted, Header, ResourceMutation, TurnCompleted
from rollout_journal.journal.file.backend import FileBackend
from rollout_journal.journal.journal import Journal
from rollout_journal.participants.workload.config import WorkloadConfig
from rollout_journal.replay import exit_codes
from rollout_journal.replay.cli.crash import WorkloadChildError, crash_midway
from rollout_journal.replay.cli.main import main
from tests.support.paths import REPO_ROOT

README = REPO_ROOT / "README.md"


def readme_table() -> dict[int, tuple[str, list[str]]]:
    """code -> (meaning, example failures), from the README's table."""
    text = README.read_text()
    start = text.index("| code | meaning | for example |")
    rows = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        code, meaning, examples = (cell.strip() for cell in line.strip("|").split(" | "))
        rows[int(code)] = (meaning, [e.strip() for e in examples.split(";") if e.strip()])
    return rows


def tiny_workload(tmp: Path, name: str = "ex", **overrides: object) -> Path:
    config = {
        "name": name,
        "groups": 1,
        "siblings": 1,
        "max_turns": 1,
        "environment": "workplace",
        "journal": str(tmp / "journal"),
    } | overrides
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def altered_chain(tmp: Path) -> list[str]:
    """A journal whose one mutation's chain hash was rewritten."""
    root = tmp / "altered"

    def header(seq: int) -> Header:
        return Header("r1", "g", 1, 1, 0, seq, 0, "w")

    with Journal(FileBackend(root)) as journal:
        journal.append_sync(
            [
                AttemptStarted(header(0), 0, "t", "new rollout"),
                ResourceMutation(
                    header(1), "r1/notes", "notes", "add", '{"text": "a"}', "r1/t0/m0", 0, 1, "{}", "d" * 64, "0" * 64
                ),
                TurnCompleted(header(2), [], [], {"r1/notes": 1}),
            ]
        )
    return ["audit", "--journal", str(root)]


def flipped_byte(tmp: Path) -> list[str]:
    """A journal of three commits, a byte of the first one's record flipped (its frame's CRC fails)."""
    root = tmp / "flipped"
    with Journal(FileBackend(root)) as journal:
        for r in ("r1", "r2", "r3"):
            journal.append_sync([AttemptStarted(Header(r, "g", 1, 1, 0, 0, 0, "w"), 0, "t", "new rollout " * 8)])
    segment = min((root / "log").glob("*.seg"))
    data = bytearray(segment.read_bytes())
    data[len(data) // 6] ^= 0xFF
    segment.write_bytes(bytes(data))
    return ["replay", "list", "--journal", str(root)]


def ran_once(tmp: Path) -> Path:
    path = tiny_workload(tmp)
    assert main(["run", str(path)]) == 0
    return path


def resumed_with_another_topology(tmp: Path) -> int:
    from rollout_journal.participants.workload.run import run_workload
    from rollout_journal.participants.workload.specs import workload_specs

    config = WorkloadConfig.load(tiny_workload(tmp, max_turns=2))
    run_workload(config, resume=False, stop_after={s.rollout_id: 1 for s in workload_specs(config)})  # unfinished
    return main(["resume", str(tiny_workload(tmp, max_turns=3))])


def writer_held(tmp: Path) -> int:
    path = tiny_workload(tmp, "held")
    root = Path(yaml.safe_load(path.read_text())["journal"])
    holder = subprocess.Popen(  # another process writes the journal
        [
            sys.executable,
            "-c",
            f"from rollout_journal.journal.file.backend import FileBackend; b = FileBackend({str(root)!r}); print('held', flush=True); input()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        return main(["run", str(path)])
    finally:
        holder.communicate("\n", timeout=30)


def kafka_user_without_cluster(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(sys, "stdin", __import__("io").StringIO("a-password\n"))
    return main(["kafka", "user", "ns-a", "--state-dir", str(tmp / "no-kafka")])


EXAMPLES: dict[str, Callable[[Path, pytest.MonkeyPatch], int]] = {
    "`audit` of a journal whose hash chain was altered": lambda tmp, mp: main(altered_chain(tmp)),
    "`replay list` with no journal named": lambda tmp, mp: (
        mp.delenv("ROLLOUT_JOURNAL_URL", raising=False),
        main(["replay", "list"]),
    )[1],
    "`export-training --format csv`": lambda tmp, mp: _argparse_code(
        ["export-training", "--journal", str(tmp), "--out", "x", "--format", "csv"]
    ),
    "`replay show nobody`": lambda tmp, mp: main(["replay", "show", "nobody", "--journal", altered_chain(tmp)[-1]]),
    "`run` of an empty workload file": lambda tmp, mp: (
        (tmp / "empty.yaml").write_text(""),
        main(["run", str(tmp / "empty.yaml")]),
    )[1],
    "`run` of a workload the journal already holds": lambda tmp, mp: main(["run", str(ran_once(tmp))]),
    "`resume` with another `max_turns`": lambda tmp, mp: resumed_with_another_topology(tmp),
    "`replay list` of a journal with a flipped byte": lambda tmp, mp: main(flipped_byte(tmp)),
    "`run` while another process writes the journal": lambda tmp, mp: writer_held(tmp),
    "`replay list` of an unreachable Kafka cluster": lambda tmp, mp: main(
        ["replay", "list", "--journal", "kafka://127.0.0.1:1/nobody?operation_timeout_ms=500"]
    ),
    "`kafka user` with no local cluster": kafka_user_without_cluster,
}
ELSEWHERE = {  # run by the tests named in the table
    "a worker of another namespace (`tests/journal/kafka/test_security.py`)",
}


def _argparse_code(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert isinstance(exited.value.code, int)
    return exited.value.code


def test_the_readme_table_is_the_codes_table() -> None:
    documented = readme_table()
    constants = {v for k, v in vars(exit_codes).items() if k.startswith("EXIT_") and isinstance(v, int)}
    assert set(documented) == constants
    help_codes = {int(m) for m in re.findall(r"^  (\d+) ", exit_codes.EXIT_CODES_HELP, re.M)}
    assert help_codes == constants  # --help prints every code too
    examples = {e for _, (_, found) in documented.items() for e in found}
    assert examples == set(EXAMPLES) | ELSEWHERE, "every example in the table is run below"


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_each_documented_failure_ends_with_its_code(
    example: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    expected = next(code for code, (_, found) in readme_table().items() if example in found)
    code = EXAMPLES[example](tmp_path, monkeypatch)
    err = capsys.readouterr().err
    assert code == expected, f"{example}: exit {code}, the README says {expected}; stderr: {err}"
    if code >= 2:  # a failure ends with one line saying what failed (after any warnings logged on the way)
        last = err.strip().splitlines()[-1]
        assert (
            last.startswith("rollout-journal" if code == 2 else "rollout-journal: ") or "kafka user: error:" in last
        ), err


def test_demo_ends_with_its_childs_code_when_the_child_fails(tmp_path: Path) -> None:
    path = ran_once(tmp_path)
    config = WorkloadConfig.load(path)
    with pytest.raises(WorkloadChildError) as failed:
        crash_midway(config, 1)  # its child's `run` finds the workload there already: refused input
    assert failed.value.exit_code == exit_codes.EXIT_INPUT
    assert exit_codes.exit_code_for(failed.value) == exit_codes.EXIT_INPUT
