"""The aggregate's rules, one by one: given these events, then this state.

Every event here is built by hand (no model, no environment, no journal), so each test states
one rule of ``RolloutProgress.apply`` / ``RolloutState.apply`` as the scenario it covers.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import zlib

import numpy as np
import pytest

from rollout_journal.journal.errors import RecordLocation
from rollout_journal.journal.events import (
    CONTINUATION_EOS_SPLICE,
    CONTINUATION_EXTEND,
    CONTINUATION_NEW_SEQUENCE,
    LOGPROB_UNKNOWN,
    AttemptFenced,
    AttemptStarted,
    ChainHead,
    ChatMessage,
    FenceEntry,
    HeadCheckpoint,
    Header,
    ModelCall,
    ModelCallProgress,
    OutputSegment,
    ResourceMutation,
    RolloutAcknowledged,
    RolloutFailed,
    RolloutFinished,
    RolloutGivenUp,
    SamplingParams,
    Snapshot,
    TemplateCheck,
    TokenSegment,
    TurnCompleted,
)
from rollout_journal.journal.journal import JournaledEvent
from rollout_journal.journal.restore import RolloutHistory
from rollout_journal.journal.snapshots import Fence, LoadedSnapshot
from rollout_journal.participants.resources import MutationRecord
from rollout_journal.participants.rollout import (
    RolloutProgress,
    RolloutState,
    StateFoldError,
    prompt_digest,
    restore_state,
    snapshot_of,
)
from rollout_journal.participants.rollout.effects import model_digest, sampling_json, tool_digest
from rollout_journal.participants.rollout.lineage import TokenLineage
from rollout_journal.participants.rollout.state import STATE_MAGIC, _unpacked
from tests.support.states import assert_same_state

RID, GID = "r", "g"
SYSTEM = [ChatMessage("system", "act"), ChatMessage("user", "do the task")]


def ids(*values: int) -> np.ndarray:
    return np.asarray(values, dtype="<i4")


def lps(*values: float) -> np.ndarray:
    return np.asarray(values, dtype="<f4")


class Rollout:
    """Hand-built events of one rollout, each with the next seq (in the order they are built)
    and the attempt, epoch and turn the events so far put it at; ``apply`` feeds them to a state."""

    def __init__(self, state: RolloutProgress | None = None) -> None:
        self.state = state if state is not None else RolloutState(RID, GID)
        self.attempt = self.epoch = self.turn = self.seq = 0

    def header(self, **change: object) -> Header:
        """The next event's header (``change``: fields set otherwise)."""
        h = Header(RID, GID, self.attempt, self.epoch, self.turn, self.seq, 0, "w")
        self.seq += 1
        return dataclasses.replace(h, **change)  # type: ignore[arg-type]

    def apply(self, *events: object) -> RolloutState:
        for event in events:
            self.state.apply(event)  # type: ignore[arg-type]
        assert isinstance(self.state, RolloutState)
        return self.state

    # -- the events ---------------------------------------------------------------------
    def start(self, resumed_from_turn: int = 0, messages: list[ChatMessage] | None = None) -> AttemptStarted:
        self.attempt, self.epoch, self.turn = self.attempt + 1, self.epoch + 1, resumed_from_turn
        if messages is None:
            messages = list(SYSTEM) if resumed_from_turn == 0 else []
        return AttemptStarted(self.header(), resumed_from_turn, f"topology-{self.attempt}", "test", messages)

    def call(
        self,
        call_id: str,
        prefix_len: int,
        delta: np.ndarray,
        output: np.ndarray,
        logprobs: np.ndarray | None = None,
        *,
        policy: str = "p0",
        parent: str | None = None,
    ) -> ModelCall:
        logprobs = logprobs if logprobs is not None else np.full(len(output), -0.5, dtype="<f4")
        return ModelCall(self.header(), call_id, parent, policy, SamplingParams(), prefix_len, delta, output, logprobs)

    def progress(
        self, call_id: str, start: int, output: np.ndarray, *, call_index: int = 0, prompt_sha: str = "sha", policy="p0"
    ) -> ModelCallProgress:
        logprobs = np.full(len(output), -0.25, dtype="<f4")
        return ModelCallProgress(self.header(), call_id, call_index, policy, prompt_sha, start, output, logprobs)

    def mutation(self, resource: str = "r/mail", revision: int = 1) -> ResourceMutation:
        return ResourceMutation(
            self.header(),
            resource,
            "mail",
            "send",
            '{"to":"bob"}',
            f"{RID}/t{self.turn}/m0",
            revision - 1,
            revision,
            '{"id":7}',
            f"digest-{revision}",
            f"chain-{revision}",
        )

    def turn_done(self, action: str = "a()", reward: float | None = None) -> TurnCompleted:
        event = TurnCompleted(
            self.header(), [ChatMessage("assistant", action), ChatMessage("tool", "ok")], [], {}, reward, [action]
        )
        self.turn += 1
        return event

    def finished(self, reward: float = 1.0) -> RolloutFinished:
        return RolloutFinished(self.header(), reward, self.turn, json.dumps({"reward": reward, "turns": self.turn}))


