"""The replay commands on journals of real runs that crashed and resumed, on the file
journal and on a real Kafka broker: list, show, state, export, export-training, fork.

One workload per backend: three prompt groups (workplace, event-sourced; counter,
exportable; sandbox, restart-only) x two siblings, five turns. The first run stops
rollouts part way (a crash at a turn boundary: what the journal holds after a
SIGKILL between commits), the second resumes them. While both run, the state of every
resource after every mutation is captured from the live resource, for ``state``.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from rollout_journal.journal.events import AttemptStarted, ModelCall, TurnCompleted
from rollout_journal.journal.open import open_journal
from rollout_journal.journal.restore import load_rollouts
from rollout_journal.participants.model.tiny_model import default_tokenizer
from rollout_journal.participants.model.tokenizer import ChatTokenizer
from rollout_journal.participants.rollout.state import restore_state
from rollout_journal.participants.workload.config import WorkloadConfig
from rollout_journal.participants.workload.run import build_backend, open_workload_journal, run_workload
from rollout_journal.participants.workload.runner import Runner, RunReport, workload_specs
from rollout_journal.replay.cli.main import main as cli
from rollout_journal.replay.errors import ForkError, NoSuchRevisionError, NoSuchTurnError
from rollout_journal.replay.exit_codes import EXIT_INPUT, EXIT_JOURNAL_DAMAGED
from rollout_journal.replay.fork import fork_rollout
from rollout_journal.replay.resource_at_revision import resource_state
from rollout_journal.replay.source import open_replay
from tests.support.kafka_drills import wait_for
from tests.support.kafka_fixtures import BACKENDS
from tests.support.recovery_support import run_child_and_kill
from tests.support.summaries_check import assert_summaries_agree

STOP = {"g0-s0": 5, "g0-s1": 2, "g1-s0": 3, "g1-s1": 1, "g2-s0": 2, "g2-s1": 0}  # turns committed at the crash


def workload(location: str, **overrides) -> WorkloadConfig:
    # A writer slot of its own: on a broker other suites share, a second "worker-0" would fence this one.
    base = {
        "name": "rp",
        "groups": 3,
        "siblings": 2,
        "max_turns": 5,
        "environment": "workplace,counter,sandbox",
        "seed": 5,
        "allow_early_submit": False,
        "journal": location,
        "snapshot_every_turns": 2,
        "writer": f"replay-test-{uuid.uuid4().hex[:8]}",
    }
    return WorkloadConfig(**(base | overrides))


def location_for(backend: str, request: pytest.FixtureRequest, tmp: Path) -> str:
    if backend == "file":
        return str(tmp / f"journal-{uuid.uuid4().hex[:6]}")
    return f"kafka://{request.getfixturevalue('kafka_bootstrap')}/rp{uuid.uuid4().hex[:8]}?partitions=4"


class WatchedRunner(Runner):
    """A runner whose resources report their state after every mutation they apply: the live
    truth ``replay state`` must reproduce. ``states[(resource, life, revision)]``; life counts
    the resource's starts over (revision 1 again)."""

    def __init__(self, *args, states: dict, initial: dict, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.watched, self.initial = states, initial  # (Runner.states is the rollouts' own)

    def _new_environment(self, spec, **kwargs):
        env = super()._new_environment(spec, **kwargs)
        for resource in env.resources.values():
            self.initial[resource.resource_id] = resource.canonical_state()
            self._watch(resource)
        return env

    def _watch(self, resource) -> None:
        mutate = resource.mutate

        def watched(request, op, args):
            record = mutate(request, op, args)
            if resource.revision == record.revision:  # applied now, not handed back for a key seen before
                lives = [key[1] for key in self.watched if key[0] == resource.resource_id]
                life = max(lives, default=-1) + (1 if record.revision == 1 else 0)
                self.watched[(resource.resource_id, max(life, 0), record.revision)] = resource.canonical_state()
            return record

        resource.mutate = watched


def run_watched(config: WorkloadConfig, states: dict, initial: dict, **run_args) -> RunReport:
    async def go() -> RunReport:
        backend = build_backend(config)
        with open_workload_journal(config) as journal:
            runner = WatchedRunner(config, journal, backend, backend.tokenizer, states=states, initial=initial)
            return await runner.run(**run_args)

    return asyncio.run(go())


@dataclass
class CrashedRun:
    config: WorkloadConfig
    ids: dict[str, str]  # "g0-s1" -> rollout id
    listing_at_crash: dict
    resumed: RunReport
    states: dict = field(default_factory=dict)
    initial: dict = field(default_factory=dict)

    @property
    def location(self) -> str:
        return self.config.journal


@pytest.fixture(scope="module", params=BACKENDS)
def crashed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CrashedRun]:
    config = workload(location_for(request.param, request, tmp_path_factory.mktemp("replay")))
    ids = {s.rollout_id.removeprefix("rp-"): s.rollout_id for s in workload_specs(config)}
    states, initial = {}, {}
    run_watched(config, states, initial, resume=False, stop_after={ids[k]: n for k, n in STOP.items()})
    with open_replay(config.journal) as source:
        from rollout_journal.replay.listing import list_rollouts

        listing_at_crash = list_rollouts(source).as_json()
    resumed = run_watched(config, states, initial, resume=True)
    yield CrashedRun(config, ids, listing_at_crash, resumed, states, initial)
    if request.param == "kafka":
        assert_summaries_agree(config.journal)


