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
import time
from collections.abc import Callable, Collection
from concurrent.futures import Future

from rollout_journal.journal.deadlines import Deadline
from rollout_journal.journal.errors import ClusterUnreachableError, PartitionFencedError, UnstableReadError
from rollout_journal.journal.journal import AppendReceipt, Journal
from rollout_journal.journal.restore import RestorePlan, load_rollouts

__all__ = ["apply_waiting_acks", "serve_acknowledgements", "take_and_restore"]

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
    settings = getattr(journal.backend, "settings", None)
    budget_ms = getattr(settings, "cluster_unavailable_timeout_ms", 60_000)
    give_up = Deadline(2 * budget_ms / 1000)
    while True:
        if journal.backend.owner_token(partition) != token:
            raise journal._revoked(partition)
        try:
            journal.take_partition(partition, token)  # idempotent: the commit points, again
            plan = load_rollouts(journal, partitions={partition}, only=only)
            apply_waiting_acks(journal, partition, plan)
            return plan
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
    it committed in a transaction after that; the take (``apply_waiting_acks``) covers those that
    came while nobody owned the partition. Every member runs it: a fleet's worker and a gateway of
    the group alike, so an acknowledged rollout's snapshot is tombstoned while its owner lives.

    ``on_applied(rollout, partition)``: its acknowledgement was appended (on the event loop);
    ``on_durable``: that append is durable (on the journal's committer thread). A backend without
    the trainer's topic (a file journal, a namespace of an older version) returns at once."""
    backend = journal.backend
    follow = getattr(backend, "follow_acks", None)
    follower = await asyncio.to_thread(follow) if follow is not None else None
    if follower is None:
        return  # acknowledgements are journaled by the trainer directly
    try:
        followed: set[int] = set()
        while True:
            mine = set(owned())
            if mine != followed:
                starts = {p: backend.acks_from.get(p) for p in mine}  # type: ignore[attr-defined]
                await asyncio.to_thread(follower.assign, starts)
                followed = mine
            if not mine:
                await asyncio.sleep(idle_s)
                continue
            for stored in await asyncio.to_thread(follower.poll, idle_s):
                partition, after = stored.location.partition, stored.location.offset + 1
                if partition not in owned():
                    continue
                try:
                    applied = journal.apply_acknowledgement(stored)
                except PartitionFencedError:  # revoked since owned() looked (the group's thread): not ours now
                    log.info(
                        "acknowledgement of %s: partition %d left this member as it came; its next owner applies it",
                        stored.key,
                        partition,
                    )
                    continue
                if applied is None:  # already applied, or stale: only the position moves
                    backend.acknowledgement_applied(partition, after)  # type: ignore[attr-defined]
                    continue
                if on_applied is not None:
                    on_applied(stored.key, partition)  # acknowledgements are keyed by rollout

                def durable(
                    future: Future[AppendReceipt], p: int = partition, o: int = after, rollout_id: str = stored.key
                ) -> None:
                    if future.exception() is None:
                        backend.acknowledgement_applied(p, o)  # type: ignore[attr-defined]
                        if on_durable is not None:
                            on_durable(rollout_id, p)

                applied.add_done_callback(durable)
    finally:
        await asyncio.to_thread(follower.close)
