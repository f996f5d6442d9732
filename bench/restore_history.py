"""Restore of a partition on Kafka as its history grows 10x, before and after the broker's cleaner ran.

    python bench/restore_history.py [--json] [--live 200] [--turns 5] [--state-bytes 4096]
                                    [--rounds 3] [--segment-ms MS] [--dirty-ratio 0.01]
                                    [--delete-retention-ms 20000] [--bucket-size 256] [--ack-wave 64]
                                    [--wait-s 300] [--bootstrap HOST:PORT]

Two namespaces on one broker, one partition each. History first: past rollouts that ran
``--turns`` turns (a snapshot of ``--state-bytes`` each turn), finished and were acknowledged by
the trainer, as many as the live ones (``1x``) or ten times as many (``10x``); then ``--live``
rollouts still running after as many turns. The snapshot topic has the journal's defaults but
three: ``--segment-ms`` (its ``segment.ms``; the journal's default without it),
``--dirty-ratio`` (``min.cleanable.dirty.ratio``, 0.01 here so one pass of the cleaner takes
everything; at the journal's 0.25 a topic holds up to a third more than its compacted size
between passes, as a running fleet's steady state does) and ``--delete-retention-ms`` (how long a
tombstone outlives its cleaning: 20 s here against the journal's 10 minutes, so that history
acknowledged more than that long ago, a fleet's steady state, is reached in a bench's time).

Restore is what a worker taking the partition runs: ``load_rollouts`` on a freshly opened
journal (the snapshot topic, then the events after each live rollout's snapshot), timed in
``--rounds`` rounds that alternate which namespace goes first. Twice: right after the writing
(``before_cleaner``: every snapshot ever written is still in the topic), and once the broker's
log cleaner compacted both snapshot topics (``after_cleaner``: the bench appends a tombstone
every few seconds, which rolls the active segment once ``segment.ms`` passed, until no key has
two records, waiting at most ``--wait-s``), and once the tombstones' retention passed and the
cleaner removed them too (``after_retention``: no tombstone left). Every row is measured in the
same run, on the same data: the first is the baseline of the others.

``restore_ratio_10x_history_kafka``: the median of the per-round ratios 10x / 1x after the
retention (issue goal <= 1.2); ``after_cleaner`` has the ratio a restore sees within the
retention of the acknowledgements. ``snapshot_records``: what each snapshot topic held (a restore
reads every one; ``tombstones`` of them); ``event_records_read``: the events a restore read after
them. What a compacted topic keeps of past rollouts, once their tombstones are gone, is the
buckets that name them (``AcknowledgedRollouts``, one per 256) and at most 255 fences not folded
yet. Each phase takes one census of each snapshot topic (records per key): the one that showed
it done. The filler that keeps each topic's log dirty (so the cleaner runs again) is one value
under a key restore ignores, the same in both topics.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from bench.common import dump_stacks_on, kafka_bootstrap, median, print_report  # noqa: E402
from rollout_journal.journal.backend import OutRecord, Stream  # noqa: E402
from rollout_journal.journal.events import (  # noqa: E402
    AttemptStarted,
    Header,
    Message,
    RolloutAcknowledged,
    RolloutFinished,
    TurnCompleted,
)
from rollout_journal.journal.journal import Journal  # noqa: E402
from rollout_journal.journal.kafka.backend import KafkaBackend  # noqa: E402
from rollout_journal.journal.kafka.config import KafkaSettings  # noqa: E402
from rollout_journal.journal.restore import load_rollouts  # noqa: E402
from rollout_journal.journal.snapshots import BUCKET_MARK, FENCE_SUFFIX, SnapshotDraft  # noqa: E402

FILLER_KEY = "bench/filler"  # a key restore ignores: a value under it rolls the active segment and dirties the log
FILLER_BYTES = 64 * 1024  # over min.cleanable.dirty.ratio of either topic's compacted size, so the cleaner runs again


def log(message: str) -> None:
    print(f"[restore_history] {message}", file=sys.stderr, flush=True)


def header(rollout: str, seq: int, turn: int = 0) -> Header:
    return Header(rollout, f"group-{rollout}", 1, 1, turn, seq, Header.now_ms(), "bench")


def write_rollouts(journal: Journal, ids: list[str], turns: int, state_bytes: int, rng: np.random.Generator) -> None:
    """``turns`` snapshotted turns of each rollout, every rollout's turn t before any turn t+1 (as a
    fleet interleaves them; group commit batches them)."""
    for turn in range(turns):
        pending: list[Future] = []
        for rollout in ids:
            event = (
                AttemptStarted(header(rollout, 0), 0, "bench", "bench")
                if turn == 0
                else TurnCompleted(header(rollout, turn, turn), [Message("assistant", "t")], [], {}, None, ["a"])
            )
            draft = SnapshotDraft(header(rollout, turn, turn), "running", turn, rng.bytes(state_bytes))
            pending.append(journal.append([event], draft))
        for future in pending:
            future.result()


def write_namespace(
    settings: KafkaSettings, live: int, past: int, turns: int, state_bytes: int, bucket_size: int, ack_wave: int
) -> None:
    """History first: ``past`` rollouts that ran ``turns`` turns, finished and were acknowledged by
    the trainer; then ``live`` rollouts still running after ``turns`` turns."""
    rng = np.random.default_rng(0)
    done = [f"past-{i}" for i in range(past)]
    with Journal(KafkaBackend(settings), acknowledgement_bucket_size=bucket_size) as journal:
        write_rollouts(journal, done, turns, state_bytes, rng)
        for future in [
            journal.append(
                [RolloutFinished(header(r, turns, turns), 1.0, turns, "{}")],
                SnapshotDraft(header(r, turns, turns), "finished", turns, rng.bytes(state_bytes)),
            )
            for r in done
        ]:
            future.result()
        for start in range(0, len(done), ack_wave):  # as a trainer acknowledges: a batch a step
            wave = done[start : start + ack_wave]
            for future in [
                journal.acknowledge(RolloutAcknowledged(header(r, turns + 1, turns), "bench")) for r in wave
            ]:
                future.result()
        write_rollouts(journal, [f"live-{i}" for i in range(live)], turns, state_bytes, rng)


def restore_once(settings: KafkaSettings, live: int, past: int) -> tuple[float, int]:
    """Seconds for a fresh journal's ``load_rollouts``, and the event records it read."""
    with Journal(KafkaBackend(settings, create_topics=False, transactional=False)) as journal:
        started = time.perf_counter()
        plan = load_rollouts(journal)
        seconds = time.perf_counter() - started
    if len(plan.rollouts) != live or len(plan.acknowledged) != past or plan.report.errors:
        raise SystemExit(
            f"restore of {settings.namespace} found {len(plan.rollouts)} of {live} live rollouts and "
            f"{len(plan.acknowledged)} of {past} acknowledged ones; errors: {plan.report.errors[:3]}"
        )
    return seconds, plan.report.records_read


