"""How a replay command reads its journal: ``--journal PATH_OR_URL`` opened read-only,
events streamed with a progress bar that shows up only on a large journal.

(Interim: the replay-commands branch brings the shared opener for every command;
this module gives way to it once that lands.)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

from journal.journal import Journal
from journal.open import open_journal

T = TypeVar("T")

PROGRESS_DELAY_S = 1.0  # a scan that ends sooner never shows a bar


def add_journal_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--journal", required=True, metavar="PATH_OR_URL",
                        help="a file journal directory or kafka://host:port/namespace")


def open_for_reading(location: str) -> Journal:
    """The journal at ``location``, read-only: a running writer is not disturbed."""
    return open_journal(location, writer="replay", read_only=True)


def with_progress(items: Iterable[T], what: str) -> Iterator[T]:
    """``items`` with a progress bar on stderr once the scan takes a while (never in a pipe)."""
    from tqdm import tqdm

    with tqdm(items, desc=what, unit=" events", file=sys.stderr, delay=PROGRESS_DELAY_S, disable=None,
              leave=False) as bar:
        yield from bar
