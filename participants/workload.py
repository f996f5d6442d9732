"""Run or resume a whole workload: open its journal, build its model, drive it."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Callable

import torch

from journal.anchoring import HeadSigner
from journal.journal import Journal
from journal.open import open_journal

from .config import WorkloadConfig
from .runner import Runner, RunReport
from .tokenizer import default_tokenizer
from .torch_policy import TinyTorchPolicy

log = logging.getLogger(__name__)

TurnCallback = Callable[[str, int], None]


def build_backend(config: WorkloadConfig) -> TinyTorchPolicy:
    """The workload's model. Process-wide settings are made here, by the program, not the library:
    torch's thread count, and a garbage-collector freeze once the model is built."""
    torch.set_num_threads(config.model.torch_threads)
    backend = TinyTorchPolicy(default_tokenizer(), weights_seed=config.model.weights_seed)
    # The imported libraries, the weights and the tokenizer live as long as the process. Frozen,
    # they drop out of the collector's full passes, which otherwise walk some 200k objects
    # (about 85 ms here) every few hundred turns.
    gc.collect()
    gc.freeze()
    return backend


def open_workload_journal(config: WorkloadConfig) -> Journal:
    """The journal a workload writes, with the workload's group-commit linger."""
    return open_journal(config.journal, writer=config.writer, linger_ms=config.journal_linger_ms)


def run_workload(config: WorkloadConfig, *, resume: bool, on_turn: TurnCallback | None = None,
                 stop_after: dict[str, int] | None = None) -> RunReport:
    """Run every rollout of ``config`` to the end; with ``resume``, continue what the journal holds.
    With ``ROLLOUT_JOURNAL_SIGNING_KEY`` set, every commit of mutations carries signed chain heads."""
    backend = build_backend(config)
    if not config.journaling:
        return asyncio.run(Runner(config, None, backend, backend.tokenizer, progress=on_turn).run(resume=False))
    signer = HeadSigner.from_environment()
    if signer is not None:
        log.info("workload %s: signing chain heads with key id %s", config.name, signer.key_id)
    with open_workload_journal(config) as journal:
        runner = Runner(config, journal, backend, backend.tokenizer, progress=on_turn, signer=signer)
        return asyncio.run(runner.run(resume=resume, stop_after=stop_after))