def one_turn(r: Rollout, call_id: str = "c0", action: str = "a()") -> list[object]:
    """A turn of one call (the head grows by a 2-token delta and a 2-token output) and its commit."""
    state = r.state
    assert isinstance(state, RolloutState)
    head = len(state.head_tokens)
    return [r.call(call_id, head, ids(10, 11), ids(20, 21), parent=state.head_call_id), r.turn_done(action)]


def fresh() -> tuple[Rollout, RolloutState]:
    r = Rollout()
    return r, r.apply(r.start())


# -- sequence numbers ------------------------------------------------------------------------


def test_events_apply_in_seq_order_and_each_moves_the_next_seq_on() -> None:
    r, state = fresh()
    assert state.next_seq == 1
    r.apply(r.call("c0", 0, ids(1, 2), ids(3)))
    assert state.next_seq == 2


def test_a_missing_record_is_a_gap_the_fold_refuses() -> None:
    r, state = fresh()
    event = r.call("c0", 0, ids(1), ids(2))
    with pytest.raises(StateFoldError, match="expected seq 1, found 3 .*a record is missing"):
        state.apply(dataclasses.replace(event, header=r.header(seq=3)))


def test_a_record_applied_twice_is_refused() -> None:
    r, state = fresh()
    turn = r.turn_done()
    r.apply(turn)
    with pytest.raises(StateFoldError, match="expected seq 2, found 1 .*a record appears twice"):
        state.apply(turn)


def test_an_event_of_another_rollout_is_refused() -> None:
    r, state = fresh()
    with pytest.raises(StateFoldError, match="rollout r: was handed an event of rollout other"):
        state.apply(TurnCompleted(r.header(rollout_id="other"), [], [], {}))


def test_an_event_type_without_a_rule_is_refused() -> None:
    r, state = fresh()

    @dataclasses.dataclass(frozen=True)
    class Unknown:
        header: Header

    with pytest.raises(StateFoldError, match="no rule to apply a Unknown"):
        state.apply(Unknown(r.header()))  # type: ignore[arg-type]


def test_audit_only_events_move_the_seq_and_nothing_else() -> None:
    r, state = fresh()
    r.apply(*one_turn(r))
    before = dataclasses.replace(state, messages=list(state.messages))
    fenced = AttemptFenced(r.header(), 0, 0, "audit")
    r.apply(fenced)
    r.apply(HeadCheckpoint(r.header(), 0, [ChainHead("r/mail", 1, "chain-1")], "ed25519", "k", b"sig"))
    assert state.next_seq == before.next_seq + 2
    assert_same_state(dataclasses.replace(before, next_seq=state.next_seq), state)


# -- attempts and epochs --------------------------------------------------------------------


def test_the_first_attempt_takes_its_epoch_topology_and_initial_conversation() -> None:
    r, state = fresh()
    assert (state.attempt, state.epoch, state.next_turn) == (1, 1, 0)
    assert state.topology == "topology-1" and state.messages == SYSTEM
    assert state.restarts == 0


def test_a_resumed_attempt_takes_the_next_epoch_and_keeps_the_conversation() -> None:
    r, state = fresh()
    r.apply(*one_turn(r))
    conversation = list(state.messages)
    r.apply(r.start(resumed_from_turn=1))
    assert (state.attempt, state.epoch, state.next_turn, state.restarts) == (2, 2, 1, 0)
    assert state.messages == conversation and state.topology == "topology-2"
    assert state.head_call_id == "c0" and len(state.head_tokens) == 4


def test_an_attempt_claiming_an_epoch_already_held_is_two_writers_at_once() -> None:
    r, state = fresh()
    r.apply(*one_turn(r))
    again = AttemptStarted(r.header(attempt=2, epoch=1), 1, "t", "a second resumer")
    with pytest.raises(StateFoldError, match="attempt 2 \\(written by w\\) claims epoch 1, which attempt 1 already"):
        state.apply(again)


def test_an_attempt_started_is_not_held_to_the_seq_order() -> None:
    """It is the fence: it may take a seq an older attempt already used (readers drop what the
    older attempt wrote from that seq on), and the seq never moves back."""
    r, state = fresh()
    r.apply(*one_turn(r))
    event = r.start(resumed_from_turn=1)
    r.apply(dataclasses.replace(event, header=dataclasses.replace(event.header, seq=1)))
    assert state.attempt == 2 and state.next_seq == 3


def test_the_next_attempt_and_its_epoch_are_one_above_the_newest() -> None:
    assert (RolloutState(RID, GID).next_attempt, RolloutState(RID, GID).next_epoch) == (1, 1)
    r, state = fresh()
    r.apply(*one_turn(r), r.start(resumed_from_turn=1))
    assert (state.next_attempt, state.next_epoch) == (3, 3)


