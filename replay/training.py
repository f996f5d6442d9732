"""``export-training``: what a trainer needs from a journal, one row per rollout.

Per rollout: the token ids of its final lineage head (every prompt token the
agent rendered and every token the model sampled, in order), the logprob of each
sampled token, a loss mask that is true on sampled tokens only, the reward, and
for each segment of the sequence the attempt, turn, call, policy version and
sampling parameters that produced it. The head comes from ``RolloutState`` (the
fold restore uses); the labels from its
:class:`rollout_journal.participants.rollout.lineage.TokenLineage`, so a resumed
rollout's tokens keep naming the attempt that sampled them. The record is the one
a worker publishes on the results stream with a rollout's final turn
(:meth:`RolloutState.training_record`), built by the same code.

This module computes the rows (:func:`training_rows`); each file format is a small
writer over them (:mod:`rollout_journal.replay.training_formats`): ``pt`` (``torch.save``),
``parquet``, ``jsonl`` and ``hf`` (a Hugging Face ``datasets`` folder). The table formats
share one set of columns (:meth:`TrainingRow.columns`), named as verl's and TRL's
loaders name them (README, "Training on the results"). The scan keeps one state per
rollout in progress and hands a rollout on once it finishes, so memory follows the
rollouts in flight and the writer, never the history.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rollout_journal.journal.events import ModelCall, RolloutFinished, SamplingParams, TrainingRecord
from rollout_journal.journal.journal import ReadReport
from rollout_journal.participants.rollout.state import RolloutState, StateFoldError
from rollout_journal.replay.progress import Progress
from rollout_journal.replay.source import ReplaySource

TRAINING_FORMAT = "rollout-journal/training/1"
SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))  # per segment, as journaled
CONTINUATION_COUNTERS = ("calls", "calls_drifted", "eos_splices", "new_sequences", "template_mismatch_calls")


@dataclass(frozen=True)
class TrainingRow:
    """One rollout as a trainer takes it: its :class:`TrainingRecord`, the sampling parameters of
    each model call it names, and how many turns it committed."""

    record: TrainingRecord
    sampling: dict[str, SamplingParams]  # by call id
    turns: int

    @property
    def prompt_len(self) -> int:
        """Tokens before the first sampled one: the initial prompt (all of them if nothing was sampled)."""
        mask = np.asarray(self.record.loss_mask, dtype=bool)
        return int(mask.argmax()) if mask.any() else len(mask)

    def segments(self) -> list[dict[str, Any]]:
        """Who made each run of tokens: bounds, sampled or not, attempt, turn, call, policy, what its
        logprobs are (mode, renormalized, constrained) and the call's sampling parameters."""
        out = []
        for s in self.record.token_segments:
            params = self.sampling.get(s.call_id)
            sampling = dataclasses.asdict(params) if params is not None else dict.fromkeys(SAMPLING_FIELDS)
            out.append(
                {
                    "start": s.start,
                    "end": s.end,
                    "generated": s.generated,
                    "attempt": s.attempt,
                    "turn": s.turn,
                    "call_id": s.call_id,
                    "policy_version": s.policy_version,
                    "logprob_mode": s.logprob_mode,
                    "renormalized": s.renormalized,
                    "constrained": s.constrained,
                }
                | sampling
            )
        return out

    def columns(self) -> dict[str, Any]:
        """The row of the table formats (parquet, jsonl, hf): plain values and lists.

        verl's ``AgentLoopOutput`` fields (``prompt_ids``, ``response_ids``, ``response_mask``: 1 on sampled
        tokens, ``response_logprobs``, ``reward_score``, ``num_turns``), TRL's pre-tokenized SFT columns
        (``input_ids``, ``assistant_masks``: 1 on sampled tokens), and ours (``logprobs`` over
        ``input_ids``, ``segments``, ``policy_versions``, ...)."""
        r = self.record
        ids = np.asarray(r.input_ids, dtype=np.int32)
        mask = np.asarray(r.loss_mask, dtype=bool).astype(np.int8)
        logprobs = np.asarray(r.logprobs, dtype=np.float32)
        cut = self.prompt_len
        reward = None if r.reward is None or math.isnan(r.reward) else float(r.reward)
        return {
            "rollout_id": r.rollout_id,
            "group_id": r.group_id,
            "finished": r.finished,
            "reward_score": reward,
            "attempts": r.header.attempt,
            "num_turns": self.turns,
            "prompt_ids": ids[:cut].tolist(),
            "response_ids": ids[cut:].tolist(),
            "response_mask": mask[cut:].tolist(),
            "response_logprobs": logprobs[cut:].tolist(),
            "input_ids": ids.tolist(),
            "assistant_masks": mask.tolist(),
            "logprobs": logprobs.tolist(),
            "policy_versions": sorted({s.policy_version for s in r.token_segments}),
            "segments": self.segments(),
        } | self.labels()

    def labels(self) -> dict[str, Any]:
        """What every format carries besides the tokens: the status, where each token sequence after
        the first starts (a ``new_sequence`` history policy) and how the calls continued their parents."""
        r = self.record
        return {
            "status": r.status,
            "sequence_starts": np.asarray(r.sequence_starts, dtype=np.int32).tolist(),
            **{name: int(getattr(r, name)) for name in CONTINUATION_COUNTERS},
        }

    def tensors(self) -> dict[str, Any]:
        """The ``pt`` format's dict: :meth:`TrainingRecord.tensors`, plus ``prompt_len``, ``num_turns``
        and ``segment_sampling`` (a dict of the sampling parameters per segment)."""
        sampling = [{k: s[k] for k in SAMPLING_FIELDS} for s in self.segments()]
        return (
            self.record.tensors()
            | self.labels()
            | {"prompt_len": self.prompt_len, "num_turns": self.turns, "segment_sampling": sampling}
        )


