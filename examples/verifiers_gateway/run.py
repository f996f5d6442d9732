"""Run a verifiers environment, unmodified, with every episode's model calls going through the
journaling gateway: kill it anywhere (SIGKILL), run it again, and every call it already made is
answered from the journal.

    rollout-journal gateway --upstream http://127.0.0.1:8000 --journal runs/gw --port 8100 &
    RJ_GATEWAY_KEY=unused .venv-verifiers/bin/python examples/verifiers_gateway/run.py \\
        --gateway http://127.0.0.1:8100 --run demo --tasks 2

Runs in verifiers' own environment (``make venv-verifiers``); rollout_journal's adapter module comes
from the source tree (``make namespace``; it needs only the standard library and verifiers).
Prints one JSON line per rollout: its id, reward, and whether the episode went well.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the rj_vf_demo taskset
sys.path.insert(0, str(HERE.parents[1] / "build" / "namespace"))  # rollout_journal, as `make namespace` builds it


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gateway", required=True, help="the gateway's URL (http://host:port)")
    parser.add_argument("--run", required=True, help="the job's name: rollout ids are {run}.s{step}.{task}.{sibling}")
    parser.add_argument("--step", type=int, default=0)
    parser.add_argument("--tasks", type=int, default=2)
    parser.add_argument("--siblings", type=int, default=1)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--model", default="tiny")
    args = parser.parse_args()

    import verifiers.v1 as vf
    from verifiers.v1.utils.loaders import load_environment

    from rollout_journal.participants.adapters.verifiers import run_durable

    os.environ.setdefault("RJ_GATEWAY_KEY", "unused")
    os.environ["RJ_DEMO_TURNS"], os.environ["RJ_DEMO_MAX_TOKENS"] = str(args.turns), str(args.max_tokens)
    config = vf.SingleAgentEnvConfig(
        taskset={"id": "rj_vf_demo", "num_tasks": args.tasks},
        interception={"type": "server"},  # verifiers' own proxy in front of the agent program
        agent={"runtime": {"type": "subprocess"}},  # the default (prime) needs a login and a tunnel
    )
    env = load_environment(config)
    sampling = vf.SamplingConfig(temperature=0.0, max_tokens=args.max_tokens)
    async with env.serving():
        results = await run_durable(
            env,
            list(env.taskset),
            args.gateway,
            run=args.run,
            step=args.step,
            model=args.model,
            sampling=sampling,
            siblings=args.siblings,
        )
    for result in results:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