def test_starting_an_attempt_fences_the_one_before_it_with_the_next_epoch() -> None:
    state = RolloutState(RID, GID)
    first = state.start_attempt("w", resumed_from_turn=0, topology="t", reason="new rollout", messages=SYSTEM)
    assert [type(e) for e in first] == [AttemptStarted]  # nothing ran before it: nothing to fence
    assert (first[0].header.attempt, first[0].header.epoch, first[0].messages) == (1, 1, SYSTEM)
    r = Rollout(state)
    r.attempt = r.epoch = r.seq = 1
    r.apply(*one_turn(r))
    started, fenced = state.start_attempt("w", resumed_from_turn=1, topology="t", reason="resume", override="o")
    assert isinstance(started, AttemptStarted) and isinstance(fenced, AttemptFenced)
    assert (started.header.attempt, started.header.epoch, started.header.seq, started.override) == (2, 2, 3, "o")
    assert (fenced.fenced_attempt, fenced.fenced_epoch, fenced.header.epoch, fenced.header.seq) == (1, 1, 2, 4)
    assert fenced.reason == "superseded by attempt 2: resume"
    assert (state.attempt, state.epoch, state.next_seq, state.next_turn) == (2, 2, 5, 1)  # both applied


def test_every_attempt_is_kept_in_the_fence_history_restarts_included() -> None:
    r, state = fresh()
    r.apply(*one_turn(r), r.start(resumed_from_turn=1), *one_turn(r, "c1"), r.start(resumed_from_turn=0))
    assert state.restarts == 1
    assert state.attempts == [FenceEntry(1, 1, 0, "w", 0), FenceEntry(2, 2, 3, "w", 0), FenceEntry(3, 3, 6, "w", 0)]
    record = state.training_record(r.header(), group_size=1)
    assert record.attempts == state.attempts  # the record is complete as built: nobody fills it in later


def test_a_new_attempt_clears_the_failure_of_the_old_one() -> None:
    r, state = fresh()
    r.apply(RolloutFailed(r.header(), "BackendError", "the server went away"))
    assert state.failure == "BackendError: the server went away"
    r.apply(r.start(resumed_from_turn=0))
    assert state.failure is None and state.attempt == 2


def test_failures_count_over_every_attempt_and_giving_up_is_terminal_with_its_fence_history() -> None:
    r, state = fresh()
    r.apply(RolloutFailed(r.header(), "SandboxCrashedError", "gone"), r.start(resumed_from_turn=0))
    r.apply(RolloutFailed(r.header(), "SandboxCrashedError", "gone again"))
    assert (state.failures, state.given_up, state.terminal) == (2, False, False)  # a new attempt keeps the count
    given_up = RolloutGivenUp(r.header(), state.failures, "SandboxCrashedError", "gone again")
    r.apply(given_up)
    assert (
        state.given_up and state.terminal and not state.finished and state.failure == "SandboxCrashedError: gone again"
    )
    record = state.given_up_record(given_up.header, 3, "drop")
    assert (record.finished, record.reward, len(record.input_ids), record.group_size) == (False, None, 0, 3)
    assert record.attempts == state.attempts and len(record.attempts) == 2
    again = RolloutState.from_bytes(state.to_bytes())  # new snapshot keys, no format change
    assert (again.failures, again.given_up) == (2, True)


def test_restart_from_turn_zero_starts_the_conversation_over_and_keeps_the_counts() -> None:
    r, state = fresh()
    r.apply(*one_turn(r), r.mutation(), *one_turn(r, "c1", "b()"))
    state.record_exports({"r/mail": b"exported"})
    r.apply(r.mutation(revision=2))
    counts = (state.model_calls, state.mutation_count, list(state.policy_versions), state.next_seq)
    over = r.start(resumed_from_turn=0, messages=[ChatMessage("system", "again")])

    assert state.starts_over(over)
    r.apply(over)

    assert state.restarts == 1 and (state.attempt, state.epoch) == (2, 2)
    assert (state.model_calls, state.mutation_count, state.policy_versions) == counts[:3]
    assert state.next_seq == counts[3] + 1
    assert state.next_turn == 0 and not state.finished and state.reward is None and state.output_tokens == 0
    assert state.messages == [ChatMessage("system", "again")] and state.actions == [] and state.outcome is None
    assert state.head_call_id is None and len(state.head_tokens) == 0
    assert state.lineage is not None and state.lineage.segments == [] and len(state.lineage.logprobs) == 0
    assert state.resource_states == {} and state.mutations_since_export == []
    assert state.turn_calls == [] and state.partial is None and state.calls_this_turn == 0


def test_a_resume_at_turn_zero_after_a_durable_call_of_turn_zero_is_no_restart() -> None:
    """An attempt that made its first call durable and crashed before the turn committed: the next
    attempt redoes turn 0 and replays that call; nothing starts over."""
    r, state = fresh()
    r.apply(r.call("c0", 0, ids(1, 2), ids(3)))
    resumed = r.start(resumed_from_turn=0, messages=[])
    assert not state.starts_over(resumed)
    r.apply(resumed)
    assert state.restarts == 0 and state.head_call_id == "c0" and state.messages == SYSTEM
    assert state.journaled_call(0) is not None and state.journaled_call(0).call_id == "c0"  # type: ignore[union-attr]


def test_a_second_restart_before_any_turn_commits_starts_over_again() -> None:
    r, state = fresh()
    r.apply(*one_turn(r))
    r.apply(r.start(resumed_from_turn=0))
    r.apply(r.call("c1", 0, ids(1, 2), ids(3)))  # the new life's first call, not yet a committed turn
    again = r.start(resumed_from_turn=0)
    assert state.starts_over(again)
    r.apply(again)
    assert state.restarts == 2 and state.head_call_id is None