@dataclass
class TrainingExport:
    """What ``export-training`` wrote."""

    location: str
    out: str
    format: str = "pt"
    rollouts: int = 0
    tokens: int = 0
    sampled_tokens: int = 0
    left_out: dict[str, str] = field(default_factory=dict)  # rollout -> why
    report: ReadReport = field(default_factory=ReadReport)

    def as_json(self) -> dict[str, Any]:
        return {
            "journal": self.location,
            "out": self.out,
            "format": self.format,
            "layout": TRAINING_FORMAT,
            "rollouts": self.rollouts,
            "tokens": self.tokens,
            "sampled_tokens": self.sampled_tokens,
            "left_out": self.left_out,
        }

    def text(self) -> Iterator[str]:
        yield (
            f"wrote {self.rollouts} rollouts ({self.tokens} tokens, {self.sampled_tokens} sampled) to {self.out}"
            f" ({self.format}, {TRAINING_FORMAT})"
        )
        for rollout_id, why in self.left_out.items():
            yield f"left out {rollout_id}: {why}"


def training_rows(
    source: ReplaySource,
    *,
    unfinished: bool = False,
    report: ReadReport | None = None,
    left_out: dict[str, str] | None = None,
    progress: Progress | None = None,
) -> Iterator[TrainingRow]:
    """A row per finished rollout (and, with ``unfinished``, per unfinished one, at the end), in
    the order they finish in the journal (``group_size`` 0: a journal does not say it). Rollouts
    whose events do not apply go to ``left_out``."""
    report = report if report is not None else ReadReport()
    left_out = left_out if left_out is not None else {}
    reading: dict[str, tuple[RolloutState, dict[str, SamplingParams]]] = {}
    done: set[str] = set()
    for item in source.scan(report, progress):
        event = item.event
        rollout_id = event.header.rollout_id
        if rollout_id in done:
            continue  # its acknowledgement, or what follows a damaged record
        if rollout_id not in reading:
            reading[rollout_id] = RolloutState(rollout_id, event.header.group_id), {}
        state, sampling = reading[rollout_id]
        try:
            state.apply(event)
        except StateFoldError as exc:
            left_out[rollout_id] = f"{exc} at {item.location}"
            del reading[rollout_id]
            done.add(rollout_id)
            continue
        if isinstance(event, ModelCall):
            sampling[event.call_id] = event.sampling
        elif isinstance(event, RolloutFinished):
            yield TrainingRow(state.training_record(event.header, group_size=0), sampling, state.next_turn)
            del reading[rollout_id]
            done.add(rollout_id)
    for rollout_id, (state, sampling) in reading.items():
        if unfinished:
            yield TrainingRow(state.training_record(state.header(""), group_size=0), sampling, state.next_turn)
        elif state.given_up:
            left_out[rollout_id] = f"given up after {state.failures} infrastructure failures (--unfinished includes it)"
        else:
            left_out[rollout_id] = f"unfinished after turn {state.next_turn - 1} (--unfinished includes it)"


def training_records(source: ReplaySource, **kwargs: Any) -> Iterator[TrainingRecord]:
    """The :class:`TrainingRecord` of each row of :func:`training_rows` (same arguments)."""
    return (row.record for row in training_rows(source, **kwargs))


def export_training(
    source: ReplaySource,
    out: str | Path,
    *,
    format: str = "pt",
    unfinished: bool = False,
    progress: Progress | None = None,
) -> TrainingExport:
    """Write the training rows of ``source`` to ``out`` in ``format`` (see ``FORMATS``): a file, or
    for ``hf`` a folder ``datasets.load_from_disk`` opens. Nothing is at ``out`` until it is whole."""
    from rollout_journal.replay.training_formats import writer_for

    result = TrainingExport(source.location, str(out), format)
    with writer_for(format, Path(out), source.location) as writer:
        for row in training_rows(
            source, unfinished=unfinished, report=result.report, left_out=result.left_out, progress=progress
        ):
            writer.add(row)
            result.rollouts += 1
            result.tokens += len(row.record.input_ids)
            result.sampled_tokens += int(np.asarray(row.record.loss_mask).sum())
    return result


__all__ = [
    "TRAINING_FORMAT",
    "TrainingExport",
    "TrainingRecord",
    "TrainingRow",
    "export_training",
    "training_records",
    "training_rows",
]