def run_cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, dict | None, str]:
    """(exit code, the JSON printed if any, stderr)."""
    code = cli(list(argv))
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip().startswith("{") else None), err


# -- list ----------------------------------------------------------------------------------------


def test_list_shows_every_rollout_with_attempts_turns_reward_and_policy(crashed: CrashedRun, capsys) -> None:
    code, doc, _ = run_cli(capsys, "replay", "list", "--journal", crashed.location, "--json")
    assert code == 0
    rows = {r["rollout_id"]: r for r in doc["rollouts"]}
    assert set(rows) == set(crashed.ids.values())
    policy = build_backend(crashed.config).policy_version
    for short, rid in crashed.ids.items():
        row = rows[rid]
        assert row["status"] == "finished" and row["turns"] == 5
        assert row["attempts"] == (1 if STOP[short] == 5 else 2)
        # g2-s1 was stopped before its first turn ran (as one queued behind the concurrency limit):
        # superseded with nothing journaled of its own, so no crash
        assert row["crashes"] == (1 if 0 < STOP[short] < 5 else 0)
        assert row["reward"] == crashed.resumed.outcomes()[rid]["reward"]
        assert row["policy_versions"] == [policy]
        assert row["group_id"] == rid.rsplit("-", 1)[0]


def test_list_at_the_crash_shows_the_unfinished_rollouts_as_running(crashed: CrashedRun) -> None:
    rows = {r["rollout_id"]: r for r in crashed.listing_at_crash["rollouts"]}
    for short, rid in crashed.ids.items():
        assert rows[rid]["status"] == ("finished" if STOP[short] == 5 else "running")
        assert rows[rid]["turns"] == STOP[short] and rows[rid]["attempts"] == 1


def test_list_filters(crashed: CrashedRun, capsys) -> None:
    def shown(*filters: str) -> set[str]:
        code, doc, _ = run_cli(capsys, "replay", "list", crashed.location, "--json", *filters)
        assert code == 0
        return {r["rollout_id"] for r in doc["rollouts"]}

    resumed_ids = {rid for short, rid in crashed.ids.items() if STOP[short] < 5}
    assert shown("--crashed") == {rid for short, rid in crashed.ids.items() if 0 < STOP[short] < 5}
    assert shown("--min-attempts", "2") == resumed_ids
    assert shown("--group", "rp-g1") == {crashed.ids["g1-s0"], crashed.ids["g1-s1"]}
    assert shown("--status", "running") == set()
    assert shown("--status", "finished", "--group", "rp-g0", "--crashed") == {crashed.ids["g0-s1"]}


def test_the_projected_list_scan_equals_the_fully_decoded_one(crashed: CrashedRun) -> None:
    """``replay list`` decodes only what the fold reads: on a real run that crashed and resumed,
    every row and every record it stepped over are what a full decode gives."""
    with open_replay(crashed.location) as source:
        from rollout_journal.replay.listing import list_rollouts

        projected, full = list_rollouts(source), list_rollouts(source, projected=False)
    assert projected.as_json() == full.as_json()
    assert projected.report.fenced == full.report.fenced and projected.report.errors == full.report.errors
    assert {r["model_calls"] for r in projected.as_json()["rollouts"]} != {0}  # calls were folded, not skipped


def test_list_in_scan_workers_shows_what_one_process_shows(crashed: CrashedRun, capsys) -> None:
    """``--jobs``: partitions scanned in worker processes (a Kafka journal has 4 here; a file
    journal one, so it stays in one process) give the same rows, in the same order."""
    one = run_cli(capsys, "replay", "list", "--journal", crashed.location, "--json", "--jobs", "1")
    assert one[0] == 0 and one[1]["rollouts"]
    assert run_cli(capsys, "replay", "list", "--journal", crashed.location, "--json", "--jobs", "3") == one


def test_list_prints_a_table(crashed: CrashedRun, capsys) -> None:
    assert cli(["list", crashed.location]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:6] == ["rollout", "group", "status", "attempts", "crashes", "turns"]
    assert any(line.startswith(crashed.ids["g1-s0"]) and " finished " in line for line in lines)
    assert lines[-1].startswith("6 of 6 rollouts")


# -- show ----------------------------------------------------------------------------------------


def journal_calls(location: str, rollout_id: str) -> list[ModelCall]:
    with open_journal(location, read_only=True) as journal:
        return [i.event for i in journal.read_rollout(rollout_id) if isinstance(i.event, ModelCall)]