# -- model calls: the head and its lineage ----------------------------------------------------


def test_a_model_call_moves_the_head_to_its_prompt_and_output() -> None:
    r, state = fresh()
    r.apply(r.call("c0", 0, ids(1, 2, 3), ids(4, 5), lps(-0.1, -0.2)))
    assert state.head_call_id == "c0" and state.head_tokens.tolist() == [1, 2, 3, 4, 5]
    assert state.head_tokens.dtype == np.int32
    assert (state.model_calls, state.output_tokens, state.policy_versions) == (1, 2, ["p0"])
    assert state.lineage is not None
    assert state.lineage.segments == [
        TokenSegment(0, 3, False, 1, 0, "c0", "p0"),
        TokenSegment(3, 5, True, 1, 0, "c0", "p0", temperature=1.0),
    ]
    assert state.lineage.logprobs.tolist() == pytest.approx([0, 0, 0, -0.1, -0.2])
    assert state.lineage.loss_mask().tolist() == [False, False, False, True, True]


def test_a_call_keeps_its_parents_prefix_and_its_labels() -> None:
    r, state = fresh()
    r.apply(r.call("c0", 0, ids(1, 2), ids(3, 4)), r.turn_done())
    r.apply(r.start(resumed_from_turn=1))  # attempt 2 continues: the tokens attempt 1 made keep naming it
    r.apply(r.call("c1", 3, ids(9), ids(8), policy="p1", parent="c0"))  # keeps 1, 2, 3 and drops the 4
    assert state.head_tokens.tolist() == [1, 2, 3, 9, 8]
    assert state.lineage is not None
    assert state.lineage.segments == [
        TokenSegment(0, 2, False, 1, 0, "c0", "p0"),
        TokenSegment(2, 3, True, 1, 0, "c0", "p0", temperature=1.0),
        TokenSegment(3, 4, False, 2, 1, "c1", "p1"),
        TokenSegment(4, 5, True, 2, 1, "c1", "p1", temperature=1.0),
    ]
    assert state.policy_versions == ["p0", "p1"]
    assert state.output_tokens == 3


def test_a_call_whose_prefix_exceeds_the_head_is_refused() -> None:
    r, state = fresh()
    r.apply(r.call("c0", 0, ids(1, 2), ids(3)))
    with pytest.raises(StateFoldError, match="lineage covers .* a call's prefix_len exceeds its parent's tokens"):
        state.apply(r.call("c1", 7, ids(4), ids(5), parent="c0"))


def test_the_calls_of_the_turn_under_way_are_journaled_calls_until_it_commits() -> None:
    r, state = fresh()
    first = r.call("c0", 0, ids(1), ids(2))
    r.apply(first)
    second = r.call("c1", 2, ids(3), ids(4), parent="c0")
    r.apply(second)
    assert state.turn_calls == [first, second] and state.calls_this_turn == 2
    assert state.journaled_call(1) == second and state.journaled_call(2) is None
    r.apply(r.turn_done())
    assert state.turn_calls == [] and state.calls_this_turn == 0 and state.journaled_call(0) is None


def test_a_policy_version_is_listed_once_in_order_of_first_use() -> None:
    r, state = fresh()
    for call_id, policy in (("c0", "p1"), ("c1", "p0"), ("c2", "p1")):
        r.apply(r.call(call_id, len(state.head_tokens), ids(1), ids(2), policy=policy, parent=state.head_call_id))
    assert state.policy_versions == ["p1", "p0"]


# -- progress of a call still generating -------------------------------------------------------


def test_progress_of_a_call_is_held_as_its_partial_call() -> None:
    r, state = fresh()
    r.apply(r.progress("c0", 0, ids(5, 6)), r.progress("c0", 2, ids(7)))
    partial = state.partial
    assert partial is not None and (partial.turn, partial.call_index, partial.prompt_sha256) == (0, 0, "sha")
    assert partial.output_ids.tolist() == [5, 6, 7] and partial.output_ids.dtype == np.int32
    assert partial.logprobs.tolist() == [-0.25] * 3 and partial.logprobs.dtype == np.float32
    assert partial.segments == [OutputSegment(1, "p0", 3, LOGPROB_UNKNOWN)]  # one attempt, one policy: one run
    assert state.progress_tokens == 3
    assert state.model_calls == 0 and state.head_call_id is None  # progress moves no head


def test_progress_by_another_attempt_or_policy_is_a_run_of_its_own() -> None:
    r, state = fresh()
    r.apply(r.progress("c0", 0, ids(5, 6)))
    r.apply(r.start(resumed_from_turn=0, messages=[]))  # crashed mid-call: attempt 2 continues it
    r.apply(r.progress("c0", 2, ids(7)), r.progress("c0", 3, ids(8, 9), policy="p1"))
    assert state.partial is not None
    assert state.partial.segments == [
        OutputSegment(1, "p0", 2, LOGPROB_UNKNOWN),
        OutputSegment(2, "p0", 1, LOGPROB_UNKNOWN),
        OutputSegment(2, "p1", 2, LOGPROB_UNKNOWN),
    ]


