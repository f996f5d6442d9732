"""Ctrl-C as the test process got it, kept for every test.

A child process inherits an ignored or blocked SIGINT through ``exec``. One test that leaves the
test process so (a library that ignores Ctrl-C in the process it runs in, a mask not restored)
silently changes every later test that sends SIGINT to a child: the Ctrl-C listing test saw its
listing ignore the signal five tries in a row in a CI run. This plugin notes how the process
held SIGINT when the session began, and before and after each test puts it back if it changed,
with a warning naming where (the summary at the end lists them).
"""

from __future__ import annotations

import signal
import threading
import warnings
from collections.abc import Iterator

import pytest

_SIGNALLED = hasattr(signal, "pthread_sigmask")
_baseline: tuple[object, bool] | None = None


class SignalStateLeak(UserWarning):
    """A test, or a fixture set up for it, changed how the test process holds SIGINT."""


def _state() -> tuple[object, bool]:
    blocked = _SIGNALLED and signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    return signal.getsignal(signal.SIGINT), blocked


def _put_back(where: str) -> None:
    assert _baseline is not None
    now = _state()
    if now == _baseline:
        return
    handler, blocked = _baseline
    if handler is not None:  # None: set from outside Python, which cannot be put back from here
        signal.signal(signal.SIGINT, handler)  # type: ignore[arg-type]
    if _SIGNALLED:
        signal.pthread_sigmask(signal.SIG_BLOCK if blocked else signal.SIG_UNBLOCK, {signal.SIGINT})
    warnings.warn(
        SignalStateLeak(f"{where}: SIGINT was left {now[0]!r}{' (blocked)' if now[1] else ''}; put back"),
        stacklevel=1,
    )


def pytest_sessionstart(session: pytest.Session) -> None:
    global _baseline
    _baseline = _state()


@pytest.fixture(autouse=True)
def sigint_as_the_session_began(request: pytest.FixtureRequest) -> Iterator[None]:
    if _baseline is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    _put_back(f"before {request.node.nodeid}")
    yield
    _put_back(request.node.nodeid)
