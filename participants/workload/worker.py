"""Every process that writes a Kafka namespace is a member of its consumer group: a fleet's
``worker``s, and ``run``/``resume``.

``submit_workload`` records a workload in the namespace once (its spec and rollout ids,
``WorkloadRegistered``, on the one-partition compacted ``<namespace>.workloads`` and, for restore
and the read tools, the snapshot topic). Any number of :class:`FleetWorker` processes, on any
machines, started with only the journal's URL, pick registrations up (and new ones later, from one
long-lived fetch of ``<namespace>.workloads``: an idle worker never reads the snapshots) and share
the rollouts: Kafka's consumer group ``<namespace>.workers`` assigns each member partitions
of the namespace (``rollout_journal.journal.kafka.group``), a rollout lives on partition
``crc32(id) % N``, and a member writes only the partitions assigned to it, through one
transactional producer whose every transaction carries the group's offsets under the member's
generation (KIP-447): Kafka itself refuses a zombie's commit.

Taking a partition is a restore: the member reads the group's committed offsets (waiting while
the previous owner's last transaction is undecided), reads the partition's rollouts to that commit
point, and continues each unfinished one as attempt N+1 with the next epoch, which only the owner
allocates. Takes run side by side (``max_parallel_takes``), each checked against the assignment it
was made for: one revoked meanwhile stops before it admits anything. A revocation (a member
joining or leaving, SIGTERM) returns at once, whatever the turn length: the partitions' appends are
refused from that moment, their rollouts are cancelled mid-turn, and the new owner redoes the turns
in flight from the last committed turn (a long model call continues from its last progress mark).
A SIGKILLed member's partitions move after the group's session timeout; one that finds its
partitions lost (it stalled past its session) drops their rollouts without writing.

``run`` and ``resume`` on Kafka (:func:`run_as_member`) register their workload and then are one
more member, static (``group.instance.id = <namespace>.<writer>``), until every rollout of the
workload is done: alone they own every partition; beside another ``run``/``resume`` that started
at the same moment they split the partitions and each drives its own. One started beside a fleet,
or beside a ``run``/``resume`` of another ``--writer``, is refused before it writes anything, with
one line naming who holds the namespace. A restarted ``resume`` with the same ``--writer`` takes
its static member's place at once; the process it replaced stops (``SlotTakenOverError``).

The rollouts are driven by the same :class:`~rollout_journal.participants.workload.runner.Runner` as the file journal's
``run``: one per workload, admitting and letting go of rollouts as partitions come and go.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rollout_journal.journal.anchoring import HeadSigner
from rollout_journal.journal.deadlines import Deadline
from rollout_journal.journal.errors import (
    ClusterUnreachableError,
    ConfigurationError,
    JournalError,
    PartitionFencedError,
    UnstableReadError,
    WriterTakenError,
    writer_fenced,
)
from rollout_journal.journal.events import Header, WorkloadRegistered
from rollout_journal.journal.journal import Journal, WorkloadFeed
from rollout_journal.journal.open import is_kafka_url, open_journal
from rollout_journal.journal.restore import RestorePlan, load_rollouts
from rollout_journal.journal.snapshots import BLOCK_BYTES
from rollout_journal.journal.takeover import read_taken, serve_acknowledgements, take_and_restore
from rollout_journal.participants.cancelling import cancel_and_wait
from rollout_journal.participants.rollout.state import StateFoldError, restore_state
from rollout_journal.participants.workload.config import WorkloadConfig
from rollout_journal.participants.workload.metrics import WorkerMetrics
from rollout_journal.participants.workload.run import build_backend
from rollout_journal.participants.workload.runner import ProgressCallback, Runner, RunReport
from rollout_journal.participants.workload.specs import RolloutSpec, fork_specs, registration_of, workload_specs
from rollout_journal.participants.workload.trainer_lag import AwaitingTrainer

log = logging.getLogger(__name__)

EventCallback = Callable[[str], None]  # one line about the worker's membership and rollouts


def submit_workload(config: WorkloadConfig, location: str) -> tuple[WorkloadRegistered, bool]:
    """Record ``config`` in the Kafka namespace at ``location`` for a fleet's workers: its spec and
    every rollout id. Once: submitting the same workload again changes nothing (False; the same
    registration is written again, which copies an older namespace's registrations to its workloads
    topic); a workload of the same name with other settings is refused. Topics are created (and
    checked) here.

    A submit writes under a transactional id of the workload's own (``<namespace>.submit.<name>``),
    opened before it reads what is registered: of two submits of one name at once, the later one's
    opening fences the earlier, whose write then fails (nothing of it lands), so a name is never
    registered twice with different settings; and its records on the snapshot and workloads topics
    commit together."""
    if not is_kafka_url(location):
        raise ConfigurationError(
            f"submit needs a Kafka journal (kafka://host:port/namespace), not {location!r}: "
            "a fleet of workers shares a namespace through a Kafka consumer group; "
            "on one machine, `rollout-journal run` a workload directly"
        )
    if config.failure_policy.group == "redispatch":
        raise ConfigurationError(
            f"workload {config.name!r}: failure_policy.group redispatch needs the single writer of a run "
            "(`rollout-journal run`): a fleet's workers cannot register replacement groups yet; submit it "
            "with group: drop"
        )
    specs = workload_specs(config)
    try:
        return _register(config, specs, location)
    except JournalError as exc:
        if not writer_fenced(exc):
            raise
        raise ConfigurationError(
            f"workload {config.name!r}: another submit of the same name ran at the same time and fenced this "
            f"one, so nothing of this one was written to {location}; run submit again to compare with what "
            "the other registered"
        ) from None


def _register(config: WorkloadConfig, specs: list[RolloutSpec], location: str) -> tuple[WorkloadRegistered, bool]:
    with open_journal(location, mode="exclusive", writer=f"submit.{config.name}") as journal:
        existing = journal.workloads().get(config.name)
        ids = [s.rollout_id for s in specs]
        if existing is not None:
            changed = config.settings_diff(existing.spec_json)  # a re-submit never drops a changed value silently
            if existing.topology == config.topology() and existing.rollout_ids == ids and not changed:
                journal.register_workload(existing).result()  # unchanged: on both topics, whatever a crash left
                return existing, False
            diff = ", ".join(config.topology_diff(existing.spec_json) or changed) or (
                f"{len(existing.rollout_ids)} rollouts -> {len(ids)}"
                if existing.rollout_ids != ids
                else "the topology fingerprint differs"
            )
            raise ConfigurationError(
                f"workload {config.name!r} is already submitted to {location} with other "
                f"settings ({diff}); submit this one under another name"
            )
        registration = WorkloadRegistered(
            config.name, config.model_dump_json(), ids, config.topology(), Header.now_ms(), "submit", True
        )
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
        return sum(
            1
            for r in self.workloads.values()
            for row in r.rollouts.values()
            if row.outcome is not None and row.turns_run_here > 0
        )


@dataclass
class _Workload:
    registration: WorkloadRegistered | None
    config: WorkloadConfig
    runner: Runner
    specs: list[RolloutSpec]
    ids: set[str]
    partitions: set[int] = field(default_factory=set)  # owned partitions whose rollouts it admitted
    stop_after: dict[str, int] = field(default_factory=dict)  # leave these rollouts after that many turns


@dataclass(frozen=True)
class FixedWorkload:
    """A workload a member drives until it is done (``run``/``resume``), instead of following
    the namespace's registrations."""

    config: WorkloadConfig
    registration: WorkloadRegistered | None
    specs: list[RolloutSpec]
    topology_override: str | None = None
    stop_after: dict[str, int] = field(default_factory=dict)


