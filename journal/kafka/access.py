"""Who may do what in a namespace of a shared cluster: the ACLs a journal client needs, the checks
a backend makes when it opens, and the one-line errors that name a refused resource.

A namespace ``NS`` owns every Kafka resource whose name starts with ``NS.``: the topics
``NS.events``, ``NS.snapshots`` (workload registrations live there too), ``NS.workloads``
(the registrations a fleet's workers follow), ``NS.results`` (the trainer's training records)
and ``NS.acks`` (its acknowledgements), the
transactional ids ``NS.w.<name>.<boot>`` (each group member's: ``worker``, ``run``, ``resume``)
and ``NS.<slot>`` (slot mode), the fleet's consumer group ``NS.workers`` and the readers' groups
``NS.reader-<random>``. So prefixed ACLs on ``NS.``
grant one namespace and nothing else. Namespaces nest by that prefix: a grant on ``team``
also covers a namespace ``team.x``; give tenants sibling names (``team-a``, ``team-b``).

The minimal sets, measured on Kafka 4.3 with ``StandardAuthorizer`` by dropping one ACL at a
time (``tests/journal/kafka/test_security.py``):

- worker (``run``, ``resume``, ``submit``, a fleet's ``worker``): topics ``READ``, ``WRITE``,
  ``CREATE`` (only to create the topics on first use), ``DESCRIBE_CONFIGS`` (the settings
  checked at every open); transactional ids ``WRITE``; groups ``READ`` (a fleet worker joins
  ``NS.workers``; readers look their group's coordinator up).
- reader (``list``, ``show``, ``audit``, ...): topics ``READ``, ``DESCRIBE_CONFIGS``;
  groups ``DESCRIBE``.

Not needed: ``DESCRIBE`` (``READ`` and ``WRITE`` imply it; ``WRITE`` on a transactional id
implies its ``DESCRIBE``, ``READ`` on a group its ``DESCRIBE``) and ``IDEMPOTENT_WRITE`` on
the cluster (a transactional or idempotent producer with ``WRITE`` on a topic needs none
since Kafka 3.0, KIP-679). ``ALTER_CONFIGS`` on the topics is needed only to raise their
``min.insync.replicas`` when ``min_insync_replicas`` asks more than they have.

Readers never join their group, but librdkafka asks the broker where the group's coordinator
is, once a second, and that needs ``DESCRIBE`` on the group: without it every read logs a
denial in the broker's authorizer log. So a backend checks that right at open instead.

A client the cluster grants everything (no authorizer, or a super user: ``ALTER`` on the
cluster, which no namespace grant holds) skips the checks; they would pass, and the
coordinator lookup of the group check is one more request a failover could catch half way
(librdkafka 2.16 was seen to abort on an ``enq_once`` assertion in a leader-kill drill then).
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from confluent_kafka import KafkaError, KafkaException, TopicCollection
from confluent_kafka.admin import (
    AclBinding,
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
    ResourceType,
)

from rollout_journal.journal.deadlines import Deadline
from rollout_journal.journal.errors import (
    AuthenticationFailedError,
    ClusterUnreachableError,
    ConfigurationError,
    JournalError,
    NotAuthorizedError,
)
from rollout_journal.journal.kafka.clients import AUTHENTICATION_CODES, ClientErrors, kafka_error
from rollout_journal.journal.kafka.config import KafkaSettings

log = logging.getLogger(__name__)

Role = Literal["worker", "reader"]
CLUSTER = "kafka-cluster"  # the one resource name of Kafka's CLUSTER resource type

# Kafka's resource types in the words an error message uses.
TOPIC, TRANSACTIONAL_ID, GROUP, CLUSTER_TYPE = "topic", "transactional id", "group", "cluster"
_REFUSED_TYPE = {
    KafkaError.TOPIC_AUTHORIZATION_FAILED: TOPIC,
    KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED: TRANSACTIONAL_ID,
    KafkaError.GROUP_AUTHORIZATION_FAILED: GROUP,
    KafkaError.CLUSTER_AUTHORIZATION_FAILED: CLUSTER_TYPE,
}
AUTHORIZATION_CODES = frozenset(_REFUSED_TYPE)
_RESOURCE_TYPES = {
    TOPIC: ResourceType.TOPIC,
    TRANSACTIONAL_ID: ResourceType.TRANSACTIONAL_ID,
    GROUP: ResourceType.GROUP,
}

_LOGIN_PROBE_S = 0.5


# -- the ACLs of a namespace ---------------------------------------------------------------


def namespace_rights(role: Role = "worker", *, create_topics: bool = True) -> dict[str, list[str]]:
    """The minimal operations of ``role`` per resource type (see the module docstring)."""
    if role == "worker":
        return {
            TOPIC: ["READ", "WRITE", "DESCRIBE_CONFIGS"] + (["CREATE"] if create_topics else []),
            TRANSACTIONAL_ID: ["WRITE"],
            GROUP: ["READ"],
        }
    if role == "reader":
        return {TOPIC: ["READ", "DESCRIBE_CONFIGS"], GROUP: ["DESCRIBE"]}
    raise ConfigurationError(f"role {role!r} is neither 'worker' nor 'reader'")


def namespace_acls(namespace: str, user: str, *, role: Role = "worker", create_topics: bool = True) -> list[AclBinding]:
    """The minimal ACLs that let ``user`` work in ``namespace`` as ``role``, all prefixed on
    ``<namespace>.``. ``create_topics=False`` leaves out ``CREATE`` for clusters whose operators
    create the topics themselves (with the configs of ``rollout_journal.journal.kafka.topics.topic_configs``)."""
    KafkaSettings(bootstrap_servers="localhost", namespace=namespace)  # refuses a namespace no topic could carry
    if not user or any(ch.isspace() or ch in ",;" for ch in user):
        raise ConfigurationError(f"user name {user!r} is empty or holds whitespace, ',' or ';'")
    return [
        AclBinding(
            _RESOURCE_TYPES[kind],
            f"{namespace}.",
            ResourcePatternType.PREFIXED,
            f"User:{user}",
            "*",
            AclOperation[operation],
            AclPermissionType.ALLOW,
        )
        for kind, operations in namespace_rights(role, create_topics=create_topics).items()
        for operation in operations
    ]


def describe_rights(namespace: str, rights: Mapping[str, list[str]]) -> str:
    """``topics NS.* READ, WRITE; transactional ids NS.* WRITE; ...``: a grant in one line."""
    return "; ".join(f"{kind}s {namespace}.* {', '.join(ops)}" for kind, ops in rights.items())


def create_acls(admin: AdminClient, bindings: list[AclBinding], *, timeout_s: float = 30.0) -> None:
    """Create ``bindings`` (creating one that exists is a no-op in Kafka) and return once the
    answering broker enforces them: the controller commits ACLs to the metadata log and each
    broker's authorizer applies them a moment later."""
    for binding, future in admin.create_acls(bindings, request_timeout=timeout_s).items():
        try:
            future.result()
        except KafkaException as exc:
            err = kafka_error(exc)
            if err is not None and err.code() in AUTHORIZATION_CODES:
                raise ConfigurationError(
                    "the admin client may not create ACLs (it needs ALTER on the cluster, or to be a super user)"
                ) from None
            raise JournalError(f"creating ACL {binding} failed: {err.str() if err is not None else exc}") from None
    wait_for_acls(admin, bindings, present=True, timeout_s=timeout_s)


