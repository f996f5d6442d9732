"""Attacks on the summaries' promise (``journal/summary.py``): sequences where ``replay list``
(the summaries) and ``replay list --scan`` (every event, fenced) must still agree, and where the
writer path must keep working as it did before summaries. Real broker, real journals."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from bench.common import turn_events
from rollout_journal.journal.events import AttemptStarted, Header, Message, RolloutEvent, RolloutFailed
from rollout_journal.journal.open import open_journal
from rollout_journal.journal.restore import load_rollouts
from rollout_journal.journal.summary import summary_of
from rollout_journal.replay.listing import Listing, list_rollouts
from rollout_journal.replay.source import open_replay

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]


def start(rid: str, attempt: int = 1, seq: int = 0, resumed_from_turn: int = 0) -> AttemptStarted:
    header = Header(rid, rid.rsplit("-", 1)[0], attempt, attempt, resumed_from_turn, seq, Header.now_ms(), "test")
    return AttemptStarted(header, resumed_from_turn, "topology", "test", [Message("user", "task")])


def turn(rid: str, t: int, seq: int, attempt: int = 1) -> list[RolloutEvent]:
    return turn_events(rid, t, seq, np.random.default_rng(t), prompt_delta=8, output=4, attempt=attempt)


def listings(location: str) -> tuple[Listing, Listing]:
    """(``replay list``, ``replay list --scan``)."""
    with open_replay(location) as source:
        return list_rollouts(source), list_rollouts(source, scan=True)


def rows(listing: Listing) -> dict[str, dict]:
    return {row.rollout_id: row.as_json() for row in listing.rows}


@pytest.fixture
def location(kafka_bootstrap: str) -> str:
    return f"kafka://{kafka_bootstrap}/atk{uuid.uuid4().hex[:8]}?partitions=2"


def test_a_zombie_event_committed_between_the_successors_restore_and_its_start(location: str) -> None:
    """The successor restores (reading seq 0-3), the zombie then commits one more event (seq 4,
    epoch 1), then the successor's AttemptStarted takes seq 4 (epoch 2). The scan admits the
    zombie's event (its fence learns epoch 2 only at the AttemptStarted, which comes later in the
    log) and folds it without damage; the successor's summary, folded from its restore, lacks it."""
    rid = "race-g0-s0"
    with open_journal(location, writer="a") as zombie:
        zombie.append_sync([start(rid), *turn(rid, 0, 1)])
        with open_journal(location, writer="b") as successor:
            history = load_rollouts(successor).rollouts[rid]
            successor.note_summary(rid, summary_of(successor.codec, history))  # what a restore does
            zombie.append_sync(turn(rid, 1, 4)[:1])  # the zombie's model call of turn 1, seq 4
            successor.append_sync([start(rid, attempt=2, seq=4, resumed_from_turn=1)])
            successor.append_sync(turn(rid, 1, 5, attempt=2))
    summarized, scanned = listings(location)
    assert not any(row.damaged for row in scanned.rows)  # the scan folds it cleanly
    assert summarized.read == "summaries"
    diff = {k: (v, rows(scanned)[rid][k]) for k, v in rows(summarized)[rid].items() if rows(scanned)[rid][k] != v}
    assert diff == {}, f"summaries vs scan: {diff}; events {summarized.events} vs {scanned.events}"
    assert summarized.events == scanned.events


def test_a_failure_whose_reason_is_large_is_journaled_as_before(location: str) -> None:
    """A RolloutFailed whose reason is over a record's size was journaled in pieces (EventChunk)
    before summaries; its summary carries the reason whole in one record (``failure``), and the
    snapshot of that commit carries that summary."""
    rid = "bigfail-g0-s0"
    with open_journal(location, writer="w0") as journal:
        journal.append_sync([start(rid), *turn(rid, 0, 1)])
        header = Header(rid, "bigfail-g0", 1, 1, 1, 4, Header.now_ms(), "test")
        reason = "tool output: " + "x" * 1_500_000  # an exception's message carrying a tool's output
        journal.append_sync([RolloutFailed(header, "ToolError", reason)])
    summarized, scanned = listings(location)
    assert rows(summarized) == rows(scanned)
    assert rows(scanned)[rid]["failures"] == 1


OLD_WRITER = """
import sys
import numpy as np
from bench.common import turn_events
from rollout_journal.journal.events import AttemptStarted, Header, Message
from rollout_journal.journal.open import open_journal

location, continued, fresh = sys.argv[1:4]
assert "summary" not in open_journal.__globals__ and not hasattr(__import__("rollout_journal.journal.events",
    fromlist=["x"]), "RolloutSummary"), "not the old version"

def turn(rid, t, seq):
    return turn_events(rid, t, seq, np.random.default_rng(t), prompt_delta=8, output=4)

with open_journal(location, writer="old") as journal:
    journal.append_sync(turn(continued, 1, 4))  # a hand-off: the old member continues a rollout
    h = Header(fresh, fresh.rsplit("-", 1)[0], 1, 1, 0, 0, Header.now_ms(), "old")
    journal.append_sync([AttemptStarted(h, 0, "topology", "test", [Message("user", "task")]), *turn(fresh, 0, 1)])
"""


