"""One retry policy for every Kafka client of the backend: what an error means, and how long to wait.

librdkafka flags few of the errors a broker loss produces as retriable (a SIGKILLed broker of three
showed ``_DESTROY_BROKER``, ``_TIMED_OUT`` and ``NOT_LEADER_FOR_PARTITION`` on offset queries, none of
them ``retriable()``), so the classification is ours, in one table, and nothing else in the backend
interprets error codes. :func:`classify` names the :class:`Action` for an error as one client
:class:`Role` meets it; :class:`Retry` paces a streak of retries (exponential backoff with jitter)
and says when the streak has run out of its budget.

The budgets:

- transport, leadership and coordinator errors (a broker gone, a leader or coordinator moving):
  retried until ``cluster_unavailable_timeout_ms`` from the first failure of the streak; a success
  ends the streak. A replicated cluster that lost one broker settles within seconds; the budget is
  for a whole cluster restarting;
- ``_ALL_BROKERS_DOWN``: the same budget, then :class:`ClusterUnreachableError`;
- the previous owner's transaction still undecided (``UNSTABLE_OFFSET_COMMIT`` at a take): until
  that transaction is decided, bounded by the caller (the transaction timeout and then some).

Everything else is not retried here: an abortable transaction is aborted and redone by the writer,
a dead one re-initialized (:mod:`rollout_journal.journal.kafka.writer`), a refusal is a
``NotAuthorizedError`` (:mod:`rollout_journal.journal.kafka.access`), anything unknown is fatal.
"""

from __future__ import annotations

import enum
import logging
import random
import time

from confluent_kafka import KafkaError

log = logging.getLogger(__name__)


def _codes(*names: str) -> frozenset[int]:
    """Error codes by name; a name this client version lacks is left out."""
    return frozenset(code for code in (getattr(KafkaError, name, None) for name in names) if code is not None)


TRANSPORT_CODES = _codes(
    "_DESTROY_BROKER",
    "_TRANSPORT",
    "_TIMED_OUT",
    "REQUEST_TIMED_OUT",
    "NETWORK_EXCEPTION",
    "_RESOLVE",
    "_TIMED_OUT_QUEUE",
)
"""A broker gone or slow: the request is resent, to a new leader once metadata says which."""
CLUSTER_DOWN_CODES = _codes("_ALL_BROKERS_DOWN")
LEADERSHIP_CODES = _codes(
    "NOT_LEADER_FOR_PARTITION",
    "LEADER_NOT_AVAILABLE",
    "FENCED_LEADER_EPOCH",
    "UNKNOWN_LEADER_EPOCH",
    "OFFSET_NOT_AVAILABLE",
    "_UNKNOWN_PARTITION",
    "UNKNOWN_TOPIC_OR_PART",  # the topics exist (the open checked): a broker that restarted has not loaded them yet
    "NOT_ENOUGH_REPLICAS",
    "NOT_ENOUGH_REPLICAS_AFTER_APPEND",
    "KAFKA_STORAGE_ERROR",
)
COORDINATOR_CODES = _codes(
    "NOT_COORDINATOR",
    "COORDINATOR_NOT_AVAILABLE",
    "COORDINATOR_LOAD_IN_PROGRESS",
    "CONCURRENT_TRANSACTIONS",
    "_WAIT_COORD",
)
UNSTABLE_CODES = _codes("UNSTABLE_OFFSET_COMMIT")
REBALANCE_CODES = _codes(
    "REBALANCE_IN_PROGRESS", "ILLEGAL_GENERATION", "UNKNOWN_MEMBER_ID", "STALE_MEMBER_EPOCH", "FENCED_MEMBER_EPOCH"
)
SLOT_TAKEN_CODES = _codes("FENCED_INSTANCE_ID")
"""A static member (``run``/``resume --writer W``) replaced by a newer process with the same writer."""
TRANSACTION_DEAD_CODES = _codes("_FENCED", "PRODUCER_FENCED", "INVALID_PRODUCER_EPOCH", "INVALID_TXN_STATE", "_FATAL")
"""The producer's transaction cannot go on: with a transactional id of its own per process start,
this never means another process took the id; only the consumer group says who owns what."""
ABORTABLE_CODES = _codes("_PURGE_QUEUE", "_MSG_TIMED_OUT")
RECORD_CODES = _codes(
    "MSG_SIZE_TOO_LARGE",
    "_MSG_SIZE_TOO_LARGE",
    "INVALID_RECORD",
    "INVALID_MSG",
    "CORRUPT_MESSAGE",
    "RECORD_LIST_TOO_LARGE",
)
"""The broker refused these records themselves: redoing them fails the same way."""


