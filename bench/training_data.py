"""Is the training data what the model sampled? Per backend, from real journals.

    python bench/training_data.py --json [--backends torch-constrained,torch-reasoning,vllm,openai]
                                  [--groups 2 --siblings 2 --turns 3] [--server-url URL]

Each backend runs the same workplace workload (seed 7, submit held back to the last turn) into
a temporary file journal, then the journal is read back as ``export-training`` reads it
(``rollout_journal.participants.model.training_check``):

- ``calls``, ``calls_drifted``: model calls of the finished rollouts' conversations, and those
  whose prompt does not start with their parent's whole prompt + output (their parent's
  sampled tokens after ``prefix_len`` are missing from the record);
- ``sampled_tokens``, ``sampled_tokens_in_loss_mask``: tokens those calls sampled, and those the
  training record holds under its loss mask, at their place, with the logprob journaled for them;
- ``logprob_max_abs_error``: each journaled logprob against one transformers forward pass over
  the call's prompt + output at the call's own sampling parameters and constraint (processed:
  mask, temperature, top-k, top-p, renormalized);
- ``template_mismatch_calls``: the baseline beside it: calls whose prompt a re-render of the
  conversation's text by the chat template would have tokenized otherwise (what building prompts
  from text, the code before issue 16, would have changed).

Top level: ``all_sampled_tokens_in_loss_mask`` and ``max_logprob_error``. Workloads: torch
constrained at T=0.7, top_p 0.9, top_k 20; torch free-form with a 32-token reasoning segment at
T=1, top_p 0.9; vLLM in process and the OpenAI backend against ``vllm serve`` (started here with
``--logprobs-mode processed_logprobs`` unless ``--server-url``), constrained with reasoning at
T=0.7, top_p 0.9, top_k 20. Wrap runs in ``flock /work/locks/heavy`` on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rollout_journal.participants.model.tiny_model import tiny_model_dir
from rollout_journal.participants.model.training_check import check_training_data, recompute_for
from rollout_journal.participants.model.vllm_backend import vllm_environment
from rollout_journal.participants.workload.config import ModelConfig, WorkloadConfig
from rollout_journal.participants.workload.run import run_workload

SAMPLED = {"temperature": 0.7, "top_p": 0.9, "top_k": 20}
WORKLOADS: dict[str, dict] = {
    "torch-constrained": {"model": {"backend": "torch", **SAMPLED}},
    "torch-reasoning": {
        "model": {"backend": "torch", "temperature": 1.0, "top_p": 0.9, "reasoning_tokens": 32},
        "constrained_actions": False,
    },
    "vllm": {"model": {"backend": "vllm", **SAMPLED, "reasoning_tokens": 32}},
    "openai": {"model": {"backend": "openai", **SAMPLED, "reasoning_tokens": 32}},
}
SERVED = "tiny"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def workload(name: str, journal: Path, args: argparse.Namespace, url: str | None) -> WorkloadConfig:
    settings = dict(WORKLOADS[name])
    model = dict(settings.pop("model"))
    if model["backend"] == "openai":
        model |= {"url": url, "served_model": SERVED}
    return WorkloadConfig(
        name="td",
        groups=args.groups,
        siblings=args.siblings,
        max_turns=args.turns,
        environment="workplace",
        seed=7,
        allow_early_submit=False,
        journal=str(journal),
        model=ModelConfig(**model),
        **settings,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def vllm_server() -> Iterator[str]:
    """vLLM's OpenAI-compatible server over the embedded model, reporting processed logprobs."""
    port = _free_port()
    env = os.environ | vllm_environment(1.0) | {"OMP_NUM_THREADS": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
    with tempfile.TemporaryFile("w+") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model_dir()),
             "--served-model-name", SERVED, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
             "--enforce-eager", "--max-model-len", "2048", "--seed", "0", "--logprobs-mode", "processed_logprobs"],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
        try:
            import httpx

            deadline = time.monotonic() + 600
            while True:
                if server.poll() is not None:
                    out.seek(0)
                    raise SystemExit(f"vLLM's server exited: {out.read()[-2000:]}")
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit("vLLM's server did not start in 600 s")
                time.sleep(1)
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGINT)
                server.wait(60)


def figures(name: str, args: argparse.Namespace, tmp: Path, url: str | None) -> dict:
    config = workload(name, tmp / name / "journal", args, url)
    started = time.perf_counter()
    run_workload(config, resume=False)
    ran = time.perf_counter() - started
    check = check_training_data(config.journal, recompute_for(config))
    log(f"{name}: {check.calls} calls, {check.sampled_tokens} sampled tokens, ran in {ran:.1f} s")
    row: dict[str, object] = {
        "calls": check.calls,
        "calls_drifted": check.calls_drifted,
        "sampled_tokens": check.sampled_tokens,
        "sampled_tokens_in_loss_mask": check.sampled_tokens_in_loss_mask,
        "logprob_max_abs_error": check.logprob_max_abs_error,
        "logprob_modes": dict(check.logprob_modes),
        "continuations": dict(check.continuations),
        "template_mismatch_calls": check.template_mismatch_calls,
    }
    if check.problems:
        row["problems"] = check.problems
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print the report as JSON (the only output)")
    parser.add_argument("--backends", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--siblings", type=int, default=2)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument(
        "--server-url", default=None, help="an OpenAI-compatible vLLM server to use (else one is started)"
    )
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.backends.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        parser.error(f"unknown backends {unknown}; choose from {', '.join(WORKLOADS)}")
    report: dict = {"backends": {}}
    with tempfile.TemporaryDirectory(prefix="rj-training-data-") as tmp:
        for name in [n for n in names if n != "openai"]:
            report["backends"][name] = figures(name, args, Path(tmp), None)
        if "openai" in names:
            if args.server_url:
                report["backends"]["openai"] = figures("openai", args, Path(tmp), args.server_url)
            else:
                with vllm_server() as url:
                    report["backends"]["openai"] = figures("openai", args, Path(tmp), url)
    rows = report["backends"].values()
    report["all_sampled_tokens_in_loss_mask"] = all(
        r["sampled_tokens"] == r["sampled_tokens_in_loss_mask"] and r["calls_drifted"] == 0 for r in rows
    )
    report["max_logprob_error"] = max((r["logprob_max_abs_error"] or 0.0 for r in rows), default=0.0)
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
