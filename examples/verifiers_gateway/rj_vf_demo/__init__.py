"""A small verifiers 0.4.0 environment: tasks, a reward, and a harness that launches an unmodified
multi-turn OpenAI-SDK agent program (agent.py) with the interception server's endpoint. Nothing in
it knows about rollout-journal: run.py only points the episode's client at the gateway."""

import os
import sys
from pathlib import Path
from typing import Any

import verifiers.v1 as vf

AGENT = str(Path(__file__).with_name("agent.py"))


class DemoData(vf.TaskData):
    pass


class DemoTask(vf.Task[DemoData]):
    @vf.reward(weight=1.0)
    async def reward(self, trace: vf.Trace) -> float:
        return float(len(trace.calls))  # one point per model call the agent made


class DemoConfig(vf.TasksetConfig):
    num_tasks: int = 2


class DemoTaskset(vf.Taskset[DemoTask, DemoConfig]):
    def load(self) -> list[DemoTask]:
        return [
            DemoTask(DemoData(prompt=f"task {i}: say something"), self.config.task)
            for i in range(self.config.num_tasks)
        ]


class DemoHarness(vf.Harness[vf.HarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    NEEDS_CONTAINER = False
    EXECUTES_CODE = False

    async def launch(
        self, ctx: Any, trace: Any, runtime: Any, endpoint: str, secret: str, mcp_urls: Any, data: Any
    ) -> Any:
        _, prompt = self.resolve_prompt(data)
        argv = [
            sys.executable,
            AGENT,
            f"--base-url={endpoint}",
            f"--api-key={secret}",
            f"--model={ctx.model}",
            f"--turns={os.environ.get('RJ_DEMO_TURNS', '3')}",
            f"--max-tokens={os.environ.get('RJ_DEMO_MAX_TOKENS', '16')}",
            f"--prompt={prompt}",
        ]
        return await runtime.run_program(argv, {})


__all__ = ["DemoTaskset", "DemoHarness"]