def delete_acls(admin: AdminClient, bindings: list[AclBinding], *, timeout_s: float = 30.0) -> None:
    """Delete exactly ``bindings``; return once the answering broker no longer enforces them."""
    filters = [
        AclBindingFilter(
            b.restype, b.name, b.resource_pattern_type, b.principal, b.host, b.operation, b.permission_type
        )
        for b in bindings
    ]
    for future in admin.delete_acls(filters, request_timeout=timeout_s).values():
        future.result()
    wait_for_acls(admin, bindings, present=False, timeout_s=timeout_s)


def wait_for_acls(admin: AdminClient, bindings: list[AclBinding], *, present: bool, timeout_s: float) -> None:
    """Poll the broker's authorizer (DescribeAcls answers from it) until every one of ``bindings``
    is there (``present``) or none is."""

    def key(b: AclBinding) -> tuple[object, ...]:
        return (b.restype, b.name, b.resource_pattern_type, b.principal, b.host, b.operation, b.permission_type)

    wanted = {key(b) for b in bindings}
    principals = {b.principal for b in bindings}
    deadline = Deadline(timeout_s)
    while True:
        seen: set[tuple[object, ...]] = set()
        for principal in principals:
            # None: any name, any host (the filter's stubs say str)
            any_name_or_host: Any = None
            every = AclBindingFilter(
                ResourceType.ANY,
                any_name_or_host,
                ResourcePatternType.ANY,
                principal,
                any_name_or_host,
                AclOperation.ANY,
                AclPermissionType.ANY,
            )
            found = admin.describe_acls(every, request_timeout=timeout_s).result()
            seen.update(key(b) for b in found)
        if (wanted <= seen) if present else not (wanted & seen):
            return
        if deadline.passed():
            raise JournalError(
                f"the cluster still {'lacks' if present else 'holds'} ACLs it "
                f"{'created' if present else 'deleted'} after {timeout_s:.0f} s"
            )
        deadline.sleep(0.05)


