"""The training data a journal gives a trainer is what the model sampled, on every backend.

One small workload per backend (torch constrained at T=0.7 with top_p and top_k, torch free-form
with reasoning, the ChatML and Llama-3 template families, vLLM in process, the OpenAI backend
against ``vllm serve``), journaled to a file, then read back as ``export-training`` reads it:

- every call with a parent starts with the parent's whole prompt + output;
- 100 % of the sampled tokens are under the training record's loss mask, with the logprobs
  journaled for them, in runs labelled ``processed``;
- each logprob equals a transformers recompute at the call's own sampling parameters and
  constraint within 1e-4.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_journal.participants.model.families import family_model_dir
from rollout_journal.participants.model.training_check import TrainingDataCheck, check_training_data, recompute_for
from rollout_journal.participants.workload.config import ModelConfig, WorkloadConfig
from rollout_journal.participants.workload.run import run_workload
from tests.support.vllm_fixtures import SERVED_NAME

pytestmark = pytest.mark.slow

SAMPLED = dict(temperature=0.7, top_p=0.9, top_k=20)
BACKENDS = {
    "torch-constrained": dict(model=dict(backend="torch", **SAMPLED)),
    "torch-free-reasoning": dict(
        model=dict(backend="torch", temperature=1.0, top_p=0.9, reasoning_tokens=24), constrained_actions=False
    ),
    "torch-chatml-free": dict(model=dict(backend="torch", **SAMPLED, family="chatml"), constrained_actions=False),
    "torch-llama3-reasoning": dict(model=dict(backend="torch", **SAMPLED, reasoning_tokens=16, family="llama3")),
    "vllm": dict(model=dict(backend="vllm", **SAMPLED, reasoning_tokens=24)),
    "openai": dict(model=dict(backend="openai", **SAMPLED, reasoning_tokens=24)),
}


def workload(name: str, journal: Path, request: pytest.FixtureRequest) -> WorkloadConfig:
    settings = dict(BACKENDS[name])
    model = dict(settings.pop("model"))
    family = model.pop("family", None)
    if family is not None:
        model["path"] = str(family_model_dir(family))
    if model["backend"] == "vllm":
        request.getfixturevalue("vllm_engine")
    if model["backend"] == "openai":
        model |= {"url": request.getfixturevalue("vllm_server"), "served_model": SERVED_NAME}
    return WorkloadConfig(
        name="td",
        groups=1,
        siblings=2,
        max_turns=3,
        environment="workplace",
        seed=7,
        allow_early_submit=False,
        journal=str(journal),
        model=ModelConfig(**model),
        **settings,
    )


@pytest.fixture(scope="module", params=list(BACKENDS))
def checked(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TrainingDataCheck:
    config = workload(request.param, tmp_path_factory.mktemp(request.param) / "journal", request)
    run_workload(config, resume=False)
    return check_training_data(config.journal, recompute_for(config))


def test_every_call_continues_its_parents_prompt_and_output(checked: TrainingDataCheck) -> None:
    assert checked.rollouts == 2 and checked.calls >= 6
    assert checked.calls_drifted == 0, checked.problems
    assert set(checked.continuations) <= {"first", "extend"}, checked.continuations


def test_every_sampled_token_is_under_the_loss_mask_with_its_logprob(checked: TrainingDataCheck) -> None:
    assert checked.sampled_tokens > 0
    assert checked.sampled_tokens_in_loss_mask == checked.sampled_tokens, checked.problems
    assert checked.sampled_tokens_with_their_logprob == checked.sampled_tokens, checked.problems
    assert dict(checked.logprob_modes) == {"processed": checked.sampled_tokens}


def test_the_logprobs_are_those_of_the_distribution_sampled_from(checked: TrainingDataCheck) -> None:
    assert checked.logprob_max_abs_error is not None and checked.logprob_max_abs_error <= 1e-4, checked.as_json()
