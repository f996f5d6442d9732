"""verifiers (PyPI ``verifiers`` 0.4.0, its ``verifiers.v1`` API) behind the journaling gateway.

A verifiers environment runs unmodified: its ``Harness`` launches the agent program with the
interception server's endpoint, and the interception forwards every model call to
``ModelContext.client.base_url`` (``verifiers/v1/clients/eval.py``). Point that base URL at the
gateway, one rollout per episode, and every call is journaled; a job killed mid-run and run again
gets every call it already made answered from the journal (verifiers' own interception replays a
retried request from memory only, 600 s and 64 entries, ``interception/server.py:89-94``).

Stable ids: ``rollout_id(run, step, task.key, sibling)``: ``task.key`` is the task's content hash
(``task.py:163``), so a restarted job re-drives the same ids. The interception sends the episode's
trace id as ``X-Session-ID`` (``clients/client.py:16``), fresh per run: the gateway takes it as the
attempt key, so the new run is a new attempt that fences the old one.

This module imports nothing of rollout_journal's runtime and imports verifiers only when called: it
runs in verifiers' own environment (``make venv-verifiers``), talking to the gateway over HTTP.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from typing import Any

__all__ = ["finish", "gateway_context", "rollout_id", "run_durable"]

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def rollout_id(run: str, step: int, task_key: str, sibling: int = 0) -> str:
    """``{run}.s{step}.{task_key[:16]}.{sibling}``, in the gateway's id alphabet."""
    return _UNSAFE.sub("-", f"{run}.s{step}.{task_key[:16]}.{sibling}")[:200]


def gateway_context(
    gateway_url: str,
    rollout: str,
    *,
    model: str,
    sampling: Any = None,
    group: str = "",
    group_size: int = 1,
    api_key_var: str = "RJ_GATEWAY_KEY",
) -> Any:
    """A ``verifiers.v1.ModelContext`` whose client goes to the gateway for ``rollout``."""
    import verifiers.v1 as vf

    headers = {"X-Rollout-Group": group or rollout, "X-Rollout-Group-Size": str(group_size)}
    client = vf.EvalClientConfig(
        base_url=f"{gateway_url.rstrip('/')}/r/{rollout}/v1", api_key_var=api_key_var, headers=headers
    )
    return vf.ModelContext(model=model, client=client, sampling=sampling or vf.SamplingConfig())


def finish(gateway_url: str, rollout: str, reward: float) -> dict[str, Any]:
    """Journal the episode's reward (``RolloutFinished`` and the training record); a rollout the
    journal already finished (a re-run) answers its status as it is."""
    request = urllib.request.Request(
        f"{gateway_url.rstrip('/')}/r/{rollout}/finish",
        data=json.dumps({"reward": reward}).encode(),
        headers={"content-type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            status: dict[str, Any] = json.loads(response.read())
            return status
    except urllib.error.HTTPError as exc:
        body = json.loads(exc.read() or b"{}")
        if exc.code == 409 and body.get("error", {}).get("type") == "rollout_finished":
            return {"rollout": rollout, "finished": True, "reward": body.get("reward")}
        raise


def episode_reward(episode: Any) -> float:
    """The sum of an episode's rewards (every trace, every reward function)."""
    total = 0.0
    for trace in episode.traces:
        for value in trace.rewards.values():
            if value is not None:
                total += float(value.value)
    return total


async def run_durable(
    env: Any,
    tasks: list[Any],
    gateway_url: str,
    *,
    run: str,
    step: int = 0,
    model: str,
    sampling: Any = None,
    siblings: int = 1,
) -> list[dict[str, Any]]:
    """Run every task's episodes (``siblings`` each, one after the other) through the gateway and
    journal each reward; returns per rollout its id, reward and whether the episode went well.
    Call it inside ``async with env.serving():``."""
    results = []
    for task in tasks:
        group = rollout_id(run, step, task.key, 0).rsplit(".", 1)[0]
        for sibling in range(siblings):
            rid = rollout_id(run, step, task.key, sibling)
            ctx = gateway_context(gateway_url, rid, model=model, sampling=sampling, group=group, group_size=siblings)
            episode = await env.run_episode(task, ctx)
            reward = episode_reward(episode)
            if episode.ok:
                finish(gateway_url, rid, reward)
            results.append({"rollout": rid, "reward": reward, "ok": bool(episode.ok), "errors": len(episode.errors)})
    return results
