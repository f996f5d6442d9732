"""Offline look at a journal: which rollouts it holds, and one rollout turn by turn.

Reads only; never calls the model. Works on a file journal (opened read-only,
so a running writer is not disturbed) or a Kafka namespace.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from journal.events import (
    AttemptFenced, AttemptStarted, ModelCall, ResourceMutation, RolloutAcknowledged, RolloutFinished, TurnCompleted,
)
from journal.journal import Journal, ReadReport
from participants.rollout_state import RolloutProgress, StateFoldError, full_prompt
from participants.tokenizer import ChatTokenizer


@dataclass
class JournalListing:
    rollouts: dict[str, RolloutProgress] = field(default_factory=dict)
    damaged: dict[str, str] = field(default_factory=dict)  # rollout -> why its events do not apply in order
    report: ReadReport = field(default_factory=ReadReport)


def list_rollouts(journal: Journal) -> JournalListing:
    """One pass over the whole journal (fenced, lenient: bad records are reported, not fatal).
    Each rollout's events are applied to its ``RolloutProgress``, exactly as restore does."""
    listing = JournalListing()
    for item in journal.scan(listing.report):
        h = item.event.header
        if h.rollout_id in listing.damaged:
            continue
        row = listing.rollouts.setdefault(h.rollout_id, RolloutProgress(h.rollout_id, h.group_id))
        try:
            row.apply(item.event)
        except StateFoldError as exc:
            listing.damaged[h.rollout_id] = f"{exc} at {item.location}"
    return listing


def show_rollout(journal: Journal, rollout_id: str, tokenizer: ChatTokenizer, *, token_ids: bool = False,
                 report: ReadReport | None = None) -> Iterator[str]:
    """Lines describing every event of one rollout, in log order, as attempt N+1 sees it."""
    head = np.zeros(0, dtype=np.int32)
    found = False
    for item in journal.read_rollout(rollout_id, report=report):
        found = True
        event, h = item.event, item.event.header
        where = f"[seq {h.seq} attempt {h.attempt} epoch {h.epoch} turn {h.turn}]"
        if isinstance(event, AttemptStarted):
            yield f"{where} attempt {h.attempt} starts at turn {event.resumed_from_turn}: {event.reason}"
        elif isinstance(event, AttemptFenced):
            yield f"{where} attempt {event.fenced_attempt} fenced: {event.reason}"
        elif isinstance(event, ModelCall):
            prompt = full_prompt(head, event)
            head = np.concatenate([prompt, event.output_ids]).astype(np.int32)
            logprob = float(event.logprobs.sum()) if len(event.logprobs) else 0.0
            yield (f"{where} model call {event.call_id} (parent {event.parent_call_id or '-'}, "
                   f"{event.policy_version}): prompt {len(prompt)} tokens ({event.prefix_len} reused, "
                   f"{len(event.prompt_delta)} new) -> {tokenizer.decode(event.output_ids)!r} "
                   f"[{len(event.output_ids)} tokens, logprob {logprob:.3f}, {event.finish_reason}]")
            if token_ids:
                yield f"    output ids {event.output_ids.tolist()}"
                yield f"    logprobs   {np.round(event.logprobs, 4).tolist()}"
        elif isinstance(event, ResourceMutation):
            yield (f"{where} {event.resource_id} r{event.prev_revision}->r{event.revision} {event.op}"
                   f"({event.args_json}) = {event.result_json} chain {event.chain_hash[:12]}")
        elif isinstance(event, TurnCompleted):
            for message in event.messages:
                yield f"{where} {message.role}: {message.content}"
        elif isinstance(event, RolloutFinished):
            yield f"{where} finished after {event.turns} turns, reward {event.reward:.4f}"
        elif isinstance(event, RolloutAcknowledged):
            yield f"{where} acknowledged by {event.acknowledged_by}"
    if not found:
        raise KeyError(f"no events of rollout {rollout_id!r} in this journal (see `rollout-journal list`)")
