"""Example environments, by name: ``make_environment("workplace", rollout_id, seed)``."""

from __future__ import annotations

from journal.errors import RolloutJournalError
from participants.environments.base import Environment, Observation, StepMutations
from participants.environments.counter import CounterEnvironment
from participants.environments.sandbox import SandboxEnvironment
from participants.environments.workplace import WorkplaceEnvironment

__all__ = [
    "ENVIRONMENTS",
    "Environment",
    "Observation",
    "StepMutations",
    "UnknownEnvironmentError",
    "environment_class",
    "make_environment",
]

ENVIRONMENTS: dict[str, type[Environment]] = {
    WorkplaceEnvironment.name: WorkplaceEnvironment,
    SandboxEnvironment.name: SandboxEnvironment,
    CounterEnvironment.name: CounterEnvironment,
}


class UnknownEnvironmentError(RolloutJournalError, LookupError):
    """No environment is registered under the requested name."""


def environment_class(name: str) -> type[Environment]:
    """The environment registered as ``name``; ``UnknownEnvironmentError`` names the known ones."""
    try:
        return ENVIRONMENTS[name]
    except KeyError:
        raise UnknownEnvironmentError(
            f"no environment named {name!r}; known environments: {', '.join(sorted(ENVIRONMENTS))}"
        ) from None


def make_environment(name: str, rollout_id: str, task_seed: int) -> Environment:
    """Build the environment registered as ``name`` for one rollout; same seed -> same task."""
    return environment_class(name)(rollout_id, task_seed)
