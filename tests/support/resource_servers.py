"""Resource servers as real subprocesses for the tests: started with the CLI, SIGKILLed, restarted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.support.paths import REPO_ROOT

TOKEN = "test-token-7f3a9c1e5b2d"  # what these tests' servers and workers share


class ServerProcess:
    """``rollout-journal serve-resources`` in a child process. Its first start binds a port the
    kernel picks (a port picked here and bound later could be taken meanwhile); a restart takes
    that port back."""

    def __init__(self, environment: str, *, faults: bool = False, pythonpath: list[Path] | None = None) -> None:
        self.environment = environment
        self.port = 0  # known once started
        self.faults = faults
        self.pythonpath = [REPO_ROOT, *(pythonpath or [])]
        self.proc: subprocess.Popen[bytes] | None = None
        self.kills = 0
        self.log = tempfile.NamedTemporaryFile(prefix=f"resource-server-{environment}-", suffix=".log")  # its stderr

    @property
    def url(self) -> str:
        assert self.port, "the server has not started yet"
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerProcess:
        command = [
            sys.executable,
            "-m",
            "rollout_journal.replay.cli.main",
            "serve-resources",
            "--environment",
            self.environment,
            "--port",
            str(self.port),
            *(["--fault-injection"] if self.faults else []),
        ]
        env = os.environ | {
            "ROLLOUT_JOURNAL_RESOURCE_TOKEN": TOKEN,
            "PYTHONPATH": os.pathsep.join(str(p) for p in self.pythonpath),
        }
        # stderr to a file: a pipe nobody reads would block a server that logs much
        self.proc = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=self.log)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode()  # "serving ENV at URL" once it listens
        if not line.startswith("serving"):
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(f"resource server for {self.environment} did not start: {line}{self.output()[-2000:]}")
        self.port = int(line.rsplit(":", 1)[1])  # "serving ENV at http://127.0.0.1:PORT"
        return self

    def output(self) -> str:
        """Everything it wrote to stderr, every life of it."""
        return Path(self.log.name).read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL: no goodbye, every session gone."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        self.kills += 1

    def restart(self) -> None:
        self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/v1/stats", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).json()

    def post(self, path: str, body: dict, token: str | None = TOKEN) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        return httpx.post(f"{self.url}{path}", json=body, headers=headers, timeout=10)


@contextmanager
def resource_servers(
    *environments: str, faults: bool = False, pythonpath: list[Path] | None = None
) -> Iterator[dict[str, ServerProcess]]:
    """One server per environment kind, stopped (never left running) at the end."""
    servers = {name: ServerProcess(name, faults=faults, pythonpath=pythonpath) for name in environments}
    try:
        for server in servers.values():
            server.start()
        yield servers
    finally:
        for server in servers.values():
            server.stop()


@contextmanager
def token_in_environment() -> Iterator[None]:
    previous = os.environ.get("ROLLOUT_JOURNAL_RESOURCE_TOKEN")
    os.environ["ROLLOUT_JOURNAL_RESOURCE_TOKEN"] = TOKEN
    try:
        yield
    finally:
        if previous is None:
            del os.environ["ROLLOUT_JOURNAL_RESOURCE_TOKEN"]
        else:
            os.environ["ROLLOUT_JOURNAL_RESOURCE_TOKEN"] = previous


def wait_until(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)
