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
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from journal.events import AttemptStarted, ModelCall, TurnCompleted
from journal.open import open_journal
from participants.config import WorkloadConfig
from participants.runner import Runner, RunReport, workload_specs
from participants.tokenizer import ChatTokenizer
from participants.torch_policy import TinyTorchPolicy
from participants.workload import build_backend, open_workload_journal, run_workload
from replay.cli import main as cli
from replay.source import open_replay
from tests.recovery_support import run_child_and_kill

BACKENDS = ["file", pytest.param("kafka", marks=pytest.mark.kafka)]
STOP = {"g0-s0": 5, "g0-s1": 2, "g1-s0": 3, "g1-s1": 1, "g2-s0": 2, "g2-s1": 0}  # turns committed at the crash


def workload(location: str, **overrides) -> WorkloadConfig:
    base = dict(name="rp", groups=3, siblings=2, max_turns=5, environment="workplace,counter,sandbox", seed=5,
                allow_early_submit=False, journal=location, snapshot_every_turns=2)
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

    def _new_environment(self, spec):
        env = super()._new_environment(spec)
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
def crashed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> CrashedRun:
    config = workload(location_for(request.param, request, tmp_path_factory.mktemp("replay")))
    ids = {s.rollout_id.removeprefix("rp-"): s.rollout_id for s in workload_specs(config)}
    states, initial = {}, {}
    run_watched(config, states, initial, resume=False, stop_after={ids[k]: n for k, n in STOP.items()})
    with open_replay(config.journal) as source:
        from replay.listing import list_rollouts
        listing_at_crash = list_rollouts(source).as_json()
    resumed = run_watched(config, states, initial, resume=True)
    return CrashedRun(config, ids, listing_at_crash, resumed, states, initial)


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
        assert row["crashes"] == (0 if STOP[short] == 5 else 1)
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

    crashed_ids = {rid for short, rid in crashed.ids.items() if STOP[short] < 5}
    assert shown("--crashed") == crashed_ids
    assert shown("--min-attempts", "2") == crashed_ids
    assert shown("--group", "rp-g1") == {crashed.ids["g1-s0"], crashed.ids["g1-s1"]}
    assert shown("--status", "running") == set()
    assert shown("--status", "finished", "--group", "rp-g0", "--crashed") == {crashed.ids["g0-s1"]}


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


def test_show_names_an_unknown_rollout_or_turn_in_one_line(crashed: CrashedRun, capsys) -> None:
    code, _, err = run_cli(capsys, "replay", "show", "rp-g9-s9", "--journal", crashed.location)
    assert code == 2 and err.strip().count("\n") == 0 and "rp-g9-s9" in err
    code, _, err = run_cli(capsys, "replay", "show", crashed.ids["g0-s0"], "--journal", crashed.location,
                           "--turn", "7")
    assert code == 2 and "never committed turn 7" in err


# -- a real SIGKILL ------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_after_a_sigkill_and_a_resume_list_and_show_agree(backend: str, request, tmp_path: Path,
                                                                          capsys) -> None:
    config = workload(location_for(backend, request, tmp_path), name="kill", groups=2, environment="workplace",
                      max_turns=6, turn_delay_ms=5)
    progress = tmp_path / "progress.txt"
    assert run_child_and_kill(config, resume=False, kill_after_turns=9, extra_delay_s=0.0, progress_path=progress)
    code, at_crash, _ = run_cli(capsys, "replay", "list", "--journal", config.journal, "--json")
    assert code == 0 and any(r["status"] == "running" for r in at_crash["rollouts"])
    resumed = run_workload(config, resume=True)
    code, listed, _ = run_cli(capsys, "replay", "list", "--journal", config.journal, "--json", "--crashed")
    hit = {r["rollout_id"] for r in at_crash["rollouts"] if r["status"] == "running"}
    assert code == 0 and {r["rollout_id"] for r in listed["rollouts"]} == hit
    for rid in hit:
        code, shown, _ = run_cli(capsys, "replay", "show", rid, "--journal", config.journal, "--json")
        assert code == 0 and len(shown["crashes"]) == 1 and shown["finished"]
        assert shown["reward"] == resumed.outcomes()[rid]["reward"]


