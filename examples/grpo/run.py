"""GRPO end to end on the journal: rollout workers, a resource server and a trainer, each a
process, each SIGKILLed once during the run.

    python examples/grpo/run.py [--small] [--json] [--plot docs/grpo-reward.png]

- a **worker** runs prompt groups of the workplace environment on the embedded tiny Llama,
  journaled to Kafka, its resources in a **resource server**; it loads each new policy the
  trainer publishes between model calls (one call per turn here: at turn boundaries), and
  every ``ModelCall`` names the version that sampled it;
- a **trainer** reads complete groups through ``rollout_journal.participants.TrainerFeed``, computes
  group-relative advantages ((r - mean) / std within the group), takes one torch optimizer
  step of a policy-gradient loss over the sampled tokens (the loss mask), saves weights,
  optimizer and feed position together, publishes the new weights as policy ``v<step>``, and
  acknowledges the group.

The orchestrator SIGKILLs the resource server (restarted on its port), the worker (resumed)
and the trainer (restarted from its checkpoint), then checks that every group was trained
exactly once. Kafka: ``KAFKA_BOOTSTRAP_SERVERS`` if set, else a local broker for the run.
Prints ``steps``, ``groups_trained``, ``groups_lost``, ``groups_trained_twice``, ``kills``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

if TYPE_CHECKING:  # the roles import what they use when they start: the orchestrator stays light
    from rollout_journal.participants.model.generation import GenerationRequest, TokenChunk

SIBLINGS, TURNS = 4, 3
TOKEN_ENV = "ROLLOUT_JOURNAL_RESOURCE_TOKEN"


# -- the worker: a workload whose policy follows what the trainer publishes --------------------
class FollowingPolicy:
    """A ``GenerationBackend`` over the newest published policy folder (``policies/CURRENT``
    names it). A new version is loaded when no call is in flight, so every call is sampled and
    labelled (``policy_version``) by one set of weights. Not deterministic over time (the
    weights change under a redone turn), so the agent journals each call before its tool call."""

    deterministic = False
    resumes_constrained = True

    def __init__(self, policies: Path) -> None:
        from rollout_journal.participants.model.torch_backend import TorchPolicy

        self._make = TorchPolicy
        self.policies = policies
        self.current = self._named()
        self.inner = TorchPolicy(policies / self.current)
        self.tokenizer = self.inner.tokenizer
        self.in_flight = 0
        self.loads = 0

    @property
    def policy_version(self) -> str:
        return self.inner.policy_version

    @property
    def logprob_mode(self) -> str:
        return self.inner.logprob_mode

    def set_policy_version(self, version: str) -> None:
        self.inner.set_policy_version(version)

    def _named(self) -> str:
        return (self.policies / "CURRENT").read_text().strip()

    async def _follow(self) -> None:
        named = self._named()
        if named != self.current and self.in_flight == 0:
            old, self.inner, self.current = self.inner, self._make(self.policies / named), named
            self.loads += 1
            await old.aclose()

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[TokenChunk, None]:
        await self._follow()
        self.in_flight += 1
        try:
            async for chunk in self.inner.stream(request):
                yield chunk
        finally:
            self.in_flight -= 1

    async def aclose(self) -> None:
        await self.inner.aclose()


def workload_config(url: str, work: Path, groups: int, server: str):
    from rollout_journal.participants.workload.config import ModelConfig, WorkloadConfig

    return WorkloadConfig(
        name="grpo",
        groups=groups,
        siblings=SIBLINGS,
        max_turns=TURNS,
        environment="workplace",
        seed=11,
        allow_early_submit=False,
        journal=url,
        writer="grpo-worker",
        concurrency=SIBLINGS * 2,
        resource_servers={"workplace": server},
        model=ModelConfig(path=str(work / "policies" / "v0"), max_concurrent_calls=2),
    )


def run_worker(args: argparse.Namespace) -> int:
    import torch

    from rollout_journal.participants.workload.run import open_workload_journal
    from rollout_journal.participants.workload.runner import Runner

    torch.set_num_threads(1)
    config = workload_config(args.url, args.work, args.groups, args.server)
    backend = FollowingPolicy(args.work / "policies")
    with open_workload_journal(config) as journal:
        runner = Runner(
            config,
            journal,
            backend,
            backend.tokenizer,
            progress=lambda rollout, turn: print(f"turn {rollout} {turn}", flush=True),
        )
        report = asyncio.run(runner.run(resume=args.resume))
    if report.failed or report.set_aside:
        print(f"failed {report.failed or report.set_aside}", file=sys.stderr, flush=True)
        return 1
    print(f"done loads={backend.loads}", flush=True)
    return 0


# -- the trainer: GRPO steps on complete groups, exactly once with its checkpoint -----------------
def publish_policy(model, work: Path, step: int) -> str:
    """Weights as policy folder ``v<step>`` (tokenizer and template from v0), then ``CURRENT``."""
    policies = work / "policies"
    name = f"v{step}"
    if not (policies / name).exists():
        tmp = Path(tempfile.mkdtemp(dir=policies, prefix=f".{name}-"))
        model.save_pretrained(tmp, safe_serialization=True)
        for f in (policies / "v0").iterdir():
            if not (tmp / f.name).exists():
                shutil.copy2(f, tmp / f.name)
        os.replace(tmp, policies / name)
    current = policies / ".CURRENT.tmp"
    current.write_text(name)
    os.replace(current, policies / "CURRENT")
    return name


def grpo_step(model, optimizer, batch: dict) -> float:
    """One policy-gradient step with group-relative advantages over the sampled tokens."""
    import torch

    rewards = batch["rewards"]
    advantages = (rewards - rewards.mean()) / (rewards.std(unbiased=False) + 1e-6)
    ids, mask = batch["input_ids"], batch["loss_mask"][:, 1:].float()
    logits = model(input_ids=ids, attention_mask=batch["attention_mask"].long()).logits[:, :-1]
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    loss = -(advantages[:, None] * logprobs * mask).sum() / mask.sum().clamp(min=1.0)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss)


def run_trainer(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from rollout_journal.journal.open import open_backend, open_journal
    from rollout_journal.participants.trainer import FeedPosition, TrainerFeed

    torch.manual_seed(0)
    torch.set_num_threads(1)
    ckpt_path = args.work / "trainer" / "checkpoint.pt"
    ckpt_path.parent.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(args.work / "policies" / "v0", dtype=torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    state: dict = {"steps": [], "position": None}
    if ckpt_path.exists():
        saved = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        state = saved["state"]
        publish_policy(model, args.work, len(state["steps"]))  # what the checkpoint's weights are
    position = FeedPosition.from_json(state["position"]) if state["position"] else None
    acknowledger = open_journal(args.url, writer="grpo-trainer", mode="plain")  # requests go to <ns>.acks
    with TrainerFeed(
        open_backend(args.url, read_only=True), position, acknowledger=acknowledger, trainer="grpo-trainer"
    ) as feed:
        for group in feed.groups(limit=args.groups - len(state["steps"]), idle_timeout_s=600):
            batch = group.tensors()
            loss = grpo_step(model, optimizer, batch)
            versions = sorted({v for per_rollout in batch["policy_versions"] for v in per_rollout})
            state["steps"].append(
                {
                    "group": group.group_id,
                    "reward": float(batch["rewards"].mean()),
                    "loss": loss,
                    "policy_versions": versions,
                }
            )
            state["position"] = group.position.to_json()
            tmp = ckpt_path.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "state": state}, tmp)
            os.replace(tmp, ckpt_path)  # the step and the groups it consumed, durable together
            name = publish_policy(model, args.work, len(state["steps"]))
            print(
                f"step {len(state['steps'])} {group.group_id} reward={state['steps'][-1]['reward']:.3f} policy={name}",
                flush=True,
            )
            for future in feed.acknowledge(group):
                future.result()
    acknowledger.close()
    return 0


# -- the orchestrator ------------------------------------------------------------------------------
class Child:
    """A role in a process of its own; its stdout lines are counted by their first word."""

    def __init__(self, name: str, argv: list[str], log_dir: Path) -> None:
        self.name = name
        self.argv = argv
        self.lines: list[str] = []
        self.stderr = (log_dir / f"{name}.stderr").open("ab")
        self.proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            env=os.environ | {"PYTHONPATH": str(ROOT)},
            text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.strip())

    def count(self, word: str) -> int:
        return sum(1 for line in list(self.lines) if line.startswith(word + " "))

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def wait(self, timeout_s: float) -> int:
        code = self.proc.wait(timeout_s)
        self.stderr.close()
        return code


@contextlib.contextmanager
def kafka() -> Iterator[str]:
    from bench.common import kafka_bootstrap

    with kafka_bootstrap() as bootstrap:
        yield bootstrap


def say(line: str) -> None:
    """Progress on stderr (stdout stays the report): a run takes minutes."""
    print(f"{time.strftime('%H:%M:%S')} grpo: {line}", file=sys.stderr, flush=True)


def wait_until(
    condition, timeout_s: float, what: str, children: list[Child], status=None, every_s: float = 10.0
) -> None:
    started = time.monotonic()
    deadline, shown = started + timeout_s, started
    while not condition():
        if status is not None and time.monotonic() - shown >= every_s:
            shown = time.monotonic()
            say(f"waiting for {what}: {status()} ({shown - started:.0f} s)")
        for child in children:
            if child.proc.poll() not in (None, 0):
                raise SystemExit(f"{child.name} exited with {child.proc.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.05)


def serve(port: int, log_dir: Path) -> tuple[Child, str]:
    server = Child(
        "resource-server",
        [
            sys.executable,
            "-m",
            "rollout_journal.replay.cli.main",
            "serve-resources",
            "--environment",
            "workplace",
            "--port",
            str(port),
        ],
        log_dir,
    )
    wait_until(lambda: server.count("serving") > 0, 60, "the resource server", [server])
    return server, server.lines[-1].split()[-1]


def orchestrate(args: argparse.Namespace) -> dict:
    from rollout_journal.participants.model.tiny_model import tiny_model_dir

    groups = args.groups or (6 if args.small else 24)
    os.environ.setdefault(TOKEN_ENV, os.urandom(16).hex())
    with tempfile.TemporaryDirectory(prefix="rj-grpo-") as tmp, kafka() as bootstrap:
        work, logs = Path(tmp), Path(tmp) / "logs"
        logs.mkdir()
        (work / "policies").mkdir()
        shutil.copytree(tiny_model_dir(), work / "policies" / "v0")
        (work / "policies" / "CURRENT").write_text("v0")
        url = f"kafka://{bootstrap}/grpo-{os.getpid()}-{time.time_ns() % 10**6}?partitions=4"
        me = [sys.executable, str(Path(__file__).resolve())]
        common = ["--url", url, "--work", str(work), "--groups", str(groups)]
        total_turns = groups * SIBLINGS * TURNS
        kills = {"resource_server": 0, "worker": 0, "trainer": 0}
        say(f"{groups} groups x {SIBLINGS} siblings x {TURNS} turns on {bootstrap}; logs in {logs}")
        server, server_url = serve(0, logs)
        say(f"resource server at {server_url}; starting the worker and the trainer")
        port = int(server_url.rsplit(":", 1)[1].split("/")[0])
        worker_argv = [*me, "--role", "worker", *common, "--server", server_url]
        trainer_argv = [*me, "--role", "trainer", *common, "--lr", str(args.lr)]
        worker = Child("worker", worker_argv, logs)
        trainer = Child("trainer", trainer_argv, logs)
        turns = lambda: worker.count("turn") + sum(c.count("turn") for c in retired_workers)  # noqa: E731
        steps = lambda: trainer.count("step") + sum(c.count("step") for c in retired_trainers)  # noqa: E731
        retired_workers: list[Child] = []
        retired_trainers: list[Child] = []
        progress = lambda: f"{turns()}/{total_turns} turns, {steps()}/{groups} trainer steps"  # noqa: E731
        try:
            wait_until(
                lambda: turns() >= total_turns // 5, 600, "a fifth of the turns", [worker, trainer, server], progress
            )
            say(f"SIGKILL the resource server ({progress()})")
            server.kill()  # its rollouts bring their resources back from the journal once it is back
            kills["resource_server"] += 1
            server, _ = serve(port, logs)
            wait_until(
                lambda: turns() >= total_turns * 2 // 5,
                600,
                "two fifths of the turns",
                [worker, trainer, server],
                progress,
            )
            say(f"SIGKILL the worker, then resume it ({progress()})")
            worker.kill()
            kills["worker"] += 1
            retired_workers.append(worker)
            worker = Child("worker", [*worker_argv, "--resume"], logs)
            wait_until(lambda: steps() >= 2, 600, "two trainer steps", [worker, trainer, server], progress)
            say(f"SIGKILL the trainer, then restart it from its checkpoint ({progress()})")
            trainer.kill()
            kills["trainer"] += 1
            retired_trainers.append(trainer)
            trainer = Child("trainer", trainer_argv, logs)
            wait_until(
                lambda: worker.proc.poll() is not None and trainer.proc.poll() is not None,
                1200,
                "the worker and the trainer to finish",
                [worker, trainer],
                progress,
            )
            say(f"done: {progress()}")
            for child, what in ((worker, "worker"), (trainer, "trainer")):
                if child.wait(60) != 0:
                    raise SystemExit(f"{what} failed: {(logs / f'{child.name}.stderr').read_text()[-3000:]}")
        finally:
            for child in (worker, trainer, server):
                if child.proc.poll() is None:
                    child.proc.send_signal(signal.SIGTERM if child is server else signal.SIGKILL)
                    child.proc.wait(60)
        import torch

        state = torch.load(work / "trainer" / "checkpoint.pt", weights_only=False)["state"]
    trained = [s["group"] for s in state["steps"]]
    expected = {f"grpo-g{g}" for g in range(groups)}
    versions = sorted({v for s in state["steps"] for v in s["policy_versions"]})
    rewards = [round(s["reward"], 4) for s in state["steps"]]
    report = {
        "steps": len(state["steps"]),
        "groups": groups,
        "groups_trained": len(set(trained) & expected),
        "groups_lost": len(expected - set(trained)),
        "groups_trained_twice": len(trained) - len(set(trained)),
        "kills": kills,
        "policy_versions_sampled": len(versions),
        "reward_per_step": rewards,
    }
    if args.plot:
        plot(rewards, Path(args.plot), kills)
    return report


def plot(rewards: list[float], out: Path, kills: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=120)
    steps = list(range(1, len(rewards) + 1))
    ax.plot(steps, rewards, marker="o", linewidth=1, markersize=3, label="group mean reward")
    window = 4
    if len(rewards) >= window:
        smooth = [sum(rewards[i - window + 1 : i + 1]) / window for i in range(window - 1, len(rewards))]
        ax.plot(steps[window - 1 :], smooth, linewidth=2, label=f"mean of {window} steps")
    ax.set_xlabel("trainer step (one prompt group each)")
    ax.set_ylabel("reward")
    killed = ", ".join(f"{name.replace('_', ' ')} x{n}" for name, n in kills.items() if n)
    ax.set_title(f"GRPO on the tiny Llama, workplace environment (SIGKILLed: {killed})", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="6 groups of 4 (the CI configuration)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--groups", type=int, default=0, help="prompt groups (default 24; --small: 6)")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--plot", help="write the reward-per-step PNG here")
    parser.add_argument("--role", choices=["worker", "trainer"], help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--server", help=argparse.SUPPRESS)
    parser.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "worker":
        return run_worker(args)
    if args.role == "trainer":
        return run_trainer(args)
    report = orchestrate(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for key, value in report.items():
            print(f"{key}: {value}")
    return 0 if report["groups_lost"] == 0 and report["groups_trained_twice"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
