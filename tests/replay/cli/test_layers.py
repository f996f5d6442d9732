"""The offline commands import nothing that runs a rollout: each runs in a fresh interpreter on a
real journal and must not have loaded the live path (runner, agent, the fleet worker, the model gate
and backends, the resource server) nor the command line's live module."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_journal.participants.model.folders import policy_version_of
from rollout_journal.participants.model.tiny_model import default_tokenizer, tiny_model_dir
from tests.support.replay_journals import SyntheticRollout, write_journal

LIVE = [
    "rollout_journal.replay.cli.live",
    "rollout_journal.participants.workload.run",
    "rollout_journal.participants.workload.runner",
    "rollout_journal.participants.workload.restore",
    "rollout_journal.participants.workload.agent",
    "rollout_journal.participants.workload.worker",
    "rollout_journal.participants.workload.checkpoint",
    "rollout_journal.participants.model.gate",
    "rollout_journal.participants.model.torch_backend",
    "rollout_journal.participants.model.vllm_backend",
    "rollout_journal.participants.model.openai_backend",
    "rollout_journal.participants.remote.host",
    "rollout_journal.participants.remote.app",
    "rollout_journal.participants.remote.server",
    "rollout_journal.participants.remote.serving",
]
OFFLINE = {
    "list": ["replay", "list"],
    "show": ["replay", "show", "lay-g0-s0"],
    "state": ["replay", "state", "lay-g0-s0/mail", "--revision", "0"],
    "status": ["status"],
    "audit": ["audit"],
    "verify": ["verify"],
    "export": ["export", "--out", "{tmp}/copy"],
    "export-training": ["export-training", "--out", "{tmp}/rows.jsonl"],
    "report": ["replay", "report", "--html", "{tmp}/report"],
}


@pytest.fixture(scope="module")
def journal(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("layers") / "journal"
    r = SyntheticRollout("lay-g0-s0", "lay-g0", default_tokenizer(), policy_version_of(tiny_model_dir()))
    r.start()
    r.turn()
    r.turn(reward=1.0)
    r.finish(1.0)
    write_journal(root, [r])
    return root


def loaded_by(argv: list[str], journal: Path, tmp: Path) -> list[str]:
    argv = [a.format(tmp=tmp) for a in argv] + ["--journal", str(journal)]
    script = (
        "import json, sys\n"
        "from rollout_journal.replay.cli.main import main\n"
        f"code = main({argv!r})\n"
        "print(json.dumps({'code': code, 'modules': sorted(m for m in sys.modules if m.startswith('rollout_journal'))}))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["code"] in (0, 3), f"{argv}: exit {result['code']}: {done.stderr}"  # state: no such resource
    return result["modules"]


@pytest.mark.parametrize("command", sorted(OFFLINE))
def test_an_offline_command_loads_nothing_that_runs_a_rollout(command: str, journal: Path, tmp_path: Path) -> None:
    modules = loaded_by(OFFLINE[command], journal, tmp_path)
    assert "rollout_journal.replay.cli.offline" in modules
    assert [m for m in LIVE if m in modules] == []


def test_fork_loads_nothing_that_runs_a_rollout(journal: Path, tmp_path: Path) -> None:
    modules = loaded_by(["fork", "lay-g0-s0", "--at-turn", "0", "--journal-out", "{tmp}/forks"], journal, tmp_path)
    assert [m for m in LIVE if m in modules] == []


def _commands(parser, path: tuple[str, ...] = ()):
    """Every command path of the CLI, with the parser that reads it."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))
    yield path, parser


def test_every_command_names_its_handler_as_a_module_and_a_function() -> None:
    """A handler is found by name when its command runs (``module:function`` under the CLI package),
    so building the parser imports no command's code; a function object there would break the command."""
    from importlib import import_module

    from rollout_journal.replay.cli.main import COMMANDS, build_parser

    for path, parser in _commands(build_parser()):
        if not path or parser._subparsers is not None:
            continue  # a group of subcommands: its members are checked
        handler = parser.get_default("run") or COMMANDS.get(path[0])
        assert isinstance(handler, str) and handler.count(":") == 1, (path, handler)
        module, function = handler.split(":")
        assert callable(getattr(import_module(f"rollout_journal.replay.cli.{module}"), function)), (path, handler)