def test_show_marks_the_crash_point_and_the_reused_turns(crashed: CrashedRun, capsys) -> None:
    rid = crashed.ids["g0-s1"]  # workplace, crashed after turn 1, resumed at turn 2
    code, doc, _ = run_cli(capsys, "replay", "show", rid, "--journal", crashed.location, "--json")
    assert code == 0
    assert [row["cells"].rstrip() for row in doc["turn_map"]["rows"]] == ["CC!", "==CCF"]
    assert doc["crashes"] == [{"attempt": 1, "epoch": 1, "stopped_at_turn": 2, "superseded_by": 2}]
    first, second = doc["attempts"]
    assert first["turns"] == [0, 1] and first["crashed"] and "superseded by attempt 2" in first["fence_reason"]
    assert second["resumed_from_turn"] == 2 and second["reused_turns"] == [0, 1]
    turns = {t["turn"]: t for t in doc["turns"]}
    assert [turns[t]["attempt"] for t in range(5)] == [1, 1, 2, 2, 2]
    assert turns[0]["reused_by"] == [2] and turns[4]["finished"]

    calls = {c.call_id: c for c in journal_calls(crashed.location, rid)}
    last = turns[4]["calls"][0]
    assert last["parent_call_id"] == turns[3]["calls"][0]["call_id"]
    tokenizer = build_backend(crashed.config).tokenizer
    for turn in turns.values():
        (call,) = turn["calls"]
        journaled = calls[call["call_id"]]
        assert call["output_ids"] == journaled.output_ids.tolist()
        assert call["logprobs"] == pytest.approx(journaled.logprobs.tolist())
        assert call["decoded_output"] == tokenizer.decode(journaled.output_ids, skip_special_tokens=False)
        assert call["decoded_output"].startswith(turn["messages"][0]["content"])  # what the agent acted on
        assert call["tokenizer"]["verified"] and call["tokenizer"]["tokenizer_fingerprint"] == tokenizer.fingerprint
    # who produced each token of the last call: turns 0-1 by attempt 1, the rest by attempt 2
    by_turn = {(s["turn"], s["generated"]): s["attempt"] for s in last["segments"]}
    assert by_turn == {(t, g): (1 if t < 2 else 2) for t in range(5) for g in (False, True)}
    assert last["segments"][-1]["end"] == last["prompt_len"] + len(last["output_ids"])


def test_show_marks_turns_a_restart_discarded_and_redid(crashed: CrashedRun, capsys) -> None:
    rid = crashed.ids["g2-s0"]  # sandbox: restart-only, so attempt 2 starts over
    code, doc, _ = run_cli(capsys, "replay", "show", rid, "--journal", crashed.location, "--json")
    assert code == 0
    assert [row["cells"].rstrip() for row in doc["turn_map"]["rows"]] == ["xx!", "RRCCF"]
    discarded = [t for t in doc["turns"] if t["discarded_by"] is not None]
    assert [(t["turn"], t["attempt"], t["discarded_by"]) for t in discarded] == [(0, 1, 2), (1, 1, 2)]
    assert [t["redo_of"] for t in doc["turns"] if t["attempt"] == 2][:3] == [1, 1, None]


def test_show_text_makes_the_crash_obvious_and_turn_k_shows_its_tokens(crashed: CrashedRun, capsys) -> None:
    rid = crashed.ids["g1-s0"]
    assert cli(["show", crashed.location, rid]) == 0
    text = capsys.readouterr().out
    assert "!! CRASH: attempt 1 (epoch 1) stopped during turn 3" in text
    assert "reuses turns 0-2 committed by earlier attempts" in text
    assert "[attempt 1, epoch 1: committed; reused by attempt 2]" in text
    assert cli(["replay", "show", rid, "--journal", crashed.location, "--turn", "3"]) == 0
    text = capsys.readouterr().out
    assert "-- turn 3 " in text and "-- turn 2 " not in text
    assert "generated  attempt 2  turn 3" in text and "generated  attempt 1  turn 2" in text
    assert "output ids" in text and "logprobs" in text
    # how each call continued its parent, and what its logprobs are
    assert "from parent + 0 inserted + " in text and "extend; template agrees" in text and "(processed" in text


def test_show_names_an_unknown_rollout_or_turn_in_one_line(crashed: CrashedRun, capsys) -> None:
    code, _, err = run_cli(capsys, "replay", "show", "rp-g9-s9", "--journal", crashed.location)
    assert code == EXIT_INPUT and err.strip().count("\n") == 0 and "rp-g9-s9" in err
    code, _, err = run_cli(capsys, "replay", "show", crashed.ids["g0-s0"], "--journal", crashed.location, "--turn", "7")
    assert code == EXIT_INPUT and "never committed turn 7" in err


# -- state ---------------------------------------------------------------------------------------


def test_state_at_every_revision_equals_what_the_live_resource_had(crashed: CrashedRun) -> None:
    assert crashed.states, "the run mutated nothing"
    kinds = set()
    with open_replay(crashed.location) as source:
        for (resource_id, life, revision), live in sorted(crashed.states.items()):
            found = resource_state(source, resource_id, revision, life=life)
            assert found.state == live, f"{resource_id} life {life} revision {revision}"
            kinds.add(found.recovery)
        for resource_id, initial in crashed.initial.items():
            assert resource_state(source, resource_id, 0, life=0).state == initial
    assert kinds == {"event_sourced", "exportable", "restart_only"}


def test_state_of_an_exportable_resource_starts_from_its_nearest_export(crashed: CrashedRun, capsys) -> None:
    resource_id = f"{crashed.ids['g1-s0']}/counters"
    latest = max(r for (rid, _, r) in crashed.states if rid == resource_id)
    code, doc, _ = run_cli(
        capsys, "replay", "state", resource_id, "--revision", str(latest), "--journal", crashed.location, "--json"
    )
    assert code == 0 and doc["state"] == crashed.states[(resource_id, 0, latest)]
    assert doc["base"].startswith("its export at revision")
    assert doc["mutation"]["revision"] == latest


