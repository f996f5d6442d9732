"""Who may write a rollout: the one owner of its partition, whichever gateway or worker serves it.

A session writes a rollout only while ``route(rollout_id)`` is :class:`Local`. Everything else is
the ownership's business:

- :class:`SingleWriter`: this process writes the whole namespace. A file journal enforces it
  with its writer lock (a second process cannot open it for writing); a Kafka namespace opened
  as one writer slot enforces it with Kafka's producer fencing: a second process opening the
  same slot (``transactional.id = <ns>.<writer>``) fences this one, whose next commit fails
  (``ProducerFencedError``) so it stops writing, cleanly, and its in-flight calls are refused.
- :class:`GroupOwnership`: a member of the namespace's consumer group, the very membership a
  fleet's workers and ``run``/``resume`` hold (``journal.kafka.group``): the group assigns it
  partitions, it writes only those (a KIP-447 producer: Kafka refuses a zombie's commit), takes
  each the way every member does (``journal.takeover``: the previous owner's commit point, then
  its rollouts restored from the journal) and lets a revoked or lost one go at once, closing its
  sessions there without another write. Where another member's partition is served comes from
  the group's own description (the address a gateway member carries in its client id).

A gateway answers a ``Remote`` rollout by forwarding it once to the owner (or 421 with its
address) and a ``Moving`` one with 503 and ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Union

from rollout_journal.journal.errors import ConfigurationError, JournalError, PartitionRevokedError
from rollout_journal.journal.journal import Journal
from rollout_journal.journal.restore import RestorePlan
from rollout_journal.participants.cancelling import cancel_and_wait

if TYPE_CHECKING:
    from rollout_journal.journal.kafka.group import GroupDescriber, GroupMember, WorkerGroup

log = logging.getLogger(__name__)

__all__ = ["GroupOwnership", "Local", "Moving", "Remote", "RolloutOwnership", "Route", "SingleWriter", "Unrouted"]


@dataclass(frozen=True)
class Local:
    """This process owns the rollout's partition."""

    partition: int


@dataclass(frozen=True)
class Remote:
    """Another member owns it; ``base_url`` is its advertised address, if known."""

    partition: int
    base_url: str | None
    member: str = ""


@dataclass(frozen=True)
class Moving:
    """The partition is being handed over; ask again after ``retry_after_s``."""

    partition: int
    retry_after_s: float = 1.0


Route = Union[Local, Remote, Moving]


LostCallback = Callable[[set[int]], None]
TakenCallback = Callable[[int, RestorePlan], None]


class RolloutOwnership(Protocol):
    """Where a rollout is written. ``on_lost`` callbacks get the partitions this process lost
    (its sessions there are closed without another write); ``on_taken`` ones a partition it took
    and what the journal holds there (``whole_namespace``: False, so the session factory reads
    only those); ``stopped`` says why it may no longer write at all (None while it may)."""

    whole_namespace: bool  # True: this process writes every partition, read once at start

    def route(self, rollout_id: str) -> Route: ...

    def on_lost(self, callback: LostCallback) -> None: ...

    def on_taken(self, callback: TakenCallback) -> None: ...

    def start(self) -> None: ...

    async def aclose(self) -> None: ...

    @property
    def stopped(self) -> str | None: ...

    def describe(self) -> dict[str, object]: ...


class SingleWriter:
    """This process is the only writer of the journal's namespace (see the module docstring)."""

    whole_namespace = True

    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self._lost: list[LostCallback] = []
        self._stopped: str | None = None

    def route(self, rollout_id: str) -> Route:
        return Local(self.journal.partition_of(rollout_id))

    def on_lost(self, callback: LostCallback) -> None:
        self._lost.append(callback)

    def on_taken(self, callback: TakenCallback) -> None:
        """Never called: the whole namespace is this process's from the start."""

    def start(self) -> None:
        """Nothing to join: the slot's producer fences whoever held it when the journal opened."""

    async def aclose(self) -> None:
        """Nothing to leave."""

    def describe(self) -> dict[str, object]:
        return {"ownership": "single", "partitions": self.journal.backend.partitions}

    @property
    def stopped(self) -> str | None:
        return self._stopped

    def fenced(self, why: str) -> None:
        """Another process took the namespace over (its producer fenced ours): every partition is lost."""
        if self._stopped is None:
            self._stopped = why
            every = set(range(self.journal.backend.partitions))
            for callback in self._lost:
                callback(every)


class Unrouted:
    """The caller decides which rollouts this process writes (the project's runner: a fleet's worker
    by the partitions its fleet gave it, a single process by its slot's producer), so every rollout
    routes here; its sessions are adopted, never opened (see ``SessionFactory.adopt``)."""

    whole_namespace = True

    def route(self, rollout_id: str) -> Route:
        return Local(-1)

    def on_lost(self, callback: LostCallback) -> None:
        """Never called: the caller lets its rollouts go itself."""

    def on_taken(self, callback: TakenCallback) -> None:
        """Never called: the caller takes its rollouts itself."""

    def start(self) -> None:
        """Nothing to join."""

    async def aclose(self) -> None:
        """Nothing to leave."""

    def describe(self) -> dict[str, object]:
        return {"ownership": "the caller's"}

    @property
    def stopped(self) -> str | None:
        return None


