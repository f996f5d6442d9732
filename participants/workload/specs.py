"""Who a workload's rollouts are: ids, groups, tasks and sampling seeds, for the
workload's own rollouts and for the forks made of them.

A fork (``rollout_journal.replay.fork``) is a rollout of its own, ``<origin>.fork-<n>``, that starts
from the state after turn K of its origin. Its task is the origin's; it samples
with the origin's turn seeds (so, unchanged, it re-runs what the origin did) unless
it was given a seed of its own. The journal says all of that in a registration
record named after the fork (``WorkloadRegistered`` listing the fork alone, whose
spec is a :class:`Fork`), so ``resume`` finds and continues the forks of its
workload's rollouts like any unfinished rollout, and a replay command can rebuild
a fork's environment.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pydantic import ValidationError

from rollout_journal.journal.errors import ConfigurationError, NotInJournalError
from rollout_journal.journal.events import Header, WorkloadRegistered
from rollout_journal.participants.environments.tasks import Task, load_tasks
from rollout_journal.participants.workload.config import WorkloadConfig, name_problem

FORK_FORMAT = "rollout-journal/fork/1"
FORK_MARK = ".fork-"


class UnknownRolloutSpecError(NotInJournalError):
    """The journal's registrations do not say which workload and task a rollout belongs to."""


@dataclass(frozen=True)
class RolloutSpec:
    """Who a rollout is and what it works on; fixed by the workload, so restore never
    needs a snapshot to know it (the aggregate, ``RolloutState``, knows the ids alone)."""

    rollout_id: str
    group_id: str
    sibling: int
    task_seed: int
    environment: str
    seed: int | None = None  # sampling seed instead of the workload's (a fork run with another seed)
    seed_rollout: str | None = None  # whose turn seeds it draws (a fork: its origin's, so it re-runs what that did)
    forked_from: str | None = None  # "<rollout_id>@<turn>" for a fork (see :class:`Fork`)
    task: Task | None = None  # the dataset row, when the workload reads tasks from a file (else the seed is all)

    def turn_seed_source(self, workload_seed: int) -> tuple[int, str]:
        """(seed, rollout id) the turn seeds of this rollout derive from."""
        return (workload_seed if self.seed is None else self.seed), (self.seed_rollout or self.rollout_id)

    def environment_task(self) -> Task:
        """What its environment is built from."""
        return self.task if self.task is not None else Task(self.task_seed)


def workload_specs(config: WorkloadConfig, redispatched: Mapping[str, int] | None = None) -> list[RolloutSpec]:
    """The rollouts of a workload, in order: ``<name>-g<group>-s<sibling>``, each group followed by
    the replacement groups ``redispatched`` names (its registration's: ``<name>-g<group>r<k>``, the
    same task, their own samples); a name the journal cannot key is refused here too (a config
    built with ``model_copy`` skipped validation)."""
    problem = name_problem(config.name)
    if problem:
        raise ConfigurationError(f"workload name {config.name!r} {problem}")
    specs = []
    rows = load_tasks(config.tasks, config.seed) if config.tasks is not None else None
    for g in range(config.groups):
        environment = config.environments[g % len(config.environments)]
        task_seed = int.from_bytes(hashlib.sha256(f"{config.seed}/task/{g}".encode()).digest()[:4], "little")
        task = rows[g % len(rows)] if rows is not None else None  # every sibling of a group: the same task
        group = f"{config.name}-g{g}"
        for generation in range((redispatched or {}).get(group, 0) + 1):
            group_id = replacement_group(group, generation)
            for s in range(config.siblings):
                specs.append(
                    RolloutSpec(
                        f"{group_id}-s{s}",
                        group_id,
                        s,
                        task.seed if task is not None else task_seed,
                        environment,
                        task=task,
                    )
                )
    return specs


_REPLACEMENT = re.compile(r"^(?P<group>.+-g\d+)r(?P<k>\d+)$")


def registration_of(
    config: WorkloadConfig,
    rollout_ids: list[str],
    previous: WorkloadRegistered | None,
    redispatched: Mapping[str, int],
) -> WorkloadRegistered:
    """The record of ``config`` and every rollout id it holds (with the replacement groups
    ``redispatched`` names: ``workload_specs(config, redispatched)``). An acknowledged rollout keeps its fence, marked, in the snapshot
    stream, so a registered rollout missing from it has never started; a journal registered before
    that (``previous`` without ``acknowledgement_markers``) keeps reading a missing registered
    rollout as acknowledged. The one builder for ``run``, ``resume``, a redispatch and a fleet."""
    return WorkloadRegistered(
        config.name,
        config.model_dump_json(),
        list(rollout_ids),
        config.topology(),
        Header.now_ms(),
        config.writer,
        previous is None or previous.acknowledgement_markers,
        dict(redispatched),
    )


def replacement_group(group: str, generation: int) -> str:
    """The id of a prompt group's replacement ``generation`` (0: the group itself)."""
    return group if generation == 0 else f"{group}r{generation}"


def group_generation(group_id: str) -> tuple[str, int]:
    """(the prompt group a group id replaces, which replacement it is); (itself, 0) for an original."""
    match = _REPLACEMENT.match(group_id)
    return (match.group("group"), int(match.group("k"))) if match else (group_id, 0)