# -- who is asking -------------------------------------------------------------------------


def principal_of(settings: KafkaSettings) -> str:
    """Who the cluster sees, in words: ``user ns-a``."""
    user = settings.librdkafka.get("sasl.username")
    if user:
        return f"user {user}"
    if "SSL" in settings.librdkafka.get("security.protocol", "").upper():
        return "the principal of this client's certificate"
    return "an anonymous client (no ROLLOUT_JOURNAL_LIBRDKAFKA_SASL_USERNAME set)"


def not_authorized(settings: KafkaSettings, operation: str, resource_type: str, resource: str) -> NotAuthorizedError:
    """The error that names a refused ``operation`` on one resource, and how it would be granted."""
    user = settings.librdkafka.get("sasl.username")
    ns = settings.namespace
    if user and resource_type != CLUSTER_TYPE and resource.startswith(f"{ns}."):
        hint = (
            f"if {user} should work in namespace {ns}, a cluster admin grants it with "
            f"`rollout-journal kafka grant --namespace {ns} --user {user}`"
        )
    else:
        hint = f"a cluster admin must grant {operation} on this {resource_type} (see README: Securing a shared cluster)"
    return NotAuthorizedError(operation, resource_type, resource, principal_of(settings), hint)


def refusal(
    settings: KafkaSettings, err: KafkaError | None, wanted: Mapping[str, tuple[str, str]]
) -> NotAuthorizedError | None:
    """``err`` as a :class:`NotAuthorizedError` when it is an authorization failure, else None.

    ``wanted`` maps each resource type the refused call touches (``topic``, ``transactional id``,
    ``group``, ``cluster``) to the ``(operation, resource name)`` it needed there; the error's
    code says which of them was refused."""
    if err is None or err.code() not in AUTHORIZATION_CODES:
        return None
    kind = _REFUSED_TYPE[err.code()]
    operation, resource = wanted.get(kind, ("IDEMPOTENT_WRITE", CLUSTER) if kind == CLUSTER_TYPE else ("use", "?"))
    return not_authorized(settings, operation, kind, resource)


def authentication_failed(settings: KafkaSettings, err: KafkaError) -> AuthenticationFailedError:
    mechanism = settings.librdkafka.get("sasl.mechanism", "GSSAPI (librdkafka's default)")
    return AuthenticationFailedError(
        f"SASL authentication failed for {principal_of(settings)} at {settings.bootstrap_servers} "
        f"(mechanism {mechanism}): {_reason(err)}; check ROLLOUT_JOURNAL_LIBRDKAFKA_SASL_USERNAME, "
        "_SASL_PASSWORD and _SASL_MECHANISM"
    )


def _reason(err: KafkaError) -> str:
    # librdkafka: "sasl_plaintext://h:p/bootstrap: SASL authentication error: <the broker's reason> (after ...)"
    text = err.str()
    text = text.split("SASL authentication error: ", 1)[-1]
    return text.split(" (after ", 1)[0]


# -- checks at open ------------------------------------------------------------------------


