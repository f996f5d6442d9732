"""Journals written by an earlier version still read the same (``tests/support/golden.py`` says how
they were made): a change that breaks old journals fails here, not in a user's restore."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rollout_journal.journal import Journal, load_rollouts, open_journal
from rollout_journal.journal.restore import history_from_first_event
from rollout_journal.participants.rollout import restore_state
from tests.support.golden import GOLDEN, PARTITIONS, RecordDumpBackend, derive, golden_workload

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


def golden_journal(backend: str, tmp_path: Path) -> Journal:
    if backend == "file":
        copy = tmp_path / "journal"
        shutil.copytree(GOLDEN / "file-journal", copy)
        return open_journal(str(copy), read_only=True)
    rows = [json.loads(line) for line in (GOLDEN / "kafka-records.jsonl").read_text().splitlines()]
    return Journal(RecordDumpBackend(rows, PARTITIONS))


@pytest.mark.parametrize("backend", ["file", "kafka"])
def test_golden_rollouts_restored_from_their_old_snapshots_know_their_attempts_from_the_fence(
    backend: str, tmp_path: Path
) -> None:
    """Their snapshots predate the state's fence history: restore takes the attempts through the
    snapshot's from the rollout's fence record (which these, written before 0.3, kept for the
    newest attempt alone: all a writer once filled a training record from), then folds those the
    events after it start; a replay from the first event folds every attempt."""
    with golden_journal(backend, tmp_path) as journal:
        plan = load_rollouts(journal)
        assert plan.rollouts
        for rollout_id, history in plan.rollouts.items():
            assert history.snapshot is not None and history.fence is not None
            attempts = restore_state(history).attempts
            assert attempts is not None and set(history.fence.history) <= set(attempts), rollout_id
            replayed = restore_state(history_from_first_event(journal, history)).attempts
            assert replayed is not None and [e.attempt for e in replayed] == list(range(1, attempts[-1].attempt + 1))
            assert replayed[-len(attempts) :] == attempts
