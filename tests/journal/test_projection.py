"""Projected reads (``rollout_journal.journal.projection``): the fields a bookkeeping scan keeps come out as a
full decode gives them, whatever schema version wrote the record, and a damaged record is
refused as the full decode refuses it."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from bench.common import turn_events
from rollout_journal.journal import Journal, open_journal
from rollout_journal.journal.codec import Codec
from rollout_journal.journal.errors import CorruptRecordError, RecordLocation
from rollout_journal.journal.events import (
    AttemptStarted,
    EventChunk,
    Header,
    Message,
    ModelCall,
    ModelCallProgress,
    OutputSegment,
    ResourceMutation,
    TurnCompleted,
)
from rollout_journal.journal.projection import Projection
from rollout_journal.participants.rollout.state import RolloutProgress
from rollout_journal.replay.listing import list_rollouts
from rollout_journal.replay.source import ReplaySource
from tests.support.golden import GOLDEN, PARTITIONS, RecordDumpBackend

HERE = RecordLocation("test.events", 0, 7)


def projected_fields_match(projection: Projection, codec: Codec, value: bytes) -> None:
    full, projected = codec.decode(value, HERE), projection.decode(value, HERE)
    assert type(projected) is type(full)
    kept = RolloutProgress.READS.get(type(full))
    for f in dataclasses.fields(full):
        got, want = getattr(projected, f.name), getattr(full, f.name)
        if kept is not None and f.name not in kept:
            assert got is None, f"{type(full).__name__}.{f.name} was decoded, not skipped"
        elif isinstance(want, np.ndarray):
            assert got.dtype == want.dtype and np.array_equal(got, want)
        else:
            assert got == want


def sample_events() -> list:
    rng = np.random.default_rng(3)
    events = turn_events("proj-g0-s0", 0, 1, rng) + turn_events("proj-g0-s0", 1, 4, rng, prompt_delta=3, output=70)
    call = events[3]
    events.append(dataclasses.replace(call, segments=[OutputSegment(1, "p0", 30), OutputSegment(2, "p1", 40)]))
    events.append(
        ModelCallProgress(call.header, call.call_id, 0, "p1", "a" * 64, 30, call.output_ids[:5], call.logprobs[:5])
    )
    events.append(dataclasses.replace(events[2], reward=0.25, messages=[], actions=[]))
    return events


@pytest.mark.parametrize("version_index", [0, -1], ids=["oldest", "current"])
def test_every_kept_writer_version_projects_to_the_full_decode(version_index: int) -> None:
    codec = Codec()
    projection = Projection(codec, RolloutProgress.READS)
    for cls in RolloutProgress.READS:
        assert projection.serves(cls)  # the current schema of each is read projected
    for event in sample_events():
        from rollout_journal import schemas

        version = schemas.released_versions()[type(event).RECORD][version_index]
        projected_fields_match(projection, codec, codec.encode_with(event, version))


def golden_journals(tmp_path: Path) -> list[Journal]:
    copy = tmp_path / "journal"
    shutil.copytree(GOLDEN / "file-journal", copy)
    rows = [json.loads(line) for line in (GOLDEN / "kafka-records.jsonl").read_text().splitlines()]
    return [open_journal(str(copy), read_only=True), Journal(RecordDumpBackend(rows, PARTITIONS))]


def test_golden_records_project_to_their_full_decode(tmp_path: Path) -> None:
    codec = Codec()
    projection = Projection(codec, RolloutProgress.READS)
    seen = set()
    for journal in golden_journals(tmp_path):
        with journal:
            for p in range(journal.backend.partitions):
                for stored in journal.backend.read_events(p, 0):
                    projected_fields_match(projection, codec, stored.value)
                    seen.add(codec.record_class(stored.value))
    assert {ModelCall, ResourceMutation, TurnCompleted} <= seen


def test_golden_journals_list_the_same_projected_or_fully_decoded(tmp_path: Path) -> None:
    for journal in golden_journals(tmp_path):
        with ReplaySource("golden", journal) as source:
            projected, full = list_rollouts(source), list_rollouts(source, projected=False)
            assert projected.as_json() == full.as_json()
            assert [str(e) for e in projected.report.errors] == [str(e) for e in full.report.errors]
            assert projected.report.fenced == full.report.fenced
            assert projected.events > 0 and projected.rows


def test_a_damaged_record_is_refused_projected_as_in_full() -> None:
    """Every cut of a record, and a byte too many, is a CorruptRecordError naming the record
    in both readers: the projection steps over the skipped fields down to the last byte."""
    codec = Codec()
    projection = Projection(codec, RolloutProgress.READS)
    for event in sample_events()[:3]:
        value = codec.encode(event)
        for damaged in [value[:cut] for cut in range(12, len(value), max(1, len(value) // 97))] + [value + b"\0"]:
            with pytest.raises(CorruptRecordError, match="partition 0 offset 7"):
                codec.decode(damaged, HERE)
            with pytest.raises(CorruptRecordError, match="partition 0 offset 7"):
                projection.decode(damaged, HERE)


def test_a_chunked_model_call_lists_the_same_projected(tmp_path: Path) -> None:
    """An event too large for one record is journaled in pieces; the scan joins them and reads the
    joined event projected, with the same row as a full decode."""
    rng = np.random.default_rng(5)
    with open_journal(str(tmp_path / "j"), max_record_bytes=2048) as journal:
        start = sample_attempt("chunk-g0-s0")
        journal.append_sync([start])
        for turn in range(3):
            journal.append_sync(turn_events("chunk-g0-s0", turn, 1 + 3 * turn, rng, prompt_delta=900, output=300))
    with open_journal(str(tmp_path / "j"), read_only=True) as journal, ReplaySource("chunked", journal) as source:
        pieces = sum(
            1
            for p in range(journal.backend.partitions)
            for r in journal.backend.read_events(p, 0)
            if journal.codec.record_class(r.value) is EventChunk
        )
        projected, full = list_rollouts(source), list_rollouts(source, projected=False)
    assert pieces > 3  # each model call went in pieces
    assert projected.as_json() == full.as_json()
    assert projected.as_json()["rollouts"][0]["model_calls"] == 3 and not projected.report.errors


def sample_attempt(rollout_id: str) -> AttemptStarted:
    header = Header(rollout_id, rollout_id.rsplit("-", 1)[0], 1, 1, 0, 0, Header.now_ms(), "test")
    return AttemptStarted(header, 0, "topology", "new rollout", [Message("user", "task")])
