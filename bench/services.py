"""What running environments and the trainer as services costs.

    python bench/services.py [--json] [--rounds N] [--only throughput,pause]

1. ``http_vs_inprocess_ratio``: rollout throughput (turns/s) of the same workload with its
   resources in resource servers (``rollout-journal serve-resources``, one process per
   environment kind, reached over loopback HTTP) divided by the same with the resources in
   the worker's process. Workplace (event-sourced) and counter (exportable) rollouts,
   journaled to a file journal, snapshot every 4 turns. Rounds alternate which runs first;
   the median of the per-round ratios is reported with a bootstrap 90% interval.
2. ``pause_p50_ms`` / ``pause_p99_ms``: the pause of coordinated checkpoints (admission
   closed, agents parked, every rollout prepared and exported by its resource server over
   HTTP, snapshots committed, sessions resumed) while the same kinds of rollouts run.

3. ``results_read_ratio``: trainer-side read throughput of a namespace's results topic
   (``rollout_journal.participants.TrainerFeed``: read_committed, Avro decoding, group assembly and each
   group's padded torch batch, ``PromptGroup.tensors()``) divided by a raw confluent-kafka
   read_committed consumer of the same topic, with the same librdkafka settings, that only
   counts the bytes, in the same run.
   ``--results-records`` training records of ``--results-tokens`` tokens, groups of 4,
   published by a transactional producer; rounds alternate which reader goes first.
   ``results_read_ratio_no_tensors`` is the feed without building tensors. Kafka:
   ``KAFKA_BOOTSTRAP_SERVERS`` if set, else a local broker started for the run.

A section is a function ``(args, tmp) -> figures`` in ``SECTIONS``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import bootstrap_median_interval, dump_stacks_on, median, pauses_taken, percentile, print_report  # noqa: E402
from rollout_journal.participants.remote.protocol import TOKEN_ENV_VAR  # noqa: E402
from rollout_journal.participants.workload.config import WorkloadConfig  # noqa: E402
from rollout_journal.participants.workload.run import build_backend, open_workload_journal  # noqa: E402
from rollout_journal.participants.workload.runner import Runner  # noqa: E402

ENVIRONMENTS = ("workplace", "counter")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def resource_servers(environments: tuple[str, ...]) -> Iterator[dict[str, str]]:
    """One ``serve-resources`` process per environment kind (a port each, picked by the server)."""
    os.environ.setdefault(TOKEN_ENV_VAR, os.urandom(16).hex())
    procs: list[subprocess.Popen[bytes]] = []
    urls = {}
    try:
        for name in environments:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "rollout_journal.replay.cli.main",
                    "serve-resources",
                    "--environment",
                    name,
                    "--port",
                    "0",
                ],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                env=os.environ | {"PYTHONPATH": str(ROOT)},
            )
            procs.append(proc)
            line = proc.stdout.readline().decode().split() if proc.stdout else []
            if len(line) < 4 or line[0] != "serving":
                raise SystemExit(f"resource server for {name} did not start")
            urls[name] = line[-1]
        yield urls
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


def workload(tmp: Path, name: str, args: argparse.Namespace, **overrides) -> WorkloadConfig:
    base = {
        "name": name,
        "groups": args.groups,
        "siblings": args.siblings,
        "max_turns": args.turns,
        "environment": ",".join(ENVIRONMENTS),
        "seed": 1,
        "allow_early_submit": False,
        "journal": str(tmp / name),
        "concurrency": args.groups * args.siblings,
    }
    return WorkloadConfig(**(base | overrides))


def run_once(config: WorkloadConfig, backend) -> tuple[Runner, float]:
    with open_workload_journal(config) as journal:
        runner = Runner(config, journal, backend, backend.tokenizer)
        gc.collect()
        started = time.perf_counter()
        report = asyncio.run(runner.run(resume=False))
        elapsed = time.perf_counter() - started
    if report.failed or report.set_aside:
        raise SystemExit(f"workload {config.name} had failures: {report.failed or report.set_aside}")
    return runner, report.turns_run / elapsed


# -- 1. throughput: resources behind HTTP vs in process ---------------------------------------
def http_vs_inprocess(args: argparse.Namespace, tmp: Path) -> dict:
    backend = build_backend(WorkloadConfig())
    with resource_servers(ENVIRONMENTS) as urls:

        def one(name: str, http: bool) -> float:
            config = workload(tmp, name, args, resource_servers=urls if http else {})
            return run_once(config, backend)[1]

        one("warmup-local", False)
        one("warmup-http", True)
        pairs = []
        for round_ in range(args.rounds):
            order = (False, True) if round_ % 2 == 0 else (True, False)
            result = {http: one(f"tp{round_}-{'http' if http else 'local'}", http) for http in order}
            pairs.append((result[True], result[False]))
            log(
                f"  round {round_ + 1}/{args.rounds}: HTTP {result[True]:.1f} turns/s, "
                f"in process {result[False]:.1f} turns/s"
            )
    ratios = [http / local for http, local in pairs]
    low, high = bootstrap_median_interval(ratios)
    return {
        "turns_per_s_http": round(median([h for h, _ in pairs]), 1),
        "turns_per_s_inprocess": round(median([loc for _, loc in pairs]), 1),
        "http_vs_inprocess_ratio": round(median(ratios), 4),
        "http_vs_inprocess_ratio_90ci": [round(low, 4), round(high, 4)],
        "throughput_rounds": args.rounds,
        "throughput_turns_per_run": args.groups * args.siblings * args.turns,
    }


# -- 2. coordinated checkpoint pauses with HTTP exports ----------------------------------------
def checkpoint_pauses(args: argparse.Namespace, tmp: Path) -> dict:
    backend = build_backend(WorkloadConfig())
    pauses: list[float] = []
    skipped = 0
    with resource_servers(ENVIRONMENTS) as urls:
        for round_ in range(max(1, args.rounds // 2)):
            config = workload(
                tmp,
                f"pause{round_}",
                args,
                resource_servers=urls,
                checkpoint_mode="coordinated",
                coordinated_every_s=0.05,
                turn_delay_ms=5.0,
                max_turns=max(args.turns, 12),
            )
            runner, _ = run_once(config, backend)
            round_pauses, round_skipped = pauses_taken(runner)
            pauses += round_pauses
            skipped += round_skipped
    return {
        "pause_p50_ms": round(percentile(pauses, 50), 2),
        "pause_p99_ms": round(percentile(pauses, 99), 2),
        "pause_checkpoints": len(pauses),
        "pause_rollouts_skipped": skipped,
        "pause_rollouts": args.groups * args.siblings,
    }


# -- 3. the trainer's reads of the results topic vs a raw consumer --------------------------------
def _publish_results(location: str, records: int, tokens: int, group_size: int) -> int:
    """Training records on the results topic, a transaction per 64 (as many final turns commit
    together); the bytes published."""
    import numpy as np

    from rollout_journal.journal.backend import OutRecord, Stream
    from rollout_journal.journal.codec import Codec
    from rollout_journal.journal.events import FenceEntry, Header, TokenSegment, TrainingRecord
    from rollout_journal.journal.open import open_backend

    codec, rng, total = Codec(), np.random.default_rng(0), 0
    backend = open_backend(location, writer="bench-results")
    try:
        batch: list[OutRecord] = []
        for i in range(records):
            rollout, group = f"b-g{i // group_size}-s{i % group_size}", f"b-g{i // group_size}"
            half = tokens // 2
            mask = np.zeros(tokens, dtype=bool)
            mask[half:] = True
            record = TrainingRecord(
                Header(rollout, group, 1, 1, 7, 40, Header.now_ms(), "bench"),
                group_size,
                float(rng.random()),
                True,
                rng.integers(0, 50_000, tokens, dtype=np.int32),
                np.where(mask, -rng.random(tokens), 0).astype("<f4"),
                mask,
                [
                    TokenSegment(0, half, False, 1, 0, f"{rollout}/c0", "p0"),
                    TokenSegment(half, tokens, True, 1, 0, f"{rollout}/c0", "p0"),
                ],
                [FenceEntry(1, 1, 0, "bench", 0)],
            )
            value = codec.encode(record)
            total += len(value)
            batch.append(OutRecord(Stream.RESULTS, rollout, value, rollout))
            if len(batch) == 64 or i == records - 1:
                for records_of in _by_partition(batch, backend.partitions).values():
                    backend.commit(records_of)
                batch = []
    finally:
        backend.close()
    return total


def _by_partition(batch: list, partitions: int) -> dict[int, list]:
    from rollout_journal.journal.backend import partition_for

    out: dict[int, list] = {}
    for record in batch:
        out.setdefault(partition_for(record.partition_key, partitions), []).append(record)
    return out


def _read_raw(location: str, records: int) -> float:
    """Seconds for a plain read_committed consumer to receive every record (bytes counted only). Its
    librdkafka settings are the feed's own (fetch and prefetch tuned alike), so the ratio is what
    the feed adds, not what a default config loses."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    from rollout_journal.journal.kafka.config import KafkaSettings
    from rollout_journal.journal.kafka.readers import ReaderPool

    settings = KafkaSettings.from_url(location)
    config = ReaderPool(settings).consumer_config()
    config.update({"enable.partition.eof": False, "fetch.wait.max.ms": 50, "group.id": f"raw-{time.time_ns()}"})
    consumer = Consumer(config)
    consumer.assign([TopicPartition(settings.results_topic, p, OFFSET_BEGINNING) for p in range(settings.partitions)])
    started, seen, nbytes = time.perf_counter(), 0, 0
    try:
        while seen < records:
            for msg in consumer.consume(4096, 1.0):
                if msg.error() is None:
                    seen += 1
                    nbytes += len(msg.value() or b"")  # a tombstone (none here) has no value
        return time.perf_counter() - started
    finally:
        consumer.close()


