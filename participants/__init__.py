"""Participants of a rollout: the workload, the agent, the model, the resources.

Public API (import from here, not from the modules)::

    from rollout_journal.participants import WorkloadConfig, run_workload, Runner, RolloutState

Names load lazily (PEP 562), so importing one (or a submodule such as
``rollout_journal.participants.workload.config``) never imports torch: only the model backend
(``TorchPolicy``, ``build_backend``, ``run_workload``) does, when asked for; vLLM is imported
only by the ``vllm`` backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollout_journal.participants.lazy_exports import lazy_exports as _lazy_exports

_EXPORTS: dict[str, str] = {
    # the workload a user writes, and running it
    "WorkloadConfig": ".workload.config",
    "ModelConfig": ".workload.config",
    "TopologyChangedError": ".workload.config",
    "check_journal_location": ".workload.config",
    "run_workload": ".workload.run",
    "build_backend": ".workload.run",
    "open_workload_journal": ".workload.run",
    "Runner": ".workload.runner",
    "RunReport": ".workload.reports",
    "RolloutReport": ".workload.reports",
    "RestoreTiming": ".workload.reports",
    "workload_specs": ".workload.specs",
    "RolloutSpec": ".workload.specs",
    # a fleet of workers on one Kafka namespace
    "FleetWorker": ".workload.worker",
    "WorkerReport": ".workload.worker",
    "submit_workload": ".workload.worker",
    # the rollout as an aggregate
    "RolloutProgress": ".rollout.state",
    "RolloutState": ".rollout.state",
    "StateFoldError": ".rollout.state",
    "restore_state": ".rollout.state",
    # the trainer's side: complete prompt groups from the results stream, exactly once
    "TrainerFeed": ".trainer",
    "PromptGroup": ".trainer",
    "FeedPosition": ".trainer",
    "WaitingGroup": ".trainer",
    "TokenLineage": ".rollout.lineage",
    # the agent, the model, checkpoints
    "Agent": ".workload.agent",
    "LiveRollout": ".workload.agent",
    "ModelParticipant": ".model.gate",
    "Generation": ".model.generation",
    "GenerationBackend": ".model.generation",
    "GenerationRequest": ".model.generation",
    "BackendError": ".model.generation",
    "TorchPolicy": ".model.torch_backend",
    "VllmBackend": ".model.vllm_backend",
    "VllmEngine": ".model.vllm_backend",
    "OpenAIBackend": ".model.openai_backend",
    "tiny_model_dir": ".model.tiny_model",
    "ChatTokenizer": ".model.tokenizer",
    "default_tokenizer": ".model.tiny_model",
    "ActionTrie": ".model.constraints",
    "ConstraintViolation": ".model.constraints",
    "CoordinatedCheckpointer": ".workload.checkpoint",
    "CheckpointReport": ".workload.checkpoint",
    # token-in-token-out prompts over real chat templates
    "PromptBuilder": ".model.chat",
    "Prompt": ".model.chat",
    "TemplateRewritesHistory": ".model.chat",
    "family_model_dir": ".model.families",
    # resource servers: environments behind HTTP
    "ResourceServer": ".remote.server",
    "serve_resources": ".remote.server",
    "RemoteEnvironment": ".remote.client",
    "EnvironmentFactory": ".remote.client",
    "ServiceToken": ".remote.protocol",
    "ControlError": ".remote.protocol",
    "TransientControlError": ".remote.protocol",
    "ResourceSessionLostError": ".remote.protocol",
    # any agent loop: the session API and the journaling gateway
    "SessionFactory": ".session",
    "RolloutSession": ".session",
    "RolloutRef": ".session",
    "ModelRequest": ".session",
    "ToolRequest": ".session",
    "ChatSession": ".session",
    "NondeterminismError": ".session",
    "GatewayConfig": ".remote.gateway",
    "GatewayServer": ".remote.gateway",
    "serve_gateway": ".remote.gateway",
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
    "ChatSession",
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
    "GatewayConfig",
    "GatewayServer",
    "Generation",
    "GenerationBackend",
    "GenerationRequest",
    "LiveRollout",
    "ModelConfig",
    "ModelParticipant",
    "ModelRequest",
    "MutationRecord",
    "MutationRequest",
    "NondeterminismError",
    "OpenAIBackend",
    "Prompt",
    "PromptBuilder",
    "PromptGroup",
    "Recovery",
    "RemoteEnvironment",
    "Resource",
    "ResourceError",
    "ResourceServer",
    "ResourceSessionLostError",
    "RestoreTiming",
    "RolloutProgress",
    "RolloutRef",
    "RolloutReport",
    "RolloutSession",
    "RolloutSpec",
    "RolloutState",
    "RunReport",
    "Runner",
    "ServiceToken",
    "SessionFactory",
    "StaleEpochError",
    "StateFoldError",
    "StateImportError",
    "StepContext",
    "Task",
    "TemplateRewritesHistory",
    "TokenLineage",
    "ToolCall",
    "ToolRequest",
    "TopologyChangedError",
    "TorchPolicy",
    "TrainerFeed",
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
    "family_model_dir",
    "load_tasks",
    "make_environment",
    "open_workload_journal",
    "restore_state",
    "run_workload",
    "serve_gateway",
    "serve_resources",
    "submit_workload",
    "tiny_model_dir",
    "workload_specs",
]

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ loads on first use
    from rollout_journal.participants.environments import (
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
    from rollout_journal.participants.model.chat import Prompt, PromptBuilder, TemplateRewritesHistory
    from rollout_journal.participants.model.constraints import ActionTrie, ConstraintViolation
    from rollout_journal.participants.model.families import family_model_dir
    from rollout_journal.participants.model.gate import ModelParticipant
    from rollout_journal.participants.model.generation import (
        BackendError,
        Generation,
        GenerationBackend,
        GenerationRequest,
    )
    from rollout_journal.participants.model.openai_backend import OpenAIBackend
    from rollout_journal.participants.model.tiny_model import default_tokenizer, tiny_model_dir
    from rollout_journal.participants.model.tokenizer import ChatTokenizer
    from rollout_journal.participants.model.torch_backend import TorchPolicy
    from rollout_journal.participants.model.vllm_backend import VllmBackend, VllmEngine
    from rollout_journal.participants.remote.client import EnvironmentFactory, RemoteEnvironment
    from rollout_journal.participants.remote.gateway import GatewayConfig, GatewayServer, serve_gateway
    from rollout_journal.participants.remote.protocol import (
        ControlError,
        ResourceSessionLostError,
        ServiceToken,
        TransientControlError,
    )
    from rollout_journal.participants.remote.server import ResourceServer, serve_resources
    from rollout_journal.participants.resources import (
        MutationRecord,
        MutationRequest,
        Recovery,
        Resource,
        ResourceError,
        StaleEpochError,
        StateImportError,
    )
    from rollout_journal.participants.rollout.lineage import TokenLineage
    from rollout_journal.participants.rollout.state import (
        RolloutProgress,
        RolloutState,
        StateFoldError,
        restore_state,
    )
    from rollout_journal.participants.session import (
        ChatSession,
        ModelRequest,
        NondeterminismError,
        RolloutRef,
        RolloutSession,
        SessionFactory,
        ToolRequest,
    )
    from rollout_journal.participants.trainer import FeedPosition, PromptGroup, TrainerFeed, WaitingGroup
    from rollout_journal.participants.workload.agent import Agent, LiveRollout
    from rollout_journal.participants.workload.checkpoint import CheckpointReport, CoordinatedCheckpointer
    from rollout_journal.participants.workload.config import (
        ModelConfig,
        TopologyChangedError,
        WorkloadConfig,
        check_journal_location,
    )
    from rollout_journal.participants.workload.reports import RestoreTiming, RolloutReport, RunReport
    from rollout_journal.participants.workload.run import build_backend, open_workload_journal, run_workload
    from rollout_journal.participants.workload.runner import Runner
    from rollout_journal.participants.workload.specs import RolloutSpec, workload_specs
    from rollout_journal.participants.workload.worker import FleetWorker, WorkerReport, submit_workload


__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS, globals())
