"""Which call, attempt and policy produced each token of a rollout's lineage.

The lineage head (a call's prompt followed by its output) is built by
``RolloutState``; this follows the same calls and labels the head's tokens in
segments: the part of a prompt rendered by the agent (the conversation: prompt
deltas) and the part sampled by the model (outputs). A call keeps the first
``prefix_len`` tokens of its parent's head, so their labels carry over: the
tokens a crashed attempt committed keep naming that attempt after a resume.
"""

from __future__ import annotations

from dataclasses import dataclass

from journal.events import ModelCall
from participants.rollout_state import RolloutState, StateFoldError


@dataclass(frozen=True)
class TokenSegment:
    """Tokens ``[start, end)`` of a head: who made them."""

    start: int
    end: int
    generated: bool  # sampled by the model (a call's output); else prompt text rendered by the agent
    attempt: int
    turn: int
    call_id: str
    policy_version: str

    def clipped(self, end: int) -> TokenSegment:
        return TokenSegment(self.start, min(self.end, end), self.generated, self.attempt, self.turn, self.call_id,
                            self.policy_version)

    def as_json(self) -> dict:
        return {"start": self.start, "end": self.end, "generated": self.generated, "attempt": self.attempt,
                "turn": self.turn, "call_id": self.call_id, "policy_version": self.policy_version}


class TokenLineage:
    """Segments of the head of one rollout, kept in step with its ``RolloutState``."""

    def __init__(self) -> None:
        self.segments: list[TokenSegment] = []

    def follow(self, state: RolloutState, event: object) -> None:
        """Call after ``state.apply(event)``: label what the event added to the head."""
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
        elif len(state.head_tokens) == 0:  # the conversation started over (a restart-only environment)
            self.segments = []
        covered = self.segments[-1].end if self.segments else 0
        if covered != len(state.head_tokens):
            raise StateFoldError(f"rollout {state.rollout_id}: token lineage covers {covered} tokens, the head holds "
                                 f"{len(state.head_tokens)}; a call's prefix_len exceeds its parent's tokens")
