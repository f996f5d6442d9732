"""The resource contract: fencing, idempotency, revisions, hash chain, replay, secrets, export."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from rollout_journal.participants.environments.counter import CounterStore
from rollout_journal.participants.resources import (
    ChainBrokenError,
    IdempotencyKeyReuseError,
    MutationRecord,
    MutationRequest,
    OperationRejectedError,
    Recovery,
    ReplayDivergenceError,
    Resource,
    RevisionConflictError,
    SecretLeakError,
    StaleEpochError,
    StateImportError,
    UnknownOperationError,
    canonical_json,
    genesis_hash,
    redact_secret,
    verify_chain,
    weakest_recovery,
)

RID = "r1/counters"


def store(**initial: int) -> CounterStore:
    return CounterStore(RID, initial or {"a": 0, "b": 0})


def req(key: str, expected: int, epoch: int = 1, attempt: int = 1, rollout: str = "r1") -> MutationRequest:
    return MutationRequest(
        rollout_id=rollout, attempt=attempt, epoch=epoch, idempotency_key=key, expected_revision=expected
    )


def run_history(s: CounterStore, ops: list[tuple[str, dict[str, Any]]], epoch: int = 1) -> list[MutationRecord]:
    return [s.mutate(req(f"r1:{i}:0", s.revision, epoch=epoch), op, args) for i, (op, args) in enumerate(ops)]


HISTORY = [
    ("incr", {"name": "a", "by": 5}),
    ("decr", {"name": "b"}),
    ("set", {"name": "a", "value": 2}),
    ("incr", {"name": "b", "by": 7}),
    ("incr", {"name": "a"}),
]


class Vault(Resource):
    """Keeps a session per user; the password is a secret and only its redaction is state."""

    kind = "vault"
    recovery = Recovery.EVENT_SOURCED
    secret_arg_names = frozenset({"password", "token"})

    def __init__(self, resource_id: str, leaky: bool = False) -> None:
        super().__init__(resource_id)
        self.sessions: dict[str, str] = {}
        self.live_passwords: dict[str, str] = {}  # raw secrets: live session only, not canonical
        self.leaky = leaky

    def _apply(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        if op != "login":
            raise self._unknown(op, ("login",))
        user, password = self._arg(op, args, "user"), self._arg(op, args, "password")
        self.live_passwords[user] = password
        self.sessions[user] = password if self.leaky else redact_secret(password)
        return {"user": user, "fingerprint": self.sessions[user]}

    def _query(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        return {"users": sorted(self.sessions)}

    def _canonical_state(self) -> object:
        return {"sessions": self.sessions}


# ----------------------------------------------------------------- fencing


def test_a_fenced_epoch_is_refused_and_changes_nothing() -> None:
    s = store()
    s.mutate(req("k0", 0, epoch=1), "incr", {"name": "a"})
    s.fence("r1", 2)
    digest = s.state_digest()
    with pytest.raises(StaleEpochError) as err:
        s.mutate(req("k1", 1, epoch=1), "incr", {"name": "a"})
    assert (err.value.resource_id, err.value.rollout_id, err.value.epoch, err.value.fenced_epoch) == (RID, "r1", 1, 2)
    assert (
        RID in str(err.value) and "r1" in str(err.value) and "epoch 1" in str(err.value) and "epoch 2" in str(err.value)
    )
    assert s.revision == 1 and s.state_digest() == digest
    s.mutate(req("k1", 1, epoch=2, attempt=2), "incr", {"name": "a"})
    assert s.counters["a"] == 2


def test_fences_only_move_forward_and_are_per_rollout() -> None:
    s = store()
    s.fence("r1", 3)
    s.fence("r1", 1)
    assert s.fenced_epoch("r1") == 3
    s.mutate(req("other:0", 0, epoch=0, rollout="r2"), "incr", {"name": "a"})  # another rollout is not fenced
    assert s.revision == 1


def test_a_newer_epoch_fences_the_older_one_by_itself() -> None:
    s = store()
    s.mutate(req("n:0", 0, epoch=2, attempt=2), "incr", {"name": "a"})
    with pytest.raises(StaleEpochError):
        s.mutate(req("z:0", 1, epoch=1), "incr", {"name": "a"})


def test_stale_epoch_is_checked_before_the_idempotency_table() -> None:
    s = store()
    s.mutate(req("k0", 0, epoch=1), "incr", {"name": "a"})
    s.fence("r1", 2)
    with pytest.raises(StaleEpochError):
        s.mutate(req("k0", 0, epoch=1), "incr", {"name": "a"})


# ----------------------------------------------------------------- idempotency and revisions


def test_a_replayed_key_returns_the_recorded_result_without_applying_twice() -> None:
    s = store()
    first = s.mutate(req("r1:0:0", 0), "incr", {"name": "a", "by": 5})
    s.mutate(req("r1:1:0", 1), "incr", {"name": "b"})
    digest, chain = s.state_digest(), s.chain_hash
    again = s.mutate(req("r1:0:0", 0), "incr", {"name": "a", "by": 5})  # re-executed turn 0 after a crash
    assert again is first
    assert again.result == {"name": "a", "value": 5}
    assert s.revision == 2 and s.state_digest() == digest and s.chain_hash == chain
    assert s.counters == {"a": 5, "b": 1}


def test_a_key_reused_for_a_different_call_is_an_error_not_a_retry() -> None:
    s = store()
    s.mutate(req("r1:0:0", 0), "incr", {"name": "a"})
    with pytest.raises(IdempotencyKeyReuseError, match="r1:0:0"):
        s.mutate(req("r1:0:0", 1), "incr", {"name": "b"})
    assert s.revision == 1


def test_an_unexpected_revision_is_a_conflict() -> None:
    s = store()
    s.mutate(req("k0", 0), "incr", {"name": "a"})
    with pytest.raises(RevisionConflictError) as err:
        s.mutate(req("k1", 0), "incr", {"name": "a"})
    assert (err.value.expected, err.value.current) == (0, 1)
    assert RID in str(err.value) and "k1" in str(err.value)
    assert s.revision == 1 and s.counters["a"] == 1


def test_rejected_and_unknown_ops_change_nothing_and_record_no_key() -> None:
    s = store()
    with pytest.raises(OperationRejectedError, match="no counter 'zz'"):
        s.mutate(req("k0", 0), "incr", {"name": "zz"})
    with pytest.raises(UnknownOperationError, match="explode"):
        s.mutate(req("k0", 0), "explode", {})
    assert s.revision == 0 and s.chain_hash == genesis_hash(RID) and s.applied_record("k0") is None
    s.mutate(req("k0", 0), "incr", {"name": "a"})  # the key is still free
    assert s.revision == 1


def test_queries_change_no_revision() -> None:
    s = store(a=4, b=0)
    assert s.query("get", {"name": "a"}) == {"name": "a", "value": 4}
    assert s.revision == 0


# ----------------------------------------------------------------- hash chain


def test_the_chain_verifies_and_breaks_if_any_past_mutation_changes() -> None:
    s = store()
    records = run_history(s, HISTORY)
    assert verify_chain(RID, records) == s.chain_hash
    assert [r.revision for r in records] == [1, 2, 3, 4, 5]

    tampered = list(records)
    tampered[1] = dataclasses.replace(records[1], args={"name": "b", "by": 100})
    with pytest.raises(ChainBrokenError) as err:
        verify_chain(RID, tampered)
    assert err.value.revision == 2

    with pytest.raises(ChainBrokenError, match="expected 2 -> 3"):
        verify_chain(RID, records[:2] + records[3:])  # a dropped mutation

    other = store()
    altered = run_history(other, HISTORY[:1] + [("decr", {"name": "b", "by": 2})] + HISTORY[2:])
    assert altered[0].chain_hash == records[0].chain_hash
    assert altered[-1].chain_hash != records[-1].chain_hash  # a different past -> a different head


def test_the_chain_covers_who_mutated_not_only_what() -> None:
    a, b = store(), store()
    ra = a.mutate(req("k", 0, epoch=1, attempt=1), "incr", {"name": "a"})
    rb = b.mutate(req("k", 0, epoch=2, attempt=2), "incr", {"name": "a"})
    assert ra.state_digest == rb.state_digest and ra.chain_hash != rb.chain_hash


# ----------------------------------------------------------------- replay


def test_replay_on_a_fresh_instance_reproduces_digest_chain_and_keys() -> None:
    s = store()
    records = run_history(s, HISTORY)
    rebuilt = store()
    for record in records:
        rebuilt.replay(record)
    assert (rebuilt.revision, rebuilt.state_digest(), rebuilt.chain_hash) == (
        s.revision,
        s.state_digest(),
        s.chain_hash,
    )
    rebuilt.replay(records[2])  # at-least-once delivery: a duplicate is skipped
    assert rebuilt.revision == 5
    assert rebuilt.mutate(req("r1:0:0", 5, epoch=2, attempt=2), "incr", {"name": "a", "by": 5}) == records[0]
    assert rebuilt.revision == 5


def test_replay_ignores_fences_but_then_fences_older_epochs() -> None:
    s = store()
    records = run_history(s, HISTORY[:2], epoch=1)
    rebuilt = store()
    rebuilt.fence("r1", 2)
    for record in records:
        rebuilt.replay(record)
    assert rebuilt.state_digest() == s.state_digest()


def test_replay_detects_a_diverging_resource() -> None:
    records = run_history(store(), HISTORY)
    with pytest.raises(ReplayDivergenceError) as err:
        store(a=1, b=0).replay(records[0])  # different starting state
    assert err.value.revision == 1 and RID in str(err.value) and "digest" in str(err.value)

    forged = dataclasses.replace(records[0], result={"name": "a", "value": 99})
    with pytest.raises(ReplayDivergenceError, match="result"):
        store().replay(forged)

    reattributed = dataclasses.replace(records[0], attempt=7)  # same effect, chain no longer matches
    with pytest.raises(ReplayDivergenceError, match="chain hash"):
        store().replay(reattributed)

    with pytest.raises(ReplayDivergenceError, match="missing or out of order"):
        store().replay(records[1])


def test_records_survive_a_json_round_trip_for_the_journal() -> None:
    records = run_history(store(), HISTORY)
    decoded = [MutationRecord.from_dict(json.loads(canonical_json(r.to_dict()))) for r in records]
    assert decoded == records
    rebuilt = store()
    for record in decoded:
        rebuilt.replay(record)
    assert rebuilt.chain_hash == records[-1].chain_hash


def test_args_are_normalised_so_live_and_replayed_runs_agree() -> None:
    record = store().mutate(req("k", 0), "incr", {"name": "a", "tag": ("x", 1), "by": 2})
    assert record.args == {"name": "a", "tag": ["x", 1], "by": 2}  # what a JSON journal gives back
    rebuilt = store()
    rebuilt.replay(record)
    assert rebuilt.counters["a"] == 2


# ----------------------------------------------------------------- secrets


def test_secrets_never_reach_the_record_and_replay_still_matches() -> None:
    vault = Vault("r1/vault")
    record = vault.mutate(req("r1:0:0", 0), "login", {"user": "ann", "password": "hunter2-secret"})
    assert record.args == {"user": "ann", "password": redact_secret("hunter2-secret")}
    assert record.args["password"].startswith("<redacted:")
    assert "hunter2-secret" not in canonical_json(record.to_dict())
    assert vault.live_passwords["ann"] == "hunter2-secret"  # the live state may keep it

    again = vault.mutate(req("r1:0:0", 1), "login", {"user": "ann", "password": "hunter2-secret"})
    assert again is record

    rebuilt = Vault("r1/vault")
    rebuilt.replay(record)
    assert (rebuilt.state_digest(), rebuilt.chain_hash) == (vault.state_digest(), vault.chain_hash)
    assert rebuilt.live_passwords["ann"] == record.args["password"]  # the raw secret is gone after replay


def test_a_resource_that_leaks_a_secret_is_stopped() -> None:
    with pytest.raises(SecretLeakError, match="r1/vault"):
        Vault("r1/vault", leaky=True).mutate(req("k", 0), "login", {"user": "ann", "password": "hunter2-secret"})


def test_redaction_is_idempotent() -> None:
    once = redact_secret("tok")
    assert redact_secret(once) == once and once != redact_secret("tok2")


# ----------------------------------------------------------------- export / import


def test_export_import_carries_state_revision_chain_keys_and_fences() -> None:
    s = store()
    records = run_history(s, HISTORY)
    s.fence("r1", 3)
    blob = s.export_state()
    restored = store(a=100, b=100)
    restored.import_state(blob)
    assert (restored.revision, restored.chain_hash, restored.state_digest()) == (5, s.chain_hash, s.state_digest())
    assert restored.fenced_epoch("r1") == 3
    assert restored.mutate(req("r1:1:0", 5, epoch=3), "decr", {"name": "b"}) == records[1]


def test_import_refuses_foreign_or_corrupt_state() -> None:
    blob = store(a=3, b=4).export_state()
    with pytest.raises(StateImportError, match="r2/counters"):
        CounterStore("r2/counters", {"a": 0, "b": 0}).import_state(blob)
    target = store(a=1, b=1)
    target.mutate(req("k", 0), "incr", {"name": "a"})
    digest = target.state_digest()
    with pytest.raises(StateImportError, match="digest"):
        target.import_state(blob.replace(b'"a":3', b'"a":9'))
    with pytest.raises(StateImportError, match="malformed"):
        target.import_state(blob.replace(b'"fences"', b'"fencez"'))
    with pytest.raises(StateImportError):
        target.import_state(b"\xff not json")
    assert (target.state_digest(), target.revision) == (digest, 1)  # a failed import changes nothing


def test_the_weakest_recovery_mode_wins() -> None:
    assert (
        weakest_recovery([Recovery.EVENT_SOURCED, Recovery.RESTART_ONLY, Recovery.EXPORTABLE]) is Recovery.RESTART_ONLY
    )
    assert weakest_recovery([Recovery.EVENT_SOURCED, Recovery.EXPORTABLE, Recovery.STATELESS]) is Recovery.EXPORTABLE
    assert weakest_recovery([]) is Recovery.STATELESS