def test_progress_without_tokens_adds_no_run() -> None:
    """Output runs follow one rule, the model gate's (``extended_segments``): no tokens, no run."""
    r, state = fresh()
    r.apply(r.progress("c0", 0, ids()))
    assert state.partial is not None and state.partial.segments == []
    r.apply(r.progress("c0", 0, ids(5)), r.progress("c0", 1, ids()))
    assert state.partial.segments == [OutputSegment(1, "p0", 1, LOGPROB_UNKNOWN)]


def test_progress_that_does_not_continue_the_held_tokens_is_a_missing_record() -> None:
    r, state = fresh()
    r.apply(r.progress("c0", 0, ids(5, 6)))
    with pytest.raises(StateFoldError, match="starts at token 3, but the journal holds 2 tokens"):
        state.apply(r.progress("c0", 3, ids(7)))


def test_progress_of_another_call_replaces_the_partial_call_and_must_start_at_zero() -> None:
    r, state = fresh()
    r.apply(r.progress("c0", 0, ids(5, 6)))
    r.apply(r.progress("c0", 0, ids(1), prompt_sha="another prompt"))
    assert state.partial is not None and state.partial.prompt_sha256 == "another prompt"
    assert state.partial.output_ids.tolist() == [1]
    with pytest.raises(StateFoldError, match="starts at token 4, but the journal holds 0 tokens"):
        state.apply(r.progress("c1", 4, ids(2), call_index=1))


def test_a_partial_call_is_offered_only_to_the_same_turn_place_and_prompt() -> None:
    r, state = fresh()
    prompt = ids(1, 2, 3)
    r.apply(r.progress("c0", 0, ids(5), prompt_sha=prompt_digest(prompt)))
    assert state.partial_call(0, prompt) is state.partial
    assert state.partial_call(1, prompt) is None
    assert state.partial_call(0, ids(1, 2)) is None


def test_the_finished_call_replaces_its_progress() -> None:
    r, state = fresh()
    r.apply(r.progress("c0", 0, ids(5, 6), prompt_sha=prompt_digest(ids(1))))
    r.apply(r.call("c0", 0, ids(1), ids(5, 6, 7)))
    assert state.partial is None and state.head_tokens.tolist() == [1, 5, 6, 7]
    assert state.progress_tokens == 2  # what was journaled as progress stays counted


def test_a_committed_turn_drops_progress_of_a_call_it_did_not_finish() -> None:
    r, state = fresh()
    r.apply(r.progress("c0", 0, ids(5)), r.turn_done())
    assert state.partial is None


# -- model calls: how each continued its parent ------------------------------------------------


def test_a_new_sequence_call_closes_the_heads_sequence_and_the_record_keeps_both() -> None:
    """The template rewrote history: the call starts a sequence of its own (prefix 0), and the
    head's sequence, labels and logprobs with it, is kept ahead of it in the training record."""
    r, state = fresh()
    r.apply(r.call("c0", 0, ids(1, 2), ids(3), lps(-0.5)), r.turn_done())
    new = dataclasses.replace(
        r.call("c1", 0, ids(5, 6), ids(7), lps(-0.25), parent="c0"), continuation=CONTINUATION_NEW_SEQUENCE
    )
    r.apply(new, r.turn_done(), r.finished())

    assert state.head_tokens.tolist() == [5, 6, 7]
    assert state.lineage is not None
    assert state.lineage.closed_ids.tolist() == [1, 2, 3]
    assert state.lineage.closed_logprobs.tolist() == [0, 0, -0.5]
    assert state.lineage.closed_segments == [
        TokenSegment(0, 2, False, 1, 0, "c0", "p0"),
        TokenSegment(2, 3, True, 1, 0, "c0", "p0", temperature=1.0),
    ]
    assert state.lineage.sequence_starts == [3]
    assert state.lineage.segments == [
        TokenSegment(0, 2, False, 1, 1, "c1", "p0"),
        TokenSegment(2, 3, True, 1, 1, "c1", "p0", temperature=1.0),
    ]
    assert (state.new_sequences, state.calls_drifted) == (1, 0)  # prefix 0 is no drift on a new sequence

    record = state.training_record(r.header(), group_size=1)
    assert record.input_ids.tolist() == [1, 2, 3, 5, 6, 7]
    assert record.loss_mask.tolist() == [False, False, True, False, False, True]
    assert record.logprobs.tolist() == [0, 0, -0.5, 0, 0, -0.25]
    assert record.sequence_starts.tolist() == [3] and record.new_sequences == 1
    assert_same_state(state, RolloutState.from_bytes(state.to_bytes()))  # the closed sequence survives a snapshot
    data, stable = state.to_sections()  # and a snapshot in blocks, where its arrays are sections of their own
    assert stable[3:] == (4 * 3, 4 * 3)
    assert_same_state(state, RolloutState.from_bytes(data))


def test_a_first_call_marked_new_sequence_closes_nothing() -> None:
    r, state = fresh()
    r.apply(dataclasses.replace(r.call("c0", 0, ids(1), ids(2)), continuation=CONTINUATION_NEW_SEQUENCE))
    assert state.lineage is not None
    assert state.lineage.closed_ids.tolist() == [] and state.lineage.sequence_starts == []
    assert state.new_sequences == 1


