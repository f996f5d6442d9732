"""How fast the journal appends realistic rollout turns, against the raw
confluent-kafka producer sending the same bytes in the same run.

    python bench/journal_throughput.py [--rollouts 200 --turns 10] [--json]

Each turn is a model call (~1k prompt-delta tokens, 256 output tokens and
logprobs, ~6 KB), a resource mutation and a TurnCompleted. Every rollout
appends its turns in order with one turn in flight, as the agent does (turn
t+1 is appended while turn t commits; t+2 waits for t); the journal
group-commits turns of all rollouts into Kafka transactions. The baseline is a plain idempotent producer (acks=all, same
linger/batch/compression) sending the already-encoded bytes, flushed at the
end: the best the broker and client can do with those bytes. The file
backend (fsync per group commit) runs the same workload for reference.
Each round measures baseline and journal back to back; ``ratio`` is the median of the
per-round ratios, so drift of a shared machine's speed cancels.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
from confluent_kafka import Producer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import dump_stacks_on, kafka_bootstrap, median, percentile, turn_events  # noqa: E402
from rollout_journal.journal.backend import partition_for  # noqa: E402
from rollout_journal.journal.codec import Codec  # noqa: E402
from rollout_journal.journal.file.backend import FileBackend  # noqa: E402
from rollout_journal.journal.journal import AppendReceipt, Journal  # noqa: E402
from rollout_journal.journal.kafka.backend import KafkaBackend  # noqa: E402
from rollout_journal.journal.kafka.config import KafkaSettings  # noqa: E402


def workload(rollouts: int, turns: int) -> dict[str, list[list]]:
    rng = np.random.default_rng(0)
    return {f"bench-{r}": [turn_events(f"bench-{r}", t, 3 * t, rng) for t in range(turns)] for r in range(rollouts)}


def run_journal(journal: Journal, turns_by_rollout: dict[str, list[list]]) -> tuple[float, list[float], int]:
    """Appends every rollout's turns in order, all rollouts concurrently; (seconds, commit ms, events)."""
    commit_ms: list[float] = []

    async def rollout(turns: list[list]) -> None:
        previous: asyncio.Future[AppendReceipt] | None = None
        for events in turns:  # as the agent does: turn t+1 appended while turn t commits
            pending = asyncio.wrap_future(journal.append(events))
            if previous is not None:
                commit_ms.append((await previous).commit_ms)
            previous = pending
        if previous is not None:  # a rollout of no turns appended nothing
            commit_ms.append((await previous).commit_ms)

    async def main() -> None:
        await asyncio.gather(*(rollout(t) for t in turns_by_rollout.values()))

    started = time.perf_counter()
    asyncio.run(main())
    seconds = time.perf_counter() - started
    return seconds, commit_ms, sum(len(e) for t in turns_by_rollout.values() for e in t)


def run_raw(settings: KafkaSettings, topic: str, payloads: list[tuple[str, bytes]], partitions: int) -> float:
    producer = Producer(
        {
            "bootstrap.servers": settings.bootstrap_servers,
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": settings.linger_ms,
            "batch.size": settings.batch_size,
            "compression.type": settings.compression_type,
        }
    )
    started = time.perf_counter()
    for key, value in payloads:
        while True:
            try:
                producer.produce(topic, value, key.encode(), partition=partition_for(key, partitions))
                break
            except BufferError:
                producer.poll(0.005)
        producer.poll(0)
    remaining = producer.flush(60)
    seconds = time.perf_counter() - started
    if remaining:
        raise RuntimeError(f"raw producer left {remaining} messages undelivered")
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=200)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3, help="alternating baseline/journal rounds (median kept)")
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--linger-ms", type=float, default=5.0, help="journal group-commit window")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    dump_stacks_on()  # SIGUSR1: its threads' and tasks' stacks (a hang's where)

    turns = workload(args.rollouts, args.turns)
    codec = Codec()
    payloads = [(e.header.rollout_id, codec.encode(e)) for t in turns.values() for events in t for e in events]
    events = len(payloads)
    payload_bytes = sum(len(v) for _, v in payloads)
    results: dict[str, list[float]] = {"raw": [], "journal": [], "file": []}
    commit_ms: list[float] = []
    file_commit_ms: list[float] = []
    with kafka_bootstrap() as bootstrap:
        for round_ in range(args.rounds):
            ns = f"bench{uuid.uuid4().hex[:8]}"
            settings = KafkaSettings(
                bootstrap_servers=bootstrap, namespace=ns, partitions=args.partitions, transactional_id=f"{ns}-w0"
            )
            with Journal(KafkaBackend(settings), linger_ms=args.linger_ms) as journal:
                results["raw"].append(run_raw(settings, settings.events_topic, payloads, args.partitions))
                seconds, ms, n = run_journal(journal, turns)
            results["journal"].append(seconds)
            commit_ms += ms
            with tempfile.TemporaryDirectory(prefix="rj-bench-file-") as d:
                with Journal(FileBackend(d), linger_ms=args.linger_ms) as journal:
                    seconds, ms, _ = run_journal(journal, turns)
            results["file"].append(seconds)
            file_commit_ms += ms
            print(
                f"round {round_ + 1}/{args.rounds}: raw {events / results['raw'][-1]:,.0f} ev/s, "
                f"journal {events / results['journal'][-1]:,.0f} ev/s, file {events / results['file'][-1]:,.0f} ev/s",
                file=sys.stderr,
            )
    raw = events / median(results["raw"])
    journal_rate = events / median(results["journal"])
    report = {
        "events": events,
        "payload_mb": round(payload_bytes / 1e6, 1),
        "raw_producer_events_per_s": round(raw),
        "journal_events_per_s": round(journal_rate),
        "ratio": round(median([r / j for r, j in zip(results["raw"], results["journal"])]), 3),  # paired per round
        "commit_p50_ms": round(percentile(commit_ms, 50), 2),
        "commit_p99_ms": round(percentile(commit_ms, 99), 2),
        "file_events_per_s": round(events / median(results["file"])),
        "file_ratio_to_raw_kafka": round(events / median(results["file"]) / raw, 3),
        "file_commit_p50_ms": round(percentile(file_commit_ms, 50), 2),
        "file_commit_p99_ms": round(percentile(file_commit_ms, 99), 2),
        "rounds": args.rounds,
        "rollouts": args.rollouts,
        "turns": args.turns,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"journal {report['journal_events_per_s']:,} events/s vs raw producer "
            f"{report['raw_producer_events_per_s']:,} events/s (same bytes, same run): ratio {report['ratio']}; "
            f"commit p50 {report['commit_p50_ms']} ms, p99 {report['commit_p99_ms']} ms; "
            f"file backend {report['file_events_per_s']:,} events/s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
