"""The exit codes of every ``rollout-journal`` command, in one table: ``--help`` prints it,
the CLI maps each error class to its code, and scripts can rely on it."""

from __future__ import annotations

from rollout_journal.journal.errors import (
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
    from rollout_journal.participants.environments import UnknownEnvironmentError
    from rollout_journal.participants.rollout.state import StateFoldError
    from rollout_journal.participants.workload.config import TopologyChangedError
    from rollout_journal.participants.workload.specs import UnknownRolloutSpecError
    from rollout_journal.replay.cli.options import MissingJournalError
    from rollout_journal.replay.errors import ExportError, ForkError, TokenizerUnavailableError

    return [
        ((MissingJournalError,), EXIT_USAGE),  # no journal named: a usage error, as argparse's own
        # before ConfigurationError, which both refine
        ((NotAuthorizedError, AuthenticationFailedError), EXIT_NOT_AUTHORIZED),
        ((TopologyChangedError,), EXIT_TOPOLOGY_CHANGED),
        (
            (
                ConfigurationError,
                UnknownEnvironmentError,
                NotInJournalError,
                ForkError,
                TokenizerUnavailableError,
                UnknownRolloutSpecError,  # the journal does not say a rollout's task: state, verify, fork need it
            ),
            EXIT_INPUT,
        ),
        ((ExportError,), EXIT_JOURNAL_DAMAGED),
        ((WriterLockedError, ProducerFencedError, FencedWriteError), EXIT_WRITER_TAKEN),
        ((CorruptRecordError, JournalDamageError, StateFoldError), EXIT_JOURNAL_DAMAGED),
        (
            (
                FatalJournalError,
                JournalClosedError,
                AbortableCommitError,
                UnstableReadError,
                ClusterUnreachableError,
                OSError,
            ),
            EXIT_JOURNAL_FAILED,
        ),
        ((RolloutJournalError,), EXIT_OTHER),
    ]


DOCUMENTED = frozenset(range(0, 10))

EXIT_CODES_HELP = f"""\
exit codes (an error of any command ends with one of 2-9 and one line on stderr):
  {EXIT_OK}    done
  {EXIT_ROLLOUTS_FAILED}    the workload ran, but some rollouts failed or were set aside (each named on
       stderr; the others finished); demo: the resumed run differs from the reference;
       audit, verify: they found problems (each named); kafka status: no cluster runs
  {EXIT_USAGE}    bad command line (no journal named: no --journal, no $ROLLOUT_JOURNAL_URL)
  {EXIT_INPUT}    a workload file, journal location, name or setting was refused (nothing was
       created), or the rollout, resource, revision or turn asked for is not in the journal;
       kafka up: a cluster of another size or security already runs (nothing started)
  {EXIT_TOPOLOGY_CHANGED}    resume refused: the model, sampling, environment or max_turns differ from
       the journal's (see resume --allow-topology-change)
  {EXIT_JOURNAL_DAMAGED}    the journal is damaged or unreadable where the command needs it (a reading
       command printed what it could and names the first record it could not read;
       export: the copy's counts or checksums differ from the source's)
  {EXIT_WRITER_TAKEN}    another writer holds this journal or worker slot, or fenced this one
  {EXIT_JOURNAL_FAILED}    the journal failed while writing or reading (I/O error, broker unreachable,
       an open transaction held a restore back); kafka: the local cluster is not there
       or could not start
  {EXIT_OTHER}    any other rollout-journal error
  {EXIT_NOT_AUTHORIZED}    the Kafka cluster refused these credentials, or an operation on a topic,
       transactional id or group that its ACLs do not grant them (the line names it; nothing written)
  {EXIT_INTERRUPTED}  interrupted (Ctrl-C)
Errors are one line on stderr: rollout-journal: <what, naming the thing>. demo ends
with its workload child's code when the child fails on its own.
"""


def exit_code_for(exc: BaseException) -> int:
    """The documented exit code of an error the command line reports in one line."""
    child = getattr(exc, "exit_code", None)  # a child process's failure (demo's workload): its own code
    if isinstance(child, int) and child in DOCUMENTED:
        return child
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
