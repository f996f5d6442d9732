"""Opening a journal from one string: ``open_journal`` hands its options on to :class:`Journal`."""

from __future__ import annotations

import inspect
import typing
from pathlib import Path

from rollout_journal.journal.journal import Journal
from rollout_journal.journal.open import JournalOptions, open_journal


def test_journal_options_name_every_keyword_of_journal_with_its_type() -> None:
    """JournalOptions restates Journal.__init__'s keywords for open_journal's callers. The type
    checker rejects an option Journal does not take, but not a keyword Journal gained that the
    options lack (open_journal's callers could never pass it) or one whose type Journal widened."""
    hints = typing.get_type_hints(Journal.__init__)
    keywords = {
        name: hints[name]
        for name, parameter in inspect.signature(Journal.__init__).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    }
    assert keywords, "Journal.__init__ takes no keyword-only options any more: JournalOptions has nothing to restate"
    assert typing.get_type_hints(JournalOptions) == keywords, (
        "JournalOptions (journal/open.py) must list every keyword-only option of Journal.__init__ "
        "(journal/journal.py) with the same type"
    )


def test_open_journal_hands_its_options_to_the_journal(tmp_path: Path) -> None:
    with open_journal(str(tmp_path / "j"), max_record_bytes=8 * 1024, max_event_bytes=1024 * 1024) as journal:
        assert (journal.max_record_bytes, journal.max_event_bytes) == (8 * 1024, 1024 * 1024)
