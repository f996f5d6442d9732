"""verl 0.9.1's agent loop on the session API: every model call journaled, and a rerun of the same
trainer step answered from the journal (run it twice: the second prints the same outputs and the
model is not called).

    .venv-verl/bin/python examples/verl_session_loop/run.py --upstream http://127.0.0.1:8000 \\
        --journal runs/verl --run demo --prompts 2

Runs in verl's own environment (``make venv-verl``); without Ray or a GPU: the loop is constructed
directly, as verl's AgentLoopWorker would, with the upstream (a vLLM server) as the session's model.
Prints one JSON line per rollout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "build" / "namespace"))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="a vLLM server (or any tokens-in server) base URL")
    parser.add_argument("--journal", required=True)
    parser.add_argument("--model-dir", help="the served model's folder (default: the one the upstream names)")
    parser.add_argument("--run", default="verl-demo")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument(
        "--upstream-logprobs",
        choices=("probe", "processed", "raw"),
        default="probe",
        help="what the upstream's logprobs are (probe: ask it; a raw vLLM server is refused)",
    )
    args = parser.parse_args()

    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from rollout_journal.journal import open_journal
    from rollout_journal.participants.adapters.verl import session_agent_loop
    from rollout_journal.participants.model.gate import ModelParticipant
    from rollout_journal.participants.remote.gateway.upstream import open_upstream
    from rollout_journal.participants.session import SessionFactory

    upstream = open_upstream(args.upstream, args.model_dir, logprobs=args.upstream_logprobs)
    journal = open_journal(args.journal, writer="verl")
    factory = SessionFactory(journal, ModelParticipant(upstream), writer="verl")
    factory.start()
    loop_class = session_agent_loop(factory, run=args.run, max_turns=args.turns)
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"prompt_length": 512, "response_length": 512}}})
    tokenizer = AutoTokenizer.from_pretrained(str(Path(upstream.tokenizer.source)))
    loop = loop_class(DictConfigWrap(config), None, tokenizer, None, RLHFDataset, DictConfigWrap(OmegaConf.create({})))
    for index in range(args.prompts):
        row = {"raw_prompt": [{"role": "user", "content": f"prompt {index}"}], "uid": f"p{index}", "index": index}
        out = await loop.run({"temperature": 0.0, "max_tokens": 8}, **row)
        session = factory.sessions[f"{args.run}.s0.p{index}.0"]
        print(
            json.dumps(
                {
                    "rollout": session.rollout_id,
                    "response_ids": out.response_ids,
                    "sampled": sum(out.response_mask),
                    "reward": out.reward_score,
                    "replayed_calls": session.replayed_calls,
                    "live_calls": session.live_calls,
                }
            ),
            flush=True,
        )
    await upstream.aclose()
    journal.close()


if __name__ == "__main__":
    asyncio.run(main())