def _read_feed(location: str, groups: int, tensors: bool) -> float:
    """Seconds for a TrainerFeed to hand on every group (and, with ``tensors``, build its batch)."""
    from rollout_journal.journal.open import open_backend
    from rollout_journal.participants.trainer import TrainerFeed

    backend = open_backend(location, read_only=True)
    started = time.perf_counter()
    try:
        with TrainerFeed(backend) as feed:
            for group in feed.groups(limit=groups, poll_s=1.0):
                if tensors:
                    group.tensors()
        return time.perf_counter() - started
    finally:
        backend.close()


def results_reads(args: argparse.Namespace, tmp: Path) -> dict:
    from bench.common import kafka_bootstrap

    group_size = 4
    records = args.results_records - args.results_records % group_size
    with kafka_bootstrap() as bootstrap:
        location = f"kafka://{bootstrap}/bench-results-{os.getpid()}-{time.time_ns() % 10**6}?partitions=4"
        nbytes = _publish_results(location, records, args.results_tokens, group_size)
        _read_raw(location, records)  # warm-up: page cache, connections
        rows = []
        for round_ in range(args.rounds):
            readers = [
                ("raw", lambda: _read_raw(location, records)),
                ("feed", lambda: _read_feed(location, records // group_size, True)),
                ("feed_no_tensors", lambda: _read_feed(location, records // group_size, False)),
            ]
            if round_ % 2:
                readers.reverse()
            seconds = {name: fn() for name, fn in readers}
            rows.append(seconds)
            log(
                f"  round {round_ + 1}/{args.rounds}: raw {records / seconds['raw']:.0f} records/s, feed "
                f"{records / seconds['feed']:.0f} records/s ({records / seconds['feed_no_tensors']:.0f} without tensors)"
            )
    ratios = [r["raw"] / r["feed"] for r in rows]
    low, high = bootstrap_median_interval(ratios)
    return {
        "results_read_ratio": round(median(ratios), 4),
        "results_read_ratio_90ci": [round(low, 4), round(high, 4)],
        "results_read_ratio_no_tensors": round(median([r["raw"] / r["feed_no_tensors"] for r in rows]), 4),
        "results_records_per_s_raw": round(records / median([r["raw"] for r in rows]), 1),
        "results_records_per_s_feed": round(records / median([r["feed"] for r in rows]), 1),
        "results_records": records,
        "results_tokens_per_record": args.results_tokens,
        "results_mb": round(nbytes / 1e6, 1),
        "results_rounds": args.rounds,
    }


SECTIONS: dict[str, Callable[[argparse.Namespace, Path], dict]] = {
    "throughput": http_vs_inprocess,
    "pause": checkpoint_pauses,
    "results": results_reads,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rounds", type=int, default=6, help="alternating HTTP / in-process rounds")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--siblings", type=int, default=4)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--results-records", type=int, default=4000, help="training records on the results topic")
    parser.add_argument("--results-tokens", type=int, default=2048, help="tokens per training record")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"sections: {', '.join(SECTIONS)}")
    args = parser.parse_args(argv)
    dump_stacks_on()
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(only) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; known: {', '.join(SECTIONS)}")
    report: dict = {}
    with tempfile.TemporaryDirectory(prefix="rj-bench-services-") as tmp:
        for name in only:
            log(f"{name} ...")
            report.update(SECTIONS[name](args, Path(tmp)))
    print_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