def wait_until_authenticated(
    admin: AdminClient, settings: KafkaSettings, errors: ClientErrors, timeout_s: float
) -> bool:
    """Return once a broker answers ``admin``: whether this client may do anything at all (no
    authorizer, or a super user: the cluster grants it ALTER on itself, which no namespace grant
    holds). :class:`AuthenticationFailedError` as soon as a broker refuses the credentials (a SCRAM
    round trip, well under a second); :class:`ClusterUnreachableError` when none answers within
    ``timeout_s``."""
    deadline = Deadline(timeout_s)
    # One request, waited on in slices: a call per slice would redial the brokers each time.
    answer = admin.describe_cluster(request_timeout=timeout_s, include_authorized_operations=True)
    while True:
        try:
            granted = answer.result(timeout=_LOGIN_PROBE_S).authorized_operations
            # None: nothing granted on the cluster (librdkafka reports an empty set so)
            return granted is not None and any(op.name in ("ALL", "ALTER") for op in granted)
        except concurrent.futures.TimeoutError:
            pass
        except KafkaException as exc:
            err = kafka_error(exc)
            if err is not None and err.code() in AUTHENTICATION_CODES:
                raise authentication_failed(settings, err) from None
            if errors.authentication is None and not deadline.passed():
                answer = admin.describe_cluster(
                    request_timeout=deadline.left(at_least=0.1), include_authorized_operations=True
                )
        admin.poll(0)  # serves error_cb
        if errors.authentication is not None:
            raise authentication_failed(settings, errors.authentication)
        if deadline.passed():
            last = f" (last error: {errors.last.name()}: {errors.last.str()})" if errors.last is not None else ""
            raise ClusterUnreachableError(
                f"cannot reach the Kafka cluster at {settings.bootstrap_servers}: no broker answered within "
                f"{timeout_s:g} s{last}; is it running, is the address right, and is security.protocol the one "
                "its listener speaks?"
            )


def check_topic_access(
    admin: AdminClient,
    settings: KafkaSettings,
    topics: Iterable[str],
    operations: Iterable[str],
    timeout_s: float,
) -> None:
    """:class:`NotAuthorizedError` naming the first of ``operations`` (``READ``, ``WRITE``) that
    the cluster does not grant this client on one of ``topics``; nothing is asked of a broker
    that reports no authorized operations."""
    operations = list(operations)
    deadline = Deadline(timeout_s)
    for topic in topics:
        while True:  # a broker other than the one that created the topic may not know it yet
            future = admin.describe_topics(
                TopicCollection([topic]), include_authorized_operations=True, request_timeout=timeout_s
            )[topic]
            try:
                granted = future.result().authorized_operations
                break
            except KafkaException as exc:
                err = kafka_error(exc)
                denied = refusal(settings, err, {TOPIC: (operations[0], topic)})
                if denied is not None:
                    raise denied from None
                transient = err is not None and (err.retriable() or err.code() == KafkaError.UNKNOWN_TOPIC_OR_PART)
                if not transient or deadline.passed():
                    raise JournalError(
                        f"cannot describe topic {topic} on {settings.bootstrap_servers}: {exc}"
                    ) from None
                deadline.sleep(0.1)
        _require(settings, granted, operations, TOPIC, topic)


def check_group_access(
    admin: AdminClient, settings: KafkaSettings, group: str, operation: str, timeout_s: float
) -> None:
    """:class:`NotAuthorizedError` when the cluster does not grant ``operation`` (``READ`` to join,
    ``DESCRIBE`` to find its coordinator) on ``group`` to this client. Another failure to describe
    the group (its coordinator still loading) leaves the check to the group's first use."""
    future = admin.describe_consumer_groups([group], include_authorized_operations=True, request_timeout=timeout_s)[
        group
    ]
    try:
        granted = future.result().authorized_operations
    except KafkaException as exc:
        err = kafka_error(exc)
        denied = refusal(settings, err, {GROUP: (operation, group)})
        if denied is not None:
            raise denied from None
        log.debug("cannot check the rights on group %s (%s); its first use will", group, exc)
        return
    _require(settings, granted, [operation], GROUP, group)


def _require(
    settings: KafkaSettings, granted: list[AclOperation] | None, operations: list[str], kind: str, name: str
) -> None:
    if granted is None:  # the broker did not say (no authorizer answers the question)
        return
    names = {op.name for op in granted}
    if "ALL" in names:
        return
    for operation in operations:
        if operation not in names:
            raise not_authorized(settings, operation, kind, name)


__all__ = [
    "AUTHORIZATION_CODES",
    "authentication_failed",
    "check_group_access",
    "check_topic_access",
    "create_acls",
    "delete_acls",
    "describe_rights",
    "namespace_acls",
    "namespace_rights",
    "not_authorized",
    "principal_of",
    "refusal",
    "wait_for_acls",
    "wait_until_authenticated",
]
