"""How fast a rollout's snapshot state is written and read back, and what the raw-array
layout saves against the layout before it, measured in the same run.

    python bench/snapshot_state.py [--turns 5,41] [--rounds 7] [--repeat 200] [--json]

For each ``--turns`` count, one rollout state is folded from realistic turns (a model call
of 256 prompt-delta and 64 sampled tokens with their logprobs, a resource mutation, a
``TurnCompleted``: ``bench.common.turn_events``), as the live path holds it at a snapshot.
Timed, ``--repeat`` calls a round, rounds alternating:

- ``to_bytes``: what the live path pays at every snapshot;
- ``from_bytes`` of those bytes: what restore and every replay command pay per state;
- baseline: ``from_bytes`` of the same state in the earlier layout (zlib'd JSON with the
  token arrays as base64 strings inside it), which journals written before 2026-12-01
  hold and which still reads.

``read_speedup`` is the median over rounds of earlier-layout read time / raw-layout read
time (above 1: the raw layout reads faster); ``size_ratio`` is raw bytes / earlier bytes.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import time
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import dump_stacks_on, median, print_report, turn_events  # noqa: E402
from rollout_journal.journal.events import AttemptStarted, Header  # noqa: E402
from rollout_journal.participants.rollout.state import STATE_MAGIC, RolloutState, _unpacked  # noqa: E402


def folded_state(turns: int) -> RolloutState:
    """A rollout ``turns`` turns in, folded event by event as the live path applies them."""
    rng = np.random.default_rng(0)
    rid = "bench-g0-s0"
    state = RolloutState(rid, "bench-g0")
    state.apply(AttemptStarted(Header(rid, "bench-g0", 1, 1, 0, 0, 0, "bench"), 0, "topology", "new rollout"))
    for turn in range(turns):
        for event in turn_events(
            rid, turn, 1 + 3 * turn, rng, prompt_delta=256, output=64, prefix_len=len(state.head_tokens)
        ):
            state.apply(event)
    return state


def earlier_layout(data: bytes) -> bytes:
    """The same state as the layout before raw arrays wrote it: the arrays base64 inside the JSON."""
    doc, tokens, logprobs = _unpacked(zlib.decompress(data[len(STATE_MAGIC) :]))
    doc["head_tokens"] = base64.b64encode(tokens).decode()
    if "lineage" in doc:
        doc["logprobs"] = base64.b64encode(logprobs).decode()
    return zlib.compress(json.dumps(doc, separators=(",", ":")).encode(), 1)


def per_call_ms(call, repeat: int) -> float:
    started = time.perf_counter()
    for _ in range(repeat):
        call()
    return (time.perf_counter() - started) / repeat * 1000


def measure(turns: int, rounds: int, repeat: int) -> dict:
    state = folded_state(turns)
    raw = state.to_bytes()
    earlier = earlier_layout(raw)
    if RolloutState.from_bytes(earlier).to_bytes() != raw:
        raise RuntimeError("the earlier layout does not read back as the same state")
    writes: list[float] = []
    reads: list[float] = []
    earlier_reads: list[float] = []
    speedups: list[float] = []
    for round_ in range(rounds):
        order = [(raw, reads), (earlier, earlier_reads)]
        for data, into in order if round_ % 2 == 0 else order[::-1]:
            into.append(per_call_ms(lambda data=data: RolloutState.from_bytes(data), repeat))
        writes.append(per_call_ms(state.to_bytes, repeat))
        speedups.append(earlier_reads[-1] / reads[-1])
    return {
        "turns": turns,
        "head_tokens": len(state.head_tokens),
        "bytes": len(raw),
        "earlier_bytes": len(earlier),
        "size_ratio": round(len(raw) / len(earlier), 3),
        "to_bytes_ms": round(median(writes), 4),
        "from_bytes_ms": round(median(reads), 4),
        "earlier_from_bytes_ms": round(median(earlier_reads), 4),
        "read_speedup": round(median(speedups), 3),
        "read_speedup_per_round": [round(s, 3) for s in speedups],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", default="5,41", help="comma-separated: how far in each measured state is")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=200, help="calls timed per round")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    dump_stacks_on()  # SIGUSR1: its threads' and tasks' stacks (a hang's where)
    report = {f"turns_{n}": measure(int(n), args.rounds, args.repeat) for n in args.turns.split(",")}
    print_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
