"""How fast ``replay list`` scans a Kafka journal, against a raw consumer reading the
same topic in the same run, and how its memory grows with the journal.

    python bench/replay_scan.py [--events 1000000] [--growth 10] [--rollouts 1000] [--rounds 3] [--json]

Two journals are written to fresh namespaces of one broker: ``--events`` events and
``--events / --growth`` events, with the same ``--rollouts`` rollouts (the larger has
``--growth`` times the turns: the history grows, not the set of rollouts). A turn
is a model call (``--prompt-delta`` prompt-delta tokens, ``--output`` sampled tokens
and their logprobs), a resource mutation and a ``TurnCompleted``, as in
``bench/journal_throughput.py``; each rollout starts with an ``AttemptStarted``.
The records are encoded once and produced with a plain idempotent producer, with what a
writer commits beside each append (the rollout's start, each turn): the rollout's summary on
``<namespace>.summaries`` (``journal/summary.py``).

Speed, on the larger journal, ``--rounds`` rounds of two back-to-back scans:

- baseline: a raw confluent-kafka consumer with the journal reader's own config
  (read_committed, same fetch settings), assigned every partition, draining it
  in batches (``consume``) and touching each value: what the broker and the
  client deliver;
- ``replay list --scan``: ``replay.list_rollouts(scan=True)`` over the same topic, what the command
  does with ``--scan`` (and did before summaries): read every record through the journal's Kafka backend, decode it (projected:
  the header and the few fields ``RolloutProgress`` reads, ``RolloutProgress.READS``;
  every other field stepped over, see ``journal/projection.py``), fence it, apply it
  to its rollout's ``RolloutProgress``; with the scan workers the command starts on a
  journal this size (``replay/partition_scan.py``: one a core and a partition, each
  folding whole partitions), started and ended inside the timing. The same scan in one
  process is timed too (``serial_ratio``).

- ``replay list``: what the command does by default: read the summaries topic (one record per
  append until the cleaner compacts it, then about one per rollout) and take each rollout's
  newest. ``summaries_fresh_ratio``: right after writing; ``summaries_ratio`` (issue 20's
  ``list_speedup_vs_raw_scan``): once the topic compacted, as it does while writers run (its
  active segment rolls after ``segment.ms``, a minute, at the next append: here each partition's
  newest summary written again), timed in ``--rounds`` more rounds beside a raw scan each.

``ratio`` is the median of the per-round ratios (list --scan events/s over raw events/s, wall
clock: issue 8's figure). Each round also times the journal's own Kafka backend
reading the same records undecoded (``backend_ratio``): the transport share of the
gap, the rest being decoding, fencing and the fold (``us_per_event``). Each scan's
process CPU time (librdkafka's threads and scan workers included) is reported too (``cpu_ratio``,
``cpu_us_per_event``): on a shared, loaded machine wall time swings with the
neighbours, CPU time much less.

Memory: ``replay list`` runs once per journal in one fresh child process (no scan
workers: every row is held in that process, the most one holds), which
reports its peak RSS (``ru_maxrss``) and, in a second child, the peak of Python
allocations (``tracemalloc``). ``memory_growth`` is large over small: 1.0 is flat.

The topics are deleted at the end (``--keep`` keeps them).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import dump_stacks_on, kafka_bootstrap, turn_events  # noqa: E402
from rollout_journal.journal.backend import partition_for, summaries_partition  # noqa: E402
from rollout_journal.journal.codec import Codec  # noqa: E402
from rollout_journal.journal.events import AttemptStarted, Header, Message  # noqa: E402
from rollout_journal.journal.kafka.backend import KafkaBackend  # noqa: E402
from rollout_journal.journal.kafka.config import KafkaSettings  # noqa: E402
from rollout_journal.journal.summary import COMPLETE_KEY, COMPLETE_VALUE, SummaryFold, summary_key  # noqa: E402
from rollout_journal.replay import open_replay  # noqa: E402
from rollout_journal.replay.partition_scan import jobs_for  # noqa: E402

PARTITIONS = 8


def url(bootstrap: str, namespace: str, segment_ms: int | None = None) -> str:
    """A namespace's URL; ``segment_ms``: its compacted topics' ``segment.ms`` (default: a minute)."""
    rolled = "" if segment_ms is None else f"&snapshot_segment_ms={segment_ms}"
    return f"kafka://{bootstrap}/{namespace}?partitions={PARTITIONS}{rolled}"


def write_journal(location: str, rollouts: int, turns: int, prompt_delta: int, output: int) -> tuple[int, int]:
    """A journal of ``rollouts`` rollouts x ``turns`` turns, produced raw; (events, value bytes)."""
    from confluent_kafka import Producer

    settings = KafkaSettings.from_url(location)
    KafkaBackend(settings, transactional=False, create_topics=True).close()
    producer = Producer(
        {
            "bootstrap.servers": settings.bootstrap_servers,
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 20,
            "batch.size": 1 << 20,
            "compression.type": "none",
        }
    )
    codec = Codec()
    rng = np.random.default_rng(0)
    events = size = 0

    def produce(key: str, value: bytes, topic: str = settings.events_topic, rollout: str | None = "") -> None:
        """``rollout``: whose partition (by default the key's; None: partition 0)."""
        partition = 0 if rollout is None else partition_for(rollout or key, PARTITIONS)
        if topic == settings.summaries_topic:  # as record_partition places a summary
            partition = summaries_partition(partition, PARTITIONS)
        while True:
            try:
                producer.produce(topic, value, key.encode(), partition=partition)
                return
            except BufferError:  # the local queue is full: let it drain
                producer.poll(0.05)

    # what a writer opening the namespace writes while it holds no event: every rollout has a summary
    produce(COMPLETE_KEY, COMPLETE_VALUE, settings.summaries_topic, rollout=None)

    def summarize(fold: SummaryFold) -> None:  # what a writer commits with each append
        rid = fold.progress.rollout_id
        produce(summary_key(rid, fold.progress.epoch), codec.encode(fold.record()), settings.summaries_topic, rid)

    for r in range(rollouts):
        rid = f"bench-g{r // 4}-s{r % 4}"
        start = AttemptStarted(
            Header(rid, rid.rsplit("-", 1)[0], 1, 1, 0, 0, Header.now_ms(), "bench"),
            0,
            "topology",
            "new rollout",
            [Message("system", "bench"), Message("user", "task")],
        )
        fold = SummaryFold.empty(rid, start.header.group_id)
        appends = [[start]] + [
            turn_events(rid, t, 1 + 3 * t, rng, prompt_delta=prompt_delta, output=output) for t in range(turns)
        ]
        for append in appends:  # an append: the rollout's start, or one turn
            for record in append:
                value = codec.encode(record)
                produce(rid, value)
                fold.apply(record)
                events += 1
                size += len(value)
            summarize(fold)
        producer.poll(0)
    if producer.flush(120):
        raise RuntimeError(f"{location}: records still undelivered after 120 s")
    return events, size


def summary_records(location: str) -> int:
    """How many records the summaries topic holds now (compaction lowers it)."""
    with open_replay(location) as source:
        return sum(1 for _ in source.journal.backend.read_summaries())


def compact_summaries(location: str, rollouts: int, deadline_s: float = 300.0) -> tuple[int, float]:
    """Let the summaries topic compact as a namespace's does while its writers run: past
    ``segment.ms`` (the namespace's ``snapshot_segment_ms``) an append rolls the active segment,
    then the cleaner keeps the newest summary per key. Here the append is each partition's newest
    summary written again (what its writer's next commit would do). Returns (records left, seconds
    waited); stops at ``deadline_s`` (the figures say how many records a listing read)."""
    from confluent_kafka import Producer

    settings = KafkaSettings.from_url(location)
    started = time.perf_counter()
    time.sleep(settings.snapshot_segment_ms / 1000 + 1)
    newest: dict[int, tuple[bytes, bytes]] = {}
    with open_replay(location) as source:
        for record in source.journal.backend.read_summaries():
            if record.value is not None:
                newest[record.location.partition] = (record.key.encode(), record.value)
    producer = Producer({"bootstrap.servers": settings.bootstrap_servers, "enable.idempotence": True, "acks": "all"})
    for partition, (key, value) in newest.items():
        producer.produce(settings.summaries_topic, value, key, partition=partition)
    producer.flush(60)
    left = summary_records(location)
    while left > 2 * rollouts + PARTITIONS and time.perf_counter() - started < deadline_s:
        time.sleep(2)
        left = summary_records(location)
    return left, time.perf_counter() - started


def raw_scan(location: str) -> tuple[int, float, float]:
    """(records, seconds, CPU seconds) of a raw consumer draining the events topic."""
    from confluent_kafka import Consumer, KafkaError, TopicPartition

    backend = KafkaBackend(KafkaSettings.from_url(location), transactional=False, create_topics=False)
    config = {k: v for k, v in backend.consumer_config().items() if k not in ("logger", "error_cb")}
    topic = backend.events_topic
    backend.close()
    consumer = Consumer(config)
    started, cpu = time.perf_counter(), time.process_time()
    consumer.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
    pending, records = set(range(PARTITIONS)), 0
    while pending:
        for message in consumer.consume(1000, 0.5):
            error = message.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    pending.discard(message.partition())
                continue
            message.value()
            records += 1
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    consumer.close()
    return records, seconds, cpu


def backend_scan(location: str) -> tuple[int, float, float]:
    """(records, seconds, CPU seconds) of the journal's Kafka backend reading every event record,
    undecoded: the transport part of what ``replay list`` does."""
    started, cpu = time.perf_counter(), time.process_time()
    with open_replay(location) as source:
        records = sum(1 for _ in source.stored_events())
    return records, time.perf_counter() - started, time.process_time() - cpu


def cpu_seconds() -> float:
    """CPU time of this process and of its children that ended (``replay list``'s scan workers)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def list_scan(location: str, jobs: int | None = None, *, scan: bool = True) -> tuple[int, float, float]:
    """(events, seconds, CPU seconds of every process) of ``replay list --scan`` over the journal,
    with ``jobs`` scan workers (None: what the command chooses); ``scan=False``: ``replay list``
    itself, which reads the rollouts' summaries."""
    from rollout_journal.replay import list_rollouts

    started, cpu = time.perf_counter(), cpu_seconds()
    with open_replay(location) as source:
        listing = list_rollouts(source, jobs=jobs, scan=scan)
    seconds, cpu = time.perf_counter() - started, cpu_seconds() - cpu
    if listing.report.errors or any(r.damaged for r in listing.rows):
        raise RuntimeError(f"{location}: the scan found problems: {listing.report.errors[:3]}")
    if listing.read != ("events" if scan else "summaries"):
        raise RuntimeError(f"{location}: replay list read the {listing.read}")
    return listing.events, seconds, cpu


def memory_child(location: str, traced: bool) -> dict:
    """``replay list`` in a fresh process: its peak RSS, or the peak of its Python allocations."""
    done = subprocess.run(
        [sys.executable, __file__, "--child", location] + (["--traced"] if traced else []),
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"memory child failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def child(location: str, traced: bool) -> None:
    import tracemalloc

    if traced:
        tracemalloc.start()
    events, seconds, _ = list_scan(location, jobs=1)  # every row in this one process: the most it holds
    report = {
        "events": events,
        "seconds": seconds,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    if traced:
        report["traced_peak_mb"] = tracemalloc.get_traced_memory()[1] / 2**20
    print(json.dumps(report))


def delete_topics(bootstrap: str, namespaces: list[str]) -> None:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})
    streams = ("events", "snapshots", "results", "acks", "workloads", "summaries")
    topics = [f"{ns}.{stream}" for ns in namespaces for stream in streams]
    for future in admin.delete_topics(topics, operation_timeout=60).values():
        try:
            future.result()
        except Exception as exc:  # noqa: BLE001 - cleanup: say so, keep going
            print(f"could not delete a bench topic: {exc}", file=sys.stderr)


def measure(args: argparse.Namespace, bootstrap: str) -> dict:
    turns_large = max(1, (args.events // args.rollouts - 1) // 3)
    turns_small = max(1, turns_large // args.growth)
    tag = uuid.uuid4().hex[:6]
    namespaces = {"small": f"replay-scan-{tag}-small", "large": f"replay-scan-{tag}-large"}
    report: dict = {
        "rollouts": args.rollouts,
        "partitions": PARTITIONS,
        "prompt_delta_tokens": args.prompt_delta,
        "output_tokens": args.output,
        "journals": {},
    }
    try:
        for size, turns in (("small", turns_small), ("large", turns_large)):
            location = url(bootstrap, namespaces[size], args.segment_ms)
            say(f"writing the {size} journal: {args.rollouts} rollouts x {turns} turns")
            events, size_bytes = write_journal(location, args.rollouts, turns, args.prompt_delta, args.output)
            report["journals"][size] = {"events": events, "turns_per_rollout": turns, "value_mb": size_bytes / 2**20}
        large = url(bootstrap, namespaces["large"], args.segment_ms)
        with open_replay(large) as source:
            report["scan_jobs"] = jobs_for(source, None, source.end_offsets())
        rounds: list[dict[str, float]] = []
        cpu_rounds: list[dict[str, float]] = []  # per round, per reader: CPU microseconds per event
        for i in range(args.rounds):
            say(f"round {i + 1}/{args.rounds}: raw consumer scan, journal backend read, replay list scan")
            raw_records, raw_s, raw_cpu = raw_scan(large)
            backend_records, backend_s, backend_cpu = backend_scan(large)
            listed, list_s, list_cpu = list_scan(large)
            serial, serial_s, serial_cpu = list_scan(large, jobs=1)
            summarized, summaries_s, _ = list_scan(large, scan=False)
            if not raw_records == backend_records == listed == serial == summarized:
                raise RuntimeError(
                    f"the raw scan read {raw_records} records, the backend {backend_records}, "
                    f"replay list --scan {listed} events ({serial} in one process), replay list {summarized}"
                )
            rounds.append(
                {
                    "raw_events_per_s": raw_records / raw_s,
                    "backend_events_per_s": backend_records / backend_s,
                    "list_events_per_s": listed / list_s,
                    "ratio": raw_s / list_s,
                    "serial_list_events_per_s": serial / serial_s,
                    "serial_ratio": raw_s / serial_s,
                    "backend_ratio": raw_s / backend_s,
                    "cpu_ratio": raw_cpu / list_cpu,
                    "summaries_fresh_ratio": raw_s / summaries_s,
                }
            )
            cpu_rounds.append(
                {
                    "raw_consumer": 1e6 * raw_cpu / raw_records,
                    "journal_backend_read": 1e6 * backend_cpu / backend_records,
                    "replay_list": 1e6 * list_cpu / listed,
                    "replay_list_one_process": 1e6 * serial_cpu / serial,
                }
            )
        report["rounds"] = [r | {"cpu_us_per_event": cpu} for r, cpu in zip(rounds, cpu_rounds)]
        for key in rounds[0]:
            report[key] = statistics.median(r[key] for r in rounds)
        report["cpu_us_per_event"] = {k: statistics.median(cpu[k] for cpu in cpu_rounds) for k in cpu_rounds[0]}
        # where a list scan's time goes, per event (medians): the transport, then decode + fence + fold
        report["us_per_event"] = {
            "raw_consumer": 1e6 / report["raw_events_per_s"],
            "journal_backend_read": 1e6 / report["backend_events_per_s"],
            "replay_list": 1e6 / report["list_events_per_s"],
        }
        report["summary_records_fresh"] = summary_records(large)
        say("letting the summaries topic compact (segment.ms, then the cleaner)")
        left, waited = compact_summaries(large, args.rollouts)
        report["summary_records_compacted"], report["compaction_wait_s"] = left, waited
        compacted_rounds = []
        for i in range(args.rounds):
            say(f"round {i + 1}/{args.rounds}, compacted: raw consumer scan, replay list")
            raw_records, raw_s, _ = raw_scan(large)
            summarized, summaries_s, _ = list_scan(large, scan=False)
            if raw_records != summarized:
                raise RuntimeError(f"the raw scan read {raw_records} records, replay list {summarized} events")
            compacted_rounds.append(raw_s / summaries_s)
        report["summaries_rounds"] = compacted_rounds
        report["summaries_ratio"] = statistics.median(compacted_rounds)
        memory = {}
        for size in ("small", "large"):
            say(f"memory of replay list over the {size} journal (two child processes)")
            location = url(bootstrap, namespaces[size], args.segment_ms)
            memory[size] = memory_child(location, traced=False) | {
                "traced_peak_mb": memory_child(location, traced=True)["traced_peak_mb"]
            }
        report["memory"] = memory
        report["memory_growth"] = {
            "events": report["journals"]["large"]["events"] / report["journals"]["small"]["events"],
            "peak_rss": memory["large"]["peak_rss_mb"] / memory["small"]["peak_rss_mb"],
            "traced_peak": memory["large"]["traced_peak_mb"] / memory["small"]["traced_peak_mb"],
        }
    finally:
        if not args.keep:
            delete_topics(bootstrap, list(namespaces.values()))
    return report


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=1_000_000, help="events in the larger journal")
    parser.add_argument("--growth", type=int, default=10, help="the larger journal holds this many times the turns")
    parser.add_argument("--rollouts", type=int, default=1000)
    parser.add_argument("--prompt-delta", type=int, default=1024, help="prompt-delta tokens per model call")
    parser.add_argument("--output", type=int, default=256, help="sampled tokens (and logprobs) per model call")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--segment-ms",
        type=int,
        help="segment.ms of the namespaces' compacted topics (default: the namespace default, a minute): "
        "how long the summaries wait to compact",
    )
    parser.add_argument("--keep", action="store_true", help="keep the bench topics")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--traced", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    dump_stacks_on()  # SIGUSR1: its threads' and tasks' stacks (a hang's where)
    if args.child:
        child(args.child, args.traced)
        return 0
    with kafka_bootstrap() as bootstrap:
        report = measure(args, bootstrap)
    report["command"] = " ".join(["python bench/replay_scan.py", *sys.argv[1:]])
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        j = report["journals"]
        rounds = ", ".join(f"{r['ratio']:.2f}" for r in report["rounds"])
        print(
            f"replay list over {j['large']['events']:,} events ({args.rollouts} rollouts): "
            f"{report['list_events_per_s']:,.0f} events/s; raw consumer {report['raw_events_per_s']:,.0f}/s; "
            f"ratio {report['ratio']:.2f} (rounds: {rounds}; {report['scan_jobs']} scan workers, "
            f"{report['serial_ratio']:.2f} in one process); the backend's undecoded read alone "
            f"{report['backend_events_per_s']:,.0f}/s ({report['backend_ratio']:.2f}); CPU time ratio "
            f"{report['cpu_ratio']:.2f} ({report['cpu_us_per_event']['replay_list']:.1f} us an event)"
        )
        print(
            f"replay list from the summaries: {report['summaries_ratio']:.1f}x the raw consumer's speed once compacted "
            f"({report['summary_records_compacted']:,} summary records; rounds: "
            f"{', '.join(f'{r:.1f}' for r in report['summaries_rounds'])}), "
            f"{report['summaries_fresh_ratio']:.1f}x right after writing ({report['summary_records_fresh']:,} records)"
        )
        g = report["memory_growth"]
        print(
            f"memory, journal grown {g['events']:.1f}x: peak RSS {report['memory']['small']['peak_rss_mb']:.0f} -> "
            f"{report['memory']['large']['peak_rss_mb']:.0f} MB ({g['peak_rss']:.2f}x), Python peak "
            f"{report['memory']['small']['traced_peak_mb']:.1f} -> {report['memory']['large']['traced_peak_mb']:.1f} MB "
            f"({g['traced_peak']:.2f}x)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
