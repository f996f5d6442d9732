"""Participants of a rollout: the workload, the agent, the model, the resources.

Public API (import from here, not from the modules)::

    from participants import WorkloadConfig, run_workload, Runner, RolloutState

Names load lazily (PEP 562), so importing one (or a submodule such as
``participants.config``) never imports torch: only the model backend
(``TinyTorchPolicy``, ``build_backend``, ``run_workload``) does, when asked for.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    # the workload a user writes, and running it
    "WorkloadConfig": ".config",
    "ModelConfig": ".config",
    "TopologyChangedError": ".config",
    "check_journal_location": ".config",
    "run_workload": ".workload",
    "build_backend": ".workload",
    "open_workload_journal": ".workload",
    "Runner": ".runner",
    "RunReport": ".runner",
    "RolloutReport": ".runner",
    "RestoreTiming": ".runner",
    "workload_specs": ".runner",
    # a fleet of workers on one Kafka namespace
    "FleetWorker": ".worker",
    "WorkerReport": ".worker",
    "submit_workload": ".worker",
    # the rollout as an aggregate
    "RolloutSpec": ".rollout_state",
    "RolloutProgress": ".rollout_state",
    "RolloutState": ".rollout_state",
    "StateFoldError": ".rollout_state",
    "restore_state": ".rollout_state",
    # the agent, the model, checkpoints
    "Agent": ".agent",
    "LiveRollout": ".agent",
    "ModelParticipant": ".model",
    "Generation": ".generation",
    "GenerationBackend": ".generation",
    "TinyTorchPolicy": ".torch_policy",
    "ChatTokenizer": ".tokenizer",
    "default_tokenizer": ".tokenizer",
    "ActionTrie": ".constraints",
    "ConstraintViolation": ".constraints",
    "CoordinatedCheckpointer": ".checkpoint",
    "CheckpointReport": ".checkpoint",
    "ResourceServer": ".resource_server",
    "HttpStateExporter": ".resource_server",
    "InProcessExporter": ".resource_server",
    "ControlError": ".resource_server",
    "TransientControlError": ".resource_server",
    # resources and environments
    "Resource": ".resources",
    "Recovery": ".resources",
    "MutationRecord": ".resources",
    "MutationRequest": ".resources",
    "ResourceError": ".resources",
    "StaleEpochError": ".resources",
    "StateImportError": ".resources",
    "Environment": ".environments",
    "ENVIRONMENTS": ".environments",
    "UnknownEnvironmentError": ".environments",
    "make_environment": ".environments",
}

__all__ = [
    "ENVIRONMENTS",
    "ActionTrie",
    "Agent",
    "ChatTokenizer",
    "CheckpointReport",
    "ConstraintViolation",
    "ControlError",
    "CoordinatedCheckpointer",
    "Environment",
    "FleetWorker",
    "Generation",
    "GenerationBackend",
    "HttpStateExporter",
    "InProcessExporter",
    "LiveRollout",
    "ModelConfig",
    "ModelParticipant",
    "MutationRecord",
    "MutationRequest",
    "Recovery",
    "Resource",
    "ResourceError",
    "ResourceServer",
    "RestoreTiming",
    "RolloutProgress",
    "RolloutReport",
    "RolloutSpec",
    "RolloutState",
    "RunReport",
    "Runner",
    "StaleEpochError",
    "StateFoldError",
    "StateImportError",
    "TinyTorchPolicy",
    "TopologyChangedError",
    "TransientControlError",
    "UnknownEnvironmentError",
    "WorkerReport",
    "WorkloadConfig",
    "build_backend",
    "check_journal_location",
    "default_tokenizer",
    "make_environment",
    "open_workload_journal",
    "restore_state",
    "run_workload",
    "submit_workload",
    "workload_specs",
]

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ loads on first use
    from .agent import Agent, LiveRollout
    from .checkpoint import CheckpointReport, CoordinatedCheckpointer
    from .config import (
        ModelConfig,
        TopologyChangedError,
        WorkloadConfig,
        check_journal_location,
    )
    from .constraints import ActionTrie, ConstraintViolation
    from .environments import (
        ENVIRONMENTS,
        Environment,
        UnknownEnvironmentError,
        make_environment,
    )
    from .generation import Generation, GenerationBackend
    from .model import ModelParticipant
    from .resource_server import (
        ControlError,
        HttpStateExporter,
        InProcessExporter,
        ResourceServer,
        TransientControlError,
    )
    from .resources import (
        MutationRecord,
        MutationRequest,
        Recovery,
        Resource,
        ResourceError,
        StaleEpochError,
        StateImportError,
    )
    from .rollout_state import (
        RolloutProgress,
        RolloutSpec,
        RolloutState,
        StateFoldError,
        restore_state,
    )
    from .runner import RestoreTiming, RolloutReport, Runner, RunReport, workload_specs
    from .tokenizer import ChatTokenizer, default_tokenizer
    from .torch_policy import TinyTorchPolicy
    from .worker import FleetWorker, WorkerReport, submit_workload
    from .workload import build_backend, open_workload_journal, run_workload


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
