"""The exit codes of every ``rollout-journal`` command, in one table: ``--help`` prints it,
the CLI maps each error class to its code, and scripts can rely on it."""

from __future__ import annotations

from journal.errors import (
    AbortableCommitError,
    AuthenticationFailedError,
    ClusterUnreachableError,
    ConfigurationError,
    CorruptRecordError,
    FatalJournalError,
    FencedWriteError,
    JournalClosedError,
    JournalDamageError,
    NotAuthorizedError,
    NotInJournalError,
    ProducerFencedError,
    RolloutJournalError,
    UnstableReadError,
    WriterLockedError,
    writer_fenced,
)

EXIT_OK = 0
EXIT_ROLLOUTS_FAILED = 1
EXIT_USAGE = 2
EXIT_INPUT = 3
EXIT_TOPOLOGY_CHANGED = 4
EXIT_JOURNAL_DAMAGED = 5
EXIT_WRITER_TAKEN = 6
EXIT_JOURNAL_FAILED = 7
EXIT_OTHER = 8
EXIT_NOT_AUTHORIZED = 9
EXIT_INTERRUPTED = 130


def _error_classes() -> list[tuple[tuple[type[BaseException], ...], int]]:
    # imported here: participants is loaded only by the commands that need it
    from participants.config import TopologyChangedError
    from participants.environments import UnknownEnvironmentError
    from participants.rollout_state import StateFoldError

    from .errors import ExportError, ForkError, TokenizerUnavailableError

    return [
        # before ConfigurationError, which both refine
        ((NotAuthorizedError, AuthenticationFailedError), EXIT_NOT_AUTHORIZED),
        ((TopologyChangedError,), EXIT_TOPOLOGY_CHANGED),
        ((ConfigurationError, UnknownEnvironmentError, NotInJournalError, ForkError, TokenizerUnavailableError),
         EXIT_INPUT),
        ((ExportError,), EXIT_JOURNAL_DAMAGED),
        ((WriterLockedError, ProducerFencedError, FencedWriteError), EXIT_WRITER_TAKEN),
        ((CorruptRecordError, JournalDamageError, StateFoldError), EXIT_JOURNAL_DAMAGED),
        ((FatalJournalError, JournalClosedError, AbortableCommitError, UnstableReadError,
          ClusterUnreachableError, OSError), EXIT_JOURNAL_FAILED),
        ((RolloutJournalError,), EXIT_OTHER),
    ]


EXIT_CODES_HELP = f"""\
exit codes (an error of any command ends with one of 3-9 and one line on stderr):
  {EXIT_OK}    done
  {EXIT_ROLLOUTS_FAILED}    the workload ran, but some rollouts failed or were set aside (each named on
       stderr; the others finished); demo: the resumed run differs from the reference;
       audit, verify: they found problems (each named)
  {EXIT_USAGE}    bad command line
  {EXIT_INPUT}    a workload file, journal location, name or setting was refused (nothing was created)
  {EXIT_TOPOLOGY_CHANGED}    resume refused: the model, sampling, environment or max_turns differ from
       the journal's (see resume --allow-topology-change)
  {EXIT_JOURNAL_DAMAGED}    the journal is damaged or unreadable where the command needs it (a reading
       command printed what it could and names the first record it could not read;
       export: the copy's counts or checksums differ from the source's)
  {EXIT_WRITER_TAKEN}    another writer holds this journal or worker slot, or fenced this one
  {EXIT_JOURNAL_FAILED}    the journal failed while writing or reading (I/O error, broker unreachable,
       an open transaction held a restore back)
  {EXIT_OTHER}    any other rollout-journal error
  {EXIT_NOT_AUTHORIZED}    the Kafka cluster refused these credentials, or an operation on a topic,
       transactional id or group that its ACLs do not grant them (the line names it; nothing written)
  {EXIT_INTERRUPTED}  interrupted (Ctrl-C)
Errors are one line on stderr: rollout-journal: <what, naming the thing>.
"""


def exit_code_for(exc: BaseException) -> int:
    """The documented exit code of an error the command line reports in one line."""
    if writer_fenced(exc):  # also a journal stopped because its writer was fenced
        return EXIT_WRITER_TAKEN
    if isinstance(getattr(exc, "cause", None), (NotAuthorizedError, AuthenticationFailedError)):
        return EXIT_NOT_AUTHORIZED  # a journal stopped because the cluster refused its writer
    for classes, code in _error_classes():
        if isinstance(exc, classes):
            return code
    return EXIT_OTHER


def one_line(exc: BaseException) -> str:
    """An error's message on one line (a message quoting a child's output or a parser's may span several)."""
    text = " ".join(part.strip() for part in str(exc).splitlines() if part.strip())
    if isinstance(exc, OSError) and exc.strerror:  # `[Errno 28] No space left on device: 'x'` -> the words
        text = f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    return text or type(exc).__name__
