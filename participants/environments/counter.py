"""A named-counter store whose state is exported/imported as opaque bytes (exportable).

The simplest resource that recovers by checkpoint rather than by replay: the
coordinated checkpoint exports it, restore imports it. Task: bring each counter
to its target; reward by distance.
"""

from __future__ import annotations

import copy
import random
from typing import Any

from rollout_journal.participants.environments.base import (
    SUBMIT,
    Environment,
    StepMutations,
    parse_kwargs,
    split_call,
)
from rollout_journal.participants.environments.tasks import Task
from rollout_journal.participants.resources import OperationRejectedError, Recovery, Resource

__all__ = ["CounterStore", "CounterEnvironment", "COUNTER_NAMES"]

COUNTER_NAMES: tuple[str, ...] = ("a", "b", "c")
_STEP_SIZES: tuple[int, ...] = (1, 5)


class CounterStore(Resource):
    """Integer counters. Ops: incr(name, by), decr(name, by), set(name, value). Queries: get, list."""

    kind = "counter-store"
    recovery = Recovery.EXPORTABLE
    supports_export = True

    def __init__(self, resource_id: str, initial: dict[str, int]) -> None:
        super().__init__(resource_id)
        self._initial = dict(initial)
        self._counters = dict(initial)

    @property
    def counters(self) -> dict[str, int]:
        return dict(self._counters)

    def _name(self, op: str, args: dict[str, Any]) -> str:
        name: str = self._arg(op, args, "name")  # checked a str
        if name not in self._counters:
            raise OperationRejectedError(
                f"counter store {self.resource_id!r} has no counter {name!r}; counters: {', '.join(sorted(self._counters))}"
            )
        return name

    def _apply(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        if op in ("incr", "decr"):
            name = self._name(op, args)
            by = self._arg(op, args, "by", int, default=1)
            self._counters[name] += by if op == "incr" else -by
        elif op == "set":
            name = self._name(op, args)
            self._counters[name] = self._arg(op, args, "value", int)
        else:
            raise self._unknown(op, ("incr", "decr", "set"))
        return {"name": name, "value": self._counters[name]}

    def _query(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        if op == "get":
            name = self._name(op, args)
            return {"name": name, "value": self._counters[name]}
        if op == "list":
            return {"counters": dict(self._counters)}
        raise self._unknown(op, ("get", "list"))

    def _canonical_state(self) -> object:
        return {"counters": self._counters}

    def _load_state(self, state: Any) -> None:
        counters = state["counters"]
        if not all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in counters.items()):
            raise ValueError("counters must map names to integers")
        self._counters = dict(counters)

    def _reset(self) -> None:
        self._counters = copy.deepcopy(self._initial)


class CounterEnvironment(Environment):
    """Reach target values on three counters. 20 actions, always the same."""

    name = "counter"

    def __init__(self, rollout_id: str, task: Task | int) -> None:
        super().__init__(rollout_id, task)
        rng = random.Random(self.task_seed)
        self.start: dict[str, int] = {}
        self.targets: dict[str, int] = {}
        for name in COUNTER_NAMES:
            self.start[name] = rng.randint(0, 10)
            self.targets[name] = rng.choice([v for v in range(0, 21) if v != self.start[name]])
        self.store = CounterStore(self.resource_id("counters"), self.start)
        self._add_resource(self.store)

    def task_prompt(self) -> str:
        goals = ", ".join(f"{n}={v}" for n, v in self.targets.items())
        return f"Bring the counters to these values: {goals}. Then call submit()."

    def action_space(self) -> list[str]:
        actions = ["counter.list()"]
        for name in COUNTER_NAMES:
            actions.append(f"counter.get(name={name})")
            actions += [f"counter.incr(name={name}, by={by})" for by in _STEP_SIZES]
            actions += [f"counter.decr(name={name}, by={by})" for by in _STEP_SIZES]
            actions.append(f"counter.set(name={name}, value=0)")
        actions.append(SUBMIT)
        return actions

    def _perform(self, action: str, mutations: StepMutations) -> str:
        call, inner = split_call(action)
        kw = parse_kwargs(inner)
        op = call.removeprefix("counter.")
        if op == "list":
            counters = self.store.query("list", {})["counters"]
            return ", ".join(f"{n}={v}" for n, v in counters.items())
        if op == "get":
            return f"{kw['name']}={self.store.query('get', {'name': kw['name']})['value']}"
        args: dict[str, Any] = {"name": kw["name"]}
        if "by" in kw:
            args["by"] = int(kw["by"])
        if "value" in kw:
            args["value"] = int(kw["value"])
        result = mutations.apply(self.store, op, args)
        return f"{result['name']}={result['value']}"

    def verify(self) -> float:
        """Mean over counters of 1 / (1 + |value - target|)."""
        counters = self.store.counters
        return sum(1.0 / (1.0 + abs(counters[n] - t)) for n, t in self.targets.items()) / len(self.targets)

    def solution(self) -> list[str]:
        """Greedy steps of 5 then 1 per counter: reward 1.0 from the initial state."""
        actions: list[str] = []
        for name in COUNTER_NAMES:
            diff = self.targets[name] - self.start[name]
            verb = "incr" if diff > 0 else "decr"
            fives, ones = divmod(abs(diff), 5)
            actions += [f"counter.{verb}(name={name}, by=5)"] * fives + [f"counter.{verb}(name={name}, by=1)"] * ones
        return actions + [SUBMIT]
