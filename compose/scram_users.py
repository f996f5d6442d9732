"""SCRAM users of a SASL cluster, created or given a new password through the Admin API.

KRaft keeps SCRAM credentials in the cluster metadata, so a user added here can log in at once,
on every broker, without a restart; only the launcher's super user is written at format time
(:func:`rollout_journal.compose.broker.config.scram_bootstrap_credential`). The password travels to the broker
inside the request only as its salted SCRAM form, computed by librdkafka.
"""

from __future__ import annotations

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import (
    AdminClient,
    ScramCredentialInfo,
    ScramMechanism,
    UserScramCredentialUpsertion,
)

from rollout_journal.compose.broker.config import SCRAM_ITERATIONS
from rollout_journal.compose.errors import LocalBrokerError


class ScramUserError(LocalBrokerError):
    """A user name or password was refused, or the cluster refused the change."""


def upsert_scram_user(admin: AdminClient, name: str, password: str, *, timeout_s: float = 30.0) -> None:
    """Create user ``name`` with ``password`` for SCRAM-SHA-512, or replace that user's password.

    ``admin`` must log in as a principal allowed to ALTER the cluster (the launcher's super user)."""
    if not name or any(ch.isspace() or ch in ",;=" for ch in name):
        raise ScramUserError(f"user name {name!r} is empty or holds whitespace, ',', ';' or '='")
    if not password:
        raise ScramUserError(f"the password of user {name} is empty")
    upsert = UserScramCredentialUpsertion(
        name, ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, SCRAM_ITERATIONS), password.encode("utf-8")
    )
    futures = admin.alter_user_scram_credentials([upsert], request_timeout=timeout_s)
    try:
        futures[name].result()
    except KafkaException as exc:
        err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
        detail = f"{err.name()}: {err.str()}" if err is not None else str(exc)
        # the password is in no part of this message: librdkafka's error names the user at most
        raise ScramUserError(f"the cluster refused the SCRAM credential of user {name}: {detail}") from None
