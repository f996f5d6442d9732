"""Shared pieces of the failure-policy tests: a workload whose infrastructure dies under one
rollout (its sandbox SIGKILLed between turns), and what the results stream holds."""

from __future__ import annotations

import asyncio
import os
import signal

from rollout_journal.journal.events import TrainingRecord
from rollout_journal.journal.open import open_backend, open_journal
from rollout_journal.journal.results import ResultsDecoder
from rollout_journal.participants.workload.config import WorkloadConfig
from rollout_journal.participants.workload.run import build_backend
from rollout_journal.participants.workload.runner import Runner, RunReport


def run_killing(
    config: WorkloadConfig, victims: set[str], attempts: int | None = None, *, resume: bool = False
) -> RunReport:
    """Run the workload (a sandbox one, ``turns_in_flight: 1``); whenever a victim's turn 0 is
    durable (in its first ``attempts`` attempts; None: in every one), SIGKILL its sandbox before
    its next step: the infrastructure dies under the rollout."""

    async def scenario() -> RunReport:
        backend = build_backend(config)
        with open_journal(config.journal) as journal:
            runner: Runner | None = None

            def on_turn(rollout_id: str, turn: int) -> None:
                assert runner is not None
                if rollout_id not in victims or turn != 0:
                    return
                live = runner.live[rollout_id]
                if attempts is None or live.state.attempt <= attempts:
                    os.kill(live.env.python.pid, signal.SIGKILL)  # type: ignore[attr-defined]

            runner = Runner(config, journal, backend, backend.tokenizer, progress=on_turn)
            try:
                return await runner.run(resume=resume)
            finally:
                await backend.aclose()

    return asyncio.run(scenario())


def published(location: str) -> dict[str, TrainingRecord]:
    """Every record on the results stream, by rollout (the last one of a rollout wins)."""
    decoder, out = ResultsDecoder(), {}
    backend = open_backend(location, read_only=True)
    try:
        for partition in range(backend.partitions):
            for stored in backend.read_results(partition):
                result = decoder.add(stored)
                if result is not None:
                    out[result.record.rollout_id] = result.record
    finally:
        backend.close()
    assert not decoder.errors, decoder.errors
    return out
