"""The rollout aggregate: one ``apply`` for the live path, restore and replay.

These scenarios check that what restore (and every offline reader) derives from the
journal is exactly what the live path held, and that one rollout's damaged journal,
a grown workload or an acknowledged result never stops the others.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from rollout_journal import schemas
from rollout_journal.journal import (
    AttemptStarted,
    Message,
    OutRecord,
    Stream,
    TurnCompleted,
    load_rollouts,
    open_journal,
)
from rollout_journal.participants.rollout.state import RolloutState, StateFoldError, restore_state
from rollout_journal.participants.workload.config import WorkloadConfig
from rollout_journal.participants.workload.run import build_backend, open_workload_journal, run_workload
from rollout_journal.participants.workload.runner import Runner, workload_specs
from rollout_journal.replay.cli.main import main as cli_main
from tests.support.recovery_support import assert_identical, reference_outcomes
from tests.support.states import EXPORTS, assert_same_state


def workload(tmp_path: Path, **overrides) -> WorkloadConfig:
    base = dict(
        name="agg",
        groups=2,
        siblings=2,
        max_turns=5,
        environment="workplace",
        seed=11,
        allow_early_submit=False,
        journal=str(tmp_path / "journal"),
        snapshot_every_turns=2,
    )
    return WorkloadConfig(**(base | overrides))


def run_runner(config: WorkloadConfig, **run_args) -> Runner:
    """Run (or resume) a workload and hand back the runner, to look at its live states."""

    async def go() -> Runner:
        backend = build_backend(config)
        with open_workload_journal(config) as journal:
            runner = Runner(config, journal, backend, backend.tokenizer)
            await runner.run(**run_args)
            return runner

    return asyncio.run(go())


def restored(config: WorkloadConfig) -> dict[str, RolloutState]:
    with open_journal(config.journal, read_only=True) as journal:
        plan = load_rollouts(journal)
    return {rid: restore_state(history) for rid, history in plan.rollouts.items()}


def same_state(live: RolloutState, again: RolloutState, *, same_exports: bool = True) -> None:
    """Every field alike; ``same_exports=False``: but the resource exports (restored from another snapshot)."""
    assert_same_state(live, again, ignoring=() if same_exports else EXPORTS)


def test_what_restore_derives_is_what_the_live_path_held(tmp_path: Path) -> None:
    config = workload(tmp_path)
    specs = workload_specs(config)
    stops = {spec.rollout_id: turns for spec, turns in zip(specs, (1, 2, 3, 5))}
    runner = run_runner(config, resume=False, stop_after=stops)

    again = restored(config)

    assert set(again) == set(stops)
    for rid, live in runner.states.items():
        same_state(live, again[rid])


def test_a_snapshot_state_reads_back_whole_and_an_older_layout_still_reads(tmp_path: Path) -> None:
    """Snapshot bytes hold the token arrays raw beside the JSON document; a state read back is the
    state written, arrays and lineage included. States written before (the arrays base64 inside
    zlib'd JSON, as the golden journals hold them) read the same."""
    import base64
    import zlib

    from rollout_journal.participants.rollout.state import STATE_MAGIC, _unpacked

    config = workload(tmp_path)
    runner = run_runner(config, resume=False, stop_after={s.rollout_id: 3 for s in workload_specs(config)})
    for live in runner.states.values():
        data = live.to_bytes()
        assert data.startswith(STATE_MAGIC)
        again = RolloutState.from_bytes(data)
        same_state(live, again)
        assert again.lineage is not None and live.lineage is not None
        assert again.lineage.segments == live.lineage.segments
        assert np.array_equal(again.lineage.logprobs, live.lineage.logprobs)
        assert again.to_bytes() == data
        doc, tokens, logprobs = _unpacked(zlib.decompress(data[len(STATE_MAGIC) :]))
        doc |= {"head_tokens": base64.b64encode(tokens).decode(), "logprobs": base64.b64encode(logprobs).decode()}
        older = RolloutState.from_bytes(zlib.compress(json.dumps(doc).encode()))
        assert older.to_bytes() == data


@pytest.mark.parametrize("damage", ["cut", "lengths", "not an object"])
def test_damaged_snapshot_state_bytes_fail_with_their_location(damage: str) -> None:
    import struct
    import zlib

    from rollout_journal.journal.errors import RecordLocation
    from rollout_journal.participants.rollout.state import STATE_MAGIC

    payload = zlib.decompress(RolloutState("r", "g").to_bytes()[len(STATE_MAGIC) :])
    if damage == "cut":
        payload = payload[:-3]
    elif damage == "lengths":
        payload = struct.pack("<III", 1, 2, 3) + payload[12:]
    else:
        payload = struct.pack("<III", 2, 0, 0) + b"[]"
    at = RecordLocation("ns.snapshots", 1, 42)
    with pytest.raises(
        StateFoldError, match="snapshot at topic ns.snapshots partition 1 offset 42 is not a rollout state"
    ):
        RolloutState.from_bytes(STATE_MAGIC + zlib.compress(payload), at)


def test_an_older_layout_state_with_a_lineage_but_no_logprobs_does_not_read() -> None:
    """A state of the earlier layout (zlib'd JSON) that names a lineage but lost its logprobs is
    damaged, as it was before the raw layout: read as empty logprobs, it would hand a trainer a
    record whose logprobs do not cover its sampled tokens."""
    import base64
    import zlib

    doc = {
        "format": "rollout-journal/rollout-state/3",
        "rollout_id": "r",
        "group_id": "g",
        "attempt": 1,
        "epoch": 1,
        "next_turn": 1,
        "next_seq": 3,
        "finished": False,
        "reward": None,
        "messages": [],
        "head_call_id": "c",
        "head_tokens": base64.b64encode(np.arange(3, dtype="<i4").tobytes()).decode(),
        "actions": [],
        "output_tokens": 2,
        "outcome": None,
        "resources": {},
        "lineage": [[0, 1, False, 1, 0, "c", 0], [1, 3, True, 1, 0, "c", 0]],
    }
    with pytest.raises(StateFoldError, match="lacks or mangles field 'logprobs'"):
        RolloutState.from_bytes(zlib.compress(json.dumps(doc).encode()))
    doc["logprobs"] = base64.b64encode(np.array([0, -0.5, -1.5], dtype="<f4").tobytes()).decode()
    again = RolloutState.from_bytes(zlib.compress(json.dumps(doc).encode()))
    assert again.lineage is not None and again.lineage.logprobs.tolist() == [0, -0.5, -1.5]


def test_a_rollout_replayed_without_any_snapshot_keeps_its_task_prompt(tmp_path: Path) -> None:
    """The first attempt journals the conversation it starts from, so a full replay
    (no usable snapshot) rebuilds the system and task prompt, not just the turns."""
    config = workload(tmp_path, groups=1, siblings=1, snapshot_every_turns=100)
    (rid,) = (s.rollout_id for s in workload_specs(config))
    runner = run_runner(config, resume=False, stop_after={rid: 3})
    with open_journal(config.journal, read_only=True) as journal:
        history = load_rollouts(journal).rollouts[rid]
        history.events = list(journal.read_rollout(rid))  # every event from the first, as with no snapshot
    history.snapshot = None

    again = restore_state(history)

    assert [m.role for m in again.messages[:2]] == ["system", "user"]
    same_state(runner.states[rid], again, same_exports=False)
    assert again.resource_states == {} and len(again.mutations_since_export) == again.mutation_count > 0


def test_a_workload_that_grew_runs_its_new_rollouts(tmp_path: Path) -> None:
    small = workload(tmp_path, groups=1)
    run_workload(small, resume=False)
    grown = small.model_copy(update={"groups": 2})
    reference = reference_outcomes(grown)

    resumed = run_workload(grown, resume=True)

    new = [
        s.rollout_id for s in workload_specs(grown) if s.rollout_id not in {x.rollout_id for x in workload_specs(small)}
    ]
    assert new and all(resumed.rollouts[rid].turns_run_here == grown.max_turns for rid in new)
    assert not any(resumed.rollouts[rid].acknowledged for rid in new)
    assert_identical(resumed, reference)
    with open_journal(grown.journal, read_only=True) as journal:
        registered = load_rollouts(journal).workloads["agg"]
    assert registered.rollout_ids == [s.rollout_id for s in workload_specs(grown)]


def test_resume_with_an_acknowledged_rollout_prints_its_report(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = workload(tmp_path, groups=1)
    first = workload_specs(config)[0].rollout_id

    async def run_and_acknowledge() -> None:
        backend = build_backend(config)
        with open_workload_journal(config) as journal:
            runner = Runner(config, journal, backend, backend.tokenizer)
            await runner.run(resume=False)
            await runner.acknowledge([first])

    asyncio.run(run_and_acknowledge())
    path = tmp_path / "workload.yaml"
    path.write_text(yaml.safe_dump(config.model_dump()))

    code = cli_main(["resume", str(path), "--json"])

    summary = json.loads(capsys.readouterr().out)
    assert code == 0
    assert summary["acknowledged"] == 1 and summary["results_offered_again"] == config.siblings - 1
    assert first not in summary["outcomes"]


def test_a_rollout_whose_journal_does_not_fold_is_set_aside_and_the_others_resume(tmp_path: Path) -> None:
    config = workload(tmp_path, groups=1, siblings=3)
    a, b, c = (s.rollout_id for s in workload_specs(config))
    reference = reference_outcomes(config)
    run_workload(config, resume=False, stop_after={a: 1, b: 2, c: 3})  # a: one turn after its first snapshot
    with open_journal(config.journal, read_only=True) as journal:
        (last,) = [e.event for e in journal.read_rollout(a) if isinstance(e.event, TurnCompleted)][-1:]
    with open_journal(config.journal, writer="vandal") as journal:  # a second record with a seq already used
        journal.append_sync([TurnCompleted(last.header, [Message("assistant", "again")], [], {}, None, ["again()"])])

    resumed = run_workload(config, resume=True)

    assert set(resumed.set_aside) == {a} and "appears twice" in resumed.set_aside[a]
    assert resumed.outcomes() == {rid: reference[rid] for rid in (b, c)}
    with pytest.raises(StateFoldError):
        restore_state(load_history(config, a))


def test_a_journal_acknowledged_before_markers_still_reads_a_missing_rollout_as_acknowledged(tmp_path: Path) -> None:
    # Before 0.3, acknowledgement tombstoned the rollout's snapshots and fence, and the (v1) registration
    # was the only trace: a registered rollout missing from the snapshot stream had been acknowledged.
    config = workload(tmp_path, groups=1, siblings=2)
    a, b = (s.rollout_id for s in workload_specs(config))
    run_workload(config, resume=False, stop_after={b: 2})
    with open_journal(config.journal, writer="old-version") as journal:
        registration = load_rollouts(journal).workloads[config.name]
        v1 = schemas.released_versions()["WorkloadRegistered"][0]
        value = journal.codec.encode_with(registration, v1)
        journal.backend.commit([OutRecord(Stream.SNAPSHOTS, f"{config.name}/workload", value, config.name)])
        journal.tombstone(a).result()

    resumed = run_workload(config, resume=True)

    assert resumed.rollouts[a].acknowledged and resumed.rollouts[a].turns_run_here == 0
    assert resumed.rollouts[b].turns_run_here == config.max_turns - 2


def test_two_attempts_claiming_one_epoch_are_a_conflict_of_that_rollout_alone(tmp_path: Path) -> None:
    # Two resumers of rollout a at once (two slots that do not fence each other): both fold the
    # same journal and both write attempt 2, epoch 2, from the same seq.
    config = workload(tmp_path, groups=1, siblings=2)
    a, b = (s.rollout_id for s in workload_specs(config))
    reference = reference_outcomes(config)
    run_workload(config, resume=False, stop_after={a: 2, b: 2})
    state = restore_state(load_history(config, a))
    with open_journal(config.journal, writer="resumers") as journal:
        for writer in ("worker-1", "worker-2"):
            header = state.header(writer, attempt=state.next_attempt, epoch=state.next_epoch)
            journal.append_sync([AttemptStarted(header, state.next_turn, config.topology(), "resume after crash")])

    resumed = run_workload(config, resume=True)

    assert set(resumed.set_aside) == {a} and "claims epoch 2, which attempt 2 already holds" in resumed.set_aside[a]
    assert resumed.outcomes() == {b: reference[b]}


def load_history(config: WorkloadConfig, rollout_id: str):
    with open_journal(config.journal, read_only=True) as journal:
        return load_rollouts(journal).rollouts[rollout_id]


def test_the_reference_and_a_journaled_run_agree(tmp_path: Path) -> None:
    """Journaling off applies the same events: an uninterrupted journaled run equals it."""
    config = workload(tmp_path, groups=1, siblings=2)
    assert_identical(run_workload(config, resume=False), reference_outcomes(config))


def test_the_runs_an_attempt_names_survive_a_snapshot_and_say_which_is_current() -> None:
    """A gateway that restarted tells the current agent run from an older one by these: the run
    each AttemptStarted names (a digest of its key), newest last, kept by the snapshot too."""
    from rollout_journal.participants.rollout.state import run_digest

    state = RolloutState("r-runs", "g")
    assert state.run_standing("k1") is None  # no run journaled: the gateway keeps its older rules
    state.start_attempt("w", resumed_from_turn=0, topology="t", reason="run 1", run=run_digest("k1"))
    state.start_attempt("w", resumed_from_turn=0, topology="t", reason="a gateway restart", run=None)
    state.start_attempt("w", resumed_from_turn=0, topology="t", reason="run 2", run=run_digest("k2"))
    state.start_attempt("w", resumed_from_turn=0, topology="t", reason="run 2 again", run=run_digest("k2"))
    assert state.runs == [run_digest("k1"), run_digest("k2")] and "k1" not in state.runs
    back = RolloutState.from_bytes(state.to_bytes())
    assert back.runs == state.runs
    assert [back.run_standing(k) for k in ("k2", "k1", "k3")] == ["current", "older", "unknown"]
