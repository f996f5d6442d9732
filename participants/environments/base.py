"""The protocol of an environment: a task, the tool calls valid now, resources, a reward.

Write your own by subclassing :class:`Environment` (the built-ins ``workplace``,
``counter`` and ``sandbox`` are worked examples):

- ``__init__(rollout_id, task)``: call ``super().__init__``, then build the task's
  resources (subclasses of :class:`~rollout_journal.participants.resources.Resource`) and register each
  with :meth:`Environment._add_resource`. ``self.task`` is a
  :class:`~rollout_journal.participants.environments.tasks.Task`: a seed, and for a dataset row its
  ``prompt`` and ``fields``.
- :meth:`Environment.task_prompt`, :meth:`Environment.action_space` (the tool calls valid
  now, ending with ``submit()``), :meth:`Environment._perform` (run one of them, mutating
  only through ``mutations.apply``) and :meth:`Environment.verify` (the reward).
- Optionally :meth:`Environment._call_tool` for free-form JSON tool calls; by default a
  JSON call runs the listed action with the same name and arguments.

An environment keeps no state outside its resources, so rebuilding its resources
(replay, import or reset) rebuilds the environment. How it recovers after a crash is
its weakest resource's :class:`~rollout_journal.participants.resources.Recovery` mode. Name it in a
workload as ``package.module:Class`` or through the ``rollout_journal.environments``
entry point group: no edit of this project is needed.

Anything the model says that is no valid call (a string outside the action list, JSON
that does not parse, an unknown function, bad arguments) becomes an observation for
the model, never an exception: only fencing, revision and idempotency errors (the
attempt must stop) and infrastructure failures leave :meth:`Environment.step`.

The environment classifies what went wrong. What the action itself caused is the
policy's doing: raise :class:`~rollout_journal.participants.resources.PolicyFault` (or let a resource
raise ``OperationRejectedError``) before anything changed, and the model is told as an
observation; the rollout goes on and is scored (the sandbox answers code that runs too
long this way). Any other exception is an infrastructure failure: the attempt fails
(``RolloutFailed``) and the workload's ``failure_policy`` retries it or gives it up.
"""

from __future__ import annotations

import asyncio
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, ClassVar, TypeVar

from rollout_journal.journal.errors import ConfigurationError, RolloutJournalError
from rollout_journal.participants.environments.tasks import Task
from rollout_journal.participants.environments.tool_calls import (
    ToolCall,
    ToolCallError,
    argument_text,
    looks_like_tool_call,
    parse_tool_call,
)
from rollout_journal.participants.resources import (
    MutationRecord,
    MutationRequest,
    OperationRejectedError,
    PolicyFault,
    Recovery,
    Resource,
    ResourceError,
    UnknownOperationError,
    weakest_recovery,
)

__all__ = [
    "SUBMIT",
    "Environment",
    "Observation",
    "RequestFor",
    "StepContext",
    "StepMutations",
    "UnknownResourceError",
    "parse_kwargs",
    "split_call",
]

SUBMIT = "submit()"
RequestFor = Callable[[Resource], MutationRequest]
Action = str | ToolCall

_CALL = re.compile(r"^([A-Za-z_][\w]*(?:\.[A-Za-z_][\w]*)?)\((.*)\)$", re.DOTALL)


class UnknownResourceError(ResourceError):
    """A journaled record names a resource this environment does not have."""


@dataclass(frozen=True)
class Observation:
    """Tool output appended to the conversation as a "tool" message."""

    text: str
    done: bool = False


class StepMutations:
    """Runs one step's mutations in order and collects their records.

    ``request_for`` is called right before each mutation, so the expected
    revision it reads is current even when one action mutates twice.
    """

    def __init__(self, request_for: RequestFor) -> None:
        self._request_for = request_for
        self.records: list[MutationRecord] = []

    def apply(self, resource: Resource, op: str, args: dict[str, Any]) -> dict[str, Any]:
        record = resource.mutate(self._request_for(resource), op, args)
        self.records.append(record)
        return record.result


