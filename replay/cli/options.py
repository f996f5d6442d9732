"""Arguments every command shares: where the journal is (``--journal``, else ``ROLLOUT_JOURNAL_URL``)."""

from __future__ import annotations

import argparse
import os

from rollout_journal.journal.errors import ConfigurationError

JOURNAL_ENV = "ROLLOUT_JOURNAL_URL"


def add_journal_argument(
    p: argparse.ArgumentParser, *, what: str = "a file journal directory or kafka://host:port/namespace"
) -> None:
    p.add_argument("--journal", metavar="PATH_OR_URL", help=f"{what} (default: ${JOURNAL_ENV})")


def named_journal(args: argparse.Namespace) -> str | None:
    """The journal a command names, if any: ``--journal``, a positional JOURNAL, or ``$ROLLOUT_JOURNAL_URL``."""
    return getattr(args, "journal", None) or getattr(args, "journal_path", None) or os.environ.get(JOURNAL_ENV) or None


def journal_location(args: argparse.Namespace) -> str:
    """:func:`named_journal`, which must name one (else :class:`MissingJournalError`, a usage error)."""
    location = named_journal(args)
    if location is None:
        raise MissingJournalError(
            f"name the journal: --journal PATH_OR_URL (a directory or kafka://host:port/namespace), "
            f"or set {JOURNAL_ENV}"
        )
    return location


class MissingJournalError(ConfigurationError):
    """No journal was named, on the command line or in the environment (a usage error)."""
