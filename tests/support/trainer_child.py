"""A trainer process for the results tests: consumes prompt groups through ``TrainerFeed``, takes a
"step" per group (records what it trained on), saves its checkpoint (the feed position with the
step, atomically) and acknowledges. ``--kill before_save|after_save --at N`` SIGKILLs itself once
the checkpoint would hold N steps: before saving (the step is lost with the crash) or after."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
from pathlib import Path

from rollout_journal.journal.open import is_kafka_url, open_backend, open_journal
from rollout_journal.participants.trainer import FeedPosition, TrainerFeed


def digest(record) -> str:
    """What the step trained on, comparable with ``replay export-training``."""
    h = hashlib.sha256()
    for array in (record.input_ids, record.logprobs, record.loss_mask):
        h.update(array.tobytes())
    h.update(
        json.dumps([(s.start, s.end, s.generated, s.attempt, s.policy_version) for s in record.token_segments]).encode()
    )
    return h.hexdigest()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("location")
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--groups", type=int, required=True)
    ap.add_argument("--kill", choices=["before_save", "after_save"])
    ap.add_argument("--at", type=int, default=0)
    ap.add_argument("--log", type=Path)
    args = ap.parse_args(argv)
    state = json.loads(args.checkpoint.read_text()) if args.checkpoint.exists() else {"position": None, "steps": []}
    position = FeedPosition.from_json(state["position"]) if state["position"] else None
    acknowledger = open_journal(args.location, writer="trainer", mode="plain" if is_kafka_url(args.location) else None)
    with TrainerFeed(open_backend(args.location, read_only=True), position, acknowledger=acknowledger) as feed:
        for group in feed.groups(limit=args.groups - len(state["steps"]), idle_timeout_s=120):
            state["steps"].append(
                {"group": group.group_id, "rollouts": {r.rollout_id: digest(r) for r in group.records}}
            )
            if args.log is not None:
                with args.log.open("a") as log:
                    log.write(group.group_id + "\n")
            if args.kill == "before_save" and len(state["steps"]) == args.at:
                os.kill(os.getpid(), signal.SIGKILL)
            state["position"] = group.position.to_json()
            tmp = args.checkpoint.with_suffix(".tmp")
            tmp.write_text(json.dumps(state))
            os.replace(tmp, args.checkpoint)  # the step and the position it consumed, saved together
            if args.kill == "after_save" and len(state["steps"]) == args.at:
                os.kill(os.getpid(), signal.SIGKILL)
            for future in feed.acknowledge(group):
                future.result()
    acknowledger.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
