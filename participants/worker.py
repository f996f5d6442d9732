"""A fleet of rollout workers on one Kafka namespace: ``submit`` a workload, run ``worker``s.

``submit_workload`` records a workload in the namespace once (its spec and rollout ids,
``WorkloadRegistered``). Any number of :class:`FleetWorker` processes, on any machines,
started with only the journal's URL, pick registrations up (and new ones later) and share
the rollouts: Kafka's consumer group ``<namespace>.workers`` assigns each worker partitions
of the namespace (``journal.kafka_group``), and a rollout lives on partition
``crc32(id) % N``.

Taking a partition is a restore: the worker opens the partition's producer
``<namespace>.p<N>`` (fencing the previous owner and ending its open transaction), reads
the partition's rollouts, and continues each unfinished one as attempt N+1 with the next
epoch, which only this owner allocates. Letting a partition go on a revocation (a graceful
leave, SIGTERM, a worker joining) stops its rollouts at a turn boundary and waits until
everything they appended is durable before the group hands it on, so a planned move redoes
nothing. A SIGKILLed worker's partitions move after the group's session timeout and its
rollouts continue from their last committed turn. A worker that finds its partitions lost
(it stalled past its session) drops their rollouts without writing: their producers were
fenced by the new owners, so nothing it still tries to write lands.

The rollouts are driven by the same :class:`~participants.runner.Runner` as the single-process
``run``: one per workload, admitting and releasing rollouts as partitions come and go.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from journal.anchoring import HeadSigner
from journal.errors import ConfigurationError, UnstableReadError
from journal.events import Header, WorkloadRegistered
from journal.journal import Journal
from journal.open import is_kafka_url, open_journal
from journal.restore import RestorePlan, load_rollouts

from .config import WorkloadConfig
from .runner import ProgressCallback, Runner, RunReport
from .specs import workload_specs
from .workload import build_backend

log = logging.getLogger(__name__)

EventCallback = Callable[[str], None]  # one line about the worker's membership and rollouts


def submit_workload(config: WorkloadConfig, location: str) -> tuple[WorkloadRegistered, bool]:
    """Record ``config`` in the Kafka namespace at ``location`` for a fleet's workers: its spec and
    every rollout id. Once: submitting the same workload again changes nothing (False); a workload
    of the same name with other settings is refused. Topics are created (and checked) here."""
    if not is_kafka_url(location):
        raise ConfigurationError(f"submit needs a Kafka journal (kafka://host:port/namespace), not {location!r}: "
                                 "a fleet of workers shares a namespace through a Kafka consumer group; "
                                 "on one machine, `rollout-journal run` a workload directly")
    specs = workload_specs(config)
    with open_journal(location, mode="plain", writer="submit") as journal:
        existing = journal.snapshots({journal.partition_of(config.name)}).workloads.get(config.name)
        ids = [s.rollout_id for s in specs]
        if existing is not None:
            if existing.topology == config.topology() and existing.rollout_ids == ids:
                return existing, False
            diff = ", ".join(config.topology_diff(existing.spec_json)) or (
                f"{len(existing.rollout_ids)} rollouts -> {len(ids)}" if existing.rollout_ids != ids
                else "the topology fingerprint differs")
            raise ConfigurationError(f"workload {config.name!r} is already submitted to {location} with other "
                                     f"settings ({diff}); submit this one under another name")
        registration = WorkloadRegistered(config.name, config.model_dump_json(), ids, config.topology(),
                                          Header.now_ms(), "submit", True)
        journal.register_workload(registration).result()
        return registration, True


@dataclass
class WorkerReport:
    """What one worker did in its life, per workload."""

    name: str
    workloads: dict[str, RunReport] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)  # rollouts another worker took over (why)
    partitions_taken: int = 0
    partitions_released: int = 0
    partitions_lost: int = 0
    seconds: float = 0.0

    @property
    def turns_run(self) -> int:
        return sum(r.turns_run for r in self.workloads.values())

    @property
    def finished_here(self) -> int:
        return sum(1 for r in self.workloads.values() for row in r.rollouts.values()
                   if row.outcome is not None and row.turns_run_here > 0)


@dataclass
class _Workload:
    registration: WorkloadRegistered
    config: WorkloadConfig
    runner: Runner
    ids: set[str]
    partitions: set[int] = field(default_factory=set)  # owned partitions whose rollouts it admitted


class FleetWorker:
    """One worker of a fleet; :meth:`run` it until ``stop`` is set (SIGTERM, Ctrl-C)."""

    def __init__(self, location: str, *, name: str | None = None, instance_id: str | None = None,
                 on_turn: ProgressCallback | None = None, on_event: EventCallback | None = None,
                 release_timeout_s: float = 120.0, poll_s: float = 1.0) -> None:
        """``name`` tells the worker apart (``status``, and the ``writer`` of the events it journals;
        default ``<host>-<pid>``). ``instance_id`` makes it a static member of the group: restarted
        under the same id within the session timeout, it gets its partitions back without a
        rebalance, but leaving holds them until the session times out (see docs/design-notes.md)."""
        if not is_kafka_url(location):
            raise ConfigurationError(f"a worker needs a Kafka journal (kafka://host:port/namespace), not {location!r}; "
                                     "on one machine, `rollout-journal run` a workload directly")
        from journal.kafka_group import default_member_name

        self.location = location
        self.name = name or default_member_name()
        self.instance_id = instance_id
        self.on_turn = on_turn or (lambda rollout_id, turn: None)
        self.on_event = on_event or (lambda line: None)
        self.release_timeout_s = release_timeout_s
        self.poll_s = poll_s
        self.report = WorkerReport(self.name)
        self.workloads: dict[str, _Workload] = {}
        self.owned: set[int] = set()
        self._journal: Journal | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: asyncio.Queue[tuple[str, list[int], concurrent.futures.Future | None]] | None = None
        self._signer = HeadSigner.from_environment()
        self._serving = True  # the membership task serves events (False once it stopped)

    # -- the worker's life --------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> WorkerReport:
        """Join the fleet, drive what the group assigns, and leave when ``stop`` is set: every
        owned rollout stops at a turn boundary and its turns are durable before it is handed on.
        Raises what stops the worker otherwise (the journal failed)."""
        from journal.kafka_backend import KafkaBackend
        from journal.kafka_group import WorkerGroup

        started = time.monotonic()
        self._loop = asyncio.get_running_loop()
        self._events = asyncio.Queue()
        journal = self._journal = await asyncio.to_thread(open_journal, self.location, mode="partitions",
                                                          writer=self.name, linger_ms=50.0)
        backend = journal.backend
        if not isinstance(backend, KafkaBackend):  # __init__ checked the location: a Kafka URL opens one
            raise ConfigurationError(f"a worker needs a Kafka journal, not a {backend.kind} one ({self.location})")
        group = WorkerGroup(backend.settings, self.name, on_assigned=self._assigned,
                            on_revoked=self._revoked, on_lost=self._lost, instance_id=self.instance_id)
        membership: asyncio.Task | None = None
        try:
            feed = journal.follow_workloads()
            self._pick_up(await asyncio.to_thread(feed.poll))  # every known workload before the first partition
            membership = asyncio.create_task(self._membership(), name="membership")
            group.start()
            self.on_event(f"worker-joined {self.name} {backend.settings.group_id}")
            while not stop.is_set():
                await self._wait(stop, membership)
                self._raise_failure(group, membership)
                new = {name: r for name, r in (await asyncio.to_thread(feed.poll)).items() if name not in self.workloads}
                if new:
                    self._events.put_nowait(("workloads", [], None))
                    self._pick_up(new)
        finally:
            await asyncio.to_thread(group.close)  # the group revokes every owned partition: let go cleanly
            if membership is not None:
                await self._drain(membership)
            for workload in self.workloads.values():
                await workload.runner.drop(list(workload.runner.live))
                await workload.runner.environments.aclose()  # its resource-server connections
            await asyncio.to_thread(journal.close)
            self.report.seconds = time.monotonic() - started
            for name, workload in self.workloads.items():
                self.report.workloads[name] = workload.runner.report
                self.report.dropped.update(workload.runner.dropped)
            self.on_event(f"worker-left {self.name}")
        return self.report

    async def _wait(self, stop: asyncio.Event, membership: asyncio.Task) -> None:
        """Until the next poll for registrations, a stop, or a failure."""
        waiters = [asyncio.ensure_future(stop.wait()), membership,
                   *(asyncio.ensure_future(w.runner.failed.wait()) for w in self.workloads.values())]
        try:
            await asyncio.wait(waiters, timeout=self.poll_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                if waiter is not membership:
                    waiter.cancel()

    def _raise_failure(self, group: object, membership: asyncio.Task) -> None:
        failure = getattr(group, "failure", None)
        if failure is not None:
            raise failure
        if membership.done():
            membership.result()  # raises what stopped it
        for workload in self.workloads.values():
            if workload.runner.failure is not None:
                raise workload.runner.failure

    async def _drain(self, membership: asyncio.Task) -> None:
        """Serve the membership events the leave produced, then stop serving."""
        assert self._events is not None
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._events.put_nowait(("stop", [], done))
        await asyncio.wait([membership], timeout=self.release_timeout_s)
        if not membership.done():
            membership.cancel()

    # -- workloads ---------------------------------------------------------------------------------

    def _pick_up(self, registrations: dict[str, WorkloadRegistered]) -> None:
        """A runner for each new workload; its rollouts on owned partitions are admitted by the
        membership task (queued, so a take or a release never runs beside it)."""
        for name, registration in sorted(registrations.items()):
            if name in self.workloads:
                continue
            try:
                config = WorkloadConfig.model_validate_json(registration.spec_json).model_copy(
                    update={"journal": self.location, "writer": self.name})
            except ValueError as exc:
                log.error("workload %s: its registration holds no usable spec (%s); skipped", name, exc)
                continue
            backend = build_backend(config)
            runner = Runner(config, self._journal, backend, backend.tokenizer, progress=self.on_turn,
                            signer=self._signer, fleet=True)
            ids = {s.rollout_id for s in workload_specs(config)}
            self.workloads[name] = _Workload(registration, config, runner, ids)
            self.on_event(f"workload-picked-up {name} {len(ids)}")

    # -- membership (callbacks on the group's polling thread) ------------------------------------

    def _post(self, kind: str, partitions: list[int], done: concurrent.futures.Future | None) -> bool:
        loop, events = self._loop, self._events
        if loop is None or events is None:  # not running (the group starts after both are set)
            return False
        try:
            loop.call_soon_threadsafe(events.put_nowait, (kind, partitions, done))
            return True
        except RuntimeError:  # the loop is gone: nothing of ours runs any more
            return False

    def _assigned(self, partitions: list[int]) -> None:
        self._post("assigned", partitions, None)

    def _revoked(self, partitions: list[int]) -> None:
        self._wait_for("revoked", partitions)

    def _lost(self, partitions: list[int]) -> None:
        self._wait_for("lost", partitions)

    def _wait_for(self, kind: str, partitions: list[int]) -> None:
        done: concurrent.futures.Future = concurrent.futures.Future()
        if not self._serving or not self._post(kind, partitions, done):
            return
        try:
            done.result(timeout=self.release_timeout_s)
        except concurrent.futures.TimeoutError:
            log.error("worker %s: partitions %s not let go within %.0f s; the next owner fences them",
                      self.name, partitions, self.release_timeout_s)
        except BaseException as exc:  # reported by the membership task too
            log.error("worker %s: letting partitions %s go failed: %s", self.name, partitions, exc)

    async def _membership(self) -> None:
        """Serve membership events in order: a partition is taken, released or dropped, one at a time."""
        try:
            await self._serve_membership()
        finally:
            self._serving = False

    async def _serve_membership(self) -> None:
        assert self._events is not None
        while True:
            kind, partitions, done = await self._events.get()
            try:
                if kind == "assigned":
                    await self._take(partitions)
                elif kind == "revoked":
                    await self._let_go(partitions, lost=False)
                elif kind == "lost":
                    await self._let_go(partitions, lost=True)
                elif kind == "workloads":
                    await self._admit_new()
            except BaseException as exc:
                if done is not None:
                    done.set_exception(exc)
                raise
            if done is not None:
                done.set_result(None)
            if kind == "stop":
                return

    async def _take(self, partitions: list[int]) -> None:
        """Fence the partitions' previous owners, restore their rollouts, and drive them."""
        self.on_event(f"partitions-assigned {_numbers(partitions)}")
        await self._admit(partitions, list(self.workloads.values()), take=True)
        self.report.partitions_taken += len(partitions)

    async def _admit_new(self) -> None:
        """Workloads picked up after their partitions were taken: admit their rollouts there now."""
        for workload in list(self.workloads.values()):
            missing = sorted(self.owned - workload.partitions)
            if missing:
                await self._admit(missing, [workload], take=False)

    async def _admit(self, partitions: list[int], chosen: list[_Workload], *, take: bool) -> None:
        """Restore the rollouts ``chosen`` workloads have on ``partitions`` (``take``: after taking the
        partitions' writers, fencing their previous owners) and drive them."""
        journal = self._journal
        assert journal is not None
        ids = {rid for w in chosen for rid in w.ids if journal.partition_of(rid) in partitions}
        # One hop to a thread for the blocking part: while the event loop runs model calls, every
        # await costs a round of them, and a takeover waits for each.
        started = time.monotonic()
        plan = await asyncio.to_thread(self._take_and_read, partitions, ids, take)
        read_s = time.monotonic() - started
        self.owned.update(partitions)
        for workload in chosen:
            workload.partitions.update(partitions)
            specs = [s for s in workload_specs(workload.config) if journal.partition_of(s.rollout_id) in partitions]
            # One admission for every partition taken: their fences share group commits (a rollout whose
            # partition was taken over meanwhile is dropped alone; the group revokes or loses it next).
            admitted = await workload.runner.admit(specs, plan, workload.registration) if specs else []
            for live in admitted:
                workload.runner.launch(live)
            counts = Counter(journal.partition_of(live.spec.rollout_id) for live in admitted)
            for partition in sorted({journal.partition_of(s.rollout_id) for s in specs}):
                self.on_event(f"rollouts-admitted {workload.config.name} p{partition} {counts[partition]}")
        # Where a takeover's time goes: taking the writers and reading, then restoring and fencing.
        self.on_event(f"takeover-seconds {_numbers(partitions)} {read_s:.3f} {time.monotonic() - started - read_s:.3f}")

    def _take_and_read(self, partitions: list[int], ids: set[str], take: bool) -> RestorePlan:
        """(In a thread.) Take the partitions' writers side by side, then read their rollouts. An open
        transaction of a producer this worker could not fence (not a worker: it would have been)
        is waited out, loudly, and the read retried."""
        journal = self._journal
        assert journal is not None
        if take:
            with concurrent.futures.ThreadPoolExecutor(max_workers=len(partitions)) as pool:
                list(pool.map(journal.take_partition, partitions))  # raises the first failure
        while True:
            try:
                return load_rollouts(journal, partitions=set(partitions), only=ids)
            except UnstableReadError as exc:
                log.error("worker %s: %s; retrying", self.name, exc)
                self.on_event(f"restore-held-back {exc.topic} {exc.partition}")

    async def _let_go(self, partitions: list[int], *, lost: bool) -> None:
        """Revoked: stop the partitions' rollouts at a turn boundary, make their turns durable, close
        the partitions' producers. Lost: drop the rollouts at once, writing nothing more."""
        journal = self._journal
        assert journal is not None
        mine = [p for p in partitions if p in self.owned]
        dropped = 0
        for workload in self.workloads.values():
            workload.partitions.difference_update(partitions)
            rollouts = [rid for rid in workload.runner.live if journal.partition_of(rid) in mine]
            if lost:
                await workload.runner.drop(rollouts)
                dropped += len(rollouts)
            else:
                await workload.runner.release(rollouts)
        for partition in mine:
            await asyncio.to_thread(journal.release_partition, partition)
        self.owned.difference_update(mine)
        if lost:
            self.report.partitions_lost += len(mine)
        else:
            self.report.partitions_released += len(mine)
        self.on_event(f"partitions-{'lost' if lost else 'revoked'} {_numbers(partitions)}")
        if lost:
            self.on_event(f"rollouts-dropped {dropped}")


def _numbers(partitions: list[int]) -> str:
    return ",".join(str(p) for p in sorted(partitions)) or "-"
