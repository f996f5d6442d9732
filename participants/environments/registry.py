"""Which class an environment name means: a built-in, ``package.module:Class``, or an entry point.

A workload names its environment in one of three ways, tried in this order:

1. a built-in name: ``workplace``, ``counter``, ``sandbox``;
2. ``package.module:Class`` (``Class`` may be dotted, ``module:Outer.Inner``): imported from
   wherever Python finds it (``PYTHONPATH``, an installed package);
3. a name registered by an installed distribution in the entry point group
   ``rollout_journal.environments``, e.g. in its ``pyproject.toml``::

       [project.entry-points."rollout_journal.environments"]
       notes = "my_envs.notes:NotesEnvironment"

Whatever the way, the class must subclass :class:`~rollout_journal.participants.environments.base.Environment`.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from rollout_journal.journal.errors import RolloutJournalError
from rollout_journal.participants.environments.base import Environment
from rollout_journal.participants.environments.counter import CounterEnvironment
from rollout_journal.participants.environments.sandbox import SandboxEnvironment
from rollout_journal.participants.environments.tasks import Task
from rollout_journal.participants.environments.workplace import WorkplaceEnvironment

__all__ = ["ENTRY_POINT_GROUP", "ENVIRONMENTS", "UnknownEnvironmentError", "environment_class", "make_environment"]

ENTRY_POINT_GROUP = "rollout_journal.environments"

ENVIRONMENTS: dict[str, type[Environment]] = {
    WorkplaceEnvironment.name: WorkplaceEnvironment,
    SandboxEnvironment.name: SandboxEnvironment,
    CounterEnvironment.name: CounterEnvironment,
}


class UnknownEnvironmentError(RolloutJournalError, LookupError):
    """No environment is known under the requested name, or the name does not load one."""


def environment_class(name: str) -> type[Environment]:
    """The environment class ``name`` means; ``UnknownEnvironmentError`` says why none."""
    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name]
    if ":" in name:
        return _checked(name, _import(name))
    found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if found:
        try:
            loaded = found[0].load()
        except (ImportError, AttributeError) as exc:
            raise UnknownEnvironmentError(
                f"environment {name!r} (entry point {found[0].value!r} of group "
                f"{ENTRY_POINT_GROUP}) does not load: {exc}"
            ) from exc
        return _checked(name, loaded)
    registered = sorted(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
    known = sorted(ENVIRONMENTS) + registered
    raise UnknownEnvironmentError(
        f"no environment named {name!r}; known environments: {', '.join(known)}; or name your own as "
        f"package.module:Class, or register it in the entry point group {ENTRY_POINT_GROUP}"
    )


def make_environment(name: str, rollout_id: str, task: Task | int) -> Environment:
    """Build the environment ``name`` means for one rollout; the same task gives the same environment."""
    return environment_class(name)(rollout_id, task)


def _import(name: str) -> object:
    module_name, _, attribute = name.partition(":")
    try:
        target: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise UnknownEnvironmentError(
            f"environment {name!r}: module {module_name!r} cannot be imported ({exc}); "
            "is its package installed or on PYTHONPATH?"
        ) from exc
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise UnknownEnvironmentError(
                f"environment {name!r}: module {module_name!r} has no {attribute!r}"
            ) from None
    return target


def _checked(name: str, loaded: object) -> type[Environment]:
    if not (isinstance(loaded, type) and issubclass(loaded, Environment)):
        raise UnknownEnvironmentError(
            f"environment {name!r} is {loaded!r}, not a subclass of "
            "rollout_journal.participants.environments.Environment"
        )
    return loaded
