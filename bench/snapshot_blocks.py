"""What a long rollout's snapshots put on the snapshot stream, written in blocks against written
whole (the layout before blocks), measured in the same run.

    python bench/snapshot_blocks.py [--turns 8,32] [--prompt-delta 512] [--output 2048]
                                    [--snapshot-every 2] [--block-bytes 16384] [--rounds 3] [--json]

One rollout is folded turn by turn from realistic turns (``bench.common.turn_events``: a model
call of ``--prompt-delta`` new prompt tokens and ``--output`` sampled tokens with their
logprobs, a resource mutation, a ``TurnCompleted``), as the live path folds it, and journaled
through a real file journal: each turn's events, with a snapshot (``snapshot_of``, the agent's
own) every ``--snapshot-every`` turns. Twice per round, alternating: with the journal's default
``snapshot_block_bytes`` (blocks), and with 0 (every snapshot one record holding the whole
state, as before blocks).

Figures, per ``--turns`` count ``T``:

- ``snapshot_bytes_T_blocks`` / ``_whole``: the bytes of every snapshot-stream record the journal
  committed (what a broker takes in; compaction keeps less), with ``event_bytes_T`` and, of the
  blocks run, ``block_bytes_T`` (its bytes in blocks);
- ``growth_blocks`` / ``growth_whole``: snapshot bytes at the largest ``T`` over the smallest.
  Linear growth is the ratio of the turn counts (4 for 8 and 32 turns), quadratic its square;
- ``bytes_ratio_T``: blocks / whole (below 1: blocks write less);
- ``restore_ms_T_blocks`` / ``_whole`` and ``restore_ratio_T``: the median time to read the
  rollout back (``load_rollouts``: its snapshot, blocks joined, and the events after it) and
  fold its state, blocks over whole (above 1: blocks restore slower).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import dump_stacks_on, median, print_report, turn_events  # noqa: E402
from rollout_journal.journal.backend import OutRecord, Stream  # noqa: E402
from rollout_journal.journal.errors import RecordLocation  # noqa: E402
from rollout_journal.journal.events import AttemptStarted, Header  # noqa: E402
from rollout_journal.journal.journal import Journal  # noqa: E402
from rollout_journal.journal.open import open_journal  # noqa: E402
from rollout_journal.journal.restore import load_rollouts  # noqa: E402
from rollout_journal.journal.snapshots import BLOCK_BYTES, BLOCK_MARK  # noqa: E402
from rollout_journal.participants.rollout import restore_state  # noqa: E402
from rollout_journal.participants.rollout.snapshot import snapshot_of  # noqa: E402
from rollout_journal.participants.rollout.state import RolloutState  # noqa: E402

ROLLOUT = "bench-g0-s0"


def journal_rollout(journal: Journal, args: argparse.Namespace, turns: int) -> None:
    """Fold and journal one rollout of ``turns`` turns, snapshotting as the live path does."""
    rng = np.random.default_rng(0)
    state = RolloutState(ROLLOUT, "bench-g0")
    start = AttemptStarted(Header(ROLLOUT, "bench-g0", 1, 1, 0, 0, Header.now_ms(), "bench"), 0, "topology", "new")
    state.apply(start)
    journal.append_sync([start], snapshot_of(state, {}, "bench", journal.snapshot_block_bytes))
    for turn in range(turns):
        events = turn_events(
            ROLLOUT,
            turn,
            state.next_seq,
            rng,
            prompt_delta=args.prompt_delta,
            output=args.output,
            prefix_len=len(state.head_tokens),
        )
        for event in events:
            state.apply(event)
        due = (turn + 1) % args.snapshot_every == 0
        journal.append_sync(events, snapshot_of(state, {}, "bench", journal.snapshot_block_bytes) if due else None)


class WrittenBytes:
    """Counts what the journal hands its backend to commit, per stream: what the brokers take in
    (a file journal's reads show only what compaction keeps)."""

    def __init__(self, journal: Journal) -> None:
        self.snapshots = self.blocks = self.events = 0
        commit = journal.backend.commit

        def counted(records: Sequence[OutRecord]) -> list[RecordLocation]:
            for record in records:
                size = len(record.value or b"")
                if record.stream is Stream.SNAPSHOTS:
                    self.snapshots += size
                    self.blocks += size if BLOCK_MARK in record.key else 0
                elif record.stream is Stream.EVENTS:
                    self.events += size
            return commit(records)

        journal.backend.commit = counted  # type: ignore[method-assign]


def restore_ms(journal: Journal, turns: int) -> float:
    started = time.perf_counter()
    plan = load_rollouts(journal)
    state = restore_state(plan.rollouts[ROLLOUT])
    elapsed = (time.perf_counter() - started) * 1000
    if state.next_turn != turns:
        raise RuntimeError(f"restored {state.next_turn} turns of {turns}")
    return elapsed


def measure(args: argparse.Namespace, turns: int, block_bytes: int, work: Path) -> tuple[int, int, int, float]:
    location = tempfile.mkdtemp(prefix=f"t{turns}-b{block_bytes}-", dir=work)
    with open_journal(location, writer="bench", snapshot_block_bytes=block_bytes) as journal:
        written = WrittenBytes(journal)
        journal_rollout(journal, args, turns)
        snapshots, blocks, events = written.snapshots, written.blocks, written.events
    with open_journal(location, writer="bench", read_only=True) as journal:
        times = [restore_ms(journal, turns) for _ in range(args.restores)]
    return snapshots, blocks, events, median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", default="8,32", help="turn counts, comma-separated (default: %(default)s)")
    parser.add_argument("--prompt-delta", type=int, default=512, help="new prompt tokens a turn")
    parser.add_argument("--output", type=int, default=2048, help="sampled tokens a turn")
    parser.add_argument("--snapshot-every", type=int, default=2, help="turns between snapshots")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each journaling both ways")
    parser.add_argument("--restores", type=int, default=5, help="restores timed per journal")
    parser.add_argument("--block-bytes", type=int, default=BLOCK_BYTES, help="the blocks run's snapshot_block_bytes")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    dump_stacks_on()
    counts = sorted({int(t) for t in args.turns.split(",")})
    report: dict[str, float | int | str] = {
        "block_bytes": args.block_bytes,
        "tokens_per_turn": args.prompt_delta + args.output,
        "snapshot_every_turns": args.snapshot_every,
    }
    with tempfile.TemporaryDirectory(prefix="rj-bench-blocks-") as tmp:
        work = Path(tmp)
        for turns in counts:
            rows: dict[str, list[tuple[int, int, int, float]]] = {"blocks": [], "whole": []}
            for round_ in range(args.rounds):
                print(f"[snapshot_blocks] {turns} turns, round {round_ + 1}/{args.rounds}", file=sys.stderr, flush=True)
                for mode, block_bytes in (("blocks", args.block_bytes), ("whole", 0)):
                    rows[mode].append(measure(args, turns, block_bytes, work))
            for mode, found in rows.items():
                report[f"snapshot_bytes_{turns}_{mode}"] = found[0][0]  # bytes are the same every round
                report[f"restore_ms_{turns}_{mode}"] = round(median([r[3] for r in found]), 2)
            report[f"block_bytes_{turns}"] = rows["blocks"][0][1]
            report[f"event_bytes_{turns}"] = rows["whole"][0][2]
            report[f"bytes_ratio_{turns}"] = round(
                int(report[f"snapshot_bytes_{turns}_blocks"]) / int(report[f"snapshot_bytes_{turns}_whole"]), 3
            )
            report[f"restore_ratio_{turns}"] = round(
                median([b[3] / w[3] for b, w in zip(rows["blocks"], rows["whole"], strict=True)]), 3
            )
    low, high = counts[0], counts[-1]
    for mode in ("blocks", "whole"):
        report[f"growth_{mode}"] = round(
            int(report[f"snapshot_bytes_{high}_{mode}"]) / int(report[f"snapshot_bytes_{low}_{mode}"]), 2
        )
    report["growth_linear_would_be"] = round(high / low, 2)
    print_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
