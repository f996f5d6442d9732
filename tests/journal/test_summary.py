"""What the journal's writer commits as a rollout's summary (``journal/summary.py``), without a
broker: after each append, exactly the fold of every event so far, in the bytes the codec writes of
that record; its fast encoder and the memos under it never serve an earlier append's summary."""

from __future__ import annotations

import dataclasses

from rollout_journal.journal.backend import Stream
from rollout_journal.journal.codec import Codec
from rollout_journal.journal.errors import RecordLocation
from rollout_journal.journal.events import RolloutEvent, RolloutFinished, RolloutSummary
from rollout_journal.journal.summary import SummaryFold, SummaryWriter, incomplete, summary_key
from tests.support.journal_conformance import model_call, started, turn_done

HERE = RecordLocation("summaries", 0, 0)


def written(codec: Codec, writer: SummaryWriter, events: list[RolloutEvent]) -> RolloutSummary:
    """The summary the writer commits with ``events``, its timestamp set aside."""
    (record,) = writer.records(events)
    assert record.stream is Stream.SUMMARIES and record.value is not None
    summary = codec.decode(record.value, HERE)
    assert isinstance(summary, RolloutSummary)
    assert record.key == summary_key(summary.rollout_id, summary.epoch)
    return dataclasses.replace(summary, ts_ms=0)


def folded(events: list[RolloutEvent]) -> RolloutSummary:
    fold = SummaryFold.empty(events[0].header.rollout_id, events[0].header.group_id)
    for event in events:
        fold.apply(event)
    return dataclasses.replace(fold.record(), ts_ms=0)


def test_each_append_of_a_rollout_commits_the_fold_of_every_event_so_far() -> None:
    """Three appends of one rollout, each changing what its summary says (a second policy version,
    more tokens, a finish and its reward): each summary is the new fold, never the one before."""
    codec, writer = Codec(), SummaryWriter(Codec())
    first = [started("r", 0), model_call("r", 1), turn_done("r", 2)]
    second = [dataclasses.replace(model_call("r", 3, turn=2, tokens=8), policy_version="policy-v2")]
    third = [turn_done("r", 4, turn=2), RolloutFinished(turn_done("r", 5, turn=2).header, 0.5, 2, "{}")]
    so_far: list[RolloutEvent] = []
    summaries = []
    for events in (first, second, third):
        so_far += events
        summary = written(codec, writer, events)
        assert summary == folded(so_far)
        summaries.append(summary)
    assert summaries[1].policy_versions == ["policy-v1", "policy-v2"] != summaries[0].policy_versions
    assert (summaries[2].finished, summaries[2].reward, summaries[2].events) == (True, 0.5, 6)


def test_a_rollout_whose_history_the_writer_does_not_know_gets_its_epochs_incomplete_summary() -> None:
    codec, writer = Codec(), SummaryWriter(Codec())
    writer.note("r", None)
    assert written(codec, writer, [model_call("r", 7, epoch=2)]) == dataclasses.replace(
        incomplete("r", "group-1", 2), ts_ms=0
    )
    assert written(codec, writer, [started("r", 8, attempt=3, epoch=3)]) == dataclasses.replace(
        incomplete("r", "group-1", 3), ts_ms=0
    )


def test_the_summary_kept_in_a_snapshot_is_the_record_the_codec_writes() -> None:
    codec, writer = Codec(), SummaryWriter(Codec())
    events = [started("r", 0), model_call("r", 1), turn_done("r", 2)]
    writer.records(events)
    encoded = writer.encoded("r", covers_seq=2)
    assert encoded is not None
    summary = codec.decode(encoded, HERE)
    assert isinstance(summary, RolloutSummary)
    assert codec.encode(summary) == encoded
    assert dataclasses.replace(summary, ts_ms=0) == folded(events)