@dataclass
class StepContext:
    """Who is mutating, for one step: every mutation of the step gets a ``MutationRequest``
    with the rollout's attempt and epoch, the idempotency key ``<key_prefix>/m<i>`` (the
    i-th mutation of the step) and the resource's revision as the expected one.

    Keys depend on (rollout, turn, index) only, so a turn re-executed after a crash maps
    to the same keys. A resource server builds the same context from a step request."""

    rollout_id: str
    attempt: int
    epoch: int
    key_prefix: str
    issued: int = 0

    def __call__(self, resource: Resource) -> MutationRequest:
        key = f"{self.key_prefix}/m{self.issued}"
        self.issued += 1
        return MutationRequest(self.rollout_id, self.attempt, self.epoch, key, resource.revision)


def _fault_observation(exc: Exception) -> Observation:
    """What the model is told of its own action's fault."""
    return Observation(f"Error: {exc}", done=isinstance(exc, PolicyFault) and exc.ends_episode)


def split_call(action: str) -> tuple[str, str]:
    """``"mail.send(to=a, subject=b)"`` -> ``("mail.send", "to=a, subject=b")``."""
    match = _CALL.match(action)
    if match is None:
        raise ValueError(f"action {action!r} is not of the form name(args)")
    return match.group(1), match.group(2)


def parse_kwargs(inner: str) -> dict[str, str]:
    """``"to=a, subject=b"`` -> ``{"to": "a", "subject": "b"}`` (values are plain tokens)."""
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in inner.split(","))):
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"argument {part!r} is not key=value")
        out[key.strip()] = value.strip()
    return out


