"""Every log line has a timestamp, a level, the logger and named fields, as logfmt text or (with
``--log-format json``) JSON, and ``-v`` works wherever it stands on the command line."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_journal.replay.cli.live import worker_event
from rollout_journal.replay.cli.logs import JsonFormatter, LogfmtFormatter, split_logging_options


def record(msg: str, *args: object, **fields: object) -> logging.LogRecord:
    made = logging.LogRecord("rollout_journal.worker", logging.INFO, __file__, 1, msg, args, None)
    made.fields = fields
    return made


def test_v_and_log_format_are_taken_from_anywhere_before_a_double_dash() -> None:
    assert split_logging_options(["replay", "list", "-v", "--journal", "j"]) == (
        ["replay", "list", "--journal", "j"],
        True,
        "text",
    )
    assert split_logging_options(["-v", "status", "--log-format", "json"]) == (["status"], True, "json")
    assert split_logging_options(["run", "w.yaml", "--log-format=json"]) == (["run", "w.yaml"], False, "json")
    assert split_logging_options(["x", "--", "-v"]) == (["x", "--", "-v"], False, "text")


def test_a_worker_event_becomes_a_line_of_named_fields_with_its_time() -> None:
    what, fields = worker_event("takeover-seconds 0,3,6,9 1.176 3.334")
    assert (what, fields) == (
        "takeover",
        {"partitions": "0,3,6,9", "read_seconds": "1.176", "restore_seconds": "3.334"},
    )
    line = LogfmtFormatter().format(record(what, **fields))
    assert re.fullmatch(
        r"ts=\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z level=info logger=rollout_journal\.worker msg=takeover "
        r"partitions=0,3,6,9 read_seconds=1\.176 restore_seconds=3\.334",
        line,
    ), line
    doc = json.loads(JsonFormatter().format(record("rollout %s: dropped", "r-1", reason="taken over")))
    assert doc["msg"] == "rollout r-1: dropped" and doc["reason"] == "taken over" and doc["level"] == "info"
    assert doc["ts"].endswith("Z") and doc["logger"] == "rollout_journal.worker"
    assert LogfmtFormatter().format(record("a b", why='x "y"')).endswith('msg="a b" why="x \\"y\\""')


@pytest.mark.parametrize("form", ["text", "json"])
def test_a_command_logs_in_the_format_asked_with_v_after_the_command(form: str, tmp_path: Path) -> None:
    """``run -v`` on a real workload: INFO lines from the library, each with its time and fields."""
    config = tmp_path / "w.yaml"
    config.write_text(f"name: lg\ngroups: 1\nsiblings: 1\nmax_turns: 1\njournal: {tmp_path / 'j'}\n")
    done = subprocess.run(
        [sys.executable, "-m", "rollout_journal.replay.cli.main", "run", str(config), "-v", "--log-format", form],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    logs = [l for l in done.stderr.splitlines() if l.startswith(("ts=", "{"))]
    assert logs, done.stderr
    for line in logs:
        if form == "json":
            doc = json.loads(line)
            assert {"ts", "level", "logger", "msg"} <= doc.keys()
        else:
            assert re.match(r"ts=\S+Z level=\w+ logger=\S+ msg=", line), line