def test_the_counters_say_how_each_call_continued_its_parent_and_a_restart_zeroes_them() -> None:
    r, state = fresh()
    r.apply(
        r.call("c0", 0, ids(1, 2), ids(3)),  # the first: no parent to drift from
        dataclasses.replace(r.call("c1", 3, ids(4), ids(5), parent="c0"), continuation=CONTINUATION_EXTEND),
        r.call("c2", 4, ids(6), ids(7), parent="c1"),  # prefix 4 of a 5-token head: the 5 is lost
        dataclasses.replace(
            r.call("c3", 6, ids(8), ids(9), parent="c2"),
            continuation=CONTINUATION_EOS_SPLICE,
            template_check=TemplateCheck(agrees=False, rendered_turns_differing=1),
        ),
        dataclasses.replace(
            r.call("c4", 0, ids(1), ids(2), parent="c3"),
            continuation=CONTINUATION_NEW_SEQUENCE,
            template_check=TemplateCheck(agrees=True),
        ),
        r.turn_done(),
        r.finished(),
    )
    counters = ("calls", "calls_drifted", "eos_splices", "new_sequences", "template_mismatch_calls")
    assert [getattr(state, name) for name in counters] == [5, 1, 1, 1, 1]
    record = state.training_record(r.header(), group_size=1)
    assert [getattr(record, name) for name in counters] == [5, 1, 1, 1, 1]

    r.apply(r.start(resumed_from_turn=0))  # a new life: its calls are counted afresh
    assert [getattr(state, name) for name in counters] == [0, 0, 0, 0, 0]


# -- the effect log: every model and tool call of the life, by position --------------------------


def test_the_effect_log_holds_each_model_and_tool_call_at_its_turn_and_step() -> None:
    r, state = fresh()
    first = dataclasses.replace(r.call("c0", 0, ids(1, 2), ids(3, 4), lps(-0.1, -0.2)), request_sha256="req-0")
    tool = dataclasses.replace(r.mutation(), idempotency_key=f"{RID}/t0/s1")  # through the session API
    env_step = r.mutation("r/calendar")  # an in-process environment's step (key .../m0): no effect
    second = r.call("c1", 4, ids(5), ids(6), parent="c0")  # journaled without a request digest
    r.apply(first, tool, env_step, second)

    log = state.effects
    assert log.known and len(log) == 3
    assert [(e.turn, e.step, e.kind, e.ref) for e in log.all()] == [
        (0, 0, "model", "c0"),
        (0, 1, "tool", f"{RID}/t0/s1"),
        (0, 2, "model", "c1"),
    ]
    assert [e.ref for e in log.model_calls()] == ["c0", "c1"]

    made = log.at(0, 0)
    assert made is not None
    assert (made.digest, made.attempt, made.prompt_len, made.out_start) == ("req-0", 1, 2, 2)
    assert made.answer[0].tolist() == [3, 4] and made.answer[1].tolist() == pytest.approx([-0.1, -0.2])
    assert (made.finish_reason, made.policy_version, made.sampling) == ("stop", "p0", sampling_json(SamplingParams()))
    assert made.segments == first.output_segments()

    later = log.at(0, 2)
    assert later is not None  # no digest journaled: the one of its whole prompt and sampling
    assert later.digest == model_digest(ids(1, 2, 3, 4, 5), SamplingParams())
    assert (later.prompt_len, later.out_start) == (5, 5)

    called = log.at(0, 1)
    assert called is not None
    assert called.digest == tool_digest("r/mail", "send", '{"to":"bob"}')
    assert (called.resource_id, called.op, called.result_json, called.revision) == ("r/mail", "send", '{"id":7}', 1)
    assert log.at(0, 3) is None


def test_each_turn_counts_its_effects_from_step_zero_and_a_restart_empties_the_log() -> None:
    r, state = fresh()
    r.apply(*one_turn(r, "c0"), *one_turn(r, "c1"))
    assert [(e.turn, e.step, e.ref) for e in state.effects.all()] == [(0, 0, "c0"), (1, 0, "c1")]
    assert [e.ref for e in state.effects.in_turn(1)] == ["c1"]

    r.apply(r.start(resumed_from_turn=1))  # a resumption keeps the life and its effects
    assert len(state.effects) == 2
    r.apply(r.start(resumed_from_turn=0))  # a restart begins a new life
    assert len(state.effects) == 0 and state.effects.known


# -- resource mutations ---------------------------------------------------------------------


def test_a_mutation_is_kept_as_its_resource_record_until_an_export_covers_it() -> None:
    r, state = fresh()
    event = r.mutation()
    r.apply(event)
    assert state.mutation_count == 1
    assert state.mutations_since_export == [
        MutationRecord(
            "r/mail", "mail", "send", {"to": "bob"}, "r/t0/m0", 0, 1, {"id": 7}, "digest-1", "chain-1", RID, 1, 1
        )
    ]
    r.apply(r.mutation("r/calendar"))
    state.record_exports({"r/mail": b"mail at revision 1"})
    assert state.resource_states == {"r/mail": b"mail at revision 1"}
    assert [m.resource_id for m in state.mutations_since_export] == ["r/calendar"]


# -- turns, the end, the trainer ----------------------------------------------------------------


