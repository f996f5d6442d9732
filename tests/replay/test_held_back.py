"""The read-only tools on a Kafka journal whose partition an open transaction holds back (a writer
SIGKILLed inside one; the broker aborts it only after its transaction timeout): they read to the
last stable offset, so turns committed after it are missing, and they say so on stderr, naming the
partition, without failing. Once the transaction ends, the same command shows everything, quietly."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
from confluent_kafka import Producer

from bench.common import turn_events
from rollout_journal.journal.backend import HeldBack, held_back_warnings, summaries_partition
from rollout_journal.journal.deadlines import Deadline
from rollout_journal.journal.events import AttemptStarted, Header, Message
from rollout_journal.journal.kafka.backend import KafkaBackend
from rollout_journal.journal.open import open_journal
from rollout_journal.replay.cli.main import main as cli
from rollout_journal.replay.listing import list_rollouts
from rollout_journal.replay.source import open_replay

pytestmark = pytest.mark.kafka


def write_rollout(location: str, rid: str, turns: int) -> None:
    rng = np.random.default_rng(1)
    with open_journal(location, writer=f"hb-{uuid.uuid4().hex[:6]}") as journal:
        header = Header(rid, rid.rsplit("-", 1)[0], 1, 1, 0, 0, Header.now_ms(), "test")
        journal.append_sync([AttemptStarted(header, 0, "topology", "new rollout", [Message("user", "task")])])
        for t in range(turns):
            journal.append_sync(turn_events(rid, t, 1 + 3 * t, rng, prompt_delta=8, output=4, prefix_len=12 * t))


def same_partition(partition_of, partition: int, prefix: str) -> str:
    return next(rid for i in range(10_000) if partition_of(rid := f"{prefix}{i}-s0") == partition)


@dataclass
class HeldJournal:
    location: str
    topic: str
    partition: int
    before: str  # committed before the open transaction: shown
    after: str  # committed after it, on the same partition: hidden until it ends
    open_txn: Producer
    ended: bool = False

    @property
    def on_events(self) -> bool:
        return self.topic.endswith(".events")

    @property
    def list_args(self) -> list[str]:
        """``list`` reads the held topic: the summaries, or (``--scan``) every event."""
        return ["--scan"] if self.on_events else []


@pytest.fixture(params=["events", "summaries"])
def held_journal(kafka_bootstrap: str, request: pytest.FixtureRequest) -> Iterator[HeldJournal]:
    """A namespace with a writer killed inside its transaction on the events topic (what ``list
    --scan``, ``show`` and ``export`` read) or on the summaries topic (what ``list`` reads)."""
    location = f"kafka://{kafka_bootstrap}/hb{uuid.uuid4().hex[:8]}?partitions=4"
    with open_journal(location, writer="probe") as journal:
        backend = journal.backend
        assert isinstance(backend, KafkaBackend)
        held_events = request.param == "events"
        producer_config = backend.producer_config()
        topic = backend.events_topic if held_events else backend.summaries_topic
        events_partition = journal.partition_of("hb-g0-s0")
        after = same_partition(journal.partition_of, events_partition, "hb-late-g")
        partition = events_partition if held_events else summaries_partition(events_partition, backend.partitions)
    write_rollout(location, "hb-g0-s0", turns=2)
    # a writer killed inside its transaction: what it produced stays undecided, the LSO stays at its start
    killed = Producer({**producer_config, "transactional.id": f"{topic}-killed"})
    killed.init_transactions(60)
    killed.begin_transaction()
    key = b"hb-g0-s0" if held_events else b"hb-g0-s0/e1"
    killed.produce(topic, key=key, value=b"never decoded", partition=partition)
    killed.flush(60)
    write_rollout(location, after, turns=3)  # a resumed worker commits after it
    held = HeldJournal(location, topic, partition, "hb-g0-s0", after, killed)
    try:
        yield held
    finally:
        if not held.ended:
            killed.abort_transaction(60)


def end_held_transaction(held: HeldJournal) -> None:
    """What the broker does once the transaction times out, done at once: abort it, then wait
    (bounded) until a reader's last stable offset passes where it began."""
    with open_replay(held.location) as source:
        backend = source.journal.backend
        assert isinstance(backend, KafkaBackend)
        stuck = backend.readers.end_offset(held.topic, held.partition)
        held.open_txn.abort_transaction(60)
        held.ended = True
        deadline = Deadline(60)
        while backend.readers.end_offset(held.topic, held.partition) <= stuck:
            assert not deadline.passed(), "the aborted transaction's markers never landed"
            deadline.sleep(0.05)


def test_a_read_only_read_notes_the_partition_an_open_transaction_holds_back(held_journal: HeldJournal) -> None:
    with open_replay(held_journal.location) as source:
        listing = list_rollouts(source, scan=held_journal.on_events)
        backend = source.journal.backend
        assert isinstance(backend, KafkaBackend)
        end = backend.readers.end_offset(held_journal.topic, held_journal.partition)
        high = backend.readers._high_watermark(held_journal.topic, held_journal.partition)
    assert [r.rollout_id for r in listing.rows] == [held_journal.before]  # the later rollout is hidden
    assert listing.report.held_back == [
        HeldBack(held_journal.topic, held_journal.partition, end, high, backend.settings.transaction_timeout_ms)
    ]
    assert not listing.report.errors  # nothing is wrong with the journal
    if held_journal.on_events:  # a scan in worker processes notes it too (the report crosses the process boundary)
        with open_replay(held_journal.location) as source:
            assert list_rollouts(source, jobs=2, scan=True).report.held_back == listing.report.held_back


def test_replay_list_warns_on_stderr_once_and_exits_0(
    held_journal: HeldJournal, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli(["list", held_journal.location, "--json", *held_journal.list_args]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert [r["rollout_id"] for r in doc["rollouts"]] == [held_journal.before]
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, err
    assert f"{held_journal.topic} partition {held_journal.partition}: records past offset " in warnings[0]
    assert "transaction still open" in warnings[0] and "rerun" in warnings[0]
    assert doc["problems"]["held_back"] and doc["problems"]["damage"] == []

    if held_journal.on_events:  # show reads the events
        assert cli(["show", held_journal.location, held_journal.before, "--no-decode"]) == 0
        assert len([line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]) == 1

    end_held_transaction(held_journal)
    assert cli(["list", held_journal.location, "--json", *held_journal.list_args]) == 0
    out, err = capsys.readouterr()
    assert {r["rollout_id"] for r in json.loads(out)["rollouts"]} == {held_journal.before, held_journal.after}
    assert "warning:" not in err and json.loads(out)["problems"]["held_back"] == []


def test_the_warning_names_every_partition_of_a_topic_in_one_line() -> None:
    one = HeldBack("ns.events", 3, 1234, 1300, 10_000)
    assert held_back_warnings([one]) == [
        "ns.events partition 3: records past offset 1234 are behind a transaction still open (a killed "
        "writer's, most likely); turns committed after it show once the broker aborts it (within "
        "transaction_timeout_ms=10000 plus the broker's abort interval); rerun then"
    ]
    two = held_back_warnings([HeldBack("ns.events", 5, 7, 9, 10_000), one, HeldBack("ns.events", 3, 99, 100, 1)])
    assert len(two) == 1 and two[0].startswith("ns.events partitions 3, 5: records past offsets 1234, 7 ")
