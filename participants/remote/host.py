"""The sessions of a resource server: one environment per rollout, and the resource contract
held at the server itself.

Every step and mutation carries the rollout's epoch (a stale one is refused), the expected
revisions (compare-and-set) and an idempotency key (a repeated key is answered with the stored
result, nothing applied twice). Environment code runs on worker threads, one request per rollout
at a time, so a slow tool (a sandbox's interpreter) never holds another rollout's request.

Sessions live in memory: a restarted server knows no rollout, answers 404, and the
worker brings each rollout back from its journal (``restore``: reconcile by revision
when this server's heads already equal the journal's, else import the last snapshot's
exports and re-apply the mutations since).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.concurrency import run_in_threadpool

from rollout_journal.participants.environments.base import Environment, StepContext
from rollout_journal.participants.environments.registry import environment_class
from rollout_journal.participants.environments.tasks import Task
from rollout_journal.participants.environments.tool_calls import ToolCall
from rollout_journal.participants.remote.protocol import (
    BadRequestError,
    SessionPreparedError,
    UnknownRolloutError,
    encode_exports,
    head_of,
)
from rollout_journal.participants.resources import (
    IdempotencyKeyReuseError,
    MutationRecord,
    MutationRequest,
    Resource,
    RevisionConflictError,
    StaleEpochError,
    genesis_hash,
)

__all__ = ["EnvironmentHost", "Session", "StepKeyReuseError"]

log = logging.getLogger(__name__)
T = TypeVar("T")
_STEPS_KEPT = 8  # a rollout's steps are sequential: only a retry of a recent one comes back


class StepKeyReuseError(IdempotencyKeyReuseError):
    """A step key already answered is reused for another action (an agent bug, not a retry)."""

    def __init__(self, rollout_id: str, key: str, recorded: str, action: str) -> None:
        self.resource_id, self.idempotency_key = rollout_id, key
        Exception.__init__(
            self,
            f"rollout {rollout_id!r}: step key {key!r} was answered for {recorded} and is now "
            f"reused for {action}; keys derive from (rollout, turn) and a re-executed turn "
            "must send the same call",
        )


@dataclass
class Session:
    """One rollout's environment in this server."""

    env: Environment
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    steps: OrderedDict[str, tuple[str, dict[str, Any]]] = field(default_factory=OrderedDict)  # key -> (call, answer)
    prepared: int | None = None  # epoch of the coordinated checkpoint holding it
    prepared_until: float = 0.0  # monotonic: a checkpoint whose worker never resumes lets go by itself
    pristine: bool = True  # built from its task and not changed since

    def fenced_epoch(self) -> tuple[int, str]:
        """The lowest epoch still accepted, and the resource holding that fence."""
        rid = self.env.rollout_id
        return max(((r.fenced_epoch(rid), r.resource_id) for r in self.env.resources.values()), default=(0, rid))


