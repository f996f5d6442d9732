"""What a replay command shows on the terminal: a progress bar on stderr during
long scans, the result as text or JSON on stdout, notes on stderr, and one
closing line and exit code when records could not be read.

Library modules never print; the command line hands their results here.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from typing import Any, Protocol

from rollout_journal.journal.backend import held_back_warnings
from rollout_journal.journal.errors import CorruptRecordError
from rollout_journal.journal.journal import ReadReport
from rollout_journal.replay.exit_codes import EXIT_JOURNAL_DAMAGED, EXIT_OK

PROGRESS_DELAY_S = 1.0  # a scan that ends sooner never shows a bar


class CommandResult(Protocol):
    """What every replay command returns."""

    report: ReadReport

    def as_json(self) -> dict[str, Any]: ...

    def text(self) -> Iterable[str]: ...


class BarProgress:
    """A tqdm bar on stderr, shown only when a scan takes longer than a second and stderr
    is a terminal (never in a pipe or a test)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._bar = None

    def start(self, total: int, unit: str) -> None:
        from tqdm import tqdm

        self.finish()
        self._bar = tqdm(
            total=total or None,
            unit=unit,
            unit_scale=unit == "B",
            desc=self.what,
            file=sys.stderr,
            delay=PROGRESS_DELAY_S,
            disable=None,
            leave=False,
        )

    def advance(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def finish(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def problems_json(report: ReadReport) -> dict[str, Any]:
    unreadable = [e for e in report.errors if isinstance(e, CorruptRecordError)]
    return {
        "unreadable": [str(e) for e in unreadable],
        "damage": [str(e) for e in report.errors if not isinstance(e, CorruptRecordError)],
        "fenced_events_dropped": len(report.fenced),
        "held_back": [str(h) for h in report.held_back],
    }


def warn(line: str) -> None:
    """A warning on stderr: the output is right but incomplete (the exit code stays as it is)."""
    print(f"warning: {line}", file=sys.stderr, flush=True)


def warn_held_back(report: ReadReport) -> None:
    """Say on stderr, once per topic, which partitions an open transaction held the read back on:
    the output shows less than is committed there, and a rerun later shows the rest."""
    for line in held_back_warnings(report.held_back):
        warn(line)


def emit(result: CommandResult, *, as_json: bool, lines: Iterable[str] | None = None) -> int:
    """Print ``result`` (``lines`` instead of ``result.text()`` if given), then what the read
    stepped over; the exit code: EXIT_JOURNAL_DAMAGED if records could not be read (the output lacks them).
    A read held back by an open transaction is warned of and leaves the exit code alone."""
    report = result.report
    if as_json:
        print(json.dumps(result.as_json() | {"problems": problems_json(report)}, indent=2))
    else:
        for line in lines if lines is not None else result.text():
            print(line)
    warn_held_back(report)
    unreadable = [e for e in report.errors if isinstance(e, CorruptRecordError)]
    for problem in [e for e in report.errors if not isinstance(e, CorruptRecordError)] + report.fenced:
        print(f"note: {problem}", file=sys.stderr)
    for problem in unreadable[1:]:
        print(f"note: {problem}", file=sys.stderr)
    if unreadable:
        more = f" (and {len(unreadable) - 1} more, above)" if len(unreadable) > 1 else ""
        print(f"rollout-journal: the output lacks what unreadable records held: {unreadable[0]}{more}", file=sys.stderr)
        return EXIT_JOURNAL_DAMAGED
    return EXIT_OK
