"""The suite puts Ctrl-C back as the session began after a test that changed it
(tests/support/signal_state.py), and says which test did."""

from __future__ import annotations

import signal

import pytest

from tests.support import signal_state


def test_a_test_that_leaves_sigint_ignored_is_named_and_sigint_put_back() -> None:
    assert signal_state._baseline is not None
    before = signal.getsignal(signal.SIGINT)
    # what a library that ignores Ctrl-C leaves behind (or, in a session started with it ignored,
    # as a background job's is, one that installs Python's handler)
    other = signal.SIG_IGN if before is not signal.SIG_IGN else signal.default_int_handler
    signal.signal(signal.SIGINT, other)
    with pytest.warns(signal_state.SignalStateLeak, match="a-test-that-ignores-sigint: SIGINT was left"):
        signal_state._put_back("a-test-that-ignores-sigint")
    assert signal.getsignal(signal.SIGINT) == before == signal_state._baseline[0]