class EnvironmentHost:
    """The environments of one kind, one per rollout. Every method is called on the event loop;
    environment code runs in the thread pool under the rollout's lock."""

    def __init__(self, environment: str) -> None:
        self.environment = environment
        self.env_class = environment_class(environment)
        self.boot_id = uuid.uuid4().hex
        self.sessions: dict[str, Session] = {}
        self.stats: Counter[str] = Counter()
        self._creating = asyncio.Lock()

    # -- sessions ----------------------------------------------------------------
    def session(self, rollout_id: str) -> Session:
        session = self.sessions.get(rollout_id)
        if session is None:
            raise UnknownRolloutError(
                f"resource server for {self.environment!r} (boot {self.boot_id[:8]}) holds no "
                f"session for rollout {rollout_id!r}: it was restarted, or the rollout never "
                "opened here; restore the rollout from its journal"
            )
        return session

    async def open(self, rollout_id: str, task: Task) -> Session:
        """The rollout's session, built from its task if this server has none."""
        async with self._creating:
            session = self.sessions.get(rollout_id)
            if session is None:
                env = await run_in_threadpool(self.env_class, rollout_id, task)
                session = self.sessions[rollout_id] = Session(env)
                self.stats["opens"] += 1
            return session

    async def describe(self, session: Session) -> dict[str, Any]:
        env = session.env
        return await run_in_threadpool(
            lambda: {
                "environment": self.environment,
                "boot_id": self.boot_id,
                "task_prompt": env.task_prompt(),
                "recovery": env.recovery.value,
                "actions": env.action_space(),
                "heads": self.heads(env),
            }
        )

    @staticmethod
    def heads(env: Environment) -> list[dict[str, Any]]:
        """What the worker mirrors of each of the environment's resources."""
        return [head_of(r, env.rollout_id) for r in env.resources.values()]

    async def close(self, rollout_id: str) -> None:
        session = self.sessions.pop(rollout_id, None)
        if session is not None:
            async with session.lock:
                await run_in_threadpool(session.env.close)

    async def close_all(self) -> None:
        for rollout_id in list(self.sessions):
            await self.close(rollout_id)

    # -- restore: reconcile by revision, or import ----------------------------------
    async def restore(
        self,
        rollout_id: str,
        task: Task,
        exports: dict[str, bytes],
        mutations: list[MutationRecord],
        fence_epoch: int | None,
    ) -> tuple[Session, str]:
        """Bring the rollout's session to the journal's point. ``reconciled``: this server's heads
        already equal the journal's (nothing moves); ``imported``: a new environment took the
        exports and the mutations since; ``fresh``: no journal material, the task's initial state."""
        session = await self.open(rollout_id, task)
        async with session.lock:
            fenced, holder = session.fenced_epoch()
            if fence_epoch is not None and fence_epoch < fenced:
                raise StaleEpochError(holder, rollout_id, 0, fence_epoch, fenced, "restore")
            fresh = not exports and not mutations
            if fresh and session.pristine:
                mode = "fresh"
            elif not fresh and await run_in_threadpool(self._heads_match, session.env, exports, mutations):
                mode = "reconciled"
            else:
                env = await run_in_threadpool(self._rebuilt, rollout_id, task, exports, mutations)
                old, session.env = session.env, env
                await run_in_threadpool(old.close)
                session.steps.clear()
                session.pristine = fresh
                mode = "fresh" if fresh else "imported"
            if fence_epoch is not None:
                session.env.fence(rollout_id, fence_epoch)
            session.prepared = None  # a restore supersedes a checkpoint its worker never finished
            self.stats[mode] += 1
            return session, mode

    @staticmethod
    def _heads_match(env: Environment, exports: Mapping[str, bytes], mutations: list[MutationRecord]) -> bool:
        if set(exports) - set(env.resources):
            return False  # the import will name the resource this environment lacks
        implied: dict[str, tuple[int, str]] = {}
        for rid, resource in env.resources.items():
            implied[rid] = resource.exported_head(exports[rid]) if rid in exports else (0, genesis_hash(rid))
        for record in mutations:
            implied[record.resource_id] = (record.revision, record.chain_hash)
        return all((r.revision, r.chain_hash) == implied.get(rid) for rid, r in env.resources.items())

    def _rebuilt(
        self, rollout_id: str, task: Task, exports: dict[str, bytes], mutations: list[MutationRecord]
    ) -> Environment:
        env = self.env_class(rollout_id, task)
        try:
            env.restore(exports, mutations)
        except BaseException:
            env.close()
            raise
        return env

    # -- the rollout's calls --------------------------------------------------------
    async def step(
        self, rollout_id: str, action: str | ToolCall, attempt: int, epoch: int, key: str, expected: Mapping[str, int]
    ) -> dict[str, Any]:
        session = self.session(rollout_id)
        spelled = action.to_json() if isinstance(action, ToolCall) else action
        async with session.lock:
            self._check_epoch(session, epoch, attempt, "step")
            stored = session.steps.get(key)
            if stored is not None:
                if stored[0] != spelled:
                    raise StepKeyReuseError(rollout_id, key, stored[0], spelled)
                self.stats["step_replays"] += 1
                return stored[1]
            self._check_not_prepared(session, rollout_id)
            env = session.env
            for rid, resource in env.resources.items():
                if expected.get(rid, 0) != resource.revision:
                    raise RevisionConflictError(rid, expected.get(rid, 0), resource.revision, key, "step")

            def run() -> dict[str, Any]:
                observation, records = env.step(action, StepContext(rollout_id, attempt, epoch, key))
                return {
                    "observation": {"text": observation.text, "done": observation.done},
                    "records": [r.to_dict() for r in records],
                    "heads": self.heads(env),
                    "actions": env.action_space(),
                }

            answer = await run_in_threadpool(run)
            session.pristine = False
            session.steps[key] = (spelled, answer)
            while len(session.steps) > _STEPS_KEPT:
                session.steps.popitem(last=False)
            self.stats["steps"] += 1
            return answer

    async def call(self, rollout_id: str, fn: Callable[[Session], T], *, mutates: bool = False) -> T:
        """Run ``fn(session)`` in the thread pool under the rollout's lock."""
        session = self.session(rollout_id)
        async with session.lock:
            if mutates:
                self._check_not_prepared(session, rollout_id)
            result = await run_in_threadpool(fn, session)
            if mutates:
                session.pristine = False
            return result

    async def mutate(
        self, rollout_id: str, name: str, request: MutationRequest, op: str, args: Mapping[str, Any]
    ) -> dict[str, Any]:
        def run(session: Session) -> dict[str, Any]:
            record = self.resource(session, name).mutate(request, op, args)
            return {"record": record.to_dict(), "heads": self.heads(session.env)}

        return await self.call(rollout_id, run, mutates=True)

    async def prepare(self, rollout_id: str, epoch: int, hold_s: float) -> dict[str, Any]:
        """Hold the session for a coordinated checkpoint (at most ``hold_s``) and export its resources."""
        session = self.session(rollout_id)
        async with session.lock:
            self._check_epoch(session, epoch, 0, "prepare")
            session.prepared, session.prepared_until = epoch, time.monotonic() + hold_s
            exports = await session.env.aprepare_checkpoint(epoch)
            self.stats["prepares"] += 1
            return {"exports": encode_exports(exports), "heads": self.heads(session.env)}

    async def finish_checkpoint(self, rollout_id: str, epoch: int, committed: bool) -> None:
        session = self.session(rollout_id)
        async with session.lock:
            if session.prepared == epoch:
                session.prepared = None
            self.stats["resumes" if committed else "aborts"] += 1

    # -- checks ----------------------------------------------------------------------
    @staticmethod
    def _check_epoch(session: Session, epoch: int, attempt: int, what: str) -> None:
        fenced, holder = session.fenced_epoch()
        if epoch < fenced:
            raise StaleEpochError(holder, session.env.rollout_id, attempt, epoch, fenced, what)

    @staticmethod
    def _check_not_prepared(session: Session, rollout_id: str) -> None:
        if session.prepared is not None and time.monotonic() > session.prepared_until:
            log.warning(
                "rollout %s: the checkpoint at epoch %d was neither resumed nor aborted in time; letting it go",
                rollout_id,
                session.prepared,
            )
            session.prepared = None
        if session.prepared is not None:
            raise SessionPreparedError(
                f"rollout {rollout_id!r} is held by a coordinated checkpoint (epoch "
                f"{session.prepared}) until it is resumed or aborted; retry"
            )

    @staticmethod
    def resource(session: Session, name: str) -> Resource:
        """The session's resource ``name``; a ``BadRequestError`` names the ones it has."""
        rid = session.env.resource_id(name)
        resource = session.env.resources.get(rid)
        if resource is None:
            raise BadRequestError(
                f"rollout {session.env.rollout_id!r} has no resource {name!r}; it has "
                + ", ".join(sorted(r.rsplit("/", 1)[-1] for r in session.env.resources))
            )
        return resource
