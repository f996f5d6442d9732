"""Server processes a bench starts and stops: a model upstream, a gateway."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def started(
    command: list[str], marker: str, log: Path, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, str]:
    """Start a server that prints ``<marker> URL`` once it listens; (process, URL)."""
    out = log.open("w")
    proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env or os.environ.copy(), cwd=str(ROOT))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if line.startswith(marker):
                return proc, line.split()[-1]
        if proc.poll() is not None:
            raise SystemExit(f"{command[2]} exited: {log.read_text()[-2000:]}")
        time.sleep(0.1)
    raise SystemExit(f"{command} did not start: {log.read_text()[-2000:]}")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 30 s."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
