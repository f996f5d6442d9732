"""Journals the replay tests read: real runs (crashed and resumed, forked) on the embedded torch
model, and large journals written event by event through the journal API (a thousand rollouts
in seconds, where running them would take minutes), each event as a worker writes it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from rollout_journal.journal.anchoring import SIGNING_KEY_ENV, HeadSigner
from rollout_journal.journal.events import (
    AttemptFenced,
    AttemptStarted,
    Header,
    Message,
    ModelCall,
    RolloutEvent,
    RolloutFailed,
    RolloutFinished,
    SamplingParams,
    TurnCompleted,
)
from rollout_journal.journal.file.backend import FileBackend
from rollout_journal.journal.journal import Journal
from rollout_journal.participants.model.tokenizer import ChatTokenizer
from rollout_journal.participants.workload.config import WorkloadConfig
from rollout_journal.participants.workload.run import run_workload
from rollout_journal.participants.workload.specs import workload_specs


def crashed_and_resumed(
    location: str,
    signer: HeadSigner | None,
    *,
    environment: str = "workplace",
    groups: int = 1,
    siblings: int = 2,
    max_turns: int = 8,
    crash_at: int = 4,
) -> WorkloadConfig:
    """A real workload stopped at turn ``crash_at`` (a crash at a turn boundary) and resumed
    as attempt 2, with ``signer``'s key in the writer's environment (or none)."""
    config = WorkloadConfig(
        name="aud",
        groups=groups,
        siblings=siblings,
        max_turns=max_turns,
        environment=environment,
        seed=8,
        allow_early_submit=False,
        journal=location,
        snapshot_every_turns=2,
    )
    with pytest.MonkeyPatch.context() as env:
        if signer is None:
            env.delenv(SIGNING_KEY_ENV, raising=False)
        else:
            env.setenv(SIGNING_KEY_ENV, signer.private_pem().decode())
        run_workload(config, resume=False, stop_after={s.rollout_id: crash_at for s in workload_specs(config)})
        run_workload(config, resume=True)
    return config


def forked_and_continued(location: str, *, at_turn: int = 1, seed: int = 7) -> tuple[WorkloadConfig, str, str]:
    """A real workload (one workplace rollout, five turns) run to its end, forked after ``at_turn``
    with another seed into the same journal, and the fork resumed to its end: (config, origin, fork)."""
    from rollout_journal.replay.fork import fork_rollout
    from rollout_journal.replay.source import open_replay

    config = WorkloadConfig(
        name="fk",
        groups=1,
        siblings=1,
        max_turns=5,
        environment="workplace",
        seed=3,
        allow_early_submit=False,
        journal=location,
    )
    run_workload(config, resume=False)
    origin = workload_specs(config)[0].rollout_id
    with open_replay(location) as source:
        fork = fork_rollout(source, origin, at_turn, seed=seed).fork_id
    run_workload(config, resume=True)
    return config, origin, fork


# -- journals written event by event ---------------------------------------------------------

TASK = "Move the globex meeting to a free slot, then call submit()."
OUTPUTS = ["calendar.list()", "mail.read(id=3)", 'calendar.move(id="e3", day="tue", hour=11)', "submit()"]
TOOL = ["e3: mon 9:00 with globex", "from bob: can we move it?", "moved e3 to tue 11:00", "Submitted."]


@dataclass
class SyntheticRollout:
    """One rollout's events, as the runner and agent write them: attempts with their fences, model
    calls whose prompts extend their parents', committed turns, and an ending."""

    rollout_id: str
    group_id: str
    tokenizer: ChatTokenizer
    policy: str
    writer: str = "synthetic"
    seq: int = 0
    attempt: int = 0
    epoch: int = 0
    turns: int = 0  # committed in the current life
    ts_ms: int = 1_790_000_000_000
    head: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    parent: str | None = None
    events: list[RolloutEvent] = field(default_factory=list)

    def _header(self, turn: int) -> Header:
        self.seq += 1
        self.ts_ms += 7
        return Header(
            self.rollout_id, self.group_id, self.attempt, self.epoch, turn, self.seq - 1, self.ts_ms, self.writer
        )

    def start(self, resumed_from_turn: int = 0, reason: str = "new rollout", forked_from: str | None = None) -> None:
        previous = (self.attempt, self.epoch)
        self.attempt, self.epoch = self.attempt + 1, self.epoch + 1
        messages = []
        if resumed_from_turn == 0:  # a start from turn 0 (or over): the conversation begins again
            messages = [Message("system", "Reply with exactly one tool call."), Message("user", TASK)]
            self.head, self.parent, self.turns = np.zeros(0, dtype=np.int32), None, 0
        self.events.append(
            AttemptStarted(
                self._header(resumed_from_turn),
                resumed_from_turn,
                "synthetic-topology",
                reason,
                messages,
                None,
                forked_from,
            )
        )
        if previous[0]:
            self.events.append(
                AttemptFenced(self._header(resumed_from_turn), *previous, f"superseded by attempt {self.attempt}")
            )

    def turn(self, *, reward: float | None = None, text: str | None = None) -> None:
        turn = self.turns
        text = text or OUTPUTS[turn % len(OUTPUTS)]
        if self.parent is None:
            delta = self.tokenizer.chat_prompt([("system", "Reply with exactly one tool call."), ("user", TASK)])
        else:
            delta = self.tokenizer.chat_prompt([("tool", TOOL[(turn - 1) % len(TOOL)])])
        output = self.tokenizer.encode(text + "<|end|>")
        logprobs = -np.linspace(0.05, 3.0, len(output), dtype=np.float32)[::-1].copy()
        call_id = f"{self.rollout_id}/a{self.attempt}/t{turn}/c0"
        self.events.append(
            ModelCall(
                self._header(turn),
                call_id,
                self.parent,
                self.policy,
                SamplingParams(temperature=1.0, top_p=0.95, max_tokens=32, seed=1000 * self.attempt + turn),
                len(self.head),
                np.asarray(delta, dtype=np.int32),
                np.asarray(output, dtype=np.int32),
                logprobs,
            )
        )
        self.head = np.concatenate([self.head, delta, output]).astype(np.int32)
        self.parent = call_id
        self.events.append(
            TurnCompleted(
                self._header(turn),
                [Message("assistant", text), Message("tool", TOOL[turn % len(TOOL)])],
                [call_id],
                {},
                reward,
                [text],
            )
        )
        self.turns += 1

    def finish(self, reward: float) -> None:
        self.events.append(
            RolloutFinished(self._header(self.turns - 1), reward, self.turns, json.dumps({"reward": reward}))
        )

    def fail(self) -> None:
        self.events.append(
            RolloutFailed(self._header(self.turns), "SandboxDied", "the sandbox process exited (code -9)")
        )