def test_state_names_an_unknown_resource_or_revision(crashed: CrashedRun, capsys) -> None:
    rid = crashed.ids["g0-s0"]
    code, _, err = run_cli(
        capsys, "replay", "state", f"{rid}/printer", "--revision", "1", "--journal", crashed.location
    )
    assert code == EXIT_INPUT and f"{rid}/printer" in err and f"{rid}/mail" in err
    with open_replay(crashed.location) as source, pytest.raises(NoSuchRevisionError, match="revisions 0.."):
        resource_state(source, f"{rid}/calendar", 99)


# -- export-training -----------------------------------------------------------------------------


def test_export_training_tensors_equal_the_journaled_model_calls(crashed: CrashedRun, tmp_path: Path, capsys) -> None:
    out = tmp_path / "rollouts.pt"
    code, doc, _ = run_cli(capsys, "export-training", "--journal", crashed.location, "--out", str(out), "--json")
    assert code == 0 and doc["rollouts"] == 6
    saved = torch.load(out, weights_only=True)
    assert saved["format"] == "rollout-journal/training/1"
    records = {r["rollout_id"]: r for r in saved["rollouts"]}
    with open_journal(crashed.location, read_only=True) as journal:
        plan = load_rollouts(journal)
        for rid in crashed.ids.values():
            record = records[rid]
            state = restore_state(plan.rollouts[rid])
            assert record["input_ids"].tolist() == state.head_tokens.tolist()
            assert record["reward"] == crashed.resumed.outcomes()[rid]["reward"]
            events = [i.event for i in journal.read_rollout(rid)]
            turn_attempt = {e.header.turn: e.header.attempt for e in events if isinstance(e, TurnCompleted)}
            calls = {e.call_id: e for e in events if isinstance(e, ModelCall)}
            lineage = [calls[c] for c in record["segment_call_id"]]
            sampled = 0
            for (start, end), generated, call, attempt in zip(
                record["segment_bounds"].tolist(),
                record["segment_generated"].tolist(),
                lineage,
                record["segment_attempt"].tolist(),
            ):
                piece = record["input_ids"][start:end].tolist()
                if generated:
                    assert piece == call.output_ids.tolist()
                    assert record["logprobs"][start:end].tolist() == call.logprobs.tolist()
                    assert record["loss_mask"][start:end].all()
                    sampled += end - start
                else:
                    assert piece == call.prompt_delta.tolist()
                    assert not record["loss_mask"][start:end].any()
                    assert not record["logprobs"][start:end].any()
                assert attempt == call.header.attempt == turn_attempt[call.header.turn]
            assert int(record["loss_mask"].sum()) == sampled
            assert record["segment_policy_version"] == [c.policy_version for c in lineage]
    for record in records.values():  # the sampling parameters of the call that made each segment
        calls = {c.call_id: c for c in journal_calls(crashed.location, record["rollout_id"])}
        assert record["segment_sampling"] == [
            {
                "temperature": calls[c].sampling.temperature,
                "top_p": calls[c].sampling.top_p,
                "max_tokens": calls[c].sampling.max_tokens,
                "seed": calls[c].sampling.seed,
                "top_k": calls[c].sampling.top_k,
            }
            for c in record["segment_call_id"]
        ]
        assert record["num_turns"] == 5 and record["loss_mask"][: record["prompt_len"]].sum() == 0
    assert set(records[crashed.ids["g0-s1"]]["token_attempt"].tolist()) == {1, 2}  # resumed: both sampled
    assert set(records[crashed.ids["g2-s0"]]["token_attempt"].tolist()) == {2}  # restarted: attempt 1's are gone


def exported_rows(form: str, out: Path) -> list[dict]:
    """The rows of an export as a trainer's loader reads them back."""
    if form == "parquet":
        import pyarrow.parquet as pq

        return pq.read_table(out).to_pylist()
    if form == "hf":
        import datasets

        return list(datasets.load_from_disk(str(out)))
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.parametrize("form", ["parquet", "hf", "jsonl"])
def test_export_training_in_the_trainers_formats_reads_back_exactly_the_journaled_tokens(
    crashed: CrashedRun, form: str, tmp_path: Path, capsys
) -> None:
    """verl's AgentLoopOutput fields and TRL's pre-tokenized columns, read back with pyarrow.parquet,
    datasets.load_from_disk and json: every token, logprob, mask bit and sampling parameter is the
    journal's, segment by segment."""
    import dataclasses

    out = tmp_path / {"parquet": "rows.parquet", "hf": "rows", "jsonl": "rows.jsonl"}[form]
    code, doc, _ = run_cli(
        capsys, "export-training", "--journal", crashed.location, "--out", str(out), "--format", form, "--json"
    )
    assert code == 0 and doc["rollouts"] == 6 and doc["format"] == form
    rows = {r["rollout_id"]: r for r in exported_rows(form, out)}
    assert set(rows) == set(crashed.ids.values())
    with open_journal(crashed.location, read_only=True) as journal:
        plan = load_rollouts(journal)
        for rid, row in rows.items():
            prompt, response = row["prompt_ids"], row["response_ids"]
            assert row["input_ids"] == prompt + response == restore_state(plan.rollouts[rid]).head_tokens.tolist()
            assert row["assistant_masks"] == [0] * len(prompt) + row["response_mask"] and row["response_mask"][0] == 1
            assert row["response_logprobs"] == row["logprobs"][len(prompt) :]
            assert row["reward_score"] == crashed.resumed.outcomes()[rid]["reward"] and row["finished"]
            assert row["group_id"] == rid.rsplit("-", 1)[0] and row["num_turns"] == 5
            calls = {e.call_id: e for e in (i.event for i in journal.read_rollout(rid)) if isinstance(e, ModelCall)}
            assert row["policy_versions"] == sorted({c.policy_version for c in calls.values()})
            for s in row["segments"]:
                call = calls[s["call_id"]]
                piece = row["input_ids"][s["start"] : s["end"]]
                mask = row["assistant_masks"][s["start"] : s["end"]]
                if s["generated"]:
                    assert piece == call.output_ids.tolist() and set(mask) == {1}
                    assert row["logprobs"][s["start"] : s["end"]] == call.logprobs.tolist()
                else:
                    assert piece == call.prompt_delta.tolist() and set(mask) == {0}
                assert (s["attempt"], s["turn"], s["policy_version"]) == (
                    call.header.attempt,
                    call.header.turn,
                    call.policy_version,
                )
                assert {k: s[k] for k in dataclasses.asdict(call.sampling)} == dataclasses.asdict(call.sampling)
            assert sum(row["assistant_masks"]) == sum(
                len(c.output_ids)
                for c in calls.values()
                if c.call_id in {s["call_id"] for s in row["segments"] if s["generated"]}
            )


