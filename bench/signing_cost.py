"""What anchoring chain heads costs a turn: signing, measured two ways.

    python bench/signing_cost.py [--json] [--rounds N]

1. Per checkpoint: building, signing (Ed25519) and encoding the ``HeadCheckpoint`` of a
   workplace rollout's three resources, as the agent does once per turn that mutates a
   resource; and what an auditor pays to verify one. Median of repeated timed loops.
2. End to end: turns/s of the same workload on the file journal (durable writes on),
   with a signing key and without, in alternating rounds in one process; the overhead
   is taken round by round and the median kept, with a bootstrap 90% interval, as the
   journaling-overhead benchmark does (``bench/recovery.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import bootstrap_median_interval, median  # noqa: E402
from rollout_journal.journal.anchoring import HeadSigner, HeadVerifier  # noqa: E402
from rollout_journal.journal.codec import Codec  # noqa: E402
from rollout_journal.journal.events import ChainHead, HeadCheckpoint, Header  # noqa: E402
from rollout_journal.journal.open import open_journal  # noqa: E402
from rollout_journal.participants.environments import make_environment  # noqa: E402
from rollout_journal.participants.workload.config import WorkloadConfig  # noqa: E402
from rollout_journal.participants.workload.run import build_backend, open_workload_journal  # noqa: E402
from rollout_journal.participants.workload.runner import Runner  # noqa: E402


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def per_checkpoint(repeats: int = 7, loops: int = 2000) -> dict:
    """Microseconds to build + sign + encode one checkpoint, and to verify one."""
    signer, codec = HeadSigner.generate(), Codec()
    verifier = HeadVerifier(signer.public_key)
    env = make_environment("workplace", "bench-g0-s0", 7)
    heads = [ChainHead(rid, r.revision, r.chain_hash) for rid, r in sorted(env.resources.items())]
    header = Header("bench-g0-s0", "bench-g0", 1, 1, 3, 17, Header.now_ms(), "bench")

    def sign_once() -> HeadCheckpoint:
        checkpoint = signer.checkpoint(header, 0, [ChainHead(h.resource_id, h.revision, h.chain_hash) for h in heads])
        codec.encode(checkpoint)
        return checkpoint

    checkpoint = sign_once()
    assert verifier.problem(checkpoint) is None
    sign_us, verify_us = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(loops):
            sign_once()
        sign_us.append((time.perf_counter() - started) / loops * 1e6)
        started = time.perf_counter()
        for _ in range(loops):
            verifier.problem(checkpoint)
        verify_us.append((time.perf_counter() - started) / loops * 1e6)
    return {
        "resources_per_checkpoint": len(heads),
        "checkpoint_bytes": len(codec.encode(checkpoint)),
        "sign_us_per_checkpoint": round(statistics.median(sign_us), 1),
        "verify_us_per_checkpoint": round(statistics.median(verify_us), 1),
    }


def throughput(tmp: Path, rounds: int, groups: int, siblings: int, turns: int) -> dict:
    """Turns/s of the same workload with and without a signing key, alternating rounds."""
    total = groups * siblings * turns
    signer = HeadSigner.generate()

    def one(name: str, signed: bool) -> tuple[float, float]:
        config = WorkloadConfig(
            name=name,
            groups=groups,
            siblings=siblings,
            max_turns=turns,
            allow_early_submit=False,
            journal=str(tmp / f"{name}-{'signed' if signed else 'plain'}"),
        )
        with open_workload_journal(config) as journal:
            runner = Runner(config, journal, backend, backend.tokenizer, signer=signer if signed else None)
            gc.collect()
            started, cpu = time.perf_counter(), time.process_time()
            report = asyncio.run(runner.run(resume=False))
            journal.flush()
            wall, cpu = time.perf_counter() - started, time.process_time() - cpu
        assert report.turns_run == total
        return total / wall, cpu

    backend = build_backend(WorkloadConfig())
    one("warmup", False)
    one("warmup", True)
    with open_journal(str(tmp / "warmup-signed"), read_only=True) as journal:  # how many turns signed at all
        checkpoints = sum(isinstance(item.event, HeadCheckpoint) for item in journal.scan())
    pairs = []
    for round_ in range(rounds):
        order = (False, True) if round_ % 2 == 0 else (True, False)
        result = {signed: one(f"sig{round_}", signed) for signed in order}
        pairs.append((result[True], result[False]))
        log(
            f"  round {round_ + 1}/{rounds}: signed {result[True][0]:.1f} turns/s ({result[True][1]:.2f} cpu s), "
            f"plain {result[False][0]:.1f} turns/s ({result[False][1]:.2f} cpu s)"
        )
    overheads = [1 - signed[0] / plain[0] for signed, plain in pairs]
    cpu_overheads = [signed[1] / plain[1] - 1 for signed, plain in pairs]  # steadier on a shared machine
    low, high = bootstrap_median_interval(overheads)
    cpu_low, cpu_high = bootstrap_median_interval(cpu_overheads)
    return {
        "turns_per_s_signed": round(median([s[0] for s, _ in pairs]), 1),
        "turns_per_s_plain": round(median([p[0] for _, p in pairs]), 1),
        "signing_overhead": round(median(overheads), 4),
        "signing_overhead_90ci": [round(low, 4), round(high, 4)],
        "signing_cpu_overhead": round(median(cpu_overheads), 4),
        "signing_cpu_overhead_90ci": [round(cpu_low, 4), round(cpu_high, 4)],
        "rounds": rounds,
        "turns_per_run": total,
        "checkpoints_per_run": checkpoints,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rounds", type=int, default=16, help="signed/plain throughput rounds")
    parser.add_argument("--rollouts", type=int, default=32, help="rollouts per run (groups of 4 siblings)")
    args = parser.parse_args(argv)
    log("per checkpoint: build + sign + encode, and verify ...")
    report = per_checkpoint()
    log(f"  sign {report['sign_us_per_checkpoint']} us, verify {report['verify_us_per_checkpoint']} us")
    log("rollout throughput, signing key on vs off ...")
    with tempfile.TemporaryDirectory(prefix="rj-bench-signing-") as d:
        report |= throughput(Path(d), rounds=args.rounds, groups=max(1, args.rollouts // 4), siblings=4, turns=8)
    # a turn signs at most once (only if it mutated a resource): the share of a turn's time, at most
    report["sign_share_of_a_turn"] = round(report["sign_us_per_checkpoint"] / (1e6 / report["turns_per_s_plain"]), 4)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"signing a checkpoint of {report['resources_per_checkpoint']} chain heads: "
            f"{report['sign_us_per_checkpoint']} us ({report['sign_share_of_a_turn']:.2%} of a "
            f"{1000 / report['turns_per_s_plain']:.1f} ms turn); verifying one: {report['verify_us_per_checkpoint']} us; "
            f"end to end {report['signing_overhead']:.1%} of throughput (90% interval "
            f"{report['signing_overhead_90ci'][0]:.1%} to {report['signing_overhead_90ci'][1]:.1%}), "
            f"{report['signing_cpu_overhead']:.1%} of CPU time (90% interval "
            f"{report['signing_cpu_overhead_90ci'][0]:.1%} to {report['signing_cpu_overhead_90ci'][1]:.1%})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
