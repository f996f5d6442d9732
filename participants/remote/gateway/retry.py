"""One retry policy for the gateway's calls out: to its model upstream and to tool servers.

A failed try is retried ``retries`` times (``retries + 1`` tries in all) when it raised one of the
caller's transient exceptions; anything else ends the call at once. The waits start at
``backoff_s`` and double (``backoff_s``, ``2 * backoff_s``, ``4 * backoff_s``, ...), each with up to
``backoff_s`` more at random: the gateway's calls fail together (an upstream restarting fails every
stream it served), and without jitter they would all come back at the same instants, a burst per
retry. The jitter is bounded by the first wait, so a call still waits at least what the doubling
says, at most ``retries * backoff_s`` longer in all, and a test's small ``backoff_s`` keeps it fast.

After the last try, the last transient exception is raised as it was (``reraise``): the caller turns
it into its own error (which names the tries) outside the loop.

:mod:`rollout_journal.participants.remote.client` retries with tenacity too, but for a time budget
(``wait_s``), not a count of tries: the gateway's settings (``--upstream-retries``) count tries.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
    wait_random,
)

__all__ = ["backoff"]

log = logging.getLogger(__name__)


def backoff(
    what: str,
    retries: int,
    backoff_s: float,
    retry_on: type[BaseException] | tuple[type[BaseException], ...],
    *,
    on_retry: Callable[[], None] | None = None,
) -> AsyncRetrying:
    """The tries of one call (``async for attempt in backoff(...): with attempt: ...``): ``retry_on``
    retried up to ``retries`` times; ``on_retry`` runs before each wait (a counter of retries)."""

    def before_sleep(state: RetryCallState) -> None:
        if on_retry is not None:
            on_retry()
        failure = state.outcome.exception() if state.outcome is not None else None
        wait = state.next_action.sleep if state.next_action is not None else 0.0
        log.debug("%s: try %d failed (%s); retrying in %.2f s", what, state.attempt_number, failure, wait)

    return AsyncRetrying(
        retry=retry_if_exception_type(retry_on),
        stop=stop_after_attempt(retries + 1),
        wait=wait_exponential(multiplier=backoff_s) + wait_random(0, backoff_s),
        before_sleep=before_sleep,
        reraise=True,
    )
