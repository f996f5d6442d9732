"""The pieces of a secured cluster that need no broker: the ACL set of a namespace, the words of a
refusal, the exit code, the SASL node config and the salted bootstrap credential. The broker
side is tests/journal/kafka/test_security.py."""

from __future__ import annotations

import base64
import hashlib
import os
import stat
from pathlib import Path

import pytest
from confluent_kafka import KafkaError
from confluent_kafka.admin import AclOperation, ResourcePatternType, ResourceType

from rollout_journal.compose.broker.config import (
    SaslSecurity,
    hide_arguments,
    scram_bootstrap_credential,
    server_config,
)
from rollout_journal.compose.local_broker import LocalKafkaNode
from rollout_journal.journal.errors import (
    AuthenticationFailedError,
    ConfigurationError,
    JournalStoppedError,
    NotAuthorizedError,
    ProducerFencedError,
)
from rollout_journal.journal.kafka.access import namespace_acls, not_authorized, principal_of, refusal
from rollout_journal.journal.kafka.config import KafkaSettings
from rollout_journal.replay.exit_codes import (
    EXIT_CODES_HELP,
    EXIT_NOT_AUTHORIZED,
    EXIT_WRITER_TAKEN,
    exit_code_for,
)

SECRET = "pw-unit-0f9e8d7c"
SASL_ENV = {
    "ROLLOUT_JOURNAL_LIBRDKAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
    "ROLLOUT_JOURNAL_LIBRDKAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
    "ROLLOUT_JOURNAL_LIBRDKAFKA_SASL_USERNAME": "ns-a",
    "ROLLOUT_JOURNAL_LIBRDKAFKA_SASL_PASSWORD": SECRET,
}


def settings(namespace: str = "team-a") -> KafkaSettings:
    return KafkaSettings.from_url(f"kafka://127.0.0.1:9092/{namespace}", env=SASL_ENV)


def test_a_worker_gets_the_minimal_set_prefixed_on_its_namespace_and_nothing_on_the_cluster() -> None:
    granted = {(b.restype, b.operation) for b in namespace_acls("team-a", "ns-a")}
    assert granted == {
        (ResourceType.TOPIC, AclOperation.READ),
        (ResourceType.TOPIC, AclOperation.WRITE),
        (ResourceType.TOPIC, AclOperation.CREATE),
        (ResourceType.TOPIC, AclOperation.DESCRIBE_CONFIGS),
        (ResourceType.TRANSACTIONAL_ID, AclOperation.WRITE),
        (ResourceType.GROUP, AclOperation.READ),
    }
    for binding in namespace_acls("team-a", "ns-a"):
        # "team-a." and not "team-a": a grant on team-a must not cover namespace team-ab
        assert (binding.name, binding.resource_pattern_type, binding.principal) == (
            "team-a.",
            ResourcePatternType.PREFIXED,
            "User:ns-a",
        )


def test_a_reader_may_read_and_find_its_group_and_nothing_more() -> None:
    granted = {(b.restype, b.operation) for b in namespace_acls("team-a", "ns-a", role="reader")}
    assert granted == {
        (ResourceType.TOPIC, AclOperation.READ),
        (ResourceType.TOPIC, AclOperation.DESCRIBE_CONFIGS),
        (ResourceType.GROUP, AclOperation.DESCRIBE),
    }
    no_create = {b.operation for b in namespace_acls("team-a", "ns-a", create_topics=False)}
    assert AclOperation.CREATE not in no_create


@pytest.mark.parametrize(("namespace", "user"), [("team a", "ns-a"), ("team-a", ""), ("team-a", "ns a")])
def test_a_namespace_or_user_no_acl_could_name_is_refused(namespace: str, user: str) -> None:
    with pytest.raises(ConfigurationError):
        namespace_acls(namespace, user)


def test_a_refusal_names_operation_resource_and_user_and_how_to_grant_it() -> None:
    err = KafkaError(KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED)
    denied = refusal(settings("team-b"), err, {"transactional id": ("WRITE", "team-b.worker-0")})
    assert isinstance(denied, NotAuthorizedError)
    assert str(denied).startswith("not authorized to WRITE transactional id team-b.worker-0 as user ns-a; ")
    assert "rollout-journal kafka grant --namespace team-b --user ns-a" in str(denied)
    assert (denied.operation, denied.resource_type, denied.resource) == ("WRITE", "transactional id", "team-b.worker-0")
    assert refusal(settings(), KafkaError(KafkaError._TIMED_OUT), {}) is None
    assert SECRET not in str(denied)


def test_a_client_without_a_user_is_named_for_what_it_is() -> None:
    plain = KafkaSettings.from_url("kafka://127.0.0.1:9092/team-a", env={})
    assert principal_of(plain).startswith("an anonymous client")
    assert "kafka grant" not in str(not_authorized(plain, "READ", "topic", "team-a.events"))


