"""Serving an ASGI app: on a socket bound here (port 0: the kernel picks one, known at once), in
this process's own loop (:func:`serve`, the CLI) or on a background thread (:class:`ThreadedServer`:
tests, notebooks, the bench), with uvloop/httptools when they are installed.

The one way this house runs uvicorn: the resource server (``participants.remote.server``) and the
journaling gateway (``participants.remote.gateway.server``) both serve through it."""

from __future__ import annotations

import asyncio
import importlib.util
import socket
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import uvicorn

from rollout_journal.journal.deadlines import Deadline

__all__ = ["ThreadedServer", "bind", "run_loop", "serve", "url_of"]


def run_loop(main: Awaitable[Any]) -> Any:
    """Run ``main`` to its end in a new event loop: uvloop's when it is installed."""
    factory = None
    if importlib.util.find_spec("uvloop") is not None:
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)  # type: ignore[arg-type]


def bind(host: str, port: int) -> socket.socket:
    """A listening, non-blocking TCP socket on ``host``:``port`` (IPv6 when ``host`` has a colon)."""
    # IPPROTO_TCP spelled out: asyncio sets TCP_NODELAY only on sockets that say so, and without it
    # every answer waits ~40 ms for a delayed ACK (headers and body are two writes).
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted server takes its port back at once
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


# How long uvicorn may take to start serving on its bound socket (lifespan off: well under a second).
START_TIMEOUT_S = 60.0


def _server(app: Any) -> uvicorn.Server:
    # No access log: request lines carry rollout ids at a rate nobody reads; the apps log errors.
    fast = importlib.util.find_spec("httptools") is not None
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_keep_alive=60,
        http="httptools" if fast else "h11",
        backlog=2048,
    )
    return uvicorn.Server(config)


async def _until_started(server: uvicorn.Server, serving: asyncio.Task[None], url: str, deadline: Deadline) -> bool:
    """Whether uvicorn started serving (False: its task ended first, a failed startup that the task
    raises). uvicorn offers no awaitable for it, only its ``started`` flag, so the flag is polled, up
    to ``deadline``: a startup that hangs cancels the task and raises :class:`TimeoutError` rather
    than leave the caller, and the loop, waiting on it forever."""
    while not server.started and not serving.done():
        if deadline.passed():
            serving.cancel()
            raise TimeoutError(f"uvicorn did not start serving {url} within {deadline.timeout_s:g} s")
        await asyncio.sleep(deadline.left(at_most=0.01))
    return server.started


async def serve(
    app: Any,
    sock: socket.socket,
    *,
    ready: Callable[[str], None] = lambda url: None,
    on_stop: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Serve ``app`` on ``sock`` in the running loop until the server is told to exit (SIGINT, SIGTERM);
    :class:`TimeoutError` if it has not started serving within :data:`START_TIMEOUT_S`."""
    server = _server(app)
    deadline = Deadline(START_TIMEOUT_S)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        if await _until_started(server, serving, url_of(sock), deadline):
            ready(url_of(sock))
        await serving
    finally:
        if on_stop is not None:
            await on_stop()


class ThreadedServer:
    """An ASGI app on a background thread with a loop of its own. ``make_app`` runs in that loop
    (what the app holds belongs to it); ``on_stop`` runs there when it closes."""

    def __init__(
        self,
        make_app: Callable[[], Any],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        name: str = "server",
        on_stop: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._sock = bind(host, port)
        self.url = url_of(self._sock)
        self.port = self._sock.getsockname()[1]
        self._started = threading.Event()
        self._failure: BaseException | None = None
        self._server: uvicorn.Server | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._make_app, self._on_stop = make_app, on_stop
        self._start = Deadline(START_TIMEOUT_S)  # the loop's bound too: it gives up when this does
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        if not self._started.wait(self._start.left()):
            raise RuntimeError(f"{name} did not start serving {self.url} within {START_TIMEOUT_S:g} s")
        if self._failure is not None or self._server is None or not self._server.started:
            raise RuntimeError(f"{name} did not start: {self._failure!r}") from self._failure

    def _run(self) -> None:
        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            self._server = _server(self._make_app())
            serving = asyncio.create_task(self._server.serve(sockets=[self._sock]))
            try:
                if not await _until_started(self._server, serving, self.url, self._start):
                    await serving  # a failed startup: what it raised is recorded before __init__ wakes
                self._started.set()
                await serving
            finally:
                if self._on_stop is not None:
                    await self._on_stop()

        try:
            run_loop(main())
        except BaseException as exc:  # reported by __init__ (or lost at interpreter exit)
            self._failure = exc
            self._started.set()

    def call(self, fn: Callable[[], Coroutine[Any, Any, Any]], timeout: float = 60.0) -> Any:
        """Run a coroutine in the server's loop and wait for its result."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(fn(), self.loop).result(timeout)

    def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        self._thread.join(60)
        self._sock.close()

    def __enter__(self) -> ThreadedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