def _old_version(tmp_path: Path) -> Path:
    """The code of the commit before summaries, importable as rollout_journal (cwd: its root)."""
    repo = Path(__file__).resolve().parents[3]
    old = tmp_path / "old"
    old.mkdir()
    try:
        archive = subprocess.run(
            ["git", "-C", str(repo), "archive", f"{SUMMARIES_COMMIT}^", *OLD_DIRS], check=True, capture_output=True
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"the version before summaries is not in this checkout's git: {exc}")
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
    ns = old / "ns" / "rollout_journal"
    ns.mkdir(parents=True)
    for d in OLD_DIRS[:-1]:
        (ns / d).symlink_to(old / d)
    return old


SUMMARIES_COMMIT = "d85be5d"  # "journal: each commit writes its rollouts' summaries; list reads them"
OLD_DIRS = ["journal", "participants", "replay", "schemas", "compose", "bench"]


def test_a_writer_of_the_version_before_summaries_on_a_namespace_this_version_created(
    location: str, tmp_path: Path
) -> None:
    """A rolling upgrade: this version created the namespace (and marked its summaries complete);
    a member still on the previous version takes a partition over and continues a rollout, and
    starts another. It writes no summaries: the listing misses the new rollout and shows the
    continued one as it stood before the hand-off, while the scan shows both as they are."""
    continued, fresh = "mixed-g0-s0", "mixed-g1-s0"
    with open_journal(location, writer="new") as journal:
        journal.append_sync([start(continued), *turn(continued, 0, 1)])
    old = _old_version(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(old / "ns")}
    ran = subprocess.run(
        [sys.executable, "-c", OLD_WRITER, location, continued, fresh],
        cwd=old,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    summarized, scanned = listings(location)
    assert {r: row["turns"] for r, row in rows(scanned).items()} == {continued: 2, fresh: 1}
    assert summarized.read == "summaries"
    assert rows(summarized) == rows(scanned)


def test_a_give_up_after_a_long_failure_with_its_final_snapshot_is_journaled_as_before(location: str) -> None:
    """A failure whose reason fits a summary record on its own, then the give-up in one commit with
    the final snapshot (as ``Agent.give_up`` writes it): the snapshot record carries the summary,
    failure and all, beside an inline state; together they are over what the broker takes."""
    from rollout_journal.journal.events import RolloutGivenUp
    from rollout_journal.journal.snapshots import SnapshotDraft

    rid = "giveup-g0-s0"
    with open_journal(location, writer="w0") as journal:
        journal.append_sync([start(rid), *turn(rid, 0, 1)])
        reason = "tool output: " + "x" * 800_000
        failed = Header(rid, "giveup-g0", 1, 1, 1, 4, Header.now_ms(), "test")
        journal.append_sync([RolloutFailed(failed, "ToolError", reason)])
        given_up = Header(rid, "giveup-g0", 1, 1, 1, 5, Header.now_ms(), "test")
        state = bytes(250_000)  # under the journal's inline limit (256 KiB): written in the snapshot record itself
        journal.append_sync(
            [RolloutGivenUp(given_up, 1, "ToolError", reason)], SnapshotDraft(given_up, "finished", 5, state)
        )
    summarized, scanned = listings(location)
    assert rows(summarized) == rows(scanned)
    assert rows(scanned)[rid]["status"] == "given up"


def test_an_acknowledgement_applied_at_a_take_leaves_a_whole_summary(location: str) -> None:
    """A take (``take_and_restore``) applies the acknowledgements that waited for an owner right
    after ``load_rollouts`` and before any ``trusted_restore``: the writer does not know the
    rollout's fold yet, so the acknowledgement's summary is written incomplete, and the rollout,
    acknowledged, is never restored again: every listing folds its partition's events from then on
    (right, but as slow as a scan, for every rollout a trainer acknowledged across a hand-off)."""
    from rollout_journal.journal.events import RolloutAcknowledged, RolloutFinished
    from rollout_journal.journal.snapshots import SnapshotDraft
    from rollout_journal.journal.summary import load_summaries
    from rollout_journal.journal.takeover import apply_waiting_acks

    rid = "acked-g0-s0"
    finished = Header(rid, "acked-g0", 1, 1, 1, 4, Header.now_ms(), "test")
    with open_journal(location, writer="w0") as runner:
        runner.append_sync([start(rid), *turn(rid, 0, 1)])
        runner.append_sync([RolloutFinished(finished, 1.0, 1, "{}")], SnapshotDraft(finished, "finished", 4, b"s"))
    # The owner is gone; the trainer acknowledges (to <ns>.acks, for whoever owns the partition next).
    with open_journal(location, writer="trainer") as trainer:
        ack = RolloutAcknowledged(Header(rid, "acked-g0", 1, 1, 1, 5, Header.now_ms(), "trainer"), "trainer")
        trainer.request_acknowledgement(ack).result()
    with open_journal(location, writer="w0") as owner:  # the next owner's take
        plan = load_rollouts(owner)
        assert rid in plan.rollouts  # finished, its acknowledgement waiting
        apply_waiting_acks(owner, owner.partition_of(rid), plan)  # what take_and_restore does next
        assert rid in plan.acknowledged
        index = load_summaries(owner.codec, owner.backend.read_summaries())
    summarized, scanned = listings(location)
    assert rows(summarized) == rows(scanned) and rows(scanned)[rid]["status"] == "acknowledged"
    assert index.summaries[rid].complete, "the acknowledged rollout's summary is incomplete for good"