def test_a_committed_turn_appends_its_messages_and_actions_and_moves_the_turn_on() -> None:
    r, state = fresh()
    r.apply(*one_turn(r, action="mail.send()"))
    assert state.next_turn == 1 and state.actions == ["mail.send()"]
    assert state.messages == [*SYSTEM, ChatMessage("assistant", "mail.send()"), ChatMessage("tool", "ok")]
    assert state.reward is None


def test_a_turn_with_a_reward_sets_it_and_one_without_keeps_it() -> None:
    r, state = fresh()
    r.apply(r.turn_done(reward=0.5))
    assert state.reward == 0.5
    r.apply(r.turn_done())
    assert state.reward == 0.5


def test_the_finished_rollout_keeps_its_reward_and_outcome() -> None:
    r, state = fresh()
    r.apply(*one_turn(r), r.finished(reward=0.75))
    assert state.finished and state.reward == 0.75 and state.outcome == {"reward": 0.75, "turns": 1}


def test_an_acknowledged_rollout_is_marked() -> None:
    r, state = fresh()
    r.apply(*one_turn(r), r.finished(), RolloutAcknowledged(r.header(), "trainer"))
    assert state.acknowledged and state.finished


def test_the_acknowledgement_takes_the_next_events_header() -> None:
    r, state = fresh()
    r.apply(*one_turn(r), r.finished())
    ack = state.acknowledgement("owner", "trainer")
    assert ack.acknowledged_by == "trainer" and ack.header.writer == "owner"
    assert (ack.header.attempt, ack.header.epoch, ack.header.turn, ack.header.seq) == (1, 1, 1, state.next_seq)
    assert not state.acknowledged  # built, not applied


def test_the_training_record_is_the_head_its_lineage_and_reward() -> None:
    r, state = fresh()
    r.apply(r.call("c0", 0, ids(1, 2), ids(3), lps(-0.5)), r.turn_done(), r.finished(reward=1.0))
    record = state.training_record(r.header(), group_size=4)
    assert record.group_size == 4 and record.reward == 1.0 and record.finished
    assert record.input_ids.tolist() == [1, 2, 3] and record.loss_mask.tolist() == [False, False, True]
    assert record.logprobs.tolist() == [0, 0, -0.5]
    assert record.token_segments == [
        TokenSegment(0, 2, False, 1, 0, "c0", "p0"),
        TokenSegment(2, 3, True, 1, 0, "c0", "p0", temperature=1.0),
    ]


def test_a_state_without_its_lineage_has_no_training_record() -> None:
    r, state = fresh()
    state.lineage = None  # as restored from a snapshot written before lineage was kept
    with pytest.raises(StateFoldError, match="token lineage is unknown"):
        state.training_record(r.header(), group_size=1)


# -- snapshots -----------------------------------------------------------------------------


def at_a_turn_boundary() -> tuple[Rollout, RolloutState]:
    """Two attempts, a restart, calls, mutations, an export and a reward: most of what a state holds."""
    r, state = fresh()
    r.apply(*one_turn(r), r.mutation())
    r.apply(r.start(resumed_from_turn=0))
    r.apply(r.call("c1", 0, ids(1, 2), ids(3), policy="p1"), r.mutation(revision=2), r.turn_done(reward=0.25))
    state.record_exports({"r/mail": b"\x00mail\xff"})
    r.apply(r.mutation("r/calendar"), *one_turn(r, "c2"))
    r.apply(RolloutFailed(r.header(), "BackendError", "gone"))
    return r, state


def test_a_state_at_a_turn_boundary_reads_back_from_its_bytes_whole() -> None:
    _, state = at_a_turn_boundary()
    assert state.lineage is not None and len(state.lineage.segments) == 4 and state.resource_states
    again = RolloutState.from_bytes(state.to_bytes())
    assert_same_state(state, again)
    assert again.to_bytes() == state.to_bytes()


def test_a_state_in_sections_reads_back_whole_and_each_section_only_grows() -> None:
    """The layout for snapshots written in blocks: the same state reads back, and a turn later each
    of its growing sections (token ids, logprobs, conversation) begins with what it held before,
    so the blocks of what it held are the same."""
    r, state = at_a_turn_boundary()
    data, stable = state.to_sections()
    assert_same_state(state, RolloutState.from_bytes(data))
    r.apply(r.start(resumed_from_turn=state.next_turn), *one_turn(r, "c3"))
    later, grown = state.to_sections()
    assert_same_state(state, RolloutState.from_bytes(later))
    for i, (was, now) in enumerate(zip(stable, grown, strict=True)):
        before, after = sum(stable[:i]), sum(grown[:i])
        assert now >= was and later[after : after + was] == data[before : before + was], f"section {i}"
    assert all(now > was for was, now in zip(stable[:3], grown[:3], strict=True))  # head, logprobs, conversation


def test_a_snapshot_is_in_sections_once_a_section_fills_a_block_and_never_without_blocks() -> None:
    _, state = at_a_turn_boundary()
    head = 4 * len(state.head_tokens)
    assert snapshot_of(state, {}, "w", block_bytes=head).stable  # the head fills a block
    assert snapshot_of(state, {}, "w", block_bytes=64 * 1024).stable == ()  # too small yet: one record
    unblocked = snapshot_of(state, {}, "w", block_bytes=0)
    assert unblocked.stable == () and unblocked.state.startswith(STATE_MAGIC)  # what every version reads