# -- the journal's own tokenizer, and unreadable records ------------------------------------------

def one_call_journal(root: Path, policy_version: str, tokenizer: ChatTokenizer) -> None:
    """A journal whose one model call was written by ``policy_version`` with ``tokenizer``."""
    from journal.events import Header, Message, SamplingParams
    from journal.journal import Journal
    from journal.file_backend import FileBackend

    def header(seq: int) -> Header:
        return Header("r1", "g", 1, 1, 0, seq, 0, "w")

    text = tokenizer.encode("mail.read(id=3)")
    with Journal(FileBackend(root)) as journal:
        journal.append_sync([
            AttemptStarted(header(0), 0, "t", "new rollout"),
            ModelCall(header(1), "r1/a1/t0/c0", None, policy_version, SamplingParams(), 0,
                      tokenizer.generation_prompt(), text, np.zeros(len(text), dtype=np.float32)),
            TurnCompleted(header(2), [Message("assistant", "mail.read(id=3)")], ["r1/a1/t0/c0"], {}),
        ])


def test_show_decodes_with_the_tokenizer_the_policy_was_built_with(tmp_path: Path, capsys) -> None:
    other = ChatTokenizer.train(vocab_size=400)  # another tokenizer: another policy version
    policy = TinyTorchPolicy(other, weights_seed=0).policy_version
    one_call_journal(tmp_path / "j", policy, other)
    code, _, err = run_cli(capsys, "replay", "show", "r1", "--journal", str(tmp_path / "j"))
    assert code == 2 and policy in err and "--tokenizer" in err  # the built-in one is refused, not assumed
    other.save_hf(tmp_path / "tok")
    code, doc, _ = run_cli(capsys, "replay", "show", "r1", "--journal", str(tmp_path / "j"), "--json",
                           "--tokenizer", str(tmp_path / "tok"))
    assert code == 0
    (call,) = doc["turns"][0]["calls"]
    assert call["decoded_output"] == "mail.read(id=3)"
    assert call["tokenizer"]["verified"] and call["tokenizer"]["tokenizer_fingerprint"] == other.fingerprint


def test_show_refuses_a_policy_family_it_cannot_identify_unless_told(tmp_path: Path, capsys) -> None:
    tokenizer = ChatTokenizer.train()
    one_call_journal(tmp_path / "j", "vllm:org/model@rev-abc", tokenizer)
    code, _, err = run_cli(capsys, "replay", "show", "r1", "--journal", str(tmp_path / "j"))
    assert code == 2 and "vllm:org/model@rev-abc" in err
    assert run_cli(capsys, "replay", "show", "r1", "--journal", str(tmp_path / "j"), "--no-decode")[0] == 0
    tokenizer.save_hf(tmp_path / "tok")
    code, doc, _ = run_cli(capsys, "replay", "show", "r1", "--journal", str(tmp_path / "j"), "--json",
                           "--tokenizer", str(tmp_path / "tok" / "tokenizer.json"))
    assert code == 0 and doc["tokenizers"]["vllm:org/model@rev-abc"]["verified"] is False


def test_a_corrupt_record_is_named_in_one_closing_line_and_the_exit_code(tmp_path: Path, capsys) -> None:
    config = workload(str(tmp_path / "j"), groups=1, siblings=2, environment="workplace")
    run_workload(config, resume=False)
    segment = sorted((tmp_path / "j" / "log").glob("*.seg"))[0]
    data = bytearray(segment.read_bytes())
    position = len(data) // 2
    data[position] ^= 0xFF
    segment.write_bytes(bytes(data))
    for argv in (["replay", "list", "--journal", str(tmp_path / "j")],
                 ["replay", "show", "rp-g0-s1", "--journal", str(tmp_path / "j")]):
        code, _, err = run_cli(capsys, *argv)
        closing = err.strip().splitlines()[-1]
        assert code == 3, argv
        assert closing.startswith("rollout-journal: ") and str(segment) in closing and "position" in closing