def test_refusals_of_the_cluster_have_an_exit_code_of_their_own() -> None:
    assert exit_code_for(not_authorized(settings(), "READ", "topic", "team-a.events")) == EXIT_NOT_AUTHORIZED
    assert exit_code_for(AuthenticationFailedError("SASL authentication failed")) == EXIT_NOT_AUTHORIZED
    # a fleet's journal stops when a partition's writer is refused: still a refusal, not a failed journal
    stopped = JournalStoppedError(not_authorized(settings(), "WRITE", "transactional id", "team-a.p3"))
    assert exit_code_for(stopped) == EXIT_NOT_AUTHORIZED
    # being fenced is checked first, as for every other code
    assert exit_code_for(JournalStoppedError(ProducerFencedError("fenced"))) == EXIT_WRITER_TAKEN
    assert f"\n  {EXIT_NOT_AUTHORIZED}    the Kafka cluster refused these credentials" in EXIT_CODES_HELP


def _node(tmp_path: Path) -> LocalKafkaNode:
    return LocalKafkaNode(node_id=1, port=19092, controller_port=19093, node_dir=tmp_path)


def test_the_default_node_config_is_plaintext_without_an_authorizer(tmp_path: Path) -> None:
    node = _node(tmp_path)
    config = server_config(node, [node], tmp_path, {})
    assert config["listeners"] == "PLAINTEXT://127.0.0.1:19092,CONTROLLER://127.0.0.1:19093"
    assert config["listener.security.protocol.map"] == "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT"
    assert not [key for key in config if "sasl" in key or "authorizer" in key or key == "super.users"]


def test_a_sasl_node_authenticates_every_listener_and_denies_what_no_acl_grants(tmp_path: Path) -> None:
    node = _node(tmp_path)
    sasl = SaslSecurity(admin_password=SECRET)
    config = server_config(node, [node], tmp_path, {}, sasl=sasl)
    assert "PLAINTEXT://" not in config["listeners"].replace("SASL_PLAINTEXT://", "")
    assert config["listener.security.protocol.map"] == "CONTROLLER:SASL_PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT"
    assert config["authorizer.class.name"] == "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
    assert config["allow.everyone.if.no.acl.found"] == "false"
    assert config["super.users"] == "User:admin"  # and no User:ANONYMOUS: no listener is unauthenticated
    assert SECRET not in repr(sasl)


def test_the_bootstrap_credential_is_the_salted_scram_password_never_the_password() -> None:
    salt = b"0123456789abcdef"
    text = scram_bootstrap_credential("admin", SECRET, salt=salt)
    expected = hashlib.pbkdf2_hmac("sha512", SECRET.encode(), salt, 8192)
    assert text == (
        f'SCRAM-SHA-512=[name=admin,iterations=8192,salt="{base64.b64encode(salt).decode()}",'
        f'saltedpassword="{base64.b64encode(expected).decode()}"]'
    )
    assert SECRET not in text


def test_hidden_arguments_leave_the_command_line_for_an_owner_only_file(tmp_path: Path) -> None:
    cmd = ["java", "-Xmx1m", "-cp", "libs/*", "kafka.tools.StorageTool", "format", "--add-scram", 'x=[s="q"]']
    argfile = tmp_path / "format.args"
    hidden = hide_arguments(cmd, "kafka.tools.StorageTool", argfile)
    assert hidden == ["java", "-Xmx1m", "-cp", "libs/*", f"@{argfile}"]
    assert stat.S_IMODE(os.stat(argfile).st_mode) == 0o600
    assert argfile.read_text().splitlines() == [
        '"kafka.tools.StorageTool"',
        '"format"',
        '"--add-scram"',
        '"x=[s=\\"q\\"]"',
    ]


@pytest.mark.parametrize(
    "query",
    [
        "sasl.password=pw-in-url",
        "librdkafka.sasl.password=pw-in-url",
        "sasl.oauthbearer.client.secret=pw-in-url",
        "ssl.key.password=pw-in-url",
    ],
)
def test_a_secret_in_the_journal_url_is_refused_naming_its_variable(query: str) -> None:
    """A journal URL is written into workload YAML and into the journal by `submit`: no secret rides in it."""
    with pytest.raises(ConfigurationError, match="ROLLOUT_JOURNAL_LIBRDKAFKA_") as refused:
        KafkaSettings.from_url(f"kafka://127.0.0.1:9092/team-a?{query}", env={})
    assert "pw-in-url" not in str(refused.value)
    located = KafkaSettings.from_url("kafka://127.0.0.1:9092/team-a?ssl.key.location=/etc/k.pem", env={})
    assert located.librdkafka == {"ssl.key.location": "/etc/k.pem"}  # a path to a key is no secret
