"""Scans that fold each partition in a worker process of its own.

Every event of a rollout lives in its rollout's partition, so a per-rollout fold
never needs two partitions: a partition is the unit of parallel work, as it is
for Kafka Streams' tasks. Each worker opens the journal itself (read-only), scans
the partitions it was dealt one at a time and hands back one result per partition;
the caller gets them in partition order, the order a serial scan reads them in.

Starting a worker costs about a third of a second (a fresh interpreter and its
imports), so :func:`jobs_for` only goes parallel on journals large enough to
repay it. A worker that fails hands its error to the caller, which raises it; one
that dies (killed, out of memory) is named with the partitions it held.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from journal.journal import ReadReport

from .errors import ReplayError
from .progress import NoProgress, Progress
from .source import ReplaySource, open_replay

R = TypeVar("R")

# What one partition's work is: (the source, the partition, where its read problems go, its
# progress) -> a picklable result. A module-level function (or a partial of one): it is pickled.
PartitionTask = Callable[[ReplaySource, int, ReadReport, Progress], R]

AUTO_MIN_RECORDS = 200_000  # a smaller Kafka journal scans faster than workers start
AUTO_MAX_JOBS = 8
_WAIT_S = 0.5  # how often the caller looks for a worker that died without a word


class ScanWorkerError(ReplayError):
    """A scan worker process ended without handing back its partitions' results."""


def jobs_for(source: ReplaySource, requested: int | None, ends: dict[int, int]) -> int:
    """Worker processes for a scan of ``source`` whose partitions end at ``ends``: ``requested``
    (at most one a partition), or, if None, one a CPU core and a partition once the journal
    holds ``AUTO_MIN_RECORDS`` records (1 below that, and for a file journal, which has one).
    Always 1 for a source that workers cannot open again (one not made by ``open_replay``)."""
    if requested is not None and requested < 1:
        raise ValueError(f"jobs must be at least 1, not {requested}")
    if not source.reopenable:
        return 1
    if requested is not None:
        return min(requested, max(1, len(ends)))
    if len(ends) < 2 or source.unit != "offsets" or sum(ends.values()) < AUTO_MIN_RECORDS:
        return 1
    return max(1, min(os.cpu_count() or 1, len(ends), AUTO_MAX_JOBS))


class _QueueProgress:
    """A worker's progress, forwarded to the caller's bar (advances only: the caller started it)."""

    def __init__(self, messages: Any) -> None:
        self._messages = messages

    def start(self, total: int, unit: str) -> None:
        pass

    def advance(self, n: int) -> None:
        self._messages.put(("advance", n))

    def finish(self) -> None:
        pass


def _picklable(error: BaseException) -> BaseException:
    try:
        pickle.dumps(error)
        return error
    except Exception:  # noqa: BLE001 - whatever it holds, its words still reach the caller
        return ScanWorkerError(f"{type(error).__name__}: {error}")


def _work(location: str, partitions: Sequence[int], task: PartitionTask, messages: Any) -> None:
    """A worker process: each of ``partitions`` through ``task``, each result sent as it is ready."""
    try:
        with open_replay(location) as source:
            for partition in partitions:
                report = ReadReport()
                result = task(source, partition, report, _QueueProgress(messages))
                messages.put(("result", partition, result, report))
    except BaseException as exc:  # noqa: BLE001 - handed to the caller, which raises it
        messages.put(("failed", _picklable(exc)))
        return
    messages.put(("done",))


class PartitionScan(Generic[R]):
    """``task`` run over every partition of ``source`` in ``jobs`` worker processes."""

    def __init__(self, source: ReplaySource, task: PartitionTask[R], jobs: int, ends: dict[int, int]) -> None:
        self.source, self.task, self.jobs, self.ends = source, task, jobs, ends

    def run(self, progress: Progress | None = None) -> list[tuple[int, R, ReadReport]]:
        """(partition, result, its read report) for every partition, in partition order."""
        progress = progress or NoProgress()
        context = multiprocessing.get_context("spawn")  # no librdkafka thread state copied by a fork
        messages = context.Queue()
        partitions = sorted(self.ends)
        dealt = [partitions[i::self.jobs] for i in range(self.jobs)]
        workers = [context.Process(target=_work, args=(self.source.location, mine, self.task, messages),
                                   name=f"scan-partitions-{','.join(map(str, mine))}", daemon=True)
                   for mine in dealt]
        results: dict[int, tuple[R, ReadReport]] = {}
        progress.start(sum(self.ends.values()), self.source.unit)
        try:
            for worker in workers:
                worker.start()
            finished = 0
            while finished < len(workers):
                try:
                    message = messages.get(timeout=_WAIT_S)
                except queue.Empty:
                    self._check_alive(workers, dealt)
                    continue
                kind = message[0]
                if kind == "advance":
                    progress.advance(message[1])
                elif kind == "result":
                    results[message[1]] = (message[2], message[3])
                elif kind == "failed":
                    raise message[1]
                else:
                    finished += 1
        finally:
            progress.finish()
            for worker in workers:
                if worker.pid is None:  # never started: a failed or interrupted start left it
                    continue
                if worker.is_alive():
                    worker.terminate()
                worker.join()
            messages.close()
        return [(p, *results[p]) for p in partitions]

    @staticmethod
    def _check_alive(workers: list, dealt: list[list[int]]) -> None:
        """A worker that exits on its own has said so ("done" or "failed") first; a nonzero exit
        code means it was killed (or crashed) on the way."""
        for worker, mine in zip(workers, dealt, strict=True):
            if worker.exitcode not in (None, 0):
                raise ScanWorkerError(f"the scan worker for partitions {mine} died (exit code {worker.exitcode}) "
                                      "before handing back their results")
