"""Errors of the replay commands. Each names the rollout, resource, revision or
file at fault and says what to do; the command line prints one as a single line."""

from __future__ import annotations

from rollout_journal.journal.errors import NotInJournalError, RolloutJournalError


class ReplayError(RolloutJournalError):
    """Base class of every error a replay command raises on purpose."""


class NoSuchRolloutError(ReplayError, NotInJournalError):
    """The journal holds no event of the rollout asked for."""

    def __init__(self, rollout_id: str, journal: str) -> None:
        super().__init__(
            f"no events of rollout {rollout_id!r} in journal {journal} "
            "(`rollout-journal replay list` shows the rollouts it holds)"
        )
        self.rollout_id = rollout_id


class NoSuchResourceError(ReplayError, NotInJournalError):
    """The rollout a resource id names has no such resource."""


class NoSuchRevisionError(ReplayError, NotInJournalError):
    """The journal holds no mutation that brings a resource to the revision asked for."""


class NoSuchTurnError(ReplayError, NotInJournalError):
    """The rollout has not committed the turn asked for."""


class TokenizerUnavailableError(ReplayError):
    """The tokenizer that wrote a policy's token ids cannot be identified or is not at hand."""


class ExportError(ReplayError):
    """An export could not be written, or what it wrote does not read back the same."""


class ForkError(ReplayError):
    """A rollout cannot be forked at the turn asked for."""