class Role(enum.Enum):
    """Which client meets the error: the same code calls for different actions."""

    PRODUCER = "producer"  # a call of the transactional writer (init, begin, produce, flush, offsets, commit)
    DELIVERY = "delivery"  # a record's delivery report inside a transaction
    READER = "reader"  # a read_committed consumer's message-level error while reading
    OFFSETS = "offsets"  # watermark offset queries
    COMMITTED = "committed"  # the group's committed offsets, read at a take
    ADMIN = "admin"  # topic administration, describing the group
    GROUP = "group"  # the group member's own errors (heartbeats, joins)


class Action(enum.Enum):
    RETRY = "retry"  # the same call again after a backoff, within the streak's budget
    SKIP = "skip"  # a message-level error of a reader: librdkafka fetches again; read on
    ABORT = "abort"  # abort the transaction and redo the batch
    REINIT = "reinit"  # the transaction is dead: a new producer (same id), redo what is still owned
    RECORD = "record"  # the records of one partition are refused: fail only their appends
    TAKEN = "taken"  # a newer process with this writer's name took its place: stop, exit "taken"
    FATAL = "fatal"  # anything else: stop; the next owner takes over


def classify(err: KafkaError | None, role: Role) -> Action:
    """The action the backend takes when ``role`` meets ``err`` (see the module docstring)."""
    if err is None:
        return Action.FATAL
    code = err.code()
    if code in SLOT_TAKEN_CODES:
        return Action.TAKEN
    if role in (Role.PRODUCER, Role.DELIVERY):
        if code in TRANSACTION_DEAD_CODES or err.fatal():
            return Action.REINIT
        if role is Role.DELIVERY:
            if code in RECORD_CODES:
                return Action.RECORD
            return Action.ABORT  # a delivery failed: nothing of the transaction may commit
        if err.txn_requires_abort() or code in ABORTABLE_CODES or code in REBALANCE_CODES:
            return Action.ABORT
        if err.retriable() or code in TRANSPORT_CODES | CLUSTER_DOWN_CODES | LEADERSHIP_CODES | COORDINATOR_CODES:
            return Action.RETRY
        return Action.FATAL
    if role is Role.READER:
        transient = TRANSPORT_CODES | CLUSTER_DOWN_CODES | LEADERSHIP_CODES | COORDINATOR_CODES
        return Action.SKIP if err.retriable() or code in transient else Action.FATAL
    if role is Role.GROUP:
        # the member's own errors: librdkafka rejoins by itself; only a fatal one ends the membership
        return Action.FATAL if err.fatal() else Action.SKIP
    if code in TRANSPORT_CODES | CLUSTER_DOWN_CODES | LEADERSHIP_CODES | COORDINATOR_CODES or err.retriable():
        return Action.RETRY
    if role is Role.COMMITTED and code in UNSTABLE_CODES | REBALANCE_CODES:
        return Action.RETRY
    return Action.FATAL


def cluster_down(err: KafkaError | None) -> bool:
    return err is not None and err.code() in CLUSTER_DOWN_CODES


class Retry:
    """Paces one streak of retries of one call: ``wait()`` after each failure sleeps a backoff
    (50 ms doubling to 2 s, +-20 % jitter) and says whether the streak may go on."""

    FIRST_S = 0.05
    MAX_S = 2.0
    JITTER = 0.2

    def __init__(self, budget_s: float, what: str, *, first_s: float = FIRST_S, max_s: float = MAX_S) -> None:
        self.budget_s = budget_s
        self.what = what
        self.started = time.monotonic()
        self.attempts = 0
        self._delay = first_s
        self._max = max_s
        self._said = False

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def left_s(self) -> float:
        return max(0.0, self.budget_s - self.elapsed_s)

    def wait(self, err: KafkaError | None = None) -> bool:
        """After a failure: False when the budget is spent (raise), else sleep the backoff, True."""
        self.attempts += 1
        left = self.left_s()
        if left <= 0:
            return False
        if not self._said and self.elapsed_s > 1.0:  # a blip stays quiet; an outage is said once per streak
            self._said = True
            log.warning("%s: %s; retrying for up to %.0f s", self.what, _describe(err), left)
        else:
            log.debug("%s: %s; retrying", self.what, _describe(err))
        delay = min(self._delay, left) * (1 + random.uniform(-self.JITTER, self.JITTER))
        time.sleep(max(0.0, delay))
        self._delay = min(self._delay * 2, self._max)
        return True


def _describe(err: KafkaError | None) -> str:
    return "no answer" if err is None else f"{err.name()}: {err.str()}"


__all__ = [
    "Action",
    "Retry",
    "Role",
    "classify",
    "cluster_down",
    "ABORTABLE_CODES",
    "CLUSTER_DOWN_CODES",
    "COORDINATOR_CODES",
    "LEADERSHIP_CODES",
    "REBALANCE_CODES",
    "RECORD_CODES",
    "SLOT_TAKEN_CODES",
    "TRANSACTION_DEAD_CODES",
    "TRANSPORT_CODES",
    "UNSTABLE_CODES",
]
