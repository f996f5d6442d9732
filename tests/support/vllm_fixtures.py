"""One vLLM engine in this process and one vLLM OpenAI-compatible server per test session.

Both load the session's embedded model folder with the settings vLLM's CPU build needs
(float32, eager, a 1 GiB KV cache, one OpenMP thread, compile caches under the project,
no usage statistics). The server is ``python -m vllm.entrypoints.openai.api_server``
on a free port of 127.0.0.1, stopped with SIGINT at the end of the session. It reports
processed logprobs (``--logprobs-mode processed_logprobs``: those of the distribution it
samples from) and serves vLLM's dev endpoints (``VLLM_SERVER_DEV_MODE=1``), which the weight
swap test uses to load other weights; that test puts the session's weights back.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rollout_journal.compose.local_broker import PORT_ATTEMPTS, free_ports
from rollout_journal.participants.model.tiny_model import tiny_model_dir
from rollout_journal.participants.model.vllm_backend import VllmEngine, vllm_environment

SERVED_NAME = "tiny"
SERVER_START_TIMEOUT_S = 600.0  # three processes import vLLM; minutes on a loaded 2-core machine


@pytest.fixture(scope="session")
def vllm_engine() -> VllmEngine:
    return VllmEngine.shared(tiny_model_dir())


def _start_server(env: dict[str, str]) -> tuple[subprocess.Popen, int, Path]:
    """Start the server on a port free now and wait until it answers: (process, port, its log).

    The port is bound by the server only after it imported vLLM (minutes under load), and
    meanwhile any outgoing connection on the machine may be given it: a server that exits
    because its address is in use is started again on another port."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        [port] = free_ports(1)
        fd, name = tempfile.mkstemp(prefix="rj-vllm-server-", suffix=".log")
        os.close(fd)
        log = Path(name)
        with log.open("w") as out:
            server = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "vllm.entrypoints.openai.api_server",
                    "--model",
                    str(tiny_model_dir()),
                    "--served-model-name",
                    SERVED_NAME,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--dtype",
                    "float32",
                    "--enforce-eager",
                    "--max-model-len",
                    "2048",
                    "--seed",
                    "0",
                    "--logprobs-mode",
                    "processed_logprobs",
                    # vLLM's tokens-in/tokens-out /inference/v1/generate, which the journaling gateway calls
                    "--enable-scale-out",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        try:
            _wait_healthy(server, port, log)
            return server, port, log
        except RuntimeError:
            exited_by_itself = server.poll() is not None  # not a health timeout we end below
            _stop(server)
            if exited_by_itself and "Address already in use" in log.read_text() and attempt < PORT_ATTEMPTS:
                log.unlink()
                continue
            raise
    raise AssertionError("unreachable")


def _wait_healthy(server: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"vLLM's server exited with {server.returncode}: {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"vLLM's server not ready in {SERVER_START_TIMEOUT_S} s: {log.read_text()[-3000:]}")
        time.sleep(1)


def _stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


@pytest.fixture(scope="session")
def vllm_server() -> Iterator[str]:
    """The server's base URL (``http://127.0.0.1:PORT/v1``)."""
    env = os.environ | vllm_environment(1.0) | {"OMP_NUM_THREADS": "1", "VLLM_SERVER_DEV_MODE": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the server runs its engine core as it likes
    server, port, log = _start_server(env)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        _stop(server)
        log.unlink(missing_ok=True)
