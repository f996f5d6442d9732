"""Progress of a scan through a journal, in the journal's own offsets (Kafka record
offsets, file journal byte positions), reported to whoever shows it.

Library code only counts; the command line hands in a bar (``rollout_journal.replay.terminal``).
Counting is batched so that a scan of millions of events does not pay for the
bar on every event.
"""

from __future__ import annotations

from typing import Protocol

from rollout_journal.journal.errors import RecordLocation

_BATCH = 4096  # offsets between two reports to the bar


class Progress(Protocol):
    """Where a scan's progress goes (a tqdm bar, say)."""

    def start(self, total: int, unit: str) -> None:
        """The scan covers ``total`` offsets, counted in ``unit``."""

    def advance(self, n: int) -> None:
        """``n`` more offsets were read."""

    def finish(self) -> None:
        """The scan ended (or stopped); nothing more comes."""


class NoProgress:
    """Progress nobody watches."""

    def start(self, total: int, unit: str) -> None:
        pass

    def advance(self, n: int) -> None:
        pass

    def finish(self) -> None:
        pass


class OffsetCounter:
    """Turns the locations a scan reads into advances of a :class:`Progress`."""

    def __init__(self, progress: Progress, starts: dict[int, int]) -> None:
        self._progress = progress
        self._next = dict(starts)  # partition -> the offset the scan reached
        self._pending = 0

    def saw(self, location: RecordLocation) -> None:
        reached = location.offset + 1
        before = self._next.get(location.partition, 0)
        if reached > before:
            self._next[location.partition] = reached
            self._pending += reached - before
            if self._pending >= _BATCH:
                self._progress.advance(self._pending)
                self._pending = 0

    def flush(self) -> None:
        if self._pending:
            self._progress.advance(self._pending)
            self._pending = 0