def test_the_tokens_journaled_as_progress_survive_a_snapshot() -> None:
    """A restore from the snapshot counts what a replay from the first event counts."""
    r, state = fresh()
    r.apply(r.progress("c0", 0, ids(5, 6), prompt_sha=prompt_digest(ids(1))), r.call("c0", 0, ids(1), ids(5, 6, 7)))
    r.apply(r.turn_done())
    assert state.progress_tokens == 2
    again = RolloutState.from_bytes(state.to_bytes())
    assert_same_state(state, again)


def test_a_finished_state_reads_back_from_its_bytes_whole() -> None:
    r, state = at_a_turn_boundary()
    r.apply(r.start(resumed_from_turn=state.next_turn), *one_turn(r, "c3"), r.finished(reward=1.0))
    again = RolloutState.from_bytes(state.to_bytes())
    assert_same_state(state, again)


def test_a_state_without_its_lineage_reads_back_without_it() -> None:
    _, state = at_a_turn_boundary()
    state.lineage = None
    again = RolloutState.from_bytes(state.to_bytes())
    assert_same_state(state, again)


def test_a_snapshot_draft_changes_nothing_and_the_live_state_records_what_restore_reads_back() -> None:
    r, state = fresh()
    r.apply(r.mutation("r/mail"), r.mutation("r/calendar"), r.turn_done())
    before = dataclasses.replace(state, mutations_since_export=list(state.mutations_since_export))

    draft = snapshot_of(state, {"r/mail": b"mail"}, "w")

    assert_same_state(before, state)
    assert (draft.status, draft.covers_seq, draft.header.seq) == ("running", state.next_seq - 1, state.next_seq)
    state.record_exports({"r/mail": b"mail"})
    assert_same_state(RolloutState.from_bytes(draft.state), state)
    assert state.resource_states == {"r/mail": b"mail"}
    assert [m.resource_id for m in state.mutations_since_export] == ["r/calendar"]


def test_a_state_written_before_the_fence_history_was_kept_reads_back_without_it() -> None:
    """What an earlier version wrote has no ``attempts``: unknown (None), never an empty history;
    restore takes them from the rollout's fence record (``restore_state``)."""
    _, state = at_a_turn_boundary()
    doc, tokens, logprobs = _unpacked(zlib.decompress(state.to_bytes()[len(STATE_MAGIC) :]))
    del doc["attempts"]
    text = json.dumps(doc, separators=(",", ":")).encode()
    lengths = struct.pack("<III", len(text), len(tokens), len(logprobs))
    older = STATE_MAGIC + zlib.compress(lengths + text + tokens + logprobs, 1)  # as to_bytes lays it out
    again = RolloutState.from_bytes(older)
    assert again.attempts is None
    assert_same_state(state, again, ignoring=["attempts"])
    assert again.to_bytes() == older


def test_a_snapshot_without_the_fence_history_takes_it_from_the_fence_record() -> None:
    r, state = at_a_turn_boundary()
    at = RecordLocation("ns.snapshots", 0, 9)
    snapshot = Snapshot(r.header(), "running", state.next_seq - 1, 0, 0, b"", "")
    older, fence_history = dataclasses.replace(state, attempts=None), tuple(state.attempts or [])
    later = r.start(resumed_from_turn=state.next_turn)
    fence = Fence(
        later.header.epoch, later.header.attempt, later.header.seq, at, (*fence_history, FenceEntry.of(later.header))
    )
    events = [JournaledEvent(later, RecordLocation("ns.events", 0, 40))]
    history = RolloutHistory(RID, LoadedSnapshot(snapshot, older.to_bytes(), at), events, fence)

    again = restore_state(history)

    assert again.attempts == list(fence.history)  # the snapshot's through its epoch, then the events'


def test_the_state_comparison_sees_every_field() -> None:
    """The helper the restore tests rely on: a difference in any field, arrays and lineage
    included, fails it."""
    _, state = at_a_turn_boundary()
    for name, value in {
        "failure": None,
        "head_tokens": np.append(state.head_tokens, 1).astype(np.int32),
        "lineage": TokenLineage(),
        "partial": None if state.partial else "x",
        "progress_tokens": 99,
    }.items():
        changed = dataclasses.replace(state, **{name: value})
        with pytest.raises(AssertionError, match=name):
            assert_same_state(state, changed)

    # Lineages alike in the head's sequence, apart in the sequences closed before it (new_sequence).
    assert state.lineage is not None
    head = {"segments": state.lineage.segments, "logprobs": state.lineage.logprobs}
    closed = TokenLineage(**head)
    closed.close_sequence(ids(7, 8))
    for name, value in {
        "closed_ids": closed.closed_ids,
        "closed_logprobs": lps(-0.5),
        "closed_segments": closed.closed_segments,
        "sequence_starts": [2],
    }.items():
        changed = dataclasses.replace(state, lineage=TokenLineage(**head, **{name: value}))
        with pytest.raises(AssertionError, match=f"lineage.{name}"):
            assert_same_state(state, changed)