def timed(
    namespaces: dict[str, KafkaSettings],
    live: int,
    past: dict[str, int],
    rounds: int,
    counted: dict[str, Counter[str]],
) -> dict:
    """Each namespace restored ``rounds`` times, the order alternating; medians and per-round ratios,
    and what ``counted`` (the phase's census of each snapshot topic) found."""
    seconds: dict[str, list[float]] = {name: [] for name in namespaces}
    records: dict[str, int] = {}
    for round_ in range(rounds):
        order = list(namespaces) if round_ % 2 == 0 else list(reversed(namespaces))
        for name in order:
            took, records[name] = restore_once(namespaces[name], live, past[name])
            seconds[name].append(took)
    ratios = [ten / one for one, ten in zip(seconds["1x"], seconds["10x"], strict=True)]
    return {
        "restore_seconds": {name: round(median(values), 4) for name, values in seconds.items()},
        "snapshot_records": {name: records_of(keys) for name, keys in counted.items()},
        "tombstones": {name: keys[TOMBSTONES] for name, keys in counted.items()},
        "buckets": {name: sum(BUCKET_MARK in key for key in keys) for name, keys in counted.items()},
        "fences": {name: sum(key.endswith(FENCE_SUFFIX) for key in keys) for name, keys in counted.items()},
        "event_records_read": records,
        "ratio_10x_vs_1x": round(median(ratios), 3),
        "round_ratios": [round(r, 3) for r in ratios],
    }


TOMBSTONES = "(tombstones)"  # a census's count of tombstone records (no key is named so)


def snapshot_keys(settings: KafkaSettings) -> Counter[str]:
    """Records per key on the snapshot topic now (the filler aside), and under ``TOMBSTONES`` how
    many of them are tombstones."""
    keys: Counter[str] = Counter()
    with KafkaBackend(settings, create_topics=False, transactional=False) as backend:
        for record in backend.read_snapshots():
            if record.key != FILLER_KEY:
                keys[record.key] += 1
                keys[TOMBSTONES] += record.value is None
    return keys


def census(namespaces: dict[str, KafkaSettings]) -> dict[str, Counter[str]]:
    """Records per key of each namespace's snapshot topic: one read of each."""
    return {name: snapshot_keys(settings) for name, settings in namespaces.items()}


def records_of(keys: Counter[str]) -> int:
    return keys.total() - keys[TOMBSTONES]


def keys_written_twice(keys: Counter[str]) -> int:
    """Keys that a census found more than one record of: 0 once the cleaner compacted everything
    written before the filler rolled the active segment."""
    return sum(1 for key, count in keys.items() if count > 1 and key != TOMBSTONES)