class FleetWorker:
    """One member of a namespace's group; :meth:`run` it until ``stop`` is set (SIGTERM, Ctrl-C),
    or, with ``workloads`` (``run``/``resume``), until they are done."""

    def __init__(
        self,
        location: str,
        *,
        name: str | None = None,
        instance_id: str | None = None,
        role: str = "worker",
        on_turn: ProgressCallback | None = None,
        on_event: EventCallback | None = None,
        poll_s: float = 1.0,
        workloads: Sequence[FixedWorkload] | None = None,
        linger_ms: float = 50.0,
        max_parallel_takes: int = 4,
        metrics_port: int | None = None,
        commit_interval_ms: float = 100.0,
        acknowledgement_bucket_size: int = 256,
        snapshot_block_bytes: int = BLOCK_BYTES,
    ) -> None:
        """``name`` tells the worker apart (``status``, and the ``writer`` of the events it journals;
        default ``<host>-<pid>``). ``instance_id`` makes it a static member of the group: restarted
        under the same id within the session timeout, it gets its partitions back without a
        rebalance, but leaving holds them until the session times out (see docs/design-notes.md).
        ``role``: what ``status`` and a refused ``run`` call it (``worker``, ``run``, ``resume``).
        ``metrics_port``: serve :attr:`metrics` for Prometheus at ``http://<host>:<port>/metrics``
        while it runs (default: counted, not served). ``commit_interval_ms``: the least time between
        two of its commits (each one transaction over every partition it owns), so its transactions
        per second stay under 1000 / interval however many turns it drives.
        ``acknowledgement_bucket_size``, ``snapshot_block_bytes``: the journal's (see :class:`Journal`;
        0 never folds, never writes blocks)."""
        if not is_kafka_url(location):
            raise ConfigurationError(
                f"a worker needs a Kafka journal (kafka://host:port/namespace), not {location!r}; "
                "on one machine, `rollout-journal run` a workload directly"
            )
        from rollout_journal.journal.kafka.group import default_member_name

        self.location = location
        self.name = name or default_member_name()
        self.instance_id = instance_id
        self.role = role
        self.on_turn = on_turn or (lambda rollout_id, turn: None)
        self.on_event = on_event or (lambda line: None)
        self.poll_s = poll_s
        self.fixed = list(workloads) if workloads is not None else None
        self.linger_ms = linger_ms
        self.commit_interval_ms = commit_interval_ms
        self.acknowledgement_bucket_size = acknowledgement_bucket_size
        self.snapshot_block_bytes = snapshot_block_bytes
        self.max_parallel_takes = max_parallel_takes
        self.report = WorkerReport(self.name)
        self.workloads: dict[str, _Workload] = {}
        self.owned: set[int] = set()  # taken, its rollouts admitted
        self._journal: Journal | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: asyncio.Queue[tuple[str, list[int], dict[int, int]]] | None = None
        self._takes: dict[int, asyncio.Task[None]] = {}
        # what ended a take other than a revocation (a newer process took the slot, the journal
        # failed): the take removes itself from ``_takes``, so it is kept here for ``run`` to raise
        self._take_failure: BaseException | None = None
        self._take_slots: asyncio.Semaphore | None = None
        self._signer = HeadSigner.from_environment()
        self._reader: Journal | None = None  # run/resume: how far the other members' partitions got
        self._checked_others = 0.0
        self.metrics = WorkerMetrics()
        self.metrics.watch_owned(lambda: len(self.owned))
        self.awaiting_trainer = AwaitingTrainer()
        self.metrics.watch_awaiting_trainer(self.awaiting_trainer.count, self.awaiting_trainer.oldest_seconds)
        self.metrics_port = metrics_port
        self._counting_members: asyncio.Task[None] | None = None

    # -- the worker's life --------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> WorkerReport:
        """Join the group, drive what it assigns, and leave when ``stop`` is set (or, with fixed
        workloads, once they are done). Raises what stops the worker otherwise (the journal
        failed, a newer process took its slot)."""
        stop_serving = None
        if self.metrics_port is not None:  # first: a port in use ends the start before anything opens
            try:
                stop_serving = self.metrics.serve(self.metrics_port)
            except OSError as exc:
                raise ConfigurationError(f"--metrics-port {self.metrics_port}: cannot listen there: {exc}") from exc
            self.on_event(f"metrics-serving {self.metrics_port}")
        try:
            return await self._run(stop)
        finally:
            if self._counting_members is not None:
                await cancel_and_wait(self._counting_members)
            if stop_serving is not None:
                await asyncio.to_thread(stop_serving)

    async def _run(self, stop: asyncio.Event) -> WorkerReport:
        """(``run`` without the metrics endpoint.)"""
        from rollout_journal.journal.kafka.backend import KafkaBackend
        from rollout_journal.journal.kafka.group import WorkerGroup

        started = time.monotonic()
        self._loop = asyncio.get_running_loop()
        self._events = asyncio.Queue()
        self._take_slots = asyncio.Semaphore(self.max_parallel_takes)
        journal = self._journal = await asyncio.to_thread(
            open_journal,
            self.location,
            mode="member",
            writer=self.name,
            linger_ms=self.linger_ms,
            metrics=self.metrics,
            commit_interval_ms=self.commit_interval_ms,
            acknowledgement_bucket_size=self.acknowledgement_bucket_size,
            snapshot_block_bytes=self.snapshot_block_bytes,
        )
        backend = journal.backend
        if not isinstance(backend, KafkaBackend):  # __init__ checked the location: a Kafka URL opens one
            raise ConfigurationError(f"a worker needs a Kafka journal, not a {backend.kind} one ({self.location})")
        group = WorkerGroup(
            backend.settings,
            self.name,
            on_assigned=self._assigned,
            on_revoked=self._revoked,
            on_lost=self._lost,
            instance_id=self.instance_id,
            role=self.role,
            on_unassigned=self._unassigned,
        )
        backend.join(group.metadata)
        self.metrics.partitions.set(backend.partitions)
        membership: asyncio.Task[None] | None = None
        acks: asyncio.Task[None] | None = None
        feed: WorkloadFeed | None = None
        try:
            if self.fixed is not None:
                self._adopt(self.fixed)
            else:
                feed = journal.follow_workloads()
                self._pick_up(await asyncio.to_thread(feed.poll))  # every known workload before the first partition
            membership = asyncio.create_task(self._membership(), name="membership")
            acks = asyncio.create_task(self._serve_acks(), name="acknowledgements")
            group.start()
            self.on_event(f"worker-joined {self.name} {backend.settings.group_id}")
            while not stop.is_set():
                await self._wait(stop, membership)
                self._raise_failure(group, membership)
                if acks.done():
                    acks.result()  # raises what stopped it
                if feed is None:
                    if await self._fixed_done(backend.partitions):
                        break
                    continue
                new = {
                    name: r for name, r in (await asyncio.to_thread(feed.poll)).items() if name not in self.workloads
                }
                if new:
                    self._pick_up(new)
                    self._post("workloads", [], {})
        finally:
            for workload in self.workloads.values():
                await workload.runner.stop_checkpoints()
            await asyncio.to_thread(group.close)  # the group revokes every owned partition: let go at once
            backend.disown(range(backend.partitions))  # and after a failure (the group stopped first): nothing more
            if acks is not None:
                await cancel_and_wait(acks)
            if membership is not None:
                await self._drain(membership)
            await cancel_and_wait(*self._takes.values())
            for workload in self.workloads.values():
                await workload.runner.drop(list(workload.runner.live), why=None)
                await workload.runner.stop_tasks()  # anything a take launched since the first stop
                await workload.runner.environments.aclose()  # its resource-server connections
                await workload.runner.model.backend.aclose()  # connections and threads of this event loop
            if feed is not None:
                await asyncio.to_thread(feed.close)
            await asyncio.to_thread(journal.close)
            if self._reader is not None:
                await asyncio.to_thread(self._reader.close)
            self.report.seconds = time.monotonic() - started
            for name, workload in self.workloads.items():
                self.report.workloads[name] = workload.runner.report
                self.report.dropped.update(workload.runner.dropped)
            self.on_event(f"worker-left {self.name}")
        return self.report

    async def _wait(self, stop: asyncio.Event, membership: asyncio.Task[None]) -> None:
        """Until the next poll for registrations, a stop, or a failure."""
        waiters = [
            asyncio.ensure_future(stop.wait()),
            membership,
            *(asyncio.ensure_future(w.runner.failed.wait()) for w in self.workloads.values()),
        ]
        try:
            await asyncio.wait(waiters, timeout=self.poll_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await cancel_and_wait(*(waiter for waiter in waiters if waiter is not membership))

    def _raise_failure(self, group: object, membership: asyncio.Task[None]) -> None:
        failure = getattr(group, "failure", None)
        if failure is not None:
            raise failure
        if membership.done():
            membership.result()  # raises what stopped it
        if self._take_failure is not None:
            raise self._take_failure
        for workload in self.workloads.values():
            if workload.runner.failure is not None:
                raise workload.runner.failure

    async def _drain(self, membership: asyncio.Task[None]) -> None:
        """Serve the membership events the leave produced, then stop serving."""
        self._post("stop", [], {})
        await asyncio.wait([membership], timeout=30)
        if not membership.done():
            await cancel_and_wait(membership)

    # -- workloads ---------------------------------------------------------------------------------

    def _runner(self, config: WorkloadConfig, override: str | None = None) -> Runner:
        backend = build_backend(config)

        def durable(rollout_id: str, turn: int) -> None:
            self.metrics.turn_committed()
            self.on_turn(rollout_id, turn)

        def published(rollout_id: str) -> None:  # its training record is on the results stream
            assert self._journal is not None
            partition = self._journal.partition_of(rollout_id)
            if partition in self.owned:  # else let go meanwhile: its next owner counts it
                self.awaiting_trainer.add(rollout_id, partition)
            # Said whether this member drove its last turn or a take found it finished: a final turn
            # whose commit's outcome its writer could not learn (a broker lost mid-commit) was never
            # reported durable, and only the partition's next take learns that it landed.
            self.on_event(f"result-published {rollout_id}")

        return Runner(
            config,
            self._journal,
            backend,
            backend.tokenizer,
            progress=durable,
            on_result=published,
            signer=self._signer,
            topology_override=override,
            fleet=True,
        )

    def _pick_up(self, registrations: dict[str, WorkloadRegistered]) -> None:
        """A runner for each new workload; its rollouts on owned partitions are admitted by the
        membership task (queued, so a take or a release never runs beside it)."""
        for name, registration in sorted(registrations.items()):
            if name in self.workloads:
                continue
            try:
                config = WorkloadConfig.model_validate_json(registration.spec_json).model_copy(
                    update={"journal": self.location, "writer": self.name}
                )
            except ValueError as exc:
                log.error("workload %s: its registration holds no usable spec (%s); skipped", name, exc)
                continue
            specs = workload_specs(config, registration.redispatched)  # with a run's replacement groups
            self.workloads[name] = _Workload(
                registration, config, self._runner(config), specs, {s.rollout_id for s in specs}
            )
            self.on_event(f"workload-picked-up {name} {len(specs)}")

    def _adopt(self, fixed: Sequence[FixedWorkload]) -> None:
        for item in fixed:
            config = item.config.model_copy(update={"writer": self.name})
            self.workloads[config.name] = _Workload(
                item.registration,
                config,
                self._runner(config, item.topology_override),
                list(item.specs),
                {s.rollout_id for s in item.specs},
                stop_after=dict(item.stop_after),
            )

    async def _fixed_done(self, partitions: int) -> bool:
        """Fixed workloads: nothing left to drive here, and (when other members hold partitions)
        every rollout on theirs finished, failed or set aside, as the journal shows."""
        if self._takes or any(w.runner.live for w in self.workloads.values()):
            return False
        others = set(range(partitions)) - self.owned
        if not others:
            return True
        if time.monotonic() - self._checked_others < max(self.poll_s, 2.0):
            return False
        self._checked_others = time.monotonic()
        return await asyncio.to_thread(self._done_elsewhere, others)

    def _done_elsewhere(self, partitions: set[int]) -> bool:
        """(In a thread.) Whether every rollout of the fixed workloads on ``partitions`` (held by
        other members) is finished, failed or damaged, read from the journal."""
        journal = self._journal
        assert journal is not None
        ids = {rid for w in self.workloads.values() for rid in w.ids if journal.partition_of(rid) in partitions}
        if not ids:
            return True
        if self._reader is None:
            self._reader = open_journal(self.location, mode="read", writer=self.name)
        plan = load_rollouts(self._reader, partitions=partitions, only=ids)
        for rid in ids - plan.acknowledged.keys():
            history = plan.rollouts.get(rid)
            if history is None:
                return False  # not started yet
            try:
                state = restore_state(history)
            except StateFoldError:
                continue  # damaged: its owner set it aside
            if not state.finished and state.failure is None:
                return False
        return True

    # -- the trainer's acknowledgements ------------------------------------------------------------

    async def _serve_acks(self) -> None:
        """Apply the trainer's acknowledgements of the partitions this member owns as they come
        (``journal.takeover.serve_acknowledgements``); the trainer's lag counts each off once durable."""
        journal = self._journal
        assert journal is not None
        await serve_acknowledgements(
            journal,
            lambda: self.owned,
            on_applied=lambda rollout_id, _: self.on_event(f"acknowledged {rollout_id}"),
            on_durable=self.awaiting_trainer.acknowledged,
        )

    # -- membership (callbacks on the group's polling thread: they return at once) ---------------

    def _post(self, kind: str, partitions: list[int], tokens: dict[int, int]) -> bool:
        loop, events = self._loop, self._events
        if loop is None or events is None:  # not running (the group starts after both are set)
            return False
        try:
            loop.call_soon_threadsafe(events.put_nowait, (kind, partitions, tokens))
            return True
        except RuntimeError:  # the loop is gone: nothing of ours runs any more
            return False

    def _assigned(self, partitions: list[int]) -> None:
        journal = self._journal
        assert journal is not None
        self._post("assigned", partitions, journal.backend.own(partitions))  # type: ignore[attr-defined]
        self.metrics.rebalanced("assigned")

    def _revoked(self, partitions: list[int]) -> None:
        journal = self._journal
        assert journal is not None
        journal.backend.disown(partitions)  # type: ignore[attr-defined]  # from now on their appends are refused
        self._post("revoked", partitions, {})
        self.metrics.rebalanced("revoked")

    def _unassigned(self) -> None:
        self._post("unassigned", [], {})

    def _lost(self, partitions: list[int]) -> None:
        journal = self._journal
        assert journal is not None
        journal.backend.disown(partitions)  # type: ignore[attr-defined]
        self._post("lost", partitions, {})
        self.metrics.rebalanced("lost")

    async def _membership(self) -> None:
        """Serve membership events in order. A take runs as a task of its own (side by side with
        other takes, never in the way of a revocation); a revocation cancels the partition's take
        and drops its rollouts at once."""
        assert self._events is not None
        while True:
            kind, partitions, tokens = await self._events.get()
            if kind == "assigned":
                self.on_event(f"partitions-assigned {_numbers(partitions)}")
                for partition in partitions:
                    previous = self._takes.pop(partition, None)
                    if previous is not None:
                        previous.cancel()
                    self._takes[partition] = asyncio.create_task(
                        self._take(partition, tokens[partition]), name=f"take p{partition}"
                    )
            elif kind in ("revoked", "lost"):
                await self._let_go(partitions, lost=kind == "lost")
            elif kind == "workloads":
                await self._admit_new()
            elif kind == "unassigned" and (self._counting_members is None or self._counting_members.done()):
                self._counting_members = asyncio.create_task(self._warn_if_outnumbered(), name="count members")
            elif kind == "stop":
                return

    async def _take(self, partition: int, token: int) -> None:
        """Learn the partition's commit point, restore its rollouts, and drive them, while the group
        still assigns it under ``token``."""
        journal = self._journal
        assert journal is not None and self._take_slots is not None
        try:
            async with self._take_slots:
                started = time.monotonic()
                chosen = list(self.workloads.values())
                ids = {rid for w in chosen for rid in w.ids if journal.partition_of(rid) == partition}
                try:
                    plan = await asyncio.to_thread(self._take_and_read, partition, token, ids)
                except PartitionFencedError:
                    return  # revoked meanwhile: the revocation drops what there is
                read_s = time.monotonic() - started
                if journal.backend.owner_token(partition) != token:
                    return
                self.owned.add(partition)
                await self._admit_partition(partition, chosen, plan)
                await self._admit_late(partition)  # workloads picked up while this take read
                # Where a takeover's time goes: the commit point and reading, then restoring and fencing.
                self.on_event(f"takeover-seconds {partition} {read_s:.3f} {time.monotonic() - started - read_s:.3f}")
                self.metrics.restored(time.monotonic() - started)
                self.report.partitions_taken += 1
        except Exception as exc:  # kept, not raised: the task ends, run() raises it at its next look
            if self._take_failure is None:
                self._take_failure = exc
        finally:
            if self._takes.get(partition) is asyncio.current_task():
                del self._takes[partition]

    async def _warn_if_outnumbered(self) -> None:
        """A rebalance left this member nothing: if the group has more members than the namespace has
        partitions (not a joiner's first cooperative round), say so: the surplus members sit idle,
        and the partition count is fixed at the namespace's creation."""
        from rollout_journal.journal.kafka.group import describe_group

        journal = self._journal
        assert journal is not None
        settings = journal.backend.settings  # type: ignore[attr-defined]
        try:
            state = await asyncio.to_thread(describe_group, settings, budget_s=settings.operation_timeout_ms / 1000)
        except JournalError as exc:  # a warning only: never the worker's end
            log.info("worker %s: could not count the group's members: %s", self.name, exc)
            return
        members, partitions = len(state.members), journal.backend.partitions
        self.metrics.members.set(members)
        if members > partitions and not self.owned:
            log.warning(
                "workers (%d) outnumber partitions (%d) of namespace %s: %d of them own nothing and sit idle; "
                "a namespace's partition count is fixed at its creation (see docs/scaling.md)",
                members,
                partitions,
                settings.namespace,
                members - partitions,
            )

    async def _admit_new(self) -> None:
        """Workloads picked up after their partitions were taken: admit their rollouts there now."""
        for partition in sorted(self.owned):
            await self._admit_late(partition)

    async def _admit_late(self, partition: int) -> None:
        """Admit on ``partition`` (taken) the rollouts of every workload not admitted there yet: one
        picked up after the take, or while the take read (the take admits the workloads it started
        with; a pick-up meanwhile found the partition not yet owned). Each workload is claimed on
        the partition before its read, so the take and a pick-up never both admit it; a partition
        revoked, or taken anew, during the read admits nothing here (its new take does)."""
        journal = self._journal
        assert journal is not None
        for workload in list(self.workloads.values()):
            if partition not in self.owned or partition in workload.partitions:
                continue
            token = journal.backend.owner_token(partition)
            if token is None:  # revoked already (its revocation waits in the queue): nothing to admit
                return
            workload.partitions.add(partition)  # claimed: a revocation clears it again
            ids = {rid for rid in workload.ids if journal.partition_of(rid) == partition}
            try:  # retried as the take's own read is: a held-back read is waited out, not the worker's end
                plan = await asyncio.to_thread(
                    read_taken, journal, partition, token, ids, on_held_back=self._held_back(partition)
                )
            except PartitionFencedError:
                return  # revoked or taken anew meanwhile: the revocation clears the claim
            if partition in self.owned and journal.backend.owner_token(partition) == token:
                await self._admit_partition(partition, [workload], plan)

    async def _admit_partition(self, partition: int, chosen: list[_Workload], plan: RestorePlan) -> None:
        """Admit what ``chosen`` workloads have on ``partition`` from ``plan`` and drive it."""
        journal = self._journal
        assert journal is not None
        for workload in chosen:  # every one claimed before the first await: see _admit_late
            workload.partitions.add(partition)
        for workload in chosen:
            specs = [s for s in workload.specs if journal.partition_of(s.rollout_id) == partition]
            report = workload.runner.report  # what restore read and stepped over, as the file journal's run reports
            report.read_errors.extend(e for e in map(str, plan.report.errors) if e not in report.read_errors)
            report.events_replayed += plan.events_replayed
            report.restore.read_s += plan.seconds
            admitted = await workload.runner.admit(specs, plan, workload.registration) if specs else []
            if partition not in self.owned:  # let go while admitting: the revocation dropped them
                await workload.runner.drop([live.spec.rollout_id for live in admitted], why=None)
                return
            for live in admitted:
                workload.runner.launch(live, workload.stop_after.get(live.spec.rollout_id))
            if specs:
                self.on_event(f"rollouts-admitted {workload.config.name} p{partition} {len(admitted)}")

    def _take_and_read(self, partition: int, token: int, ids: set[str]) -> RestorePlan:
        """(In a thread.) Learn where the partition's previous owner committed to, then read its
        rollouts (``journal.takeover``: every member's take)."""
        journal = self._journal
        assert journal is not None
        return take_and_restore(journal, partition, token, ids, on_held_back=self._held_back(partition))

    def _held_back(self, partition: int) -> Callable[[UnstableReadError | ClusterUnreachableError], None]:
        def held_back(exc: UnstableReadError | ClusterUnreachableError) -> None:
            log.error("worker %s: %s; retrying", self.name, exc)
            topic = exc.topic if isinstance(exc, UnstableReadError) else "-"  # unreachable: no one topic
            self.on_event(f"restore-held-back {topic} {partition}")

        return held_back

    async def _let_go(self, partitions: list[int], *, lost: bool) -> None:
        """Revoked or lost: their appends are refused already (the callback disowned them); cancel their
        takes and drop their rollouts at once, mid-turn: the next owner continues from the last
        committed turn."""
        journal = self._journal
        assert journal is not None
        for partition in partitions:
            take = self._takes.pop(partition, None)
            if take is not None:
                take.cancel()
        mine = [p for p in partitions if p in self.owned]
        self.owned.difference_update(partitions)
        self.awaiting_trainer.let_go(partitions)  # with ``owned``: nothing of these is counted again
        dropped = 0
        why = "its partition was lost" if lost else "its partition was revoked (handed on mid-turn)"
        for workload in self.workloads.values():
            workload.partitions.difference_update(partitions)
            rollouts = [rid for rid in workload.runner.live if journal.partition_of(rid) in partitions]
            await workload.runner.drop(rollouts, why=why if lost else None)
            dropped += len(rollouts)
        for partition in partitions:
            await asyncio.to_thread(journal.release_partition, partition)
        if lost:
            self.report.partitions_lost += len(mine)
        else:
            self.report.partitions_released += len(mine)
        self.on_event(f"partitions-{'lost' if lost else 'revoked'} {_numbers(partitions)}")
        self.on_event(f"rollouts-dropped {dropped}")


# -- run and resume as members --------------------------------------------------------------------


def refuse_if_held(location: str, role: str, writer: str) -> None:
    """Refuse (``WriterTakenError``, naming who) a ``run``/``resume`` on a namespace that a fleet's
    workers, or a ``run``/``resume`` of another ``--writer``, hold. A static member that just left
    (a finished ``run``) stays listed until its session times out: waited for that long."""
    from rollout_journal.journal.kafka.config import KafkaSettings
    from rollout_journal.journal.kafka.group import WORKER, describe_group

    settings = KafkaSettings.from_url(location)
    deadline = Deadline(settings.group_session_timeout_ms / 1000 + 2.0)
    while True:
        # The cluster's whole budget, as the journal's own operations get: one request's timeout was
        # once the budget, and a loaded broker's slow answer ended a run (exit 7) before it began.
        members = describe_group(settings).members
        workers = [m for m in members if m.role == WORKER]
        others = [m for m in members if m.role != WORKER and m.name != writer]
        if workers:
            names = ", ".join(m.name for m in workers)
            raise WriterTakenError(
                f"namespace {settings.namespace} is run by a fleet ({len(workers)} worker(s): {names}); "
                f"submit the workload instead (rollout-journal submit ... --journal {location})"
            )
        if not others:
            return
        if deadline.passed():
            who = ", ".join(str(m) for m in others)
            raise WriterTakenError(
                f"namespace {settings.namespace} is held by {who}; stop it, or {role} with "
                f"--writer {others[0].name} to take over"
            )
        deadline.sleep(0.5)


def prepare_workload(
    config: WorkloadConfig, *, resume: bool, topology_override: str | None = None
) -> tuple[WorkloadRegistered | None, list[RolloutSpec]]:
    """Register ``config`` in its Kafka namespace as ``run`` does (refused when the namespace already
    holds it: use resume), or check it for ``resume``; the registration and every spec to drive
    (the workload's and, resuming, its forks')."""
    with open_journal(config.journal, mode="plain", writer=config.writer) as journal:
        index = journal.snapshots()
        existing = index.workloads.get(config.name)
        # resuming: with an earlier run's replacement groups, which the registration keeps naming
        redispatched = dict(existing.redispatched) if resume and existing is not None else {}
        specs = workload_specs(config, redispatched)
        ids = [s.rollout_id for s in specs]
        if not resume and (existing is not None or set(ids) & (index.snapshots.keys() | index.fences.keys())):
            raise ConfigurationError(
                f"journal {config.journal} already holds workload {config.name!r}; "
                "use `rollout-journal resume` to continue it, or point --journal at a fresh location"
            )
        if resume:
            own = set(ids)
            forks = fork_specs(specs, index.workloads)
            if forks and existing is None and not own & (index.snapshots.keys() | index.fences.keys()):
                specs = []  # a journal of forks only: the workload's own rollouts live elsewhere
            specs += forks
        stale = existing is not None and existing.topology != config.topology() and topology_override is not None
        if existing is not None and existing.rollout_ids == ids and not stale:
            return existing, specs
        registration = registration_of(config, ids, existing, redispatched)
        journal.register_workload(registration).result()
        return registration, specs


def run_as_member(
    config: WorkloadConfig,
    *,
    resume: bool,
    on_turn: ProgressCallback | None = None,
    stop_after: dict[str, int] | None = None,
    topology_override: str | None = None,
) -> RunReport:
    """``run``/``resume`` of a workload on a Kafka namespace: one more member of its group, a static
    one named for ``config.writer``, until every rollout of the workload is done (see the module
    docstring). Refused up front beside a fleet or another writer (``WriterTakenError``)."""
    role = "resume" if resume else "run"
    refuse_if_held(config.journal, role, config.writer)
    registration, specs = prepare_workload(config, resume=resume, topology_override=topology_override)
    from rollout_journal.journal.kafka.config import KafkaSettings

    namespace = KafkaSettings.from_url(config.journal).namespace
    worker = FleetWorker(
        config.journal,
        name=config.writer,
        instance_id=f"{namespace}.{config.writer}",
        role=role,
        on_turn=on_turn,
        poll_s=0.2,
        linger_ms=config.journal_linger_ms,
        snapshot_block_bytes=config.snapshot_block_bytes,
        workloads=[FixedWorkload(config, registration, specs, topology_override, dict(stop_after or {}))],
    )
    started = time.perf_counter()

    async def until_done() -> WorkerReport:
        return await worker.run(asyncio.Event())

    report = asyncio.run(until_done()).workloads[config.name]
    report.run_seconds = time.perf_counter() - started
    return report


def _numbers(partitions: list[int]) -> str:
    return ",".join(str(p) for p in sorted(partitions)) or "-"