class GroupOwnership:
    """This process as one member of the namespace's consumer group (see the module docstring).

    ``journal`` is a member's (``open_journal(url, mode="member", writer=name)``); ``address`` is
    where other members send this one's requests (a gateway's base URL). :meth:`start` joins the
    group from within the event loop the sessions live in: takes and losses are applied there,
    one at a time, while the group's callbacks (on its own thread) only stop appends at once."""

    whole_namespace = False

    def __init__(
        self, journal: Journal, *, name: str, address: str | None, role: str = "gateway", retry_after_s: float = 1.0
    ) -> None:
        if not journal.backend.writes_per_partition:
            raise ConfigurationError(
                f"ownership by consumer group needs a Kafka journal opened as a group member, not a "
                f"{journal.backend.kind} one: give a kafka://host:port/namespace journal, or use single ownership"
            )
        self.journal = journal
        self.name, self.address, self.role = name, address, role
        self.retry_after_s = retry_after_s
        self._ready: dict[int, int] = {}  # partition -> the token it was taken and restored under
        self._lock = threading.Lock()
        self._lost: list[LostCallback] = []
        self._taken: list[TakenCallback] = []
        self._failure: str | None = None
        self._owners: dict[int, GroupMember] = {}  # the group's assignment, as last described
        self._group: WorkerGroup | None = None
        self._describer: GroupDescriber | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: asyncio.Queue[tuple[str, list[int], dict[int, int]]] = asyncio.Queue()
        self._takes: dict[int, asyncio.Task[None]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._look = asyncio.Event()  # someone asked for a partition held elsewhere: describe the group again

    # -- what the session API asks ---------------------------------------------------------------
    def route(self, rollout_id: str) -> Route:
        partition = self.journal.partition_of(rollout_id)
        current = self.journal.backend.owner_token(partition)
        with self._lock:
            taken = self._ready.get(partition)
        if current is not None and taken == current:
            return Local(partition)
        if current is not None:  # assigned here, still being taken
            return Moving(partition, self.retry_after_s)
        self._look.set()
        owner = self._owners.get(partition)
        if owner is None or (owner.name, owner.address) == (self.name, self.address):
            return Moving(partition, self.retry_after_s)  # nobody yet, or it just left here
        return Remote(partition, owner.address, owner.name)

    def on_lost(self, callback: LostCallback) -> None:
        self._lost.append(callback)

    def on_taken(self, callback: TakenCallback) -> None:
        self._taken.append(callback)

    @property
    def stopped(self) -> str | None:
        group = self._group
        if self._failure is None and group is not None and group.failure is not None:
            return f"the consumer group stopped this member: {group.failure}"
        return self._failure

    @property
    def ready(self) -> set[int]:
        """The partitions taken and restored here: their rollouts are written here."""
        with self._lock:
            return {p for p, token in self._ready.items() if self.journal.backend.owner_token(p) == token}

    def describe(self) -> dict[str, object]:
        owners = {p: {"member": m.name, "address": m.address} for p, m in sorted(self._owners.items())}
        return {"ownership": "group", "member": self.name, "ready": sorted(self.ready), "owners": owners}

    # -- the membership's life -----------------------------------------------------------------
    def start(self) -> None:
        """Join the group (from within the running event loop the sessions use)."""
        from rollout_journal.journal.kafka.group import GroupDescriber, WorkerGroup

        self._loop = asyncio.get_running_loop()
        backend = self.journal.backend
        settings = backend.settings  # type: ignore[attr-defined]  # a member's backend is Kafka's
        self._group = WorkerGroup(
            settings,
            self.name,
            on_assigned=self._assigned,
            on_revoked=self._revoked,
            on_lost=self._lost_partitions,
            role=self.role,
            address=self.address,
        )
        backend.join(self._group.metadata)  # type: ignore[attr-defined]
        self._describer = GroupDescriber(settings)
        self._tasks = [
            asyncio.create_task(self._membership(), name="group membership"),
            asyncio.create_task(self._watch_owners(), name="group owners"),
            asyncio.create_task(self._serve_acks(), name="acknowledgements"),
        ]
        self._group.start()
        log.info("%s %s joined group %s (serving at %s)", self.role, self.name, settings.group_id, self.address)

    async def aclose(self) -> None:
        """Leave the group: every partition is handed on (its sessions closed without another write)."""
        if self._group is not None:
            await asyncio.to_thread(self._group.close)  # the revocations are queued for the membership task
        self.journal.backend.disown(range(self.journal.backend.partitions))  # type: ignore[attr-defined]
        self._events.put_nowait(("stop", [], {}))
        if self._tasks:
            await asyncio.wait([self._tasks[0]], timeout=30)
        await cancel_and_wait(*self._tasks, *self._takes.values())
        if self._describer is not None:
            await asyncio.to_thread(self._describer.close)

    # -- the group's callbacks (its polling thread: they return at once) -------------------------
    def _post(self, kind: str, partitions: list[int], tokens: dict[int, int]) -> None:
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(self._events.put_nowait, (kind, partitions, tokens))
        except RuntimeError:  # the loop is gone: nothing of ours runs any more
            pass

    def _assigned(self, partitions: list[int]) -> None:
        self._post("assigned", partitions, self.journal.backend.own(partitions))  # type: ignore[attr-defined]

    def _revoked(self, partitions: list[int]) -> None:
        self.journal.backend.disown(partitions)  # type: ignore[attr-defined]  # their appends are refused now
        self._post("revoked", partitions, {})

    def _lost_partitions(self, partitions: list[int]) -> None:
        self.journal.backend.disown(partitions)  # type: ignore[attr-defined]
        self._post("lost", partitions, {})

    # -- on the event loop ------------------------------------------------------------------------
    async def _membership(self) -> None:
        """Serve membership events in order: a take runs as a task of its own; a revocation or a
        loss cancels the partition's take and closes its sessions at once."""
        while True:
            kind, partitions, tokens = await self._events.get()
            if kind == "stop":
                return
            if kind == "assigned":
                for partition in partitions:
                    previous = self._takes.pop(partition, None)
                    if previous is not None:
                        previous.cancel()
                    self._takes[partition] = asyncio.create_task(
                        self._take(partition, tokens[partition]), name=f"take p{partition}"
                    )
            else:
                await self._let_go(partitions, lost=kind == "lost")
            self._look.set()

    def _stop_writing(self, why: str) -> None:
        """This member may write nothing more (``why``): it leaves the group too, so its partitions
        go to the other members instead of staying assigned to one that refuses their rollouts (it
        then forwards them, as any member does; ``/health`` says ``ok: false`` and why)."""
        if self._failure is not None:
            return
        self._failure = why
        group = self._group
        log.error("%s %s: %s; it writes nothing more and leaves the group", self.role, self.name, why)
        if group is not None:
            self._tasks.append(asyncio.create_task(asyncio.to_thread(group.close), name="leave the group"))

    async def _serve_acks(self) -> None:
        """The trainer's acknowledgements of the partitions taken here, applied as they come (as a
        fleet worker does), not only at the next take: an acknowledged rollout's snapshot is
        tombstoned while this member lives. A failure there stops this member's writes."""
        from rollout_journal.journal.takeover import serve_acknowledgements

        try:
            await serve_acknowledgements(self.journal, lambda: self.ready)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._stop_writing(f"applying the trainer's acknowledgements failed: {exc}")

    async def _take(self, partition: int, token: int) -> None:
        from rollout_journal.journal.takeover import take_and_restore

        def held_back(exc: JournalError) -> None:
            log.error("%s %s: taking partition %s: %s; retrying", self.role, self.name, partition, exc)

        try:
            plan = await asyncio.to_thread(take_and_restore, self.journal, partition, token, on_held_back=held_back)
            if self.journal.backend.owner_token(partition) != token:
                return  # revoked meanwhile: the revocation let it go
            for callback in self._taken:
                callback(partition, plan)
            with self._lock:
                self._ready[partition] = token
            log.info(
                "%s %s: took partition %s (%d rollouts restored)", self.role, self.name, partition, len(plan.rollouts)
            )
        except PartitionRevokedError:
            return
        except Exception as exc:  # the journal failed under the take: this member writes nothing more
            self._stop_writing(f"taking partition {partition} failed: {exc}")
        finally:
            if self._takes.get(partition) is asyncio.current_task():
                del self._takes[partition]

    async def _let_go(self, partitions: list[int], *, lost: bool) -> None:
        for partition in partitions:
            take = self._takes.pop(partition, None)
            if take is not None:
                take.cancel()
        with self._lock:
            for partition in partitions:
                self._ready.pop(partition, None)
        for callback in self._lost:
            callback(set(partitions))  # closes their sessions: nothing more is written of them
        for partition in partitions:
            await asyncio.to_thread(self.journal.release_partition, partition)
        how = "lost (this member missed its group session)" if lost else "revoked"
        log.info("%s %s: partitions %s %s; their sessions closed", self.role, self.name, sorted(partitions), how)

    async def _watch_owners(self) -> None:
        """Keep the group's assignment at hand: described again after each change here and whenever
        a request asked for a partition held elsewhere (at most twice a second), else every 30 s."""
        describer = self._describer
        assert describer is not None
        while True:
            try:  # asyncio.timeout: 3.11's wait_for can swallow the cancellation that stops this loop
                async with asyncio.timeout(30):
                    await self._look.wait()
            except TimeoutError:
                pass
            self._look.clear()
            try:
                state = await asyncio.to_thread(describer.describe)
                self._owners = state.assignment()
            except JournalError as exc:
                log.warning("%s %s: cannot describe the group: %s", self.role, self.name, exc)
            await asyncio.sleep(0.5)
