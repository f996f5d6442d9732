"""Audit of resource mutations: a vandal who rewrites a file journal (valid frame CRCs and
commit markers, so no storage check notices) is named record by record, and with signed
chain heads even a chain recomputed consistently is caught without trusting the journal."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout_journal.journal import ReadReport, ResourceMutation, open_journal
from rollout_journal.journal.anchoring import HeadSigner, HeadVerifier
from rollout_journal.journal.events import HeadCheckpoint, TurnCompleted
from rollout_journal.replay.audit import AuditSummary, Problem, audit_events
from rollout_journal.replay.cli.main import main as cli_main
from rollout_journal.replay.exit_codes import EXIT_INPUT
from tests.support.journal_tamper import TamperedLog
from tests.support.replay_journals import crashed_and_resumed


@pytest.fixture(scope="module")
def writer_key() -> HeadSigner:
    return HeadSigner.generate()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory, writer_key: HeadSigner) -> dict[str, Path]:
    """One journal written without a key and one with signed heads, from the same workload."""
    root = tmp_path_factory.mktemp("pristine")
    crashed_and_resumed(str(root / "unsigned"), None)
    crashed_and_resumed(str(root / "signed"), writer_key)
    return {"unsigned": root / "unsigned", "signed": root / "signed"}


@pytest.fixture(params=["unsigned", "signed"])
def journal_copy(request: pytest.FixtureRequest, pristine: dict[str, Path], tmp_path: Path) -> Iterator[Path]:
    copy = tmp_path / "journal"
    shutil.copytree(pristine[request.param], copy)
    yield copy


def audit(path: Path, verifier: HeadVerifier | None = None) -> AuditSummary:
    report = ReadReport()
    with open_journal(str(path), read_only=True) as journal:
        _, summary = audit_events(journal.scan(report), report, verifier)
    return summary


def busiest_resource(log: TamperedLog) -> str:
    """The resource with the most mutations in the log (all of one life: workplace is event-sourced)."""
    counts: dict[str, int] = {}
    for event in log.events():
        if isinstance(event, ResourceMutation):
            counts[event.resource_id] = counts.get(event.resource_id, 0) + 1
    resource = max(counts, key=counts.__getitem__)
    assert counts[resource] >= 4, f"the workload mutated no resource 4 times: {counts}"
    return resource


def named(summary: AuditSummary, kind: str, location: str) -> Problem:
    """The problem of ``kind`` naming the record at ``location``."""
    found = [p for p in summary.problems if p.kind == kind and p.location == location]
    assert found, f"no {kind} problem at {location}; problems: {[str(p) for p in summary.problems]}"
    assert not summary.chain_ok
    return found[0]


def test_an_untouched_journal_audits_clean_and_a_rewrite_that_changes_nothing_too(
    journal_copy: Path, writer_key: HeadSigner
) -> None:
    signed = any(isinstance(e, HeadCheckpoint) for e in TamperedLog(journal_copy).events())
    verifier = HeadVerifier(writer_key.public_key) if signed else None
    before = audit(journal_copy, verifier)
    TamperedLog(journal_copy).save()  # the vandal's tool, used with no change at all
    after = audit(journal_copy, verifier)
    for summary in (before, after):
        assert summary.chain_ok, [str(p) for p in summary.problems]
        assert summary.anchored == ("yes" if signed else "no")
        assert summary.anchors_verified is (True if signed else None)


def test_changed_arguments_are_named_at_the_record(journal_copy: Path) -> None:
    log = TamperedLog(journal_copy)
    second = log.mutations(busiest_resource(log))[1]
    forged = dataclasses.replace(second, args_json=json.dumps({"to": "attacker@example.com"}))
    log.replace(second, forged)
    where = log.save()

    problem = named(audit(journal_copy), "altered", where[id(forged)])
    assert problem.revision == second.revision and problem.resource_id == second.resource_id


def test_a_dropped_record_is_a_gap_named_at_the_record_after_it(journal_copy: Path) -> None:
    log = TamperedLog(journal_copy)
    _, second, third, *_ = log.mutations(busiest_resource(log))
    log.drop(second)
    log.renumber(second.header.rollout_id)  # no hole in the seqs: only the chain can tell
    where = log.save()
    after = next(
        e for e in log.events() if isinstance(e, ResourceMutation) and e.idempotency_key == third.idempotency_key
    )

    problem = named(audit(journal_copy), "gap", where[id(after)])
    assert f"r{second.revision} missing after r{second.prev_revision}" in problem.message
    assert "sequence" not in {p.kind for p in audit(journal_copy).problems}


def adjacent_pair_of_one_attempt(mutations: list[ResourceMutation]) -> tuple[ResourceMutation, ResourceMutation]:
    """Two consecutive mutations after the first, written by one rollout in one attempt (a swap
    across a crash would be read as a fenced write instead)."""
    for a, b in zip(mutations[1:], mutations[2:]):
        if (a.header.rollout_id, a.header.epoch) == (b.header.rollout_id, b.header.epoch):
            return a, b
    raise AssertionError("no two consecutive mutations of one attempt")


def test_two_records_swapped_are_named_as_reordered(journal_copy: Path) -> None:
    log = TamperedLog(journal_copy)
    second, third = adjacent_pair_of_one_attempt(log.mutations(busiest_resource(log)))
    log.swap(second, third)  # each takes the other's place and seq
    where = log.save()
    late = next(
        e for e in log.events() if isinstance(e, ResourceMutation) and e.idempotency_key == second.idempotency_key
    )

    summary = audit(journal_copy)
    problem = named(summary, "reordered", where[id(late)])
    assert problem.revision == second.revision
    assert "gap" not in {p.kind for p in summary.problems}  # the hole r3 left is explained by the late record


def test_a_dropped_tail_is_named_at_the_turn_that_still_names_it(journal_copy: Path) -> None:
    log = TamperedLog(journal_copy)
    mutations = log.mutations(busiest_resource(log))
    last = mutations[-1]
    log.drop(last)
    checkpoints = [
        e for e in log.events() if isinstance(e, HeadCheckpoint) and e.header.rollout_id == last.header.rollout_id
    ]
    log.renumber(last.header.rollout_id)
    where = log.save()
    turn = next(
        e
        for e in log.events()
        if isinstance(e, TurnCompleted)
        and e.header.rollout_id == last.header.rollout_id
        and e.header.turn == last.header.turn
    )

    summary = audit(journal_copy)
    problem = named(summary, "dropped_tail", where[id(turn)])
    assert problem.resource_id == last.resource_id and problem.revision == last.revision
    if checkpoints:  # signed: the checkpoint of that commit names the dropped revision as well
        signed_at = [p for p in summary.problems if p.kind == "dropped_tail" and p.location != where[id(turn)]]
        assert signed_at and all(p.revision == last.revision for p in signed_at)


def test_a_turn_naming_a_revision_below_zero_is_a_problem_not_a_crash(journal_copy: Path) -> None:
    """A vandal's TurnCompleted that says a resource no mutation ever touched reached r-1: the audit
    names it (it once failed on the missing chain's last location with an AttributeError)."""
    log = TamperedLog(journal_copy)
    turn = next(e for e in log.events() if isinstance(e, TurnCompleted))
    forged = dataclasses.replace(turn, resource_revisions={**turn.resource_revisions, "ghost": -1})
    log.replace(turn, forged)
    where = log.save()

    problem = named(audit(journal_copy), "inserted", where[id(forged)])
    assert problem.resource_id == "ghost"


def test_a_record_written_twice_is_a_duplicate(journal_copy: Path) -> None:
    log = TamperedLog(journal_copy)
    second = log.mutations(busiest_resource(log))[1]
    copy = dataclasses.replace(second)
    log.insert_after(second, copy)
    log.renumber(second.header.rollout_id)
    where = log.save()
    again = [e for e in log.events() if isinstance(e, ResourceMutation) and e.idempotency_key == second.idempotency_key]

    problem = named(audit(journal_copy), "duplicate", where[id(again[1])])
    assert where[id(again[0])] in problem.message  # it names the original too


def test_a_mutation_from_a_fenced_epoch_is_named(journal_copy: Path) -> None:
    log = TamperedLog(journal_copy)
    resource = busiest_resource(log)
    last = log.mutations(resource)[-1]
    rollout_events = [
        e for e in log.events() if getattr(e, "header", None) and e.header.rollout_id == last.header.rollout_id
    ]
    assert rollout_events[-1].header.epoch >= 2, "the fixture's rollout was resumed: attempt 2 holds the fence"
    zombie = dataclasses.replace(
        last,
        header=dataclasses.replace(last.header, attempt=1, epoch=1, seq=rollout_events[-1].header.seq + 1),
        revision=last.revision + 1,
        prev_revision=last.revision,
        idempotency_key="zombie",
    )
    log.insert_after(rollout_events[-1], zombie)
    where = log.save()

    named(audit(journal_copy), "fenced_epoch", where[id(zombie)])


# -- signed heads -----------------------------------------------------------------------


@pytest.fixture
def signed_copy(pristine: dict[str, Path], tmp_path: Path) -> Path:
    copy = tmp_path / "journal"
    shutil.copytree(pristine["signed"], copy)
    return copy


def recompute_without_the_key(path: Path) -> tuple[TamperedLog, ResourceMutation, str]:
    """Change one mutation's arguments and recompute its resource's chain, hashes and all."""
    log = TamperedLog(path)
    resource = busiest_resource(log)
    second = log.mutations(resource)[1]
    log.replace(second, dataclasses.replace(second, args_json=json.dumps({"to": "attacker@example.com"})))
    log.rechain(resource)
    return log, second, resource


def first_checkpoint_after(log: TamperedLog, mutation: ResourceMutation) -> HeadCheckpoint:
    events = log.events()
    start = next(
        i
        for i, e in enumerate(events)
        if isinstance(e, ResourceMutation) and e.idempotency_key == mutation.idempotency_key
    )
    return next(e for e in events[start:] if isinstance(e, HeadCheckpoint))


def test_a_recomputed_chain_no_longer_matches_its_signed_heads(signed_copy: Path, writer_key: HeadSigner) -> None:
    log, changed, resource = recompute_without_the_key(signed_copy)
    where = log.save()
    summary = audit(signed_copy, HeadVerifier(writer_key.public_key))
    assert not [p for p in summary.problems if p.kind == "altered"], "the plain chain verifies: it was recomputed"
    problem = named(summary, "anchor_mismatch", where[id(first_checkpoint_after(log, changed))])
    assert problem.resource_id == resource and problem.revision == changed.revision
    assert not summary.chain_ok
    # ...and without the public key the heads still disagree with the chain
    assert any(p.kind == "anchor_mismatch" for p in audit(signed_copy).problems)


def test_heads_rewritten_to_match_break_the_signature(signed_copy: Path, writer_key: HeadSigner) -> None:
    log, changed, _ = recompute_without_the_key(signed_copy)
    log.resign_heads(changed.header.rollout_id, signer=None)  # new heads, the old signatures
    where = log.save()
    summary = audit(signed_copy, HeadVerifier(writer_key.public_key))
    problem = named(summary, "bad_signature", where[id(first_checkpoint_after(log, changed))])
    assert "does not verify" in problem.message
    assert summary.anchors_verified is False and summary.anchored == "partly"


def test_a_signature_forged_with_another_key_is_caught(signed_copy: Path, writer_key: HeadSigner) -> None:
    log, changed, _ = recompute_without_the_key(signed_copy)
    vandal = HeadSigner.generate()
    log.resign_heads(changed.header.rollout_id, signer=vandal)
    where = log.save()
    summary = audit(signed_copy, HeadVerifier(writer_key.public_key))
    problem = named(summary, "bad_signature", where[id(first_checkpoint_after(log, changed))])
    assert f"signed by key {vandal.key_id[:16]}" in problem.message
    assert summary.anchors_verified is False


def test_a_forged_signature_claiming_the_writers_key_id_is_caught(signed_copy: Path, writer_key: HeadSigner) -> None:
    log, changed, _ = recompute_without_the_key(signed_copy)
    vandal = HeadSigner.generate()
    vandal.key_id = writer_key.key_id  # claims to be the writer's key
    log.resign_heads(changed.header.rollout_id, signer=vandal)
    where = log.save()
    problem = named(
        audit(signed_copy, HeadVerifier(writer_key.public_key)),
        "bad_signature",
        where[id(first_checkpoint_after(log, changed))],
    )
    assert "does not verify" in problem.message


def test_mutations_after_the_last_checkpoint_are_unanchored(signed_copy: Path, writer_key: HeadSigner) -> None:
    log = TamperedLog(signed_copy)
    resource = busiest_resource(log)
    last = log.mutations(resource)[-1]
    log.drop(first_checkpoint_after(log, last))  # the vandal appended `last` without the key, say
    log.renumber(last.header.rollout_id)  # and closed the seq gap the checkpoint left
    last = log.mutations(resource)[-1]  # renumbering made new records
    where = log.save()
    summary = audit(signed_copy, HeadVerifier(writer_key.public_key))
    problem = named(summary, "unanchored", where[id(last)])
    assert problem.resource_id == resource and problem.revision == last.revision
    assert summary.anchored == "partly"


def test_a_journal_without_checkpoints_is_not_anchored_yet_its_chain_verifies(
    pristine: dict[str, Path], writer_key: HeadSigner
) -> None:
    plain = audit(pristine["unsigned"])
    assert plain.chain_ok and plain.anchored == "no" and plain.checkpoints == 0
    expected = audit(pristine["unsigned"], HeadVerifier(writer_key.public_key))  # the auditor expects anchors
    assert not expected.chain_ok and {p.kind for p in expected.problems} == {"unanchored"}


def test_a_journal_cut_back_at_a_commit_boundary_is_caught_only_by_a_witness(
    signed_copy: Path, writer_key: HeadSigner, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    public = tmp_path / "verify.pem"
    public.write_bytes(writer_key.public_pem())
    assert cli_main(["audit", "--journal", str(signed_copy), "--public-key", str(public), "--json"]) == 0
    witness = tmp_path / "witness.json"  # what an earlier audit printed, kept elsewhere
    witness.write_text(capsys.readouterr().out)
    log = TamperedLog(signed_copy)
    last = next(
        i
        for i in reversed(range(len(log.batches)))
        if any(isinstance(e, ResourceMutation) for _, e in log.batches[i].records)
    )
    cut = [e for _, e in log.batches[last].records if isinstance(e, ResourceMutation)][-1]
    log.batches = log.batches[:last]  # whole commits, signed heads and all: a genuine older journal
    log.save()

    assert audit(signed_copy, HeadVerifier(writer_key.public_key)).chain_ok  # no chain can tell
    assert (
        cli_main(["audit", "--journal", str(signed_copy), "--public-key", str(public), "--witness", str(witness)]) == 1
    )
    out = capsys.readouterr().out
    assert f"PROBLEM truncated: {cut.resource_id} life 0: an earlier audit saw r{cut.revision}" in out


def test_a_rewrite_the_witness_saw_is_named(
    signed_copy: Path, writer_key: HeadSigner, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert cli_main(["audit", "--journal", str(signed_copy), "--json"]) == 0
    witness = tmp_path / "witness.json"
    witness.write_text(capsys.readouterr().out)
    log, changed, resource = recompute_without_the_key(signed_copy)
    log.resign_heads(changed.header.rollout_id, signer=HeadSigner.generate())  # and the vandal's own key
    log.save()
    assert cli_main(["audit", "--journal", str(signed_copy), "--witness", str(witness)]) == 1  # no public key given
    assert f"PROBLEM rewritten: {resource} life 0" in capsys.readouterr().out


# -- the command line -------------------------------------------------------------------


def test_the_command_lists_mutations_and_says_the_heads_verify(
    pristine: dict[str, Path], writer_key: HeadSigner, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    public = tmp_path / "verify.pem"
    public.write_bytes(writer_key.public_pem())
    assert cli_main(["audit", "--journal", str(pristine["signed"]), "--public-key", str(public), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["chain_ok"] is True and doc["anchored"] == "yes" and doc["anchors_verified"] is True
    assert doc["key_id"] == writer_key.key_id and doc["problems"] == []
    row = doc["mutations"][0]
    for key in ("time", "rollout_id", "attempt", "epoch", "op", "args", "prev_revision", "revision", "location"):
        assert key in row
    assert {r["attempt"] for r in doc["mutations"]} == {1, 2}  # the crash: both attempts mutated

    resource = row["resource_id"]
    assert cli_main(["audit", resource, "--journal", str(pristine["signed"]), "--public-key", str(public)]) == 0
    out = capsys.readouterr().out
    assert resource in out and "chain ok" in out and "all verify" in out


def test_an_unknown_resource_is_one_line_and_an_input_exit_code(
    pristine: dict[str, Path], capsys: pytest.CaptureFixture
) -> None:
    assert cli_main(["audit", "nobody/mail", "--journal", str(pristine["unsigned"])]) == EXIT_INPUT
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "'nobody/mail'" in captured.err


def test_a_corrupt_record_is_named_and_fails_the_audit(journal_copy: Path, capsys: pytest.CaptureFixture) -> None:
    segment = min((journal_copy / "log").glob("*.seg"))
    data = bytearray(segment.read_bytes())
    data[200] ^= 0xFF  # inside an early committed batch: damage, not a torn tail
    segment.write_bytes(bytes(data))
    assert cli_main(["audit", "--journal", str(journal_copy)]) == 1
    out = capsys.readouterr().out
    assert f"PROBLEM corrupt: corrupt record at file {segment}" in out
