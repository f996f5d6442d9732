"""Scans that fold each partition in a worker process of its own.

Every event of a rollout lives in its rollout's partition, so a per-rollout fold
never needs two partitions: a partition is the unit of parallel work, as it is
for Kafka Streams' tasks. Each worker opens the journal itself (read-only), scans
the partitions it was dealt one at a time and hands back one result per partition;
the caller gets them in partition order, the order a serial scan reads them in.

Starting a worker costs about a third of a second (a fresh interpreter and its
imports), so :func:`jobs_for` only goes parallel on journals large enough to
repay it. A worker that fails hands its error to the caller, which raises it; one
that dies (killed, out of memory) is named with the partitions it held, and
workers end with the caller (killed, interrupted) rather than outlive it.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Generic, TypeVar

from rollout_journal.journal.journal import ReadReport
from rollout_journal.replay.errors import ReplayError
from rollout_journal.replay.progress import NoProgress, Progress
from rollout_journal.replay.source import ReplaySource, open_replay

R = TypeVar("R")

# What one partition's work is: (the source, the partition, where its read problems go, its
# progress) -> a picklable result. A module-level function (or a partial of one): it is pickled.
PartitionTask = Callable[[ReplaySource, int, ReadReport, Progress], R]

AUTO_MIN_RECORDS = 200_000  # a smaller Kafka journal scans faster than workers start
AUTO_MAX_JOBS = 8
_DEATH_S = 5.0  # how long the caller waits for a dead worker's exit code


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


class _PipeProgress:
    """A worker's progress, forwarded to the caller's bar (advances only: the caller started it)."""

    def __init__(self, messages: Connection) -> None:
        self._messages = messages

    def start(self, total: int, unit: str) -> None:
        pass

    def advance(self, n: int) -> None:
        self._messages.send(("advance", n))

    def finish(self) -> None:
        pass


def _picklable(error: BaseException) -> BaseException:
    try:
        pickle.dumps(error)
        return error
    except Exception:  # noqa: BLE001 - whatever it holds, its words still reach the caller
        return ScanWorkerError(f"{type(error).__name__}: {error}")


def _end_with_parent() -> None:
    """Exit as soon as the process that started this worker is gone (killed, SIGTERM): nobody
    is left to read what the worker finds, and it must not scan on, holding the caller's outputs."""
    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="scan-parent-watch", daemon=True).start()


def _work(location: str, partitions: Sequence[int], task: PartitionTask[object], messages: Connection) -> None:
    """A worker process: each of ``partitions`` through ``task``, each result sent as it is ready."""
    _end_with_parent()
    try:
        with open_replay(location) as source:
            for partition in partitions:
                report = ReadReport()
                result = task(source, partition, report, _PipeProgress(messages))
                messages.send(("result", partition, result, report))
        messages.send(("done",))
    except BaseException as exc:  # noqa: BLE001 - handed to the caller, which raises it
        try:
            messages.send(("failed", _picklable(exc)))
        except OSError:  # the caller is gone: nobody to tell
            pass


@contextmanager
def _interrupts_held() -> Iterator[None]:
    """SIGINT blocked in this thread while it starts a worker, which inherits the mask: Ctrl-C
    (sent to the whole process group) then reaches the caller only, which ends its workers,
    instead of each worker printing a KeyboardInterrupt traceback half way through its imports.
    A Ctrl-C meanwhile is delivered once the worker has started.

    The mask is this thread's only: another thread (librdkafka's) may take the signal, and Python
    then runs its handler in the main thread all the same, which interrupted a start half way
    through handing the worker its preparation data (the worker's EOFError traceback). So in the
    main thread the handler is deferred too: a Ctrl-C during the start is noted and raised after."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    # The first start would launch multiprocessing's resource tracker, which unblocks SIGINT in
    # this thread once it has (its own guard): launched before the block, it leaves ours alone.
    resource_tracker.ensure_running()
    noted: list[int] = []
    deferring = threading.current_thread() is threading.main_thread()
    handler = signal.signal(signal.SIGINT, lambda signum, frame: noted.append(signum)) if deferring else None
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        if deferring and handler is not None:  # None: one set outside Python, which stays
            signal.signal(signal.SIGINT, handler)
            if noted and callable(handler):
                handler(signal.SIGINT, None)  # Python's default raises KeyboardInterrupt here


@dataclass
class _Worker:
    process: BaseProcess
    messages: Connection  # the reading end of the worker's own pipe
    partitions: list[int]

    def died(self) -> ScanWorkerError:
        self.process.join(_DEATH_S)
        return ScanWorkerError(
            f"the scan worker for partitions {self.partitions} died (exit code "
            f"{self.process.exitcode}) before handing back their results"
        )


class PartitionScan(Generic[R]):
    """``task`` run over every partition of ``source`` in ``jobs`` worker processes."""

    def __init__(self, source: ReplaySource, task: PartitionTask[R], jobs: int, ends: dict[int, int]) -> None:
        self.source, self.task, self.jobs, self.ends = source, task, jobs, ends

    def run(self, progress: Progress | None = None) -> list[tuple[int, R, ReadReport]]:
        """(partition, result, its read report) for every partition, in partition order."""
        progress = progress or NoProgress()
        context = multiprocessing.get_context("spawn")  # no librdkafka thread state copied by a fork
        partitions = sorted(self.ends)
        dealt = [partitions[i :: self.jobs] for i in range(self.jobs)]
        workers: list[_Worker] = []
        results: dict[int, tuple[R, ReadReport]] = {}
        progress.start(sum(self.ends.values()), self.source.unit)
        try:
            for mine in dealt:
                # A pipe a worker, whose writing end only that worker holds: a worker that dies,
                # even half way through a message, is an end of file here, never a wait
                reader, writer = context.Pipe(duplex=False)
                process = context.Process(
                    target=_work,
                    args=(self.source.location, mine, self.task, writer),
                    name=f"scan-partitions-{','.join(map(str, mine))}",
                    daemon=True,
                )
                workers.append(_Worker(process, reader, mine))
                try:
                    with _interrupts_held():
                        process.start()
                finally:
                    writer.close()
            running = {worker.messages: worker for worker in workers}
            while running:
                for ready in wait(list(running)):
                    # typeshed: wait() returns any waitable; these are the Connections passed in
                    worker = running[ready]  # type: ignore[index]
                    try:
                        message = worker.messages.recv()
                    except (EOFError, OSError):
                        raise worker.died() from None
                    kind = message[0]
                    if kind == "advance":
                        progress.advance(message[1])
                    elif kind == "result":
                        results[message[1]] = (message[2], message[3])
                    elif kind == "failed":
                        raise message[1]
                    else:
                        del running[worker.messages]
        finally:
            progress.finish()
            for worker in workers:
                if worker.process.pid is not None:  # started (a failed or interrupted start leaves some not)
                    if worker.process.is_alive():
                        worker.process.terminate()
                    worker.process.join()
                worker.messages.close()
        return [(p, *results[p]) for p in partitions]