def write_journal(root: Path, rollouts: list[SyntheticRollout]) -> None:
    """Every rollout's events into the file journal at ``root``, group-committed."""
    with Journal(FileBackend(root)) as journal:
        pending = [journal.append(r.events[i : i + 16]) for r in rollouts for i in range(0, len(r.events), 16)]
        for future in pending:
            future.result()


@dataclass
class Scenario:
    """What a synthetic journal holds, by kind of rollout."""

    finished: list[str] = field(default_factory=list)
    crashed: list[str] = field(default_factory=list)  # crashed after a turn, resumed, finished
    queued: list[str] = field(default_factory=list)  # superseded before it ran: no crash
    restarted: list[str] = field(default_factory=list)  # started over (restart-only), turns redone
    running: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    forks: dict[str, str] = field(default_factory=dict)  # fork -> origin
    long: str = ""

    def all(self) -> Iterator[str]:
        yield from self.finished
        yield from self.crashed
        yield from self.queued
        yield from self.restarted
        yield from self.running
        yield from self.failed
        yield from self.forks
        if self.long:
            yield self.long


def thousand_rollouts(
    root: Path, tokenizer: ChatTokenizer, policy: str, *, groups: int = 250, long_turns: int = 200
) -> Scenario:
    """A journal of ``groups`` x 4 rollouts of every kind (finished, crashed and resumed, queued at a crash,
    restarted, running, failed, forked) plus one rollout of ``long_turns`` turns crashed and resumed."""
    scenario = Scenario()
    rollouts = []
    for g in range(groups):
        for s in range(4):
            rid, n = f"big-g{g}-s{s}", g * 4 + s
            r = SyntheticRollout(rid, f"big-g{g}", tokenizer, policy)
            turns = 3 + n % 3
            r.start()
            if n % 7 == 3:  # crashed after turn 1, resumed at turn 2
                r.turn()
                r.turn()
                r.start(2, "resume after crash at turn 2")
                kind = scenario.crashed
            elif n % 11 == 5:  # queued behind the concurrency limit when the worker died: never ran
                r.start(0, "resume after crash at turn 0")
                kind = scenario.queued
            elif n % 13 == 6:  # a restart-only rollout: attempt 2 starts over and redoes its turns
                r.turn()
                r.turn()
                r.start(0, "restart: its sandbox cannot be restored")
                kind = scenario.restarted
            else:
                kind = scenario.finished
            if n % 17 == 8 and kind is scenario.finished:
                r.turn()
                r.fail()
                scenario.failed.append(rid)
            elif n % 19 == 9 and kind is scenario.finished:
                r.turn()
                scenario.running.append(rid)
            else:
                while r.turns < turns:
                    r.turn(reward=round((n % 10) / 10, 1) if r.turns == turns - 1 else None)
                r.finish(round((n % 10) / 10, 1))
                kind.append(rid)
            rollouts.append(r)
    for origin in scenario.finished[:3]:  # forks after turn 1: turns 0-1 copied, then their own
        fork = SyntheticRollout(f"{origin}.fork-1", origin.rsplit("-", 1)[0], tokenizer, policy)
        fork.start(0, f"fork of {origin} after turn 1", forked_from=f"{origin}@1")
        fork.turn()
        fork.turn()
        fork.start(2, f"continue fork of {origin}")
        fork.turn(text='mail.send(to="bob", body="tue 11:00?")')
        fork.turn(reward=0.5)
        fork.finish(0.5)
        scenario.forks[fork.rollout_id] = origin
        rollouts.append(fork)
    if long_turns:
        long = SyntheticRollout("long-g0-s0", "long-g0", tokenizer, policy)
        long.start()
        for _ in range(long_turns * 3 // 5):
            long.turn()
        long.start(long.turns, f"resume after crash at turn {long.turns}")
        while long.turns < long_turns:
            long.turn(reward=1.0 if long.turns == long_turns - 1 else None)
        long.finish(1.0)
        scenario.long = long.rollout_id
        rollouts.append(long)
    write_journal(root, rollouts)
    return scenario
