"""``export-training`` keeps what a trainer needs to tell rows apart: in every format, a rollout's
status, its group policy, the closed sequences of a ``new_sequence`` history policy and the
counters of how its calls continued; a given-up rollout exported with ``--unfinished`` says it
was given up. Real file journals, real chat templates, real fastavro, pyarrow and datasets."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rollout_journal.journal.events import (
    AttemptStarted,
    ChatMessage,
    Header,
    ModelCall,
    RolloutFailed,
    RolloutFinished,
    RolloutGivenUp,
    SamplingParams,
    TurnCompleted,
)
from rollout_journal.journal.open import open_journal
from rollout_journal.participants.model.chat import PromptBuilder
from rollout_journal.participants.model.tokenizer import ChatTokenizer
from rollout_journal.participants.rollout.state import RolloutState
from rollout_journal.replay.source import open_replay
from rollout_journal.replay.training import export_training
from tests.support.template_models import CONVERSATION, model_folder

FORMATS = ["pt", "parquet", "jsonl", "hf"]
OUT = {"pt": "rows.pt", "parquet": "rows.parquet", "jsonl": "rows.jsonl", "hf": "rows"}


def two_sequence_rollout(location: str) -> RolloutState:
    """A finished rollout whose chat template rewrites history (``chatml-think``) under
    ``history_policy: new_sequence``: its record holds two token sequences."""
    tok = ChatTokenizer.from_folder(model_folder("chatml-think"))
    builder = PromptBuilder(tok, history_policy="new_sequence")
    state = RolloutState("r", "g")
    events: list = []
    seq = 0

    def header(turn: int) -> Header:
        nonlocal seq
        seq += 1
        return Header("r", "g", 1, 1, turn, seq, 0, "w")

    def add(event) -> None:
        state.apply(event)
        events.append(event)

    add(AttemptStarted(header(0), 0, "topo", "test", CONVERSATION[:2]))
    text = "<think>\nalice first\n</think>\n\nDone."
    output = np.concatenate([tok.chat_ids(text), [tok.eos_id]]).astype(np.int32)
    for turn in range(2):
        prompt = builder.prompt(state)
        call = ModelCall(
            header(turn),
            f"r/a1/t{turn}/c0",
            state.head_call_id,
            "p",
            SamplingParams(0.7, 0.9, 32, 0),
            prompt.prefix_len,
            prompt.delta,
            output,
            np.full(len(output), -1.0, dtype="<f4"),
            logprob_mode="processed",
            continuation=prompt.continuation,
        )
        add(call)
        messages = [ChatMessage("assistant", text, call_id=call.call_id), ChatMessage("user", "And Bob?")]
        add(TurnCompleted(header(turn), messages, [call.call_id], {}))
    add(RolloutFinished(header(1), 1.0, 2, json.dumps({"reward": 1.0})))
    with open_journal(location, writer="w") as journal:
        journal.append_sync(events)
    assert state.new_sequences == 1 and len(state.training_record(state.header("w"), 1).sequence_starts) == 1
    return state


def given_up_rollout(location: str) -> None:
    """A rollout with one committed turn whose infrastructure failures ran out: given up."""
    tok = ChatTokenizer.from_folder(model_folder("chatml"))
    builder = PromptBuilder(tok)
    state = RolloutState("q", "h")
    seq = 0

    def header(turn: int) -> Header:
        nonlocal seq
        seq += 1
        return Header("q", "h", 1, 1, turn, seq, 0, "w")

    events: list = [AttemptStarted(header(0), 0, "topo", "test", CONVERSATION[:2])]
    state.apply(events[0])
    prompt = builder.prompt(state)
    output = np.concatenate([tok.chat_ids("Done."), [tok.eos_id]]).astype(np.int32)
    call = ModelCall(
        header(0), "q/a1/t0/c0", None, "p", SamplingParams(1.0, 1.0, 16, 0), prompt.prefix_len, prompt.delta,
        output, np.full(len(output), -1.0, dtype="<f4"), logprob_mode="processed", continuation=prompt.continuation,
    )  # fmt: skip
    events += [
        call,
        TurnCompleted(header(0), [ChatMessage("assistant", "Done.", call_id=call.call_id)], [call.call_id], {}),
        RolloutFailed(header(1), "TimeoutError", "the sandbox did not answer"),
        RolloutGivenUp(header(1), 1, "TimeoutError", "the sandbox did not answer"),
    ]
    with open_journal(location, writer="w") as journal:
        journal.append_sync(events)


def rows_of(form: str, out: Path) -> list[dict]:
    if form == "pt":
        import torch

        return torch.load(out, weights_only=True)["rollouts"]
    if form == "parquet":
        import pyarrow.parquet as pq

        return pq.read_table(out).to_pylist()
    if form == "hf":
        import datasets

        return list(datasets.load_from_disk(str(out)))
    return [json.loads(line) for line in out.read_text().splitlines()]


def as_list(value) -> list:
    return value.tolist() if hasattr(value, "tolist") else list(value)


@pytest.mark.parametrize("form", FORMATS)
def test_every_format_keeps_the_status_and_the_closed_sequences(tmp_path: Path, form: str) -> None:
    """Without ``sequence_starts`` a loader sees one sequence and attends the second across the
    first, whose tokens its sampled ones never saw: a trainer would learn from wrong contexts."""
    location = str(tmp_path / "j")
    state = two_sequence_rollout(location)
    expected = state.training_record(state.header("w"), 0)
    out = tmp_path / OUT[form]
    export_training(open_replay(location), out, format=form)
    (row,) = rows_of(form, out)
    assert row["status"] == "finished"
    assert as_list(row["sequence_starts"]) == expected.sequence_starts.tolist() != []
    for counter in ("calls", "calls_drifted", "eos_splices", "new_sequences", "template_mismatch_calls"):
        assert int(row[counter]) == getattr(expected, counter), counter


@pytest.mark.parametrize("form", FORMATS)
def test_a_given_up_rollout_exported_with_unfinished_says_it_was_given_up(tmp_path: Path, form: str) -> None:
    """A trainer filtering on status must not take a given-up rollout for one still running."""
    location = str(tmp_path / "j")
    given_up_rollout(location)
    out = tmp_path / OUT[form]
    export_training(open_replay(location), out, format=form, unfinished=True)
    (row,) = rows_of(form, out)
    assert row["status"] == "given_up"
    assert not row["finished"]


@pytest.mark.parametrize("form", FORMATS)
def test_every_format_says_what_each_segments_logprobs_are(tmp_path: Path, form: str) -> None:
    """A run sampled at top_p 0.9 has renormalized processed logprobs: a trainer that reads
    parquet or hf must see ``logprob_mode`` and ``renormalized`` to compute a right ratio."""
    location = str(tmp_path / "j")
    state = two_sequence_rollout(location)
    expected = state.training_record(state.header("w"), 0).token_segments
    out = tmp_path / OUT[form]
    export_training(open_replay(location), out, format=form)
    (row,) = rows_of(form, out)
    if form == "pt":
        got = [
            {"logprob_mode": m, "renormalized": bool(r), "constrained": bool(c)}
            for m, r, c in zip(row["segment_logprob_mode"], row["segment_renormalized"], row["segment_constrained"])
        ]
    else:
        got = [{k: s[k] for k in ("logprob_mode", "renormalized", "constrained")} for s in row["segments"]]
    assert got == [
        {"logprob_mode": s.logprob_mode, "renormalized": s.renormalized, "constrained": s.constrained} for s in expected
    ]
    assert any(s.generated and s.renormalized and s.logprob_mode == "processed" for s in expected)
