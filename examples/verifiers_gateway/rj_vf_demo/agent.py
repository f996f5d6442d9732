"""An unmodified agent program: the plain OpenAI SDK, a multi-turn chat, nothing of rollout-journal."""

import argparse

from openai import OpenAI

parser = argparse.ArgumentParser()
for name in ("base-url", "api-key", "model", "prompt"):
    parser.add_argument(f"--{name}")
parser.add_argument("--turns", type=int, default=3)
parser.add_argument("--max-tokens", type=int, default=16)
args = parser.parse_args()
client = OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0)
messages: list = [{"role": "user", "content": args.prompt}]
for turn in range(args.turns):
    reply = client.chat.completions.create(
        model=args.model, messages=messages, max_tokens=args.max_tokens, temperature=0
    )
    messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
    messages.append({"role": "user", "content": f"turn {turn + 1}: go on"})
    print(f"turn {turn}: {reply.choices[0].message.content!r}", flush=True)