def test_export_training_names_a_format_it_cannot_guess_before_reading(crashed: CrashedRun, tmp_path: Path, capsys):
    code, _, err = run_cli(capsys, "export-training", "--journal", crashed.location, "--out", str(tmp_path / "rows"))
    assert code == EXIT_INPUT and "--format" in err and err.count("\n") == 1
    assert not (tmp_path / "rows").exists()


def test_the_html_report_of_the_journal_lists_what_list_lists(crashed: CrashedRun, tmp_path: Path, capsys) -> None:
    """``replay report --html DIR`` on each backend: an index row and a page per rollout, as ``list`` has them."""
    import re

    out = tmp_path / "report"
    code, doc, _ = run_cli(capsys, "replay", "report", "--journal", crashed.location, "--html", str(out), "--json")
    assert code == 0 and doc["rollouts"] == 6 and doc["pages"] == 7
    _, listed, _ = run_cli(capsys, "replay", "list", "--journal", crashed.location, "--json")
    html = (out / "index.html").read_text()
    for row in listed["rollouts"]:
        cells = re.search(rf'<a href="rollouts/{re.escape(row["rollout_id"])}\.html">.*?</tr>', html, re.S)
        assert cells is not None, row["rollout_id"]
        values = re.findall(r'data-v="([^"]*)"', cells.group(0))
        assert values[1:5] == [row["status"], str(row["attempts"]), str(row["crashes"]), str(row["turns"])]
        assert (out / "rollouts" / f"{row['rollout_id']}.html").is_file()


# -- export --------------------------------------------------------------------------------------


def test_export_copies_every_record_byte_for_byte_and_verifies(crashed: CrashedRun, tmp_path: Path, capsys) -> None:
    out = tmp_path / "copy"
    code, doc, _ = run_cli(capsys, "export", "--journal", crashed.location, "--out", str(out), "--json")
    assert code == 0 and doc["verified"]
    for stream in ("events", "snapshots"):
        check = doc[stream]
        assert check["source_records"] == check["copy_records"] > 0
        assert check["source_sha256"] == check["copy_sha256"]
    with open_journal(crashed.location, read_only=True) as source, open_journal(str(out), read_only=True) as copy:
        original = [(r.key, r.value) for p in range(source.backend.partitions) for r in source.backend.read_events(p)]
        assert [(r.key, r.value) for r in copy.backend.read_events(0)] == original
        # the snapshot stream: every key's values in their order (Kafka interleaves partitions as it reads)
        assert by_key(copy.backend.read_snapshots()) == by_key(source.backend.read_snapshots())
    # the copy replays as the source does
    _, listed, _ = run_cli(capsys, "replay", "list", "--journal", str(out), "--json")
    _, original_listing, _ = run_cli(capsys, "replay", "list", "--journal", crashed.location, "--json")
    assert listed["rollouts"] == original_listing["rollouts"]
    _, shown, _ = run_cli(capsys, "replay", "show", crashed.ids["g1-s1"], "--journal", str(out), "--json")
    _, original_show, _ = run_cli(
        capsys, "replay", "show", crashed.ids["g1-s1"], "--journal", crashed.location, "--json"
    )
    assert _without_locations(shown["turns"]) == _without_locations(original_show["turns"])
    assert json.loads((out / "EXPORT.json").read_text())["verified"] is True
    # an existing export is never overwritten
    code, _, err = run_cli(capsys, "export", "--journal", crashed.location, "--out", str(out))
    assert code == EXIT_INPUT and "not an empty directory" in err


def by_key(records) -> dict[str, list[bytes | None]]:
    found: dict[str, list[bytes | None]] = {}
    for record in records:
        found.setdefault(record.key, []).append(record.value)
    return found


def _without_locations(doc):
    if isinstance(doc, dict):
        return {k: _without_locations(v) for k, v in doc.items() if k != "location"}
    if isinstance(doc, list):
        return [_without_locations(v) for v in doc]
    return doc


# -- fork ----------------------------------------------------------------------------------------