def wait_for_cleaner(
    namespaces: dict[str, KafkaSettings], wait_s: float, left: Callable[[Counter[str]], int], what: str
) -> tuple[float, dict[str, Counter[str]]]:
    """Append the filler to each snapshot topic every few seconds (it rolls the active segment once
    ``segment.ms`` passed, and leaves the log dirty enough for the cleaner) until ``left`` finds
    nothing of ``what`` in either topic's census; the seconds it took, and the census that found it
    so (the phase's: the topics are not read again)."""
    started = time.monotonic()
    writers = {name: KafkaBackend(s, create_topics=False) for name, s in namespaces.items()}
    filler = os.urandom(FILLER_BYTES)  # random: zeros would compress to nothing and dirty nothing
    try:
        while True:
            for backend in writers.values():
                backend.commit([OutRecord(Stream.SNAPSHOTS, FILLER_KEY, filler, FILLER_KEY)])
            found = census(namespaces)
            still = {name: left(keys) for name, keys in found.items()}
            if not any(still.values()):
                return time.monotonic() - started, found
            if time.monotonic() - started > wait_s:
                raise SystemExit(f"the cleaner did not remove them within {wait_s:.0f} s: {what} {still}")
            log(f"waiting for the cleaner: {what} {still}")
            time.sleep(max(1.0, min(10.0, (namespaces["1x"].snapshot_segment_ms / 1000) / 6)))
    finally:
        for backend in writers.values():
            backend.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--live", type=int, default=200, help="running rollouts in each namespace")
    parser.add_argument("--turns", type=int, default=5, help="snapshotted turns per rollout")
    parser.add_argument("--state-bytes", type=int, default=4096, help="bytes of each snapshot's state")
    parser.add_argument("--rounds", type=int, default=3, help="timed restores of each namespace per phase")
    parser.add_argument("--segment-ms", type=int, default=None, help="the snapshot topic's segment.ms")
    parser.add_argument("--dirty-ratio", type=float, default=0.01, help="min.cleanable.dirty.ratio (journal's: 0.25)")
    parser.add_argument(
        "--delete-retention-ms", type=int, default=20_000, help="the snapshot topic's delete.retention.ms"
    )
    parser.add_argument(
        "--bucket-size",
        type=int,
        default=256,
        help="acknowledged fences a bucket folds (the journal's 256; more than the past rollouts: no buckets, the layout before them)",
    )
    parser.add_argument("--ack-wave", type=int, default=64, help="acknowledgements made at once (a training step's)")
    parser.add_argument("--wait-s", type=float, default=300, help="the longest wait for each pass of the cleaner")
    parser.add_argument("--bootstrap", help="a broker (default: KAFKA_BOOTSTRAP_SERVERS, else one started here)")
    args = parser.parse_args(argv)
    dump_stacks_on()  # SIGUSR1: its threads' and tasks' stacks (a hang's where)
    with kafka_bootstrap() if args.bootstrap is None else contextlib.nullcontext(args.bootstrap) as bootstrap:
        run = uuid.uuid4().hex[:6]
        extra: dict = {
            "snapshot_min_cleanable_dirty_ratio": args.dirty_ratio,
            "snapshot_delete_retention_ms": args.delete_retention_ms,
        }
        if args.segment_ms is not None:
            extra["snapshot_segment_ms"] = args.segment_ms
        namespaces = {
            name: KafkaSettings(
                bootstrap_servers=bootstrap,
                namespace=f"bench-history-{name}-{run}",
                partitions=1,
                transactional_id=f"bench-history-{name}-{run}-writer",
                **extra,
            )
            for name in ("1x", "10x")
        }
        past = {"1x": args.live, "10x": 10 * args.live}
        for name, settings in namespaces.items():
            log(f"writing {name}: {args.live} live + {past[name]} acknowledged rollouts x {args.turns} turns")
            write_namespace(
                settings, args.live, past[name], args.turns, args.state_bytes, args.bucket_size, args.ack_wave
            )
        log("restoring before the cleaner ran ...")
        before = timed(namespaces, args.live, past, args.rounds, census(namespaces))
        waited, compacted = wait_for_cleaner(namespaces, args.wait_s, keys_written_twice, "keys with older records")
        log(f"the cleaner compacted both topics after {waited:.0f} s; restoring again ...")
        after = timed(namespaces, args.live, past, args.rounds, compacted)
        expired, cleaned = wait_for_cleaner(namespaces, args.wait_s, lambda keys: keys[TOMBSTONES], "tombstones")
        log(f"the tombstones were gone {expired:.0f} s later; restoring again ...")
        retained = timed(namespaces, args.live, past, args.rounds, cleaned)
    report = {
        "restore_ratio_10x_history_kafka": retained["ratio_10x_vs_1x"],
        "after_retention": retained,
        "after_cleaner": after,
        "before_cleaner": before,
        "cleaner_wait_seconds": round(waited, 1),
        "retention_wait_seconds": round(expired, 1),
        "delete_retention_ms": args.delete_retention_ms,
        "acknowledgement_bucket_size": args.bucket_size,
        "ack_wave": args.ack_wave,
        "segment_ms": namespaces["1x"].snapshot_segment_ms,
        "min_cleanable_dirty_ratio": args.dirty_ratio,
        "live_rollouts": args.live,
        "past_rollouts": past,
        "turns": args.turns,
        "state_bytes": args.state_bytes,
    }
    print_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
