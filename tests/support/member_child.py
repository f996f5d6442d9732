"""A group member in a process of its own, for the ownership tests: it takes what the group assigns
and commits one record per owned partition every ``--every-ms``, printing a line per commit
(``committed <partition> <seq>``) and per membership change, until stdin closes or SIGTERM.

    python -m tests.support.member_child BOOTSTRAP NAMESPACE NAME [--partitions N]
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time

from rollout_journal.journal.backend import OutRecord, Stream, partition_for
from rollout_journal.journal.errors import JournalError
from rollout_journal.journal.journal import Journal
from rollout_journal.journal.kafka.backend import KafkaBackend
from rollout_journal.journal.kafka.config import KafkaSettings
from rollout_journal.journal.kafka.group import WorkerGroup


def key_on(partition: int, partitions: int) -> str:
    return next(f"k{i}" for i in range(10_000) if partition_for(f"k{i}", partitions) == partition)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("bootstrap")
    parser.add_argument("namespace")
    parser.add_argument("name")
    parser.add_argument("--partitions", type=int, default=2)
    parser.add_argument("--every-ms", type=float, default=100)
    args = parser.parse_args()
    settings = KafkaSettings(bootstrap_servers=args.bootstrap, namespace=args.namespace, partitions=args.partitions)
    backend = KafkaBackend(settings, member=args.name)
    journal = Journal(backend, linger_ms=1)
    lock = threading.Lock()
    taken: dict[int, int] = {}

    def say(*words: object) -> None:
        print(*words, flush=True)

    def assigned(partitions: list[int]) -> None:
        tokens = backend.own(partitions)
        for p in partitions:
            journal.take_partition(p, tokens[p])
            with lock:
                taken[p] = tokens[p]
        say("assigned", ",".join(map(str, partitions)))

    def gone(kind: str) -> object:
        def callback(partitions: list[int]) -> None:
            backend.disown(partitions)
            with lock:
                for p in partitions:
                    taken.pop(p, None)
            say(kind, ",".join(map(str, partitions)))

        return callback

    group = WorkerGroup(settings, args.name, on_assigned=assigned, on_revoked=gone("revoked"), on_lost=gone("lost"))
    backend.join(group.metadata)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    group.start()
    seq = 0
    while not stop.is_set() and group.failure is None:
        with lock:
            owned = sorted(taken)
        futures = []
        for p in owned:
            seq += 1
            body = json.dumps({"writer": args.name, "seq": seq}).encode()
            record = OutRecord(Stream.EVENTS, key_on(p, args.partitions), body, key_on(p, args.partitions))
            futures.append(
                (p, seq, journal._committer.submit(lambda r=record: [r], check=journal._partition_check([p])))
            )
        for p, s, future in futures:
            try:
                future.result(timeout=60)
                say("committed", p, s)
            except JournalError as exc:
                say("refused", p, s, type(exc).__name__)
        time.sleep(args.every_ms / 1000)
    group.close()
    journal.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
