"""Which call, attempt and policy produced each token of a rollout's lineage, and its logprob.

The lineage head (a call's prompt followed by its output) is built by
``RolloutState``; this follows the same calls and labels the head's tokens in
segments: the part of a prompt rendered by the agent (the conversation: prompt
deltas) and the part sampled by the model (outputs), with the logprob of every
sampled token. A call keeps the first ``prefix_len`` tokens of its parent's head,
so their labels carry over: the tokens a crashed attempt committed keep naming
that attempt after a resume.

A call's output is labelled run by run (``ModelCall.output_segments``): a call continued
after a crash, or across a weight swap, names each attempt and policy version that sampled
its tokens, and each sampled run says what distribution it was drawn from (temperature,
top_p, top_k, logprob mode, renormalized, constrained). A call that starts a new sequence
(``continuation == "new_sequence"``: the chat template rewrote history and the workload asked
for a fresh render) closes the current one; the closed sequences stay in the record, in order.

One piece of code serves the live worker (the training record it publishes with a
rollout's final turn), the snapshot it restores from, and every offline reader
(``replay export-training``, the timeline).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rollout_journal.journal.errors import RolloutJournalError
from rollout_journal.journal.events import LOGPROB_PROCESSED, ModelCall, OutputSegment, TokenSegment

__all__ = ["TokenLineage", "TokenSegment", "LineageMismatch", "extended_segments"]


def extended_segments(
    segments: list[OutputSegment], attempt: int, policy_version: str, tokens: int, logprob_mode: str | None
) -> list[OutputSegment]:
    """A call's output runs (who generated its tokens, in order, and what their logprobs are)
    after ``tokens`` more by ``attempt`` under ``policy_version`` with ``logprob_mode``: the last
    run grows when it is theirs, else a run is added; no tokens, no run. A run without a mode
    (journaled before ModelCallProgress.v2) counts as one of this mode. The one rule for the model
    gate (a call continued across aborts and attempts) and the aggregate (a call's journaled
    progress). ``segments`` is not changed."""
    if tokens == 0:
        return list(segments)
    run = (attempt, policy_version, logprob_mode)
    last = segments[-1] if segments else None
    if last is not None and (last.attempt, last.policy_version, last.logprob_mode or logprob_mode) == run:
        return [*segments[:-1], OutputSegment(attempt, policy_version, last.tokens + tokens, logprob_mode)]
    return [*segments, OutputSegment(attempt, policy_version, tokens, logprob_mode)]


class LineageMismatch(RolloutJournalError):
    """A call's ``prefix_len`` exceeds its parent's tokens: the lineage no longer covers the head."""


def sampled_runs(event: ModelCall, start: int) -> list[TokenSegment]:
    """The generated segments of a call's output placed at ``start``: one per run of
    ``output_segments()`` (who sampled it), each labelled with the distribution sampled from."""
    h, p = event.header, event.sampling
    runs, pos = [], start
    for run in event.output_segments():
        mode = run.logprob_mode or event.logprob_mode
        runs.append(
            TokenSegment(
                pos,
                pos + run.tokens,
                True,
                run.attempt,
                h.turn,
                event.call_id,
                run.policy_version,
                temperature=p.temperature,
                top_p=p.top_p,
                top_k=p.top_k,
                logprob_mode=mode,
                renormalized=mode == LOGPROB_PROCESSED and p.filters(),
                constrained=event.constrained,
            )
        )
        pos += run.tokens
    return runs


class TokenLineage:
    """Segments (and sampled logprobs) of the head of one rollout, kept in step with its state,
    and the sequences closed before it (a ``new_sequence`` call), with their token ids."""

    def __init__(
        self,
        segments: list[TokenSegment] | None = None,
        logprobs: np.ndarray | None = None,
        closed_ids: np.ndarray | None = None,
        closed_logprobs: np.ndarray | None = None,
        closed_segments: list[TokenSegment] | None = None,
        sequence_starts: list[int] | None = None,
    ) -> None:
        self.segments: list[TokenSegment] = list(segments or [])
        end = self.segments[-1].end if self.segments else 0
        self.logprobs = np.zeros(end, dtype=np.float32) if logprobs is None else np.asarray(logprobs, np.float32)
        # Sequences before the head's, concatenated (positions of closed_segments are into closed_ids)
        self.closed_ids = np.zeros(0, np.int32) if closed_ids is None else np.asarray(closed_ids, np.int32)
        self.closed_logprobs = (
            np.zeros(0, np.float32) if closed_logprobs is None else np.asarray(closed_logprobs, np.float32)
        )
        self.closed_segments: list[TokenSegment] = list(closed_segments or [])
        self.sequence_starts: list[int] = list(sequence_starts or [])  # where each sequence after the first starts

    def close_sequence(self, head_tokens: np.ndarray) -> None:
        """The head's sequence ends (the next call starts a new one): keep it, labels and all."""
        offset = len(self.closed_ids)
        self.closed_segments += [
            dataclasses.replace(s, start=s.start + offset, end=s.end + offset) for s in self.segments
        ]
        self.closed_ids = np.concatenate([self.closed_ids, head_tokens]).astype(np.int32)
        self.closed_logprobs = np.concatenate([self.closed_logprobs, self.logprobs]).astype(np.float32)
        self.sequence_starts.append(len(self.closed_ids))
        self.segments, self.logprobs = [], np.zeros(0, dtype=np.float32)

    def follow(self, rollout_id: str, head_len: int, event: object) -> None:
        """Call after the state applied ``event``: label what it added to a head of ``head_len`` tokens
        (a ``new_sequence`` call: after :meth:`close_sequence`)."""
        if isinstance(event, ModelCall):
            h = event.header
            kept = [s.clipped(event.prefix_len) for s in self.segments if s.start < event.prefix_len]
            delta_end = event.prefix_len + len(event.prompt_delta)
            end = delta_end + len(event.output_ids)
            if len(event.prompt_delta):
                kept.append(
                    TokenSegment(
                        event.prefix_len, delta_end, False, h.attempt, h.turn, event.call_id, event.policy_version
                    )
                )
            if len(event.output_ids):
                runs = sampled_runs(event, delta_end)
                if runs[-1].end != end:
                    raise LineageMismatch(
                        f"rollout {rollout_id}: call {event.call_id} names runs of {runs[-1].end - delta_end} "
                        f"tokens for its {len(event.output_ids)} output tokens"
                    )
                kept += runs
            self.segments = kept
            self.logprobs = np.concatenate(
                [
                    self.logprobs[: event.prefix_len],
                    np.zeros(len(event.prompt_delta), dtype=np.float32),
                    np.asarray(event.logprobs, dtype=np.float32)[: len(event.output_ids)],
                ]
            )
        elif head_len == 0:  # the conversation started over (a restart-only environment)
            self.segments, self.logprobs = [], np.zeros(0, dtype=np.float32)
            self.closed_ids, self.closed_logprobs = np.zeros(0, np.int32), np.zeros(0, np.float32)
            self.closed_segments, self.sequence_starts = [], []
        covered = self.segments[-1].end if self.segments else 0
        if covered != head_len:
            raise LineageMismatch(
                f"rollout {rollout_id}: token lineage covers {covered} tokens, the head holds "
                f"{head_len}; a call's prefix_len exceeds its parent's tokens"
            )

    def loss_mask(self) -> np.ndarray:
        """True on every sampled token of the head."""
        return _mask(len(self.logprobs), self.segments)

    # -- the whole record: the closed sequences, then the head's -------------------------
    def record_ids(self, head_tokens: np.ndarray) -> np.ndarray:
        return np.concatenate([self.closed_ids, head_tokens]).astype(np.int32) if len(self.closed_ids) else head_tokens

    def record_logprobs(self) -> np.ndarray:
        return np.concatenate([self.closed_logprobs, self.logprobs]) if len(self.closed_ids) else self.logprobs

    def record_segments(self) -> list[TokenSegment]:
        offset = len(self.closed_ids)
        if not offset:
            return list(self.segments)
        head = [dataclasses.replace(s, start=s.start + offset, end=s.end + offset) for s in self.segments]
        return [*self.closed_segments, *head]

    def record_loss_mask(self) -> np.ndarray:
        return _mask(len(self.closed_ids) + len(self.logprobs), self.record_segments())


def _mask(length: int, segments: list[TokenSegment]) -> np.ndarray:
    mask = np.zeros(length, dtype=bool)
    for seg in segments:
        if seg.generated:
            mask[seg.start : seg.end] = True
    return mask
