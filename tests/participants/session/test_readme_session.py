"""The README's session-API example ("Bring your own agent", way 1) runs as written: its code
block, taken from the README itself, drives a real model upstream and a file journal, and a second
run of the same code (a restarted job) is answered from the journal without calling the model."""

from __future__ import annotations

import asyncio
import re
import textwrap
from pathlib import Path
from typing import Any

import numpy as np

from rollout_journal.participants.session import ToolOutcome
from tests.support.fixed_rate_upstream import FixedRateUpstream
from tests.support.paths import REPO_ROOT

HEADING = "**1. The session API**"


def readme_example() -> str:
    """The first ```python block after the heading, as the README shows it."""
    text = (REPO_ROOT / "README.md").read_text()
    after = text[text.index(HEADING) :]
    match = re.search(r"```python\n(.*?)```", after, re.S)
    assert match is not None, f"no python block after {HEADING!r} in the README"
    return match.group(1)


def run_example(code: str, upstream_url: str, journal: Path) -> dict[str, Any]:
    """Run the block inside a coroutine (its awaits are top-level), with the names it leaves to the
    reader: a prompt, some code, a tool runner, the turn's messages and a reward."""
    # the fixed-rate upstream's constant logprobs are declared processed, as the gateway's tests declare them
    upstream = f'{upstream_url!r}, logprobs="processed"'
    code = code.replace('"http://127.0.0.1:8000"', upstream).replace('"runs/my-job"', repr(str(journal)))
    calls: list[dict[str, Any]] = []

    async def run_it(ctx: Any) -> ToolOutcome:
        calls.append({"key": ctx.idempotency_key})
        return ToolOutcome({"ran": len(calls)})

    scope: dict[str, Any] = {
        "prompt_ids": np.asarray([1, 5, 40, 60, 6], dtype=np.int32),
        "code": "print(1)",
        "run_it": run_it,
        "messages": [],
        "reward": 1.0,
    }
    exec(
        compile("async def _example():\n" + textwrap.indent(code, "    ") + "\n    return locals()", "README", "exec"),
        scope,
    )
    names = asyncio.run(scope["_example"]())
    names["tool_runs"] = len(calls)
    names["journal"].close()
    return names


def test_the_readme_session_example_runs_as_written_and_a_rerun_is_answered_from_the_journal(
    tmp_path: Path, upstream: FixedRateUpstream
) -> None:
    code = readme_example()
    first = run_example(code, upstream.url, tmp_path / "journal")
    generated = upstream.upstream.tokens
    again = run_example(code, upstream.url, tmp_path / "journal")

    assert not first["answer"].replayed and first["tool_runs"] == 1
    assert first["record"] is not None and first["record"].reward == 1.0
    assert again["answer"].replayed and again["result"].replayed and again["tool_runs"] == 0
    assert again["answer"].output_ids.tolist() == first["answer"].output_ids.tolist()
    # the rerun generated nothing for the agent: only open_upstream's one-token probe of the API
    assert upstream.upstream.tokens - generated == 1 and len(first["answer"].output_ids) > 1
