"""The model: the admission gate, the generation protocol, its backends, tokenizers.

Public API (import from here)::

    from rollout_journal.participants.model import ModelParticipant, GenerationBackend, TorchPolicy

Names load lazily (PEP 562): importing this package, or a light module of it such as
``.generation``, never imports torch, transformers or vLLM; a backend loads them when asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollout_journal.participants.lazy_exports import lazy_exports as _lazy_exports

_EXPORTS: dict[str, str] = {
    "ModelParticipant": ".gate",
    "TokenSink": ".gate",
    "BackendError": ".generation",
    "Generation": ".generation",
    "GenerationBackend": ".generation",
    "GenerationRequest": ".generation",
    "TokenChunk": ".generation",
    "TorchPolicy": ".torch_backend",
    "VllmBackend": ".vllm_backend",
    "VllmEngine": ".vllm_backend",
    "OpenAIBackend": ".openai_backend",
    "ChatTokenizer": ".tokenizer",
    "default_tokenizer": ".tiny_model",
    "tiny_model_dir": ".tiny_model",
    "ActionTrie": ".constraints",
    "ConstraintViolation": ".constraints",
    "TokenConstraint": ".constraints",
    "Prompt": ".chat",
    "PromptBuilder": ".chat",
    "TemplateRewritesHistory": ".chat",
    "family_model_dir": ".families",
}

__all__ = [  # the names of _EXPORTS, spelled out for tools that read __all__ without running it
    "ActionTrie",
    "BackendError",
    "ChatTokenizer",
    "ConstraintViolation",
    "Generation",
    "GenerationBackend",
    "GenerationRequest",
    "ModelParticipant",
    "OpenAIBackend",
    "Prompt",
    "PromptBuilder",
    "TemplateRewritesHistory",
    "TokenChunk",
    "TokenConstraint",
    "TokenSink",
    "TorchPolicy",
    "VllmBackend",
    "VllmEngine",
    "default_tokenizer",
    "family_model_dir",
    "tiny_model_dir",
]

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ loads on first use
    from rollout_journal.participants.model.chat import Prompt, PromptBuilder, TemplateRewritesHistory
    from rollout_journal.participants.model.constraints import ActionTrie, ConstraintViolation, TokenConstraint
    from rollout_journal.participants.model.families import family_model_dir
    from rollout_journal.participants.model.gate import ModelParticipant, TokenSink
    from rollout_journal.participants.model.generation import (
        BackendError,
        Generation,
        GenerationBackend,
        GenerationRequest,
        TokenChunk,
    )
    from rollout_journal.participants.model.openai_backend import OpenAIBackend
    from rollout_journal.participants.model.tiny_model import default_tokenizer, tiny_model_dir
    from rollout_journal.participants.model.tokenizer import ChatTokenizer
    from rollout_journal.participants.model.torch_backend import TorchPolicy
    from rollout_journal.participants.model.vllm_backend import VllmBackend, VllmEngine


__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS, globals())
