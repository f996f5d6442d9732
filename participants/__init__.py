"""Participants of a rollout: the workload, the agent, the model, the resources.

Public API (import from here, not from the modules)::

    from participants import WorkloadConfig, run_workload, Runner, RolloutState

Names load lazily (PEP 562), so importing one (or a submodule such as
``participants.config``) never imports torch: only the model backend
(``TorchPolicy``, ``build_backend``, ``run_workload``) does, when asked for; vLLM is imported
only by the ``vllm`` backend.
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
    "workload_specs": ".specs",
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
    # the trainer's side: complete prompt groups from the results stream, exactly once
    "TrainerFeed": ".trainer",
    "PromptGroup": ".trainer",
    "FeedPosition": ".trainer",
    "WaitingGroup": ".trainer",
    "TokenLineage": ".token_lineage",
    # the agent, the model, checkpoints
    "Agent": ".agent",
    "LiveRollout": ".agent",
    "ModelParticipant": ".model",
    "Generation": ".generation",
    "GenerationBackend": ".generation",
    "GenerationRequest": ".generation",
    "BackendError": ".generation",
    "TorchPolicy": ".torch_policy",
    "VllmBackend": ".vllm_backend",
    "VllmEngine": ".vllm_backend",
    "OpenAIBackend": ".openai_backend",
    "tiny_model_dir": ".tiny_model",
    "ChatTokenizer": ".tokenizer",
    "default_tokenizer": ".tokenizer",
    "ActionTrie": ".constraints",
    "ConstraintViolation": ".constraints",
    "CoordinatedCheckpointer": ".checkpoint",
    "CheckpointReport": ".checkpoint",
    # resource servers: environments behind HTTP
    "ResourceServer": ".resource_server",
    "serve_resources": ".resource_server",
    "RemoteEnvironment": ".resource_client",
    "EnvironmentFactory": ".resource_client",
    "ServiceToken": ".resource_protocol",
    "ControlError": ".resource_protocol",
    "TransientControlError": ".resource_protocol",
    "ResourceSessionLostError": ".resource_protocol",
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
    "environment_class": ".environments",
    "Task": ".environments",
    "load_tasks": ".environments",
    "ToolCall": ".environments",
    "StepContext": ".environments",
}

__all__ = [  # the names of _EXPORTS, spelled out for tools that read __all__ without running it
    "ActionTrie",
    "Agent",
    "BackendError",
    "ChatTokenizer",
    "CheckpointReport",
    "ConstraintViolation",
    "ControlError",
    "CoordinatedCheckpointer",
    "ENVIRONMENTS",
    "Environment",
    "EnvironmentFactory",
    "FeedPosition",
    "FleetWorker",
    "Generation",
    "GenerationBackend",
    "GenerationRequest",
    "LiveRollout",
    "ModelConfig",
    "ModelParticipant",
    "MutationRecord",
    "MutationRequest",
    "OpenAIBackend",
    "PromptGroup",
    "Recovery",
    "RemoteEnvironment",
    "Resource",
    "ResourceError",
    "ResourceServer",
    "ResourceSessionLostError",
    "RestoreTiming",
    "RolloutProgress",
    "RolloutReport",
    "RolloutSpec",
    "RolloutState",
    "RunReport",
    "Runner",
    "ServiceToken",
    "StaleEpochError",
    "StateFoldError",
    "StateImportError",
    "StepContext",
    "Task",
    "TokenLineage",
    "ToolCall",
    "TopologyChangedError",
    "TrainerFeed",
    "TorchPolicy",
    "TransientControlError",
    "UnknownEnvironmentError",
    "VllmBackend",
    "VllmEngine",
    "WaitingGroup",
    "WorkerReport",
    "WorkloadConfig",
    "build_backend",
    "check_journal_location",
    "default_tokenizer",
    "environment_class",
    "load_tasks",
    "make_environment",
    "open_workload_journal",
    "restore_state",
    "run_workload",
    "serve_resources",
    "submit_workload",
    "tiny_model_dir",
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
        StepContext,
        Task,
        ToolCall,
        UnknownEnvironmentError,
        environment_class,
        load_tasks,
        make_environment,
    )
    from .generation import BackendError, Generation, GenerationBackend, GenerationRequest
    from .model import ModelParticipant
    from .openai_backend import OpenAIBackend
    from .resource_client import EnvironmentFactory, RemoteEnvironment
    from .resource_protocol import (
        ControlError,
        ResourceSessionLostError,
        ServiceToken,
        TransientControlError,
    )
    from .resource_server import ResourceServer, serve_resources
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
    from .tiny_model import tiny_model_dir
    from .token_lineage import TokenLineage
    from .tokenizer import ChatTokenizer, default_tokenizer
    from .torch_policy import TorchPolicy
    from .trainer import FeedPosition, PromptGroup, TrainerFeed, WaitingGroup
    from .vllm_backend import VllmBackend, VllmEngine
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