@dataclass(frozen=True)
class Fork:
    """A fork: ``rollout_id`` starts from the state after turn ``at_turn`` of ``origin``."""

    rollout_id: str
    origin: str
    at_turn: int
    seed: int | None  # None: the origin's turn seeds
    workload: str  # the workload whose rollout the fork (perhaps of a fork) descends from
    workload_config: str = ""  # that workload's config (JSON), so a journal holding only forks knows the task

    @property
    def forked_from(self) -> str:
        """What ``AttemptStarted.forked_from`` records: ``<origin>@<turn>``."""
        return f"{self.origin}@{self.at_turn}"

    def registration(self, topology: str, writer: str) -> WorkloadRegistered:
        spec = {
            "format": FORK_FORMAT,
            "origin": self.origin,
            "at_turn": self.at_turn,
            "seed": self.seed,
            "workload": self.workload,
            "workload_config": json.loads(self.workload_config) if self.workload_config else None,
        }
        return WorkloadRegistered(
            self.rollout_id, json.dumps(spec, sort_keys=True), [self.rollout_id], topology, Header.now_ms(), writer
        )

    @classmethod
    def from_registration(cls, registration: WorkloadRegistered) -> Fork | None:
        """The fork a registration records; None for a workload's own registration."""
        try:
            doc = json.loads(registration.spec_json)
        except ValueError:
            return None
        if not isinstance(doc, dict) or doc.get("format") != FORK_FORMAT:
            return None
        try:
            config = doc.get("workload_config")
            return cls(
                registration.name,
                str(doc["origin"]),
                int(doc["at_turn"]),
                None if doc.get("seed") is None else int(doc["seed"]),
                str(doc["workload"]),
                "" if config is None else json.dumps(config, sort_keys=True),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise UnknownRolloutSpecError(
                f"fork registration {registration.name!r} is unreadable ({exc!r}): {registration.spec_json}"
            ) from None


def forks_in(workloads: Mapping[str, WorkloadRegistered]) -> dict[str, Fork]:
    """Every fork the registrations record, by the fork's rollout id."""
    return {fork.rollout_id: fork for fork in map(Fork.from_registration, workloads.values()) if fork is not None}


def next_fork_id(origin: str, taken: Iterable[str]) -> str:
    """``<origin>.fork-<n>`` with the smallest n above every fork of ``origin`` in ``taken``."""
    pattern = re.compile(re.escape(origin + FORK_MARK) + r"(\d+)$")
    used = [int(m.group(1)) for name in taken if (m := pattern.match(name))]
    return f"{origin}{FORK_MARK}{max(used, default=0) + 1}"


def as_fork(origin: RolloutSpec, fork: Fork) -> RolloutSpec:
    """The spec of ``fork``: its origin's task and group, its own id, and the seeds it samples with."""
    return dataclasses.replace(
        origin,
        rollout_id=fork.rollout_id,
        forked_from=fork.forked_from,
        seed=origin.seed if fork.seed is None else fork.seed,
        seed_rollout=(origin.seed_rollout or origin.rollout_id) if fork.seed is None else fork.rollout_id,
    )


def fork_specs(own: Iterable[RolloutSpec], workloads: Mapping[str, WorkloadRegistered]) -> list[RolloutSpec]:
    """The specs of every fork (and fork of a fork) of the ``own`` rollouts the registrations record."""
    known = {spec.rollout_id: spec for spec in own}
    pending = sorted(forks_in(workloads).values(), key=lambda f: f.rollout_id)
    found: list[RolloutSpec] = []
    while True:  # a fork of a fork needs its origin's spec first
        ready = [f for f in pending if f.origin in known]
        if not ready:
            return found
        for fork in ready:
            known[fork.rollout_id] = spec = as_fork(known[fork.origin], fork)
            found.append(spec)
            pending.remove(fork)


def resolve_spec(rollout_id: str, workloads: Mapping[str, WorkloadRegistered]) -> tuple[WorkloadConfig, RolloutSpec]:
    """The workload config and spec of any rollout the journal's registrations name (a fork's too).

    Raises :class:`UnknownRolloutSpecError` naming what is missing."""
    forks = forks_in(workloads)
    chain: list[Fork] = []
    root = rollout_id
    while root in forks:
        chain.append(forks[root])
        root = forks[root].origin
        if len(chain) > len(forks):
            raise UnknownRolloutSpecError(f"the fork registrations of {rollout_id!r} form a cycle")
    config, redispatched = None, {}
    for registration in workloads.values():
        if root in registration.rollout_ids and Fork.from_registration(registration) is None:
            config = _config_of(registration.name, registration.spec_json)
            redispatched = registration.redispatched
    if config is None and chain and chain[-1].workload_config:  # a journal of forks (fork --journal-out)
        config = _config_of(chain[-1].workload, chain[-1].workload_config)
    if config is not None:
        spec = next((s for s in workload_specs(config, redispatched) if s.rollout_id == root), None)
        if spec is None:
            raise UnknownRolloutSpecError(
                f"workload {config.name!r} does not make rollout {root!r} with its recorded config"
            )
        for fork in reversed(chain):
            spec = as_fork(spec, fork)
        return config, spec
    known = sorted(workloads)
    raise UnknownRolloutSpecError(
        f"no workload registration in this journal names rollout {root!r} (registrations: "
        f"{', '.join(known) or 'none'}); its task and environment are unknown"
    )


def registered_specs(workloads: Mapping[str, WorkloadRegistered]) -> dict[str, RolloutSpec]:
    """The spec of every rollout the registrations name: each workload's own and every fork's.
    Raises :class:`UnknownRolloutSpecError` naming a registration that does not say its task."""
    specs: dict[str, RolloutSpec] = {}
    for registration in workloads.values():
        for rollout_id in registration.rollout_ids:
            specs[rollout_id] = resolve_spec(rollout_id, workloads)[1]
    return specs


def _config_of(name: str, spec_json: str) -> WorkloadConfig:
    try:
        return WorkloadConfig.model_validate_json(spec_json)
    except ValidationError as exc:
        raise UnknownRolloutSpecError(
            f"workload {name!r} was registered without a readable config (written by 0.1.0?): "
            f"{exc.errors()[0]['msg'] if exc.errors() else exc}"
        ) from None
