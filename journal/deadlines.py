"""Waiting with a deadline: one helper for the loops that poll until something holds or time is up.

A loop that asks a broker, a child process or a log again and again keeps one :class:`Deadline`
(monotonic time, so a clock step never stretches or cuts a wait) and asks it how long is left for
the next blocking call, whether it has passed, and to sleep until the next try without
overshooting. The loop itself stays plain: what it asks and what it raises at the end are its own.
"""

from __future__ import annotations

import math
import time


class Deadline:
    """``timeout_s`` from now, on the monotonic clock."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.at = time.monotonic() + timeout_s

    def left(self, *, at_least: float = 0.0, at_most: float = math.inf) -> float:
        """Seconds until the deadline, kept within ``[at_least, at_most]`` (a blocking call given
        the time left: ``at_least`` so it still asks once at the very end, ``at_most`` so it comes
        back to check what else may have changed)."""
        return min(at_most, max(at_least, self.at - time.monotonic()))

    def passed(self) -> bool:
        return time.monotonic() >= self.at

    def sleep(self, interval_s: float) -> None:
        """Sleep ``interval_s``, or only what is left of the wait if that is less."""
        time.sleep(self.left(at_most=interval_s))
