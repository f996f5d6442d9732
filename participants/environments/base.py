"""What the agent talks to: an environment = a task + a finite action space + resources.

An environment keeps no state outside its resources, so rebuilding its
resources (replay, import or reset) rebuilds the environment. Actions are short
tool-call strings; the set valid *now* is :meth:`Environment.action_space`, and
:meth:`Environment.step` accepts exactly those strings (anything else yields an
"invalid action" observation, never an exception).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Callable, ClassVar, Iterable

from participants.resources import (
    MutationRecord,
    MutationRequest,
    OperationRejectedError,
    Recovery,
    Resource,
    ResourceError,
    weakest_recovery,
)

__all__ = [
    "Observation",
    "Environment",
    "StepMutations",
    "RequestFor",
    "SUBMIT",
    "split_call",
    "parse_kwargs",
    "UnknownResourceError",
]

SUBMIT = "submit()"
RequestFor = Callable[[Resource], MutationRequest]

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
    """A deterministic task over resources; same ``task_seed`` -> same task.

    Subclasses set ``name``, create their resources in ``__init__`` with
    :meth:`_add_resource`, and implement :meth:`task_prompt`,
    :meth:`action_space`, :meth:`_perform` and :meth:`verify`.
    """

    name: ClassVar[str]

    def __init__(self, rollout_id: str, task_seed: int) -> None:
        self.rollout_id = rollout_id
        self.task_seed = task_seed
        self.resources: dict[str, Resource] = {}

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

    @abstractmethod
    def action_space(self) -> list[str]:
        """Valid tool-call strings now, in a deterministic order; always ends with ``submit()``."""

    def step(self, action: str, request_for: RequestFor) -> tuple[Observation, list[MutationRecord]]:
        """Run one action; returns the observation and the mutation records in order.

        An action outside :meth:`action_space` or one the resource rejects gives
        an observation saying so. Fencing, revision and idempotency errors
        propagate: they mean the attempt itself must stop.
        """
        action = action.strip()
        if action == SUBMIT:
            return Observation("Submitted. The episode is over.", done=True), []
        valid = self.action_space()
        if action not in valid:
            return Observation(
                f"Invalid action {action!r}: it is not one of the {len(valid)} actions available now; "
                "choose one of them exactly as written."
            ), []
        mutations = StepMutations(request_for)
        try:
            text = self._perform(action, mutations)
        except OperationRejectedError as exc:
            text = f"Error: {exc}"
        return Observation(text), mutations.records

    @abstractmethod
    def _perform(self, action: str, mutations: StepMutations) -> str:
        """Carry out a valid, non-submit action; mutate only through ``mutations.apply``."""

    @abstractmethod
    def verify(self) -> float:
        """Reward in [0, 1], deterministic from the resources' state."""

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

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
