"""Journals written by an earlier version still read the same (``tests/golden.py`` says how
they were made): a change that breaks old journals fails here, not in a user's restore."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from journal import Journal, open_journal
from tests.golden import GOLDEN, PARTITIONS, RecordDumpBackend, derive, golden_workload

EXPECTED = json.loads((GOLDEN / "expected.json").read_text())


def test_a_golden_file_journal_restores_lists_and_audits_as_when_it_was_written(tmp_path: Path) -> None:
    copy = tmp_path / "journal"
    shutil.copytree(GOLDEN / "file-journal", copy)
    config = golden_workload(str(copy))
    with open_journal(str(copy), read_only=True) as journal:
        assert derive(journal, config) == EXPECTED["file"]


def test_golden_kafka_records_restore_lists_and_audit_as_when_they_were_written() -> None:
    rows = [json.loads(line) for line in (GOLDEN / "kafka-records.jsonl").read_text().splitlines()]
    assert {row["topic"] for row in rows} == {"events", "snapshots"}
    config = golden_workload("kafka://127.0.0.1:9092/golden")  # never opened: the records come from the dump
    with Journal(RecordDumpBackend(rows, PARTITIONS)) as journal:
        assert derive(journal, config) == EXPECTED["kafka"]


@pytest.mark.parametrize("backend", ["file", "kafka"])
def test_the_golden_history_holds_what_it_was_made_to_hold(backend: str) -> None:
    """The golden sets exercise what old journals must keep doing: an acknowledged rollout,
    rollouts three attempts in, restart-only rollouts that started over twice, signed heads."""
    expected = EXPECTED[backend]
    rollouts = expected["rollouts"]
    assert rollouts["golden-g0-s0"] is None  # acknowledged: its snapshot and fence are gone
    assert {r["attempt"] for r in rollouts.values() if r} == {3}
    assert [rid for rid, r in rollouts.items() if r and r["restarts"] == 2] == ["golden-g2-s0", "golden-g2-s1"]
    assert expected["audit"]["chain_ok"] and expected["audit"]["anchors_verified"]
    assert expected["audit"]["anchored"] == "yes"