class Environment(ABC):
    """A deterministic task over resources; the same task gives the same environment.

    Subclasses set ``name``, create their resources in ``__init__`` with
    :meth:`_add_resource`, and implement :meth:`task_prompt`,
    :meth:`action_space`, :meth:`_perform` and :meth:`verify`.
    """

    name: ClassVar[str]

    def __init__(self, rollout_id: str, task: Task | int) -> None:
        """``task`` may be a bare seed (``Task(seed)``), as the built-ins were always built."""
        self.rollout_id = rollout_id
        self.task = task if isinstance(task, Task) else Task(int(task))
        self.task_seed = self.task.seed
        self.resources: dict[str, Resource] = {}
        # resources whose export a coordinated checkpoint gave up on and which still runs (aprepare_checkpoint)
        self._exports_running: set[str] = set()

    # -- construction ------------------------------------------------------------
    def resource_id(self, name: str) -> str:
        """Resource ids are ``f"{rollout_id}/{name}"``."""
        return f"{self.rollout_id}/{name}"

    def _add_resource(self, resource: Resource) -> Resource:
        self.resources[resource.resource_id] = resource
        return resource

    # -- the agent-facing API ----------------------------------------------------
    @abstractmethod
    def task_prompt(self) -> str:
        """The user's instruction for this task."""

    def tools(self) -> list[dict[str, Any]] | None:
        """The functions the model may call, as JSON schemas (OpenAI's ``tools``), for the chat
        template to show it; fixed for a rollout (a changing list would rewrite its history).
        None (the default): the template shows none; a dataset row's ``tools`` take precedence."""
        return None

    @abstractmethod
    def action_space(self) -> list[str]:
        """Valid tool-call strings now, in a deterministic order; always ends with ``submit()``."""

    def step(self, action: Action, request_for: RequestFor) -> tuple[Observation, list[MutationRecord]]:
        """Run one action; returns the observation and the mutation records in order.

        ``action`` is a string of :meth:`action_space`, a JSON tool call (as text or a
        :class:`ToolCall`), or anything else the model said. Whatever cannot be parsed or
        executed, or is rejected by a resource, gives an observation saying so (with the
        records of the mutations it did make). Fencing, revision and idempotency errors
        propagate: they mean the attempt itself must stop.
        """
        if isinstance(action, str):
            action = action.strip()
            if action == SUBMIT:
                return Observation("Submitted. The episode is over.", done=True), []
            if looks_like_tool_call(action):
                try:
                    action = parse_tool_call(action)
                except ToolCallError as exc:
                    return Observation(f"Error: could not parse the tool call: {exc}."), []
        if isinstance(action, ToolCall):
            return self._step_tool_call(action, request_for)
        valid = self.action_space()
        if action not in valid:
            return Observation(
                f"Invalid action {action!r}: it is not one of the {len(valid)} actions available now; "
                "choose one of them exactly as written."
            ), []
        mutations = StepMutations(request_for)
        try:
            text = self._perform(action, mutations)
        except (OperationRejectedError, PolicyFault) as exc:
            return _fault_observation(exc), mutations.records
        return Observation(text), mutations.records

    def _step_tool_call(self, call: ToolCall, request_for: RequestFor) -> tuple[Observation, list[MutationRecord]]:
        if call.name == SUBMIT.removesuffix("()"):
            return Observation("Submitted. The episode is over.", done=True), []
        mutations = StepMutations(request_for)
        try:
            text = self._call_tool(call, mutations)
        except (ToolCallError, OperationRejectedError, UnknownOperationError, PolicyFault) as exc:
            return _fault_observation(exc), mutations.records
        except (KeyError, TypeError, ValueError) as exc:  # the environment's code choked on the arguments
            if isinstance(exc, RolloutJournalError):
                raise
            text = f"Error: {call.name} could not be executed with these arguments ({type(exc).__name__}: {exc})"
        return Observation(text), mutations.records

    def _call_tool(self, call: ToolCall, mutations: StepMutations) -> str:
        """Execute a JSON tool call. By default: the action of :meth:`action_space` with the same
        function name and the same arguments (in any order), run by :meth:`_perform`. Override it
        to take arguments no action list could enumerate; raise :class:`ToolCallError` (or let a
        resource raise ``OperationRejectedError``) to tell the model what is wrong."""
        wanted = {k: argument_text(v) for k, v in call.arguments.items()}
        names = []
        for action in self.action_space():
            try:
                name, inner = split_call(action)
                if name == call.name and parse_kwargs(inner) == wanted:
                    return self._perform(action, mutations)
            except ValueError:
                continue  # an action whose arguments are no key=value list cannot match a JSON call
            names.append(name)
        known = sorted(set(names))
        if call.name not in known:
            raise ToolCallError(f"there is no tool {call.name!r} now; tools: {', '.join(known)}")
        raise ToolCallError(f"{call.name} takes other arguments than {dict(call.arguments)} now")

    @abstractmethod
    def _perform(self, action: str, mutations: StepMutations) -> str:
        """Carry out a valid, non-submit action; mutate only through ``mutations.apply``."""

    @abstractmethod
    def verify(self) -> float:
        """Reward in [0, 1], deterministic from the resources' state."""

    # -- what the agent awaits (a remote environment answers over HTTP) -----------
    async def astep(self, action: Action, request_for: RequestFor) -> tuple[Observation, list[MutationRecord]]:
        """:meth:`step`, awaitable: an environment behind a resource server does not block the loop."""
        return self.step(action, request_for)

    async def averify(self) -> float:
        """:meth:`verify`, awaitable."""
        return self.verify()

    async def aexport(self, resource_ids: Iterable[str]) -> dict[str, bytes]:
        """The exported state of these resources (for a snapshot)."""
        return {rid: self.resources[rid].export_state() for rid in resource_ids}

    async def aprepare_checkpoint(self, epoch: int) -> dict[str, bytes]:
        """A coordinated checkpoint's prepare: the exports of every exportable resource (none for a
        restart-only environment, which no export brings back). The agents are parked, so nothing
        mutates meanwhile; a remote environment also holds its server's session still."""
        if self.recovery is Recovery.RESTART_ONLY:
            return {}
        resources = [r for r in self.resources.values() if r.supports_export]
        # An export a checkpoint gave up on runs on: this rollout is skipped until it has ended, so
        # a stuck export holds one thread, not one more every round.
        running = self._exports_running
        still = sorted(r.resource_id for r in resources if r.resource_id in running)
        if still:
            raise ResourceError(f"the export of {', '.join(still)} that an earlier checkpoint gave up on still runs")

        def export(resource: Resource) -> Callable[[], bytes]:
            running.add(resource.resource_id)

            def run() -> bytes:
                try:
                    return resource.export_state()
                finally:
                    running.discard(resource.resource_id)

            return run

        states = await asyncio.gather(*(in_daemon_thread(export(r), f"export {r.resource_id}") for r in resources))
        return {r.resource_id: state for r, state in zip(resources, states)}

    async def aend_checkpoint(self, epoch: int, committed: bool) -> None:
        """The checkpoint that prepared this environment was committed (or abandoned): resume."""

    @property
    def recovery(self) -> Recovery:
        """The weakest recovery mode among the resources (restart_only dominates)."""
        return weakest_recovery(r.recovery for r in self.resources.values())

    # -- restore helpers (the restorer's side) -----------------------------------
    def fence(self, rollout_id: str, epoch: int) -> None:
        """Fence every resource: refuse epochs below ``epoch`` for ``rollout_id``."""
        for resource in self.resources.values():
            resource.fence(rollout_id, epoch)

    def replay(self, records: Iterable[MutationRecord]) -> None:
        """Re-apply journaled records (in journal order) to the matching resources."""
        for record in records:
            resource = self.resources.get(record.resource_id)
            if resource is None:
                raise UnknownResourceError(
                    f"environment {self.name!r} of rollout {self.rollout_id!r} has no resource {record.resource_id!r} "
                    f"(revision {record.revision}); known: {', '.join(sorted(self.resources))}"
                )
            resource.replay(record)

    def restore(
        self, exports: Mapping[str, bytes], mutations: Sequence[MutationRecord], *, fence_epoch: int | None = None
    ) -> None:
        """Bring this freshly built environment to a journaled point: import the exports of the
        rollout's last snapshot, re-apply the mutations journaled since, then fence the next
        attempt's epoch (imports carry older fences). A ``ResourceError`` means this snapshot
        does not restore (the caller may fall back to an older one)."""
        for resource_id, exported in exports.items():
            resource = self.resources.get(resource_id)
            if resource is None:
                raise ConfigurationError(
                    f"rollout {self.rollout_id}: its snapshot holds resource {resource_id!r}, which environment "
                    f"{self.name!r} does not have; was the workload's environment changed?"
                )
            resource.import_state(exported)
        self.replay(mutations)
        if fence_epoch is not None:
            self.fence(self.rollout_id, fence_epoch)

    async def arestore(
        self, exports: Mapping[str, bytes], mutations: Sequence[MutationRecord], *, fence_epoch: int | None = None
    ) -> None:
        """:meth:`restore`, awaitable. The agent calls it live only on an environment whose resources
        live elsewhere and were lost (a restarted resource server); ``{}`` and ``[]`` mean the
        task's initial state."""
        self.restore(exports, mutations, fence_epoch=fence_epoch)

    def revisions(self) -> dict[str, int]:
        return {rid: r.revision for rid, r in self.resources.items()}

    def state_digests(self) -> dict[str, str]:
        return {rid: r.state_digest() for rid, r in self.resources.items()}

    def reset(self) -> None:
        """Reset every resource to the task's initial state (restart from turn 0)."""
        for resource in self.resources.values():
            resource.reset()

    def close(self) -> None:
        """Release resources that hold OS state (subprocesses); safe to call twice."""
        for resource in self.resources.values():
            resource.close()

    def __enter__(self) -> Environment:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


_T = TypeVar("_T")


async def in_daemon_thread(fn: Callable[[], _T], name: str) -> _T:
    """``fn()`` on a daemon thread of its own. A caller may give up on it (a coordinated
    checkpoint's prepare timeout skips an export that does not end): such a thread runs on, and
    neither the event loop's end nor the process's exit waits for it, as both do for every thread
    of asyncio's default executor (``asyncio.to_thread``), without a bound."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[_T] = loop.create_future()

    def settle(result: _T | None, error: BaseException | None) -> None:
        if done.done():  # its caller gave up
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)  # type: ignore[arg-type]  # no error: fn returned it

    def run() -> None:
        try:
            outcome: tuple[_T | None, BaseException | None] = (fn(), None)
        except BaseException as exc:  # handed to the awaiting caller
            outcome = (None, exc)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop is closed: nobody waits for it any more
            pass

    threading.Thread(target=run, name=name, daemon=True).start()
    return await done