def resume_into(config: WorkloadConfig, location: str, tmp_path: Path) -> RunReport:
    path = tmp_path / "workload.yaml"
    path.write_text(yaml.safe_dump(config.model_copy(update={"journal": location}).model_dump()))
    return run_workload(WorkloadConfig.load(path), resume=True)


def fork_target(crashed: CrashedRun, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh journal of the source's kind for the fork (the shared journal stays as the other tests expect it)."""
    return location_for("kafka" if crashed.location.startswith("kafka://") else "file", request, tmp_path)


def test_fork_continues_from_turn_k_and_its_lineage_names_the_fork_point(
    crashed: CrashedRun, tmp_path: Path, request, capsys
) -> None:
    origin = crashed.ids["g0-s1"]
    out = fork_target(crashed, request, tmp_path)
    code, doc, _ = run_cli(
        capsys, "fork", origin, "--at-turn", "2", "--journal", crashed.location, "--journal-out", out, "--json"
    )
    assert code == 0
    fork_id = doc["fork_id"]
    assert fork_id == f"{origin}.fork-1" and doc["forked_from"] == f"{origin}@2" and doc["next_turn"] == 3

    resumed = resume_into(crashed.config, out, tmp_path)
    assert set(resumed.rollouts) == {fork_id}  # a journal of forks: the workload's own rollouts live elsewhere
    assert resumed.rollouts[fork_id].turns_committed_before == 3 and resumed.rollouts[fork_id].turns_run_here == 2
    # without a seed of its own the fork samples with its origin's turn seeds: it re-runs what the origin did
    assert resumed.outcomes()[fork_id]["actions"] == crashed.resumed.outcomes()[origin]["actions"]
    assert resumed.outcomes()[fork_id]["reward"] == crashed.resumed.outcomes()[origin]["reward"]

    with open_journal(out, read_only=True) as journal:
        events = [i.event for i in journal.read_rollout(fork_id)]
    starts = [e for e in events if isinstance(e, AttemptStarted)]
    assert starts[0].forked_from == f"{origin}@2" and starts[0].header.attempt == 1
    assert "continue fork of" in starts[1].reason
    origin_calls = journal_calls(crashed.location, origin)
    fork_calls = [e for e in events if isinstance(e, ModelCall)]
    assert fork_calls[:3] == [_with_header(c, f) for c, f in zip(origin_calls[:3], fork_calls[:3])]
    assert fork_calls[3].parent_call_id == origin_calls[2].call_id  # the lineage names the fork point
    assert fork_calls[3].call_id.startswith(fork_id)

    with open_replay(out) as source:  # it did what the origin did, so its resources went through the same states
        for (resource_id, _, revision), live in crashed.states.items():
            if resource_id.startswith(origin + "/"):
                name = resource_id.rpartition("/")[2]
                assert resource_state(source, f"{fork_id}/{name}", revision).state == live
    code, shown, _ = run_cli(capsys, "replay", "show", fork_id, "--journal", out, "--json")
    assert code == 0 and shown["attempts"][0]["forked_from"] == f"{origin}@2" and not shown["crashes"]
    assert [row["cells"].rstrip() for row in shown["turn_map"]["rows"]] == ["fff", "===CF"]


def _with_header(call: ModelCall, like: ModelCall) -> ModelCall:
    import dataclasses

    return dataclasses.replace(call, header=like.header)


def test_fork_with_a_seed_samples_anew(crashed: CrashedRun, tmp_path: Path, request, capsys) -> None:
    origin = crashed.ids["g1-s0"]
    if crashed.location.startswith("kafka://"):  # the shared namespace stays as the other tests expect it
        journal, where = crashed.location, ["--journal-out", fork_target(crashed, request, tmp_path)]
    else:  # into the journal it forks, here a copy of it
        journal, where = str(tmp_path / "same"), []
        shutil.copytree(crashed.location, journal)
    code, doc, _ = run_cli(
        capsys, "fork", origin, "--at-turn", "1", "--seed", "77", "--journal", journal, *where, "--json"
    )
    assert code == 0
    target = doc["journal"]
    resumed = resume_into(crashed.config, target, tmp_path)
    fork_id = doc["fork_id"]
    assert resumed.rollouts[fork_id].turns_run_here == 3
    assert all(r.reused_result for rid, r in resumed.rollouts.items() if rid != fork_id)  # nothing else re-ran
    fork_seeds = [c.sampling.seed for c in journal_calls(target, fork_id)]
    origin_seeds = [c.sampling.seed for c in journal_calls(crashed.location, origin)]
    assert fork_seeds[:2] == origin_seeds[:2] and all(a != b for a, b in zip(fork_seeds[2:], origin_seeds[2:]))
    code, listed, _ = run_cli(capsys, "replay", "list", "--journal", target, "--json")
    row = {r["rollout_id"]: r for r in listed["rollouts"]}[fork_id]
    assert row["forked_from"] == f"{origin}@1" and row["status"] == "finished" and row["crashes"] == 0


def test_fork_refuses_what_it_cannot_rerun(crashed: CrashedRun, tmp_path: Path) -> None:
    out = str(tmp_path / "forks")
    with open_replay(crashed.location) as source:
        with pytest.raises(ForkError, match="is the last"):
            fork_rollout(source, crashed.ids["g0-s0"], 4, journal_out=out)
        with pytest.raises(NoSuchTurnError, match="committed turns 0-4"):
            fork_rollout(source, crashed.ids["g0-s0"], 5, journal_out=out)
        with pytest.raises(ForkError, match="restart_only"):
            fork_rollout(source, crashed.ids["g2-s0"], 1, journal_out=out)


# -- a real SIGKILL ------------------------------------------------------------------------------


def held_back(capsys: pytest.CaptureFixture, journal: str) -> list[str]:
    """The partitions a read-only ``replay list`` of ``journal`` found held back by an open transaction."""
    code, doc, err = run_cli(capsys, "replay", "list", "--journal", journal, "--json")
    assert code == 0 and doc is not None, err
    return doc["problems"]["held_back"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_after_a_sigkill_and_a_resume_list_show_and_export_training_agree(
    backend: str, request, tmp_path: Path, capsys
) -> None:
    config = workload(
        location_for(backend, request, tmp_path),
        name="kill",
        groups=2,
        environment="workplace",
        max_turns=6,
        turn_delay_ms=5,
    )
    progress = tmp_path / "progress.txt"
    assert run_child_and_kill(config, resume=False, kill_after_turns=9, extra_delay_s=0.0, progress_path=progress)
    code, at_crash, _ = run_cli(capsys, "replay", "list", "--journal", config.journal, "--json")
    assert code == 0 and any(r["status"] == "running" for r in at_crash["rollouts"])
    resumed = run_workload(config, resume=True)
    # The SIGKILLed child's transaction stays open until the broker aborts it (the transaction
    # timeout plus its abort scan), and a read-only read stops there: list and show would each see
    # the journal before or after the abort. Wait, bounded, until no read is held back.
    wait_for(lambda: not held_back(capsys, config.journal), 120, "the killed child's transaction to be aborted")
    code, listed, _ = run_cli(capsys, "replay", "list", "--journal", config.journal, "--json", "--crashed")
    hit = {r["rollout_id"] for r in at_crash["rollouts"] if r["status"] == "running"}
    assert code == 0 and {r["rollout_id"] for r in listed["rollouts"]} == hit
    for rid in hit:
        code, shown, _ = run_cli(capsys, "replay", "show", rid, "--journal", config.journal, "--json")
        assert code == 0 and len(shown["crashes"]) == 1 and shown["finished"]
        assert shown["reward"] == resumed.outcomes()[rid]["reward"]
    out = tmp_path / "t.pt"
    assert cli(["export-training", "--journal", config.journal, "--out", str(out)]) == 0
    assert {r["rollout_id"] for r in torch.load(out, weights_only=True)["rollouts"]} == set(resumed.outcomes())


# -- the journal's own tokenizer, and unreadable records ------------------------------------------


def one_call_journal(root: Path, policy_version: str, tokenizer: ChatTokenizer) -> None:
    """A journal whose one model call was written by ``policy_version`` with ``tokenizer``."""
    from rollout_journal.journal.events import Header, Message, SamplingParams
    from rollout_journal.journal.file.backend import FileBackend
    from rollout_journal.journal.journal import Journal

    def header(seq: int) -> Header:
        return Header("r1", "g", 1, 1, 0, seq, 0, "w")

    text = tokenizer.encode("mail.read(id=3)")
    with Journal(FileBackend(root)) as journal:
        journal.append_sync(
            [
                AttemptStarted(header(0), 0, "t", "new rollout"),
                ModelCall(
                    header(1),
                    "r1/a1/t0/c0",
                    None,
                    policy_version,
                    SamplingParams(),
                    0,
                    tokenizer.chat_prompt([("user", "read mail 3")]),
                    text,
                    np.zeros(len(text), dtype=np.float32),
                ),
                TurnCompleted(header(2), [Message("assistant", "mail.read(id=3)")], ["r1/a1/t0/c0"], {}),
            ]
        )


def another_model_folder(root: Path) -> Path:
    """The embedded model's folder under another chat template: another tokenizer identity,
    so another policy version, under the embedded model's own name."""
    import shutil

    from rollout_journal.participants.model.tiny_model import tiny_model_dir

    folder = root / tiny_model_dir().name
    shutil.copytree(tiny_model_dir(), folder)
    template = next(p for p in folder.iterdir() if p.name in ("chat_template.jinja", "chat_template.json"))
    template.write_text(template.read_text() + "{# another build of the same template #}")
    return folder


def test_show_decodes_with_the_tokenizer_the_policy_was_built_with(tmp_path: Path, capsys) -> None:
    from rollout_journal.participants.model.folders import policy_version_of

    folder = another_model_folder(tmp_path / "models")
    other = ChatTokenizer.from_folder(folder)
    policy = policy_version_of(folder)
    one_call_journal(tmp_path / "j", policy, other)
    code, _, err = run_cli(capsys, "replay", "show", "r1", "--journal", str(tmp_path / "j"))
    assert code == EXIT_INPUT and policy in err and "--tokenizer" in err  # the embedded one is refused, not assumed
    code, doc, _ = run_cli(
        capsys, "replay", "show", "r1", "--journal", str(tmp_path / "j"), "--json", "--tokenizer", str(folder)
    )
    assert code == 0
    (call,) = doc["turns"][0]["calls"]
    assert call["decoded_output"] == "mail.read(id=3)"
    assert call["tokenizer"]["verified"] and call["tokenizer"]["tokenizer_fingerprint"] == other.fingerprint


def test_show_builds_the_embedded_model_this_machine_lacks(tmp_path: Path, capsys, monkeypatch) -> None:
    """A journal made elsewhere names the embedded model: the library reads only cached folders
    (it never imports the model room), the command line builds the missing one, and on an install
    without torch says what to do instead of failing in an import."""
    import sys

    from rollout_journal.participants.model.folders import policy_version_of
    from rollout_journal.participants.model.tiny_model import tiny_model_dir
    from rollout_journal.replay.errors import TokenizerUnavailableError
    from rollout_journal.replay.tokenizers import TokenizerCatalog

    policy = policy_version_of(tiny_model_dir())
    one_call_journal(tmp_path / "j", policy, default_tokenizer())
    monkeypatch.setenv("ROLLOUT_JOURNAL_MODEL_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(TokenizerUnavailableError, match="not built at"):
        TokenizerCatalog().identify(policy)

    with monkeypatch.context() as no_torch:
        no_torch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError, as on the core install
        code, _, err = run_cli(capsys, "replay", "show", "r1", "--journal", str(tmp_path / "j"))
    assert code == EXIT_INPUT and "rollout-journal[torch]" in err and "--no-decode" in err

    code, doc, _ = run_cli(capsys, "replay", "show", "r1", "--journal", str(tmp_path / "j"), "--json")
    assert code == 0
    (call,) = doc["turns"][0]["calls"]
    assert call["decoded_output"] == "mail.read(id=3)" and call["tokenizer"]["verified"]
    assert (tmp_path / "empty-cache" / tiny_model_dir().name / "config.json").is_file()


def test_show_refuses_a_policy_no_folder_reproduces_unless_told(tmp_path: Path, capsys) -> None:
    tokenizer = default_tokenizer()
    one_call_journal(tmp_path / "j", "vllm:org/model@rev-abc", tokenizer)
    code, _, err = run_cli(capsys, "replay", "show", "r1", "--journal", str(tmp_path / "j"))
    assert code == EXIT_INPUT and "vllm:org/model@rev-abc" in err
    assert run_cli(capsys, "replay", "show", "r1", "--journal", str(tmp_path / "j"), "--no-decode")[0] == 0
    folder = another_model_folder(tmp_path / "models")
    code, doc, _ = run_cli(
        capsys,
        "replay",
        "show",
        "r1",
        "--journal",
        str(tmp_path / "j"),
        "--json",
        "--tokenizer",
        str(folder / "tokenizer.json"),
    )
    assert code == 0 and doc["tokenizers"]["vllm:org/model@rev-abc"]["verified"] is False


def test_a_corrupt_record_is_named_in_one_closing_line_and_the_exit_code(tmp_path: Path, capsys) -> None:
    config = workload(str(tmp_path / "j"), groups=1, siblings=2, environment="workplace")
    run_workload(config, resume=False)
    segment = min((tmp_path / "j" / "log").glob("*.seg"))
    data = bytearray(segment.read_bytes())
    position = len(data) // 2
    data[position] ^= 0xFF
    segment.write_bytes(bytes(data))
    for argv in (
        ["replay", "list", "--journal", str(tmp_path / "j")],
        ["replay", "show", "rp-g0-s1", "--journal", str(tmp_path / "j")],
        ["export-training", "--journal", str(tmp_path / "j"), "--out", str(tmp_path / "t.pt")],
    ):
        code, _, err = run_cli(capsys, *argv)
        closing = err.strip().splitlines()[-1]
        assert code == EXIT_JOURNAL_DAMAGED, argv
        assert closing.startswith("rollout-journal: ") and str(segment) in closing and "position" in closing


# -- forks under audit and verify -----------------------------------------------------------------


def test_a_signed_fork_audits_clean_and_anchored_and_verifies(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollout_journal.journal.anchoring import SIGNING_KEY_ENV, HeadSigner

    signer = HeadSigner.generate()
    monkeypatch.setenv(SIGNING_KEY_ENV, signer.private_pem().decode())
    config = workload(str(tmp_path / "j"), groups=1, siblings=2, environment="workplace")
    origin = workload_specs(config)[1].rollout_id
    run_workload(config, resume=False, stop_after={origin: 3})
    run_workload(config, resume=True)
    code, doc, _ = run_cli(capsys, "fork", origin, "--at-turn", "2", "--journal", config.journal, "--json")
    assert code == 0
    (tmp_path / "verify.pem").write_bytes(signer.public_pem())

    def audited_and_verified() -> None:
        code, audited, _ = run_cli(
            capsys, "audit", "--journal", config.journal, "--public-key", str(tmp_path / "verify.pem"), "--json"
        )
        assert code == 0 and audited["chain_ok"], audited["problems"]
        assert audited["anchored"] == "yes" and audited["anchors_verified"]
        assert any(r["resource_id"].startswith(doc["fork_id"] + "/") for r in audited["mutations"])
        code, verified, _ = run_cli(capsys, "verify", "--journal", config.journal, "--json")
        assert code == 0 and verified["first_divergence"] is None

    audited_and_verified()  # the fork's copied turns are anchored as live turns are
    run_workload(config, resume=True)  # continues the fork
    audited_and_verified()
    code, shown, _ = run_cli(capsys, "replay", "show", doc["fork_id"], "--journal", config.journal, "--json")
    assert code == 0 and all(t["signed"] == bool(t["mutations"]) for t in shown["turns"])
    assert {t["life"] for t in shown["turns"]} == {0}
