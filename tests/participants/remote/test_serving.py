"""Serving through uvicorn: a server whose startup hangs is an error that names where it was to
serve and how long it was waited for, never a wait without end (nor a loop left spinning)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from rollout_journal.participants.remote import serving


class NeverStarts:
    """Stands in for ``uvicorn.Server``: its ``started`` flag never turns True, ``serve`` never returns."""

    started = False
    should_exit = False

    async def serve(self, sockets: Any = None) -> None:
        await asyncio.Event().wait()


@pytest.fixture
def never_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serving, "_server", lambda app: NeverStarts())
    monkeypatch.setattr(serving, "START_TIMEOUT_S", 0.2)


@pytest.mark.usefixtures("never_starts")
def test_serve_gives_up_on_a_server_that_never_starts_naming_its_url_and_the_wait() -> None:
    sock = serving.bind("127.0.0.1", 0)
    url = serving.url_of(sock)
    ready: list[str] = []

    async def main() -> BaseException | None:
        task = asyncio.create_task(serving.serve(object(), sock, ready=ready.append))
        done, _ = await asyncio.wait({task}, timeout=10)
        assert done, "serve() was still waiting for the server to start after 10 s"
        return task.exception()

    try:
        raised = asyncio.run(main())
    finally:
        sock.close()
    assert isinstance(raised, TimeoutError)
    assert str(raised) == f"uvicorn did not start serving {url} within 0.2 s"
    assert ready == []


@pytest.mark.usefixtures("never_starts")
def test_a_threaded_server_that_never_starts_says_so_and_its_thread_ends() -> None:
    name = "never-starts"
    with pytest.raises(RuntimeError, match=r"never-starts did not start.* http://127\.0\.0\.1:\d+ within 0\.2 s"):
        serving.ThreadedServer(object, name=name)
    for thread in [t for t in threading.enumerate() if t.name == name]:
        thread.join(10)
        assert not thread.is_alive(), "the server's loop went on polling after its start was given up"
