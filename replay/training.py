"""``export-training``: what a trainer needs from a journal, as torch tensors.

Per rollout: the token ids of its final lineage head (every prompt token the
agent rendered and every token the model sampled, in order), the logprob of each
sampled token, a loss mask that is true on sampled tokens only, the reward, and
for each segment of the sequence the attempt, turn, call and policy version that
produced it. The head comes from ``RolloutState`` (the fold restore uses); the
labels from :class:`replay.lineage.TokenLineage`, so a resumed rollout's tokens
keep naming the attempt that sampled them.

The file is ``torch.save`` of ``{"format", "journal", "rollouts": [dict per
rollout]}`` (see :meth:`TrainingRecord.tensors`); ``torch.load`` it with
``weights_only=True``. The scan keeps one state per rollout in progress and hands
a rollout on once it finishes, so memory follows the rollouts in flight and the
output, never the history.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from journal.events import ModelCall, RolloutFinished
from journal.journal import ReadReport
from participants.rollout_state import RolloutState, StateFoldError

from .lineage import TokenLineage, TokenSegment
from .progress import Progress
from .source import ReplaySource

TRAINING_FORMAT = "rollout-journal/training/1"


@dataclass
class TrainingRecord:
    """One rollout ready for a trainer (numpy; :meth:`tensors` for torch)."""

    rollout_id: str
    group_id: str
    reward: float | None
    finished: bool
    attempts: int
    input_ids: np.ndarray  # int32 [T]
    logprobs: np.ndarray  # float32 [T], 0 where the model did not sample the token
    loss_mask: np.ndarray  # bool [T]
    segments: list[TokenSegment]

    def tensors(self) -> dict:
        """The record as torch tensors (``input_ids`` int64, ``logprobs`` float32, ``loss_mask`` bool,
        ``token_attempt`` int32; per segment ``segment_bounds`` int64 [S, 2], ``segment_attempt`` /
        ``segment_turn`` int32, ``segment_generated`` bool, ``segment_policy_version`` and
        ``segment_call_id`` lists; ``reward`` float, NaN for an unfinished rollout)."""
        import torch

        attempt = np.zeros(len(self.input_ids), dtype=np.int32)
        for s in self.segments:
            attempt[s.start:s.end] = s.attempt
        bounds = np.asarray([[s.start, s.end] for s in self.segments], dtype=np.int64).reshape(-1, 2)
        return {
            "rollout_id": self.rollout_id, "group_id": self.group_id,
            "reward": float("nan") if self.reward is None else float(self.reward),
            "finished": self.finished, "attempts": self.attempts,
            "input_ids": torch.from_numpy(self.input_ids.astype(np.int64)),
            "logprobs": torch.from_numpy(self.logprobs.copy()),
            "loss_mask": torch.from_numpy(self.loss_mask.copy()),
            "token_attempt": torch.from_numpy(attempt),
            "segment_bounds": torch.from_numpy(bounds),
            "segment_attempt": torch.tensor([s.attempt for s in self.segments], dtype=torch.int32),
            "segment_turn": torch.tensor([s.turn for s in self.segments], dtype=torch.int32),
            "segment_generated": torch.tensor([s.generated for s in self.segments], dtype=torch.bool),
            "segment_policy_version": [s.policy_version for s in self.segments],
            "segment_call_id": [s.call_id for s in self.segments],
            "policy_versions": sorted({s.policy_version for s in self.segments}),
        }


class _InProgress:
    """A rollout being read: its state, its token labels, and the logprobs of its calls."""

    __slots__ = ("lineage", "logprobs", "state")

    def __init__(self, state: RolloutState) -> None:
        self.state = state
        self.lineage = TokenLineage()
        self.logprobs: dict[str, np.ndarray] = {}

    def record(self) -> TrainingRecord:
        s = self.state
        logprobs = np.zeros(len(s.head_tokens), dtype=np.float32)
        mask = np.zeros(len(s.head_tokens), dtype=bool)
        for seg in self.lineage.segments:
            if seg.generated:
                logprobs[seg.start:seg.end] = self.logprobs[seg.call_id][: seg.end - seg.start]
                mask[seg.start:seg.end] = True
        return TrainingRecord(s.rollout_id, s.group_id, s.reward, s.finished, s.attempt,
                              s.head_tokens.astype(np.int32), logprobs, mask, list(self.lineage.segments))


@dataclass
class TrainingExport:
    """What ``export-training`` wrote."""

    location: str
    out: str
    rollouts: int = 0
    tokens: int = 0
    sampled_tokens: int = 0
    left_out: dict[str, str] = field(default_factory=dict)  # rollout -> why
    report: ReadReport = field(default_factory=ReadReport)

    def as_json(self) -> dict:
        return {"journal": self.location, "out": self.out, "format": TRAINING_FORMAT, "rollouts": self.rollouts,
                "tokens": self.tokens, "sampled_tokens": self.sampled_tokens, "left_out": self.left_out}

    def text(self) -> Iterator[str]:
        yield (f"wrote {self.rollouts} rollouts ({self.tokens} tokens, {self.sampled_tokens} sampled) to {self.out}"
               f" ({TRAINING_FORMAT})")
        for rollout_id, why in self.left_out.items():
            yield f"left out {rollout_id}: {why}"


def training_records(source: ReplaySource, *, unfinished: bool = False, report: ReadReport | None = None,
                     left_out: dict[str, str] | None = None, progress: Progress | None = None
                     ) -> Iterator[TrainingRecord]:
    """A record per finished rollout (and, with ``unfinished``, per unfinished one, at the end),
    in the order they finish in the journal. Rollouts whose events do not apply go to ``left_out``."""
    report = report if report is not None else ReadReport()
    left_out = left_out if left_out is not None else {}
    reading: dict[str, _InProgress] = {}
    done: set[str] = set()
    for item in source.scan(report, progress):
        event = item.event
        rollout_id = event.header.rollout_id
        if rollout_id in done:
            continue  # its acknowledgement, or what follows a damaged record
        rollout = reading.get(rollout_id)
        if rollout is None:
            rollout = reading[rollout_id] = _InProgress(RolloutState(rollout_id, event.header.group_id))
        try:
            rollout.state.apply(event)
            rollout.lineage.follow(rollout.state, event)
        except StateFoldError as exc:
            left_out[rollout_id] = f"{exc} at {item.location}"
            del reading[rollout_id]
            done.add(rollout_id)
            continue
        if not rollout.lineage.segments:  # the conversation started over: earlier calls are out of it
            rollout.logprobs.clear()
        if isinstance(event, ModelCall):
            rollout.logprobs[event.call_id] = event.logprobs.copy()  # not a view: the record's bytes can go
        elif isinstance(event, RolloutFinished):
            yield rollout.record()
            del reading[rollout_id]
            done.add(rollout_id)
    for rollout_id, rollout in reading.items():
        if unfinished:
            yield rollout.record()
        else:
            left_out[rollout_id] = f"unfinished after turn {rollout.state.next_turn - 1} (--unfinished includes it)"


def export_training(source: ReplaySource, out: str | Path, *, unfinished: bool = False,
                    progress: Progress | None = None) -> TrainingExport:
    """Write the training records of ``source`` to ``out`` (``torch.save``)."""
    import torch

    result = TrainingExport(source.location, str(out))
    tensors = []
    for record in training_records(source, unfinished=unfinished, report=result.report, left_out=result.left_out,
                                   progress=progress):
        tensors.append(record.tensors())
        result.rollouts += 1
        result.tokens += len(record.input_ids)
        result.sampled_tokens += int(record.loss_mask.sum())
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"format": TRAINING_FORMAT, "journal": source.location, "rollouts": tensors}, tmp)
    tmp.replace(path)  # a reader never sees half a file
    return result
