"""Taking a partition the namespace's group assigned: what every member does before it writes there.

One code path for every member (a fleet's ``worker``, ``run``/``resume``, a gateway): learn where
the previous owner's commits end (the group's committed offsets, waiting while its last transaction
is undecided), read the partition's rollouts to that point, and apply the trainer's
acknowledgements that waited for an owner, so an acknowledged rollout is never offered again. The
take is checked against the assignment it was made for (``token``, the backend's ``own()``): one
revoked meanwhile raises ``PartitionRevokedError`` before anything is admitted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import Future
from dataclasses import dataclass

from rollout_journal.journal.backend import StoredRecord
from rollout_journal.journal.deadlines import Deadline
from rollout_journal.journal.errors import ClusterUnreachableError, PartitionFencedError, UnstableReadError
from rollout_journal.journal.journal import AppendReceipt, Journal
from rollout_journal.journal.restore import RestorePlan, load_rollouts

__all__ = ["AckPositions", "apply_waiting_acks", "read_taken", "serve_acknowledgements", "take_and_restore"]

log = logging.getLogger(__name__)

HeldBack = Callable[[UnstableReadError | ClusterUnreachableError], None]
AckCallback = Callable[[str, int], None]  # (rollout id, partition)


def take_and_restore(
    journal: Journal,
    partition: int,
    token: int,
    only: Collection[str] | None = None,
    *,
    on_held_back: HeldBack | None = None,
    retry_s: float = 1.0,
) -> RestorePlan:
    """(Blocking.) Take ``partition`` under ``token`` and read its rollouts (of ``only``, if given).
    A transaction that holds the read back (an older zombie's, until the broker aborts it; a
    producer of an older version's) is waited out, loudly (``on_held_back``), and the read retried,
    up to twice the cluster's unavailability budget; an unreachable partition is retried for as
    long as the group assigns it here (a broker's loss; a revocation ends the take)."""

    def take() -> RestorePlan:
        journal.take_partition(partition, token)  # idempotent: the commit points, again
        plan = load_rollouts(journal, partitions={partition}, only=only)
        apply_waiting_acks(journal, partition, plan)
        if plan.orphans:  # left by a writer that did not know them: nobody else ever drops them
            journal.discard(plan.orphans).result()
        return plan

    return _while_owned(journal, partition, token, take, on_held_back, retry_s)


def read_taken(
    journal: Journal,
    partition: int,
    token: int,
    only: Collection[str] | None = None,
    *,
    on_held_back: HeldBack | None = None,
    retry_s: float = 1.0,
) -> RestorePlan:
    """(Blocking.) Read the rollouts (of ``only``) of ``partition``, taken already under ``token``
    (a workload learned of after the take), retried as :func:`take_and_restore` retries its read."""
    return _while_owned(
        journal,
        partition,
        token,
        lambda: load_rollouts(journal, partitions={partition}, only=only),
        on_held_back,
        retry_s,
    )


def _while_owned(
    journal: Journal,
    partition: int,
    token: int,
    read: Callable[[], RestorePlan],
    on_held_back: HeldBack | None,
    retry_s: float,
) -> RestorePlan:
    settings = getattr(journal.backend, "settings", None)
    budget_ms = getattr(settings, "cluster_unavailable_timeout_ms", 60_000)
    give_up = Deadline(2 * budget_ms / 1000)
    while True:
        if journal.backend.owner_token(partition) != token:
            raise journal._revoked(partition)
        try:
            return read()
        except (UnstableReadError, ClusterUnreachableError) as exc:
            if isinstance(exc, UnstableReadError) and give_up.passed():
                raise
            if on_held_back is not None:
                on_held_back(exc)
            time.sleep(retry_s)  # not give_up.sleep: an unreachable partition is retried past it


def apply_waiting_acks(journal: Journal, partition: int, plan: RestorePlan) -> None:
    """(Blocking, at a take.) Apply the acknowledgements that waited for an owner (the trainer
    acknowledged while nobody, or a crashed owner, held the partition), before anything is
    admitted: an acknowledged rollout leaves ``plan`` for ``plan.acknowledged``."""
    backend = journal.backend
    read_acks = getattr(backend, "read_acks", None)
    if read_acks is None:  # a backend without the trainer's topic: acknowledgements are journaled directly
        return
    records, end = read_acks(partition)
    pending = []
    for stored in records:
        history = plan.rollouts.get(stored.key)
        if history is not None:  # no restore follows an acknowledged rollout: its summary goes on whole
            journal.note_restored(history)
        applied = journal.apply_acknowledgement(stored)
        if applied is None:
            continue
        pending.append(applied)
        history = plan.rollouts.pop(stored.key, None)
        fence = history.fence if history is not None else None
        if fence is not None:
            plan.acknowledged[stored.key] = dataclasses.replace(fence, acknowledged_epoch=fence.epoch)
    for future in pending:
        future.result()  # durable before the position past them is committed
    if records:
        backend.acknowledgement_applied(partition, end)  # type: ignore[attr-defined]


class AckPositions:
    """Where a member's applied acknowledgements end, per partition, in order: the position the
    member's next transaction commits (``acknowledgement_applied``) never passes an acknowledgement
    that is not durable yet, so one whose append failed is not skipped by a later one that
    succeeded; it is applied again, and a crash meanwhile leaves it to the next owner. A partition
    followed anew starts a new round: what an append of an earlier round reports is ignored.
    (Appends resolve on the journal's committer thread; the loop begins them on its own.)"""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._round: dict[int, int] = {}  # partition -> how many times it was followed anew
        self._open: dict[int, set[int]] = {}  # partition -> offsets applied, not durable yet
        self._past: dict[int, int] = {}  # partition -> the offset after the newest one settled

    def restart(self, partitions: Collection[int]) -> None:
        """Partitions followed anew (taken, or gone): their acknowledgements start again from the
        committed position."""
        with self._lock:
            for partition in partitions:
                self._round[partition] = self._round.get(partition, 0) + 1
                self._open.pop(partition, None)
                self._past.pop(partition, None)

    def round_of(self, partition: int) -> int:
        with self._lock:
            return self._round.get(partition, 0)

    def begin(self, partition: int, offset: int) -> None:
        """An acknowledgement (of the partition's current round) is being applied."""
        with self._lock:
            self._open.setdefault(partition, set()).add(offset)

    def durable(self, partition: int, offset: int, round_: int) -> int | None:
        """The acknowledgement at ``offset`` is durable (or needed nothing): the position the
        partition's acknowledgements may now be committed at; None for an earlier round's."""
        with self._lock:
            if round_ != self._round.get(partition, 0):
                return None
            waiting = self._open.setdefault(partition, set())
            waiting.discard(offset)
            self._past[partition] = max(self._past.get(partition, 0), offset + 1)
            return min(waiting) if waiting else self._past[partition]


ACK_ATTEMPTS = 6  # applications of one acknowledgement before its position is left to the next owner
ACK_RETRY_MAX_S = 30.0


@dataclass(frozen=True)
class _AckRetry:
    """One acknowledgement record being applied: its ``attempt`` (1 first), the partition's round
    it belongs to, and when it may be applied again after a failure."""

    stored: StoredRecord
    round_: int
    attempt: int = 1
    due: float = 0.0

    def failed(self, why: BaseException | None, idle_s: float) -> _AckRetry | None:
        """The next attempt, ``idle_s`` doubling per failure (capped); None after the last one."""
        where = f"acknowledgement of {self.stored.key} ({self.stored.location})"
        if self.attempt >= ACK_ATTEMPTS:
            log.error(
                "%s did not commit in %d attempts (last: %s); its position is held, so the partition's "
                "next owner applies it again",
                where,
                self.attempt,
                why,
            )
            return None
        delay = min(ACK_RETRY_MAX_S, idle_s * 2 ** (self.attempt - 1))
        log.log(
            logging.WARNING if self.attempt == 1 else logging.INFO,
            "%s did not commit: %s; applying it again in %.1f s (attempt %d of %d)",
            where,
            why,
            delay,
            self.attempt + 1,
            ACK_ATTEMPTS,
        )
        return dataclasses.replace(self, attempt=self.attempt + 1, due=time.monotonic() + delay)


async def serve_acknowledgements(
    journal: Journal,
    owned: Callable[[], Collection[int]],
    *,
    on_applied: AckCallback | None = None,
    on_durable: AckCallback | None = None,
    idle_s: float = 0.5,
) -> None:
    """(A member's, on its event loop, until cancelled.) Apply the trainer's acknowledgements of
    the partitions ``owned()`` names as they arrive on ``<namespace>.acks`` (from where the group's
    offsets say the last owner stopped), each in the member's next transaction, the position past
    it committed in a transaction after that (``AckPositions``: never past one not yet durable); the
    take (``apply_waiting_acks``) covers those that came while nobody owned the partition. Every
    member runs it: a fleet's worker and a gateway of the group alike, so an acknowledged rollout's
    snapshot is tombstoned while its owner lives. One whose append fails (the broker refused the
    partition's records, a commit that ran out of retries) is applied again while its partition
    stays here, ``idle_s`` after the first failure and twice as long after each next one, up to
    ``ACK_ATTEMPTS`` times; then its position stays held (the partition's next owner applies it).

    ``on_applied(rollout, partition)``: its acknowledgement was appended (on the event loop);
    ``on_durable``: that append is durable (on the journal's committer thread). A backend without
    the trainer's topic (a file journal, a namespace of an older version) returns at once."""
    backend = journal.backend
    follow = getattr(backend, "follow_acks", None)
    follower = await asyncio.to_thread(follow) if follow is not None else None
    if follower is None:
        return  # acknowledgements are journaled by the trainer directly
    positions = AckPositions()
    failed: queue.SimpleQueue[_AckRetry] = queue.SimpleQueue()  # put on the committer thread

    def settled(retry: _AckRetry, future: Future[AppendReceipt] | None) -> None:
        stored = retry.stored
        partition, offset = stored.location.partition, stored.location.offset
        if future is not None and not future.cancelled() and future.exception() is not None:
            retry_again = retry.failed(future.exception(), idle_s)
            if retry_again is not None:
                failed.put(retry_again)
            return  # its offset stays open: the position waits (for good, after the last attempt)
        position = positions.durable(partition, offset, retry.round_)
        if position is not None:
            backend.acknowledgement_applied(partition, position)  # type: ignore[attr-defined]
        if future is not None and on_durable is not None:
            on_durable(stored.key, partition)

    def apply(retry: _AckRetry) -> None:
        stored = retry.stored
        partition = stored.location.partition
        if partition not in owned():
            return  # its round ends at the next look: the partition's next owner applies it
        try:
            applied = journal.apply_acknowledgement(stored)
        except PartitionFencedError:  # revoked since owned() looked (the group's thread): not ours now
            log.info(
                "acknowledgement of %s: partition %d left this member as it came; its next owner applies it",
                stored.key,
                partition,
            )
            return
        positions.begin(partition, stored.location.offset)
        if applied is None:  # already applied, or stale: only the position moves
            settled(retry, None)
            return
        if on_applied is not None and retry.attempt == 1:
            on_applied(stored.key, partition)  # acknowledgements are keyed by rollout
        # Future's own method: the committer's would make the batch due and skip its linger.
        Future.add_done_callback(applied, lambda future: settled(retry, future))

    try:
        followed: dict[int, int | None] = {}  # partition -> the assignment it was followed under
        while True:
            mine = {p: backend.owner_token(p) for p in owned()}
            if mine != followed:  # taken, gone, or taken anew (under a new token) since the last look
                positions.restart({p for p in mine.keys() | followed.keys() if mine.get(p) != followed.get(p)})
                starts = {p: backend.acks_from.get(p) for p in mine}  # type: ignore[attr-defined]
                await asyncio.to_thread(follower.assign, starts)
                followed = mine
            if not mine:
                await asyncio.sleep(idle_s)
                continue
            for retry in [failed.get_nowait() for _ in range(failed.qsize())]:
                if retry.round_ != positions.round_of(retry.stored.location.partition):
                    continue  # followed anew since: it comes again from the committed position
                if time.monotonic() < retry.due:
                    failed.put(retry)
                else:
                    apply(retry)
            for stored in await asyncio.to_thread(follower.poll, idle_s):
                apply(_AckRetry(stored, positions.round_of(stored.location.partition)))
    finally:
        await asyncio.to_thread(follower.close)
