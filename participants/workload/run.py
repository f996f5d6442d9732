"""Run or resume a whole workload: open its journal, build its model, drive it."""

from __future__ import annotations

import asyncio
import atexit
import gc
import logging
from collections.abc import Callable

import torch

from rollout_journal.journal.anchoring import HeadSigner
from rollout_journal.journal.errors import ConfigurationError
from rollout_journal.journal.journal import Journal
from rollout_journal.journal.open import is_kafka_url, open_journal
from rollout_journal.participants.model.generation import GenerationBackend
from rollout_journal.participants.model.tiny_model import model_folder
from rollout_journal.participants.workload.config import WorkloadConfig
from rollout_journal.participants.workload.runner import Runner, RunReport

log = logging.getLogger(__name__)

TurnCallback = Callable[[str, int], None]


def build_backend(config: WorkloadConfig) -> GenerationBackend:
    """The workload's model: its folder (``model.path``, or the embedded tiny Llama) loaded by
    the configured backend. Process-wide settings are made here, by the program, not the
    library: torch's thread count, vLLM's environment, and a garbage-collector freeze once
    the model is built."""
    model = config.model
    torch.set_num_threads(model.torch_threads)
    folder = model_folder(model)
    backend: GenerationBackend
    if model.backend == "torch":
        from rollout_journal.participants.model.torch_backend import TorchPolicy

        backend = TorchPolicy(folder)
    elif model.backend == "vllm":
        from rollout_journal.participants.model.vllm_backend import VllmBackend, VllmEngine

        backend = VllmBackend(
            VllmEngine.shared(
                folder, dtype=model.dtype, max_model_len=model.max_model_len, kv_cache_gib=model.kv_cache_gib
            )
        )
    else:
        from rollout_journal.participants.model.openai_backend import OpenAIBackend

        assert model.url is not None  # checked by ModelConfig
        backend = OpenAIBackend(
            model.url,
            folder,
            served_model=model.served_model,
            timeout_s=model.request_timeout_s,
            accept_raw_logprobs=model.server_logprobs == "accept_raw",
        )
    # The imported libraries, the weights and the tokenizer live as long as the process. Frozen,
    # they drop out of the collector's full passes, which otherwise walk some 200k objects
    # (about 85 ms here) every few hundred turns.
    gc.collect()
    gc.freeze()
    # ...until the process exits: objects still frozen then are never freed, and native libraries
    # that count their live objects (triton's nanobind bindings, imported by torch) print warnings.
    atexit.register(gc.unfreeze)
    return backend


def open_workload_journal(config: WorkloadConfig) -> Journal:
    """The journal a workload writes, with the workload's group-commit linger."""
    try:
        return open_journal(
            config.journal,
            writer=config.writer,
            linger_ms=config.journal_linger_ms,
            snapshot_block_bytes=config.snapshot_block_bytes,
        )
    except OSError as exc:  # a directory that cannot be made or written (checked earlier where it could be)
        where = f" ({exc.filename})" if exc.filename else ""
        raise ConfigurationError(
            f"journal {config.journal} cannot be opened for writing: {exc.strerror or exc}{where}"
        ) from exc


def run_workload(
    config: WorkloadConfig,
    *,
    resume: bool,
    on_turn: TurnCallback | None = None,
    stop_after: dict[str, int] | None = None,
    topology_override: str | None = None,
) -> RunReport:
    """Run every rollout of ``config`` to the end; with ``resume``, continue what the journal holds.
    With ``ROLLOUT_JOURNAL_SIGNING_KEY`` set, every commit of mutations carries signed chain heads.
    ``topology_override`` (why) lets a resume continue with other model, sampling, environment or
    max_turns settings than the journal's rollouts ran with (see ``Runner``).

    On a Kafka namespace the run is a member of the namespace's consumer group, like a fleet's
    worker, until the workload is done (``participants.workload.worker.run_as_member``): it writes
    only the partitions the group assigns it, so no second process can write its rollouts too."""
    if config.journaling and is_kafka_url(config.journal):
        from rollout_journal.participants.workload.worker import run_as_member

        return run_as_member(
            config, resume=resume, on_turn=on_turn, stop_after=stop_after, topology_override=topology_override
        )
    if not config.journaling:
        backend = build_backend(config)
        return asyncio.run(_run(Runner(config, None, backend, backend.tokenizer, progress=on_turn), resume=False))
    signer = HeadSigner.from_environment()
    if signer is not None:
        log.info("workload %s: signing chain heads with key id %s", config.name, signer.key_id)
    with open_workload_journal(config) as journal:
        backend = build_backend(config)
        runner = Runner(
            config,
            journal,
            backend,
            backend.tokenizer,
            progress=on_turn,
            signer=signer,
            topology_override=topology_override,
        )
        return asyncio.run(_run(runner, resume=resume, stop_after=stop_after))


async def _run(runner: Runner, *, resume: bool, stop_after: dict[str, int] | None = None) -> RunReport:
    """Run, then release what the backend holds for this event loop (connections, threads)."""
    try:
        return await runner.run(resume=resume, stop_after=stop_after)
    finally:
        await runner.model.backend.aclose()
