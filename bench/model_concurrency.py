"""Rollouts/s at concurrency 1 and 12 against a model server answering in about 50 ms.

    python bench/model_concurrency.py [--json] [--rollouts N] [--turns N] [--latency-ms MS]

The "server" is the real embedded model (the torch backend) behind an awaited delay of
``--latency-ms`` per call, what one HTTP round trip to a model server costs; the compute
itself runs off the event loop. The same workload (file journal, durable commits) runs
with ``concurrency`` and ``max_concurrent_calls`` 1, then 12; ``speedup_12_vs_1`` is
the ratio of rollouts/s. Before calls were async, 36 such calls took 2.8 s at
concurrency 1 and 3.0 s at 12 (the model blocked the event loop).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import AsyncGenerator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rollout_journal.participants.model.generation import GenerationBackend, GenerationRequest, TokenChunk  # noqa: E402
from rollout_journal.participants.workload.config import WorkloadConfig  # noqa: E402
from rollout_journal.participants.workload.run import build_backend, open_workload_journal  # noqa: E402
from rollout_journal.participants.workload.runner import Runner  # noqa: E402


class RemoteLatency:
    """A backend plus a fixed awaited latency per call (a model server's round trip)."""

    def __init__(self, inner: GenerationBackend, latency_s: float) -> None:
        self.inner, self.latency_s = inner, latency_s
        self.tokenizer, self.policy_version = inner.tokenizer, inner.policy_version
        self.deterministic, self.resumes_constrained = inner.deterministic, inner.resumes_constrained
        self.logprob_mode = inner.logprob_mode

    def set_policy_version(self, version: str) -> None:
        self.inner.set_policy_version(version)
        self.policy_version = version

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[TokenChunk, None]:
        await asyncio.sleep(self.latency_s)
        async for chunk in self.inner.stream(request):
            yield chunk

    async def aclose(self) -> None:
        await self.inner.aclose()


def one_run(tmp: Path, name: str, concurrency: int, rollouts: int, turns: int, latency_s: float) -> dict:
    config = WorkloadConfig(
        name=name,
        groups=rollouts // 3,
        siblings=3,
        max_turns=turns,
        seed=5,
        environment="workplace",
        allow_early_submit=False,
        journal=str(tmp / name),
        concurrency=concurrency,
    )
    config = config.model_copy(update={"model": config.model.model_copy(update={"max_concurrent_calls": concurrency})})
    backend = RemoteLatency(build_backend(config), latency_s)
    with open_workload_journal(config) as journal:
        runner = Runner(config, journal, backend, backend.tokenizer)
        started = time.perf_counter()
        report = asyncio.run(runner.run(resume=False))
        seconds = time.perf_counter() - started
    return {
        "concurrency": concurrency,
        "seconds": round(seconds, 3),
        "turns": report.turns_run,
        "rollouts_per_s": round(len(report.outcomes()) / seconds, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rollouts", type=int, default=12)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--latency-ms", type=float, default=50.0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rj-bench-conc-") as tmp:
        runs = [one_run(Path(tmp), f"c{c}", c, args.rollouts, args.turns, args.latency_ms / 1000) for c in (1, 12)]
    report = {
        "latency_ms": args.latency_ms,
        "rollouts": args.rollouts,
        "turns": args.turns,
        "rollouts_per_s_concurrency_1": runs[0]["rollouts_per_s"],
        "rollouts_per_s_concurrency_12": runs[1]["rollouts_per_s"],
        "speedup_12_vs_1": round(runs[1]["rollouts_per_s"] / runs[0]["rollouts_per_s"], 2),
        "runs": runs,
    }
    print(
        json.dumps(report, indent=2)
        if args.json
        else f"rollouts/s: {report['rollouts_per_s_concurrency_1']} at concurrency 1, "
        f"{report['rollouts_per_s_concurrency_12']} at 12 ({report['speedup_12_vs_1']}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
