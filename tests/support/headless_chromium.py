"""A real headless Chromium (Debian's ``chromium``) driven over the DevTools protocol on a
pipe (``--remote-debugging-pipe``: no port, no websocket library): open a page, collect
every console message and uncaught exception, evaluate JavaScript, take a screenshot."""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# As the machine notes prescribe: no sandbox (root), no GPU, and nothing that reaches for the network.
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--remote-debugging-pipe",
]


def chromium_path() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        raise RuntimeError("Debian's chromium is not installed (apt-get install chromium); .ci/run installs it")
    return found


@dataclass
class PageRun:
    """What a page did while it loaded."""

    console: list[dict] = field(default_factory=list)  # Runtime.consoleAPICalled and Log.entryAdded, as (level, text)
    exceptions: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)  # every URL the page asked for, itself included

    @property
    def errors(self) -> list[str]:
        return self.exceptions + [f"{m['level']}: {m['text']}" for m in self.console if m["level"] == "error"]


class HeadlessChromium:
    """One browser process; use as a context manager."""

    def __init__(self, width: int = 1280, height: int = 900, timeout_s: float = 60.0) -> None:
        self.width, self.height, self.timeout_s = width, height, timeout_s
        self._profile = tempfile.TemporaryDirectory(prefix="rj-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def as_fds_3_and_4() -> None:  # the DevTools pipe: the browser reads fd 3, writes fd 4 (only dup2: fork-safe)
            os.dup2(to_browser_r, 3)
            os.dup2(from_browser_w, 4)

        self.process = subprocess.Popen(
            [
                chromium_path(),
                *FLAGS,
                f"--user-data-dir={self._profile.name}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            # 3 and 4 kept too: the child closes every fd not listed after preexec_fn has made them
            pass_fds=(3, 4, to_browser_r, from_browser_w),
            preexec_fn=as_fds_3_and_4,
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next_id = 0
        self._events: list[dict] = []
        self.session = self._attach()

    def __enter__(self) -> HeadlessChromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.send("Browser.close", session=False)
            except (OSError, RuntimeError):
                pass
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for fd in (self._to_browser, self._from_browser):
            try:
                os.close(fd)
            except OSError:
                pass
        if self.process.stderr is not None:
            self.process.stderr.close()
        self._profile.cleanup()

    # -- the protocol ----------------------------------------------------------------
    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_browser], [], [], left)[0]:
                raise RuntimeError(f"chromium did not answer within {self.timeout_s} s")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                self.process.wait(10)
                why = self.process.stderr.read().decode(errors="replace")[-2000:] if self.process.stderr else ""
                raise RuntimeError(f"chromium exited (code {self.process.poll()}): {why}")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def send(self, method: str, params: dict | None = None, *, session: bool = True) -> dict[str, Any]:
        """Send one command and wait for its answer; events that arrive meanwhile are kept."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = self.session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout_s
        while True:
            answer = self._read_message(deadline)
            if answer.get("id") == self._next_id:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return answer.get("result", {})
            self._events.append(answer)

    def wait_for(self, method: str) -> dict:
        deadline = time.monotonic() + self.timeout_s
        while True:
            for i, event in enumerate(self._events):
                if event.get("method") == method:
                    return self._events.pop(i)
            self._events.append(self._read_message(deadline))

    def _attach(self) -> str:
        targets = self.send("Target.getTargets", session=False)["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        return self.send("Target.attachToTarget", {"targetId": page["targetId"], "flatten": True}, session=False)[
            "sessionId"
        ]

    # -- what a test does ------------------------------------------------------------
    def open(self, path: Path) -> PageRun:
        """Load ``path`` and wait for its load event; what it logged and threw."""
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.send(f"{domain}.enable")
        self.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": self.width, "height": self.height, "deviceScaleFactor": 1, "mobile": False},
        )
        self._events.clear()
        self.send("Page.navigate", {"url": path.resolve().as_uri()})
        self.wait_for("Page.loadEventFired")
        self.evaluate("1")  # a round trip: console events of the load are in by now
        run = PageRun()
        for event in self._events:
            params = event.get("params", {})
            if event.get("method") == "Runtime.exceptionThrown":
                details = params["exceptionDetails"]
                run.exceptions.append(details.get("exception", {}).get("description") or details.get("text", "?"))
            elif event.get("method") == "Runtime.consoleAPICalled":
                text = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
                run.console.append(
                    {"level": "error" if params["type"] in ("error", "assert") else params["type"], "text": text}
                )
            elif event.get("method") == "Network.requestWillBeSent":
                run.requests.append(params["request"]["url"])
            elif event.get("method") == "Log.entryAdded":
                entry = params["entry"]
                run.console.append({"level": entry["level"], "text": f"{entry.get('url', '')} {entry['text']}"})
        return run

    def evaluate(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, out: Path, *, full_page: bool = True) -> Path:
        """A PNG of the page (all of it with ``full_page``)."""
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            size = self.send("Page.getLayoutMetrics")["cssContentSize"]
            params |= {
                "captureBeyondViewport": True,
                "clip": {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1},
            }
        out.write_bytes(base64.b64decode(self.send("Page.captureScreenshot", params)["data"]))
        return out
