"""Shared benchmark plumbing: a broker to measure against, realistic events, percentiles."""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import io
import json
import os
import signal
import statistics
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from rollout_journal.journal.events import Header, Message, ModelCall, ResourceMutation, SamplingParams, TurnCompleted

if TYPE_CHECKING:  # a type only: the benches that take no checkpoint need not import the runner
    from rollout_journal.participants.workload.runner import Runner


@contextlib.contextmanager
def kafka_bootstrap() -> Iterator[str]:
    """``KAFKA_BOOTSTRAP_SERVERS`` if set, else a local single-node broker started for the run."""
    if os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        yield os.environ["KAFKA_BOOTSTRAP_SERVERS"]
        return
    from rollout_journal.compose.local_broker import start_local_cluster

    with tempfile.TemporaryDirectory(prefix="rj-bench-kafka-") as data:
        cluster = start_local_cluster(1, Path(data))
        try:
            yield cluster.bootstrap_servers
        finally:
            cluster.stop()


def dump_stacks_on(signum: int = signal.SIGUSR1) -> None:
    """On ``signum``, print every thread's stack and every task of the running event loop to
    stderr and carry on: a run that hangs waits in ``select()`` with every thread idle, and only
    the tasks' stacks say what it waits for. The smoke tests send it before they kill a child
    that ran past its time. The threads' stacks come from ``faulthandler``'s C-level handler, at
    once, even while the main thread is stuck inside C code; the tasks' from the Python handler it
    chains to, which runs once the main thread is back in Python."""

    def dump(_signum: int, _frame: object) -> None:
        try:
            tasks = asyncio.all_tasks(asyncio.get_running_loop())
        except RuntimeError:  # no loop runs now
            tasks = set()
        for task in tasks:
            text = io.StringIO()
            task.print_stack(file=text)
            print(text.getvalue(), file=sys.stderr, flush=True)

    signal.signal(signum, dump)
    faulthandler.register(signum, file=sys.stderr, all_threads=True, chain=True)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return float(np.percentile(np.asarray(values), q))


def median(values: list[float]) -> float:
    return statistics.median(values)


def pauses_taken(runner: Runner) -> tuple[list[float], int]:
    """The pause of each coordinated checkpoint a run took (ms), and the rollouts they skipped in all."""
    if runner.checkpointer is None:
        raise ValueError(
            f"workload {runner.config.name!r} ran with checkpoint_mode={runner.config.checkpoint_mode!r}, "
            "so it took no coordinated checkpoints to measure; set checkpoint_mode='coordinated'"
        )
    history = runner.checkpointer.history
    return [c.pause_ms for c in history], sum(len(c.skipped) for c in history)


def bootstrap_median_interval(
    values: list[float], confidence: float = 0.9, resamples: int = 4000
) -> tuple[float, float]:
    """A bootstrap interval of the median of ``values``: how much a noisy machine's figure can be trusted.
    Seeded, so the same measurements always print the same interval."""
    rng = np.random.default_rng(0)
    samples = rng.choice(np.asarray(values), size=(resamples, len(values)), replace=True)
    medians = np.median(samples, axis=1)
    tail = (1 - confidence) / 2 * 100
    return float(np.percentile(medians, tail)), float(np.percentile(medians, 100 - tail))


def turn_events(
    rollout: str,
    turn: int,
    seq: int,
    rng: np.random.Generator,
    *,
    prompt_delta: int = 1024,
    output: int = 256,
    attempt: int = 1,
    prefix_len: int | None = None,
) -> list:
    """One realistic turn: a model call (~1k prompt-delta tokens, 256 output tokens and
    their logprobs), one resource mutation, and the turn's commit record, by ``attempt``
    (whose epoch is the same number). ``prefix_len``: the tokens of the head the call builds on
    (default: a long conversation, ``2048 * turn``; give the head's length for events a
    ``RolloutState`` must fold)."""

    def header(s: int) -> Header:
        return Header(rollout, rollout.rsplit("-", 1)[0], attempt, attempt, turn, s, Header.now_ms(), "bench")

    call = ModelCall(
        header(seq),
        f"{rollout}/t{turn}/c0",
        f"{rollout}/t{turn - 1}/c0" if turn else None,
        "policy-v1",
        SamplingParams(1.0, 1.0, output, seq),
        2048 * turn if prefix_len is None else prefix_len,
        rng.integers(0, 32000, prompt_delta, dtype=np.int32),
        rng.integers(0, 32000, output, dtype=np.int32),
        -rng.random(output, dtype=np.float32) * 5,
        "stop",
        12.5,
    )
    mutation = ResourceMutation(
        header(seq + 1),
        f"{rollout}/mail",
        "mailbox",
        "send_email",
        '{"subject":"meeting-tue-10","to":"alice"}',
        f"{rollout}/t{turn}/m0",
        turn,
        turn + 1,
        '{"id":7}',
        "d" * 64,
        "c" * 64,
    )
    done = TurnCompleted(
        header(seq + 2),
        [
            Message("assistant", "mail.send(to=alice, subject=meeting-tue-10)"),
            Message("tool", "sent message 7 to alice"),
        ],
        [call.call_id],
        {f"{rollout}/mail": turn + 1},
        None,
        ["mail.send(to=alice)"],
    )
    return [call, mutation, done]


def print_report(report: dict, as_json: bool) -> None:
    """A benchmark's figures: JSON, or one ``key: value`` line each."""
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        for key, value in report.items():
            print(f"{key}: {value}")
