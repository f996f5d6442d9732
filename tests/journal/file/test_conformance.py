"""The conformance suite on the embedded file backend."""

import pytest

from rollout_journal.journal.file.backend import FileBackend
from tests.support.journal_conformance import JournalConformance


class TestFileJournal(JournalConformance):
    @pytest.fixture
    def open_backend(self, tmp_path):
        opened: list[FileBackend] = []

        def open_() -> FileBackend:
            for backend in opened:
                backend.close()  # one writer at a time
            opened.append(FileBackend(tmp_path / "journal"))
            return opened[-1]

        yield open_
        for backend in opened:
            backend.close()
