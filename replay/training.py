"""``export-training``: what a trainer needs from a journal, as torch tensors.

Per rollout: the token ids of its final lineage head (every prompt token the
agent rendered and every token the model sampled, in order), the logprob of each
sampled token, a loss mask that is true on sampled tokens only, the reward, and
for each segment of the sequence the attempt, turn, call and policy version that
produced it. The head comes from ``RolloutState`` (the fold restore uses); the
labels from its :class:`participants.token_lineage.TokenLineage`, so a resumed
rollout's tokens keep naming the attempt that sampled them. The record is the one
a worker publishes on the results stream with a rollout's final turn
(:meth:`RolloutState.training_record`), built by the same code.

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

from journal.events import RolloutFinished, TrainingRecord
from journal.journal import ReadReport
from participants.rollout_state import RolloutState, StateFoldError

from .progress import Progress
from .source import ReplaySource

TRAINING_FORMAT = "rollout-journal/training/1"


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
    in the order they finish in the journal (``group_size`` 0: a journal does not say it). Rollouts whose events do not apply go to ``left_out``."""
    report = report if report is not None else ReadReport()
    left_out = left_out if left_out is not None else {}
    reading: dict[str, RolloutState] = {}
    done: set[str] = set()
    for item in source.scan(report, progress):
        event = item.event
        rollout_id = event.header.rollout_id
        if rollout_id in done:
            continue  # its acknowledgement, or what follows a damaged record
        state = reading.get(rollout_id)
        if state is None:
            state = reading[rollout_id] = RolloutState(rollout_id, event.header.group_id)
        try:
            state.apply(event)
        except StateFoldError as exc:
            left_out[rollout_id] = f"{exc} at {item.location}"
            del reading[rollout_id]
            done.add(rollout_id)
            continue
        if isinstance(event, RolloutFinished):
            yield state.training_record(event.header, group_size=0)
            del reading[rollout_id]
            done.add(rollout_id)
    for rollout_id, state in reading.items():
        if unfinished:
            yield state.training_record(state.header(""), group_size=0)
        else:
            left_out[rollout_id] = f"unfinished after turn {state.next_turn - 1} (--unfinished includes it)"


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


__all__ = ["TRAINING_FORMAT", "TrainingExport", "TrainingRecord", "export_training", "training_records"]
