"""The verifiers crash drill, shared by its test and ``bench/gateway.py``: a verifiers 0.4.0 job
(``examples/verifiers_gateway/run.py``, in verifiers' own venv) drives episodes through a gateway
running in this process; one copy of the job is SIGKILLed mid-run and run again, another runs
uninterrupted beside it; the journal then says what the rerun regenerated (goal: nothing)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_journal.journal import ModelCall, TrainingRecord, open_journal
from rollout_journal.participants.remote.gateway import GatewayServer
from tests.support.paths import REPO_ROOT

VENV = REPO_ROOT / ".venv-verifiers"
JOB = REPO_ROOT / "examples" / "verifiers_gateway" / "run.py"
JOB_TIMEOUT_S = 1800.0  # verifiers imports for a minute or two on a loaded 2-core machine


def verifiers_python() -> Path:
    """verifiers' venv (built from PyPI by ``make venv-verifiers`` when missing) and the namespace."""
    if not (VENV / ".stamp").exists():
        subprocess.run(["make", "-C", str(REPO_ROOT), "venv-verifiers"], check=True)
    subprocess.run(["make", "-s", "-C", str(REPO_ROOT), "namespace"], check=True)
    return VENV / "bin" / "python"


def start_job(python: Path, gateway_url: str, run: str, *, tasks: int, turns: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "RJ_GATEWAY_KEY": "unused"}
    env.pop("PYTHONPATH", None)  # the job finds rollout_journal's adapter in build/namespace by itself
    out = log.open("w")
    return subprocess.Popen(
        [str(python), str(JOB), "--gateway", gateway_url, "--run", run, "--tasks", str(tasks), "--turns", str(turns)],
        stdout=out,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=str(log.parent),
        start_new_session=True,  # its agent programs are its children: one kill takes the group
    )


def finished_job(job: subprocess.Popen, log: Path) -> list[dict[str, Any]]:
    code = job.wait(JOB_TIMEOUT_S)
    text = log.read_text()
    if code != 0:
        raise AssertionError(f"the verifiers job exited {code}:\n{text[-4000:]}")
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


@dataclass
class Drill:
    turns_committed_at_crash: int
    calls_journaled_at_crash: int
    model_tokens_regenerated_for_committed_turns: int
    replayed_calls: int
    replayed_calls_per_s: float
    identical_to_uninterrupted: bool
    rewards: dict[str, float]

    def as_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _sessions(server: GatewayServer, run: str) -> list[Any]:
    assert server.gateway is not None
    return [chat.session for rid, chat in list(server.gateway.chats.items()) if rid.startswith(run + ".")]


def crash_drill(server: GatewayServer, journal: Path, workdir: Path, *, tasks: int = 2, turns: int = 3) -> Drill:
    """Run ``clean`` and ``crash`` side by side, SIGKILL ``crash`` once it made ``turns + 1`` live calls
    (its first episode done, the second begun), run it again; compare through the journal."""
    python = verifiers_python()
    clean = start_job(python, server.url, "clean", tasks=tasks, turns=turns, log=workdir / "clean.log")
    crash = start_job(python, server.url, "crash", tasks=tasks, turns=turns, log=workdir / "crash-1.log")
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while sum(s.live_calls for s in _sessions(server, "crash")) < turns + 1:
        if crash.poll() is not None:
            raise AssertionError(f"the job ended before the kill:\n{(workdir / 'crash-1.log').read_text()[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError("the job made no progress")
        time.sleep(0.05)
    os.killpg(crash.pid, signal.SIGKILL)
    crash.wait()
    at_crash = {s.rollout_id: (s.state.next_turn, sum(1 for e in s.state.effects.all() if e.kind == "model"))
                for s in _sessions(server, "crash")}  # fmt: skip
    rerun = start_job(python, server.url, "crash", tasks=tasks, turns=turns, log=workdir / "crash-2.log")
    rewards = {r["rollout"]: r["reward"] for r in finished_job(rerun, workdir / "crash-2.log")}
    rewards.update({r["rollout"]: r["reward"] for r in finished_job(clean, workdir / "clean.log")})
    sessions = _sessions(server, "crash")
    replayed = sum(s.replayed_calls for s in sessions)
    spans = [s.first_live_s - s.first_replay_s for s in sessions if s.first_live_s and s.first_replay_s]
    server.close()

    reader = open_journal(str(journal), read_only=True)
    regenerated = 0
    for rollout, (committed, _) in at_crash.items():
        for item in reader.read_rollout(rollout):
            e = item.event
            if isinstance(e, ModelCall) and e.header.attempt > 1 and e.header.turn < committed:
                regenerated += len(e.output_ids)
    records: dict[str, TrainingRecord] = {}
    for partition in range(reader.backend.partitions):
        for stored in reader.backend.read_results(partition):
            if stored.value is None:
                continue
            record = reader.codec.decode(stored.value, stored.location)
            if isinstance(record, TrainingRecord):
                records[record.rollout_id] = record
    pairs = [(rid, "clean." + rid.removeprefix("crash.")) for rid in records if rid.startswith("crash.")]
    identical = len(pairs) == tasks and all(
        other in records
        and (records[rid].input_ids.tobytes(), records[rid].logprobs.tobytes())
        == (records[other].input_ids.tobytes(), records[other].logprobs.tobytes())
        for rid, other in pairs
    )
    return Drill(
        turns_committed_at_crash=sum(c for c, _ in at_crash.values()),
        calls_journaled_at_crash=sum(n for _, n in at_crash.values()),
        model_tokens_regenerated_for_committed_turns=regenerated,
        replayed_calls=replayed,
        replayed_calls_per_s=round(replayed / sum(spans), 1) if spans and sum(spans) > 0 else 0.0,
        identical_to_uninterrupted=identical,
        rewards=rewards,
    )
