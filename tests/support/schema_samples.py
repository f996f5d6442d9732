"""One sample record of every record type the schemas hold: written with every kept schema
version by tests/schemas/test_schemas.py, and handed to Avro's Java implementation by
tests/schemas/test_avro_java.py."""

from __future__ import annotations

import dataclasses

import numpy as np

from rollout_journal.journal.events import (
    AcknowledgedRollouts,
    AttemptFenced,
    AttemptStarted,
    BlobChunk,
    BlobRef,
    ChainHead,
    EventChunk,
    FenceEntry,
    FenceHistory,
    HeadCheckpoint,
    Message,
    ModelCallProgress,
    OutputSegment,
    ResourceMutation,
    RolloutAcknowledged,
    RolloutFailed,
    RolloutFinished,
    RolloutGivenUp,
    RolloutSummary,
    SamplingParams,
    Snapshot,
    TemplateCheck,
    TokenSegment,
    ToolCallRef,
    TrainingRecord,
    WorkloadRegistered,
)
from tests.support.journal_conformance import header, model_call, started, turn_done

SAMPLES = {
    "AttemptStarted": AttemptStarted(
        started("r", 0, attempt=3, epoch=4).header,
        0,
        "topo",
        "new rollout",
        [Message("system", "be brief"), Message("user", "task"), Message("tool", "ok", tool_call_id="c0", name="mail")],
        "max_turns 5 -> 6",
        "r0@3",
        "9f86d081884c7d659a2feaa0c55ad015",
    ),
    "AttemptFenced": AttemptFenced(header("r", 1), 2, 3, "superseded by attempt 3"),
    "ModelCall": dataclasses.replace(
        model_call("r", 2, tokens=1024),
        sampling=SamplingParams(0.7, 0.9, 16, 2, 20),
        segments=[OutputSegment(1, "policy-a", 600), OutputSegment(2, "policy-b", 424, "raw")],
        logprob_mode="processed",
        constrained=True,
        continuation="extend",
        inserted_tokens=2,
        template_check=TemplateCheck(False, 1, 0, False),
        request_sha256="a" * 64,
    ),
    "ModelCallProgress": ModelCallProgress(
        header("r", 2),
        "r/a1/t0/c0",
        0,
        "policy-a",
        "s" * 64,
        32,
        np.arange(32, dtype="<i4"),
        np.linspace(-3, 0, 32, dtype="<f4"),
        "processed",
    ),
    "ResourceMutation": ResourceMutation(
        header("r", 3), "r/mail", "mailbox", "send", '{"to":"a"}', "r:1:0", 4, 5, '{"ok":true}', "d" * 64, "c" * 64
    ),
    "TurnCompleted": dataclasses.replace(
        turn_done("r", 4),
        messages=[
            Message("assistant", "", [ToolCallRef("c1", "mail.send", '{"to": "bob"}')], call_id="r/a1/t1/c0"),
            Message("tool", "sent", tool_call_id="c1", name="mail.send"),
        ],
    ),
    "RolloutFinished": RolloutFinished(header("r", 5), 0.75, 5, '{"reward":0.75}'),
    "RolloutFailed": RolloutFailed(header("r", 5), "SandboxCrashedError", "sandbox r/python exited with code -9"),
    "RolloutGivenUp": RolloutGivenUp(header("r", 6), 3, "SandboxCrashedError", "sandbox r/python exited with code -9"),
    "RolloutAcknowledged": RolloutAcknowledged(header("r", 6), "trainer-0"),
    "Snapshot": Snapshot(
        header("r", 7), "running", 6, 0, 123, b"state", "e" * 64, BlobRef("f" * 64, 10, 1), b"\xc3\x01summary"
    ),
    "RolloutSummary": RolloutSummary(
        "r",
        "g",
        2,
        True,
        2,
        3,
        9,
        True,
        0.5,
        False,
        False,
        0,
        4,
        40,
        2,
        ["p0", "p1"],
        "t" * 16,
        None,
        1,
        0,
        0,
        1,
        True,
        True,
        False,
        10,
        42,
        123,
    ),  # fmt: skip
    "BlobChunk": BlobChunk("f" * 64, 0, 1, b"0123456789"),
    "WorkloadRegistered": WorkloadRegistered(
        "demo", '{"groups":2}', ["demo-g0-s0", "demo-g1-s0", "demo-g1r1-s0"], "t" * 16, 7, "w0", True, {"demo-g1": 1}
    ),
    "FenceHistory": FenceHistory("r", [FenceEntry(1, 1, 0, "w0", 5), FenceEntry(2, 2, 6, "w1", 9)], 2),
    "AcknowledgedRollouts": AcknowledgedRollouts(3, ["r", "s"], [2, 1], [2, 1]),
    "HeadCheckpoint": HeadCheckpoint(
        header("r", 8),
        1,
        [ChainHead("r/mail", 5, "c" * 64), ChainHead("r/crm", 0, "a" * 64)],
        "ed25519",
        "k" * 64,
        bytes(range(64)),
    ),
    "EventChunk": EventChunk(header("r", 8), "ModelCall", "a" * 64, 1, 3, 1_500_000, b"piece"),
    "TrainingRecord": TrainingRecord(
        header("r", 5),
        3,
        0.75,
        True,
        np.arange(6, dtype="<i4"),
        np.array([0, 0, 0, -0.5, -1.25, 0], dtype="<f4"),
        np.array([0, 0, 0, 1, 1, 0], dtype=bool),
        [
            TokenSegment(0, 3, False, 1, 0, "r/a1/t0/c0", "policy-a"),
            TokenSegment(3, 5, True, 2, 0, "r/a1/t0/c0", "policy-b", 0.7, 0.9, 20, "processed", True, False),
            TokenSegment(5, 6, False, 2, 1, "r/a2/t1/c0", "policy-b"),
        ],
        [FenceEntry(1, 1, 0, "w0", 5), FenceEntry(2, 2, 6, "w1", 9)],
        "finished",
        "drop",
        np.array([5], dtype="<i4"),
        2,
        0,
        1,
        1,
        1,
    ),
}
