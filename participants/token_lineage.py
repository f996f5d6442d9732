"""Which call, attempt and policy produced each token of a rollout's lineage, and its logprob.

The lineage head (a call's prompt followed by its output) is built by
``RolloutState``; this follows the same calls and labels the head's tokens in
segments: the part of a prompt rendered by the agent (the conversation: prompt
deltas) and the part sampled by the model (outputs), with the logprob of every
sampled token. A call keeps the first ``prefix_len`` tokens of its parent's head,
so their labels carry over: the tokens a crashed attempt committed keep naming
that attempt after a resume.

One piece of code serves the live worker (the training record it publishes with a
rollout's final turn), the snapshot it restores from, and every offline reader
(``replay export-training``, the timeline).
"""

from __future__ import annotations

import numpy as np

from journal.errors import RolloutJournalError
from journal.events import ModelCall, TokenSegment

__all__ = ["TokenLineage", "TokenSegment", "LineageMismatch"]


class LineageMismatch(RolloutJournalError):
    """A call's ``prefix_len`` exceeds its parent's tokens: the lineage no longer covers the head."""


class TokenLineage:
    """Segments (and sampled logprobs) of the head of one rollout, kept in step with its state."""

    def __init__(self, segments: list[TokenSegment] | None = None, logprobs: np.ndarray | None = None) -> None:
        self.segments: list[TokenSegment] = list(segments or [])
        end = self.segments[-1].end if self.segments else 0
        self.logprobs = np.zeros(end, dtype=np.float32) if logprobs is None else np.asarray(logprobs, np.float32)

    def follow(self, rollout_id: str, head_len: int, event: object) -> None:
        """Call after the state applied ``event``: label what it added to a head of ``head_len`` tokens."""
        if isinstance(event, ModelCall):
            h = event.header
            kept = [s.clipped(event.prefix_len) for s in self.segments if s.start < event.prefix_len]
            delta_end = event.prefix_len + len(event.prompt_delta)
            end = delta_end + len(event.output_ids)
            if len(event.prompt_delta):
                kept.append(TokenSegment(event.prefix_len, delta_end, False, h.attempt, h.turn, event.call_id,
                                         event.policy_version))
            if len(event.output_ids):
                kept.append(TokenSegment(delta_end, end, True, h.attempt, h.turn, event.call_id,
                                         event.policy_version))
            self.segments = kept
            self.logprobs = np.concatenate([self.logprobs[: event.prefix_len],
                                            np.zeros(len(event.prompt_delta), dtype=np.float32),
                                            np.asarray(event.logprobs, dtype=np.float32)[: len(event.output_ids)]])
        elif head_len == 0:  # the conversation started over (a restart-only environment)
            self.segments, self.logprobs = [], np.zeros(0, dtype=np.float32)
        covered = self.segments[-1].end if self.segments else 0
        if covered != head_len:
            raise LineageMismatch(f"rollout {rollout_id}: token lineage covers {covered} tokens, the head holds "
                                  f"{head_len}; a call's prefix_len exceeds its parent's tokens")

    def loss_mask(self) -> np.ndarray:
        """True on every sampled token of the head."""
        mask = np.zeros(len(self.logprobs), dtype=bool)
        for seg in self.segments:
            if seg.generated:
                mask[seg.start:seg.end] = True
        return mask
