"""Only the right workers get in: one real broker with a SASL/SCRAM listener and Kafka's own
authorizer (StandardAuthorizer), started once per test session with the launcher
(``rollout-journal kafka up --sasl``) and stopped with ``kafka down``. One user is made and
granted with ``kafka user`` / ``kafka grant`` as the README shows; the others through the Admin
API (what those commands call), to keep the cost low.

A worker of namespace A is refused on B's topics, transactional ids (a slot's ``NS.<slot>`` and a
fleet's ``NS.p<N>``) and groups (the readers' and the fleet's ``NS.workers``) with one line
naming the resource and the operation, exit code 9, and nothing reaches B; a wrong password is
one line, at once; the minimal ACL set of rollout_journal.journal.kafka.access is exactly enough (each of its
ACLs is needed); and no password appears in a log line, the CLI's output, a repr or the journal.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AclBinding, AdminClient, ResourceType

from rollout_journal.compose.scram_users import upsert_scram_user
from rollout_journal.journal.backend import OutRecord, Stream
from rollout_journal.journal.errors import NotAuthorizedError
from rollout_journal.journal.kafka.access import create_acls, delete_acls, namespace_acls
from rollout_journal.journal.kafka.backend import KafkaBackend
from rollout_journal.journal.kafka.config import KafkaSettings
from rollout_journal.journal.kafka.group import WorkerGroup
from rollout_journal.journal.kafka.retry import Action, Retry, Role, classify
from rollout_journal.replay.exit_codes import EXIT_INPUT, EXIT_NOT_AUTHORIZED, EXIT_OK
from rollout_journal.replay.status import fleet_status
from tests.support.fleet_support import WorkerProcess, wait_for
from tests.support.paths import REPO_ROOT

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(300)]

PROBE_LOG = logging.getLogger("tests.kafka_security.probe")
WORKLOAD = "name: sec\ngroups: 2\nsiblings: 1\nmax_turns: 2\nenvironment: counter\n"
CLI_TIMEOUT_S = 240  # a refusal that is never reported (a worker waiting forever) fails the test here


def clean_environment() -> dict[str, str]:
    """The test's environment without a broker address or journal settings of its own."""
    env = {
        k: v for k, v in os.environ.items() if k != "KAFKA_BOOTSTRAP_SERVERS" and not k.startswith("ROLLOUT_JOURNAL_")
    }
    env["PYTHONPATH"] = str(REPO_ROOT)
    return env


@dataclass
class SecureCluster:
    """The session's SASL broker with ACLs (started by ``kafka up --sasl``), its super user's
    admin client, and the users made so far."""

    state_dir: Path
    bootstrap: str
    admin_security: dict[str, str]  # the super user's librdkafka login (holds its password)
    passwords: dict[str, str] = field(default_factory=dict)
    _admin: AdminClient | None = None

    @property
    def admin(self) -> AdminClient:
        if self._admin is None:
            self._admin = AdminClient({"bootstrap.servers": self.bootstrap, "logger": PROBE_LOG, **self.admin_security})
        return self._admin

    def kafka(self, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
        """``rollout-journal kafka ARGS --state-dir STATE`` in a process of its own."""
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "rollout_journal.replay.cli.main",
                "kafka",
                *args,
                "--state-dir",
                str(self.state_dir),
            ],
            input=stdin,
            env=clean_environment(),
            capture_output=True,
            text=True,
            timeout=CLI_TIMEOUT_S,
            check=False,
        )

    def new_user(self) -> str:
        """A user with a password no other string in this run could contain by chance."""
        name = f"u-{uuid.uuid4().hex[:8]}"
        self.passwords[name] = f"pw-{secrets.token_hex(12)}"
        upsert_scram_user(self.admin, name, self.passwords[name])
        return name

    def env(self, user: str, password: str | None = None) -> dict[str, str]:
        return {
            "ROLLOUT_JOURNAL_LIBRDKAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
            "ROLLOUT_JOURNAL_LIBRDKAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
            "ROLLOUT_JOURNAL_LIBRDKAFKA_SASL_USERNAME": user,
            "ROLLOUT_JOURNAL_LIBRDKAFKA_SASL_PASSWORD": self.passwords[user] if password is None else password,
        }

    def url(self, namespace: str, **query: object) -> str:
        tail = "&".join(f"{k}={v}" for k, v in {"partitions": 2, **query}.items())
        return f"kafka://{self.bootstrap}/{namespace}?{tail}"

    def settings(self, user: str, namespace: str, **query: object) -> KafkaSettings:
        return KafkaSettings.from_url(self.url(namespace, **query), env=self.env(user))

    def grant(
        self,
        user: str,
        namespace: str,
        *,
        role: str = "worker",
        only: set[ResourceType] | None = None,
        without: set[str] = frozenset(),
    ) -> list[AclBinding]:
        """Grant ``user`` the namespace's ACLs of ``role``, limited to the resource types ``only``,
        less the ACLs named in ``without`` (``"READ on GROUP"``)."""
        bindings = [
            b
            for b in namespace_acls(namespace, user, role=role)  # type: ignore[arg-type]
            if (only is None or b.restype in only) and acl_name(b) not in without
        ]
        create_acls(self.admin, bindings)
        return bindings

    def journal_state(self, namespace: str) -> dict[str, object]:
        """What the super user sees of a namespace: its topics and every partition's offsets (the
        high watermark counts aborted records and transaction markers too: any write moves it)."""
        metadata = self.admin.list_topics(timeout=30)
        topics = sorted(t for t in metadata.topics if t.startswith(f"{namespace}."))
        consumer = Consumer(
            {"bootstrap.servers": self.bootstrap, "group.id": "admin-probe", "logger": PROBE_LOG, **self.admin_security}
        )

        def offsets(topic: str, partition: int) -> tuple[int, int]:
            # A topic just created may not have its leader yet: retried as the journal's own queries are.
            retry = Retry(60, f"offsets of {topic}[{partition}]")
            while True:
                try:
                    return consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=30, cached=False)
                except KafkaException as exc:
                    err = exc.args[0]
                    if classify(err, Role.OFFSETS) is Action.RETRY and retry.wait(err):
                        continue
                    raise

        try:
            return {f"{t}[{p}]": offsets(t, p) for t in topics for p in metadata.topics[t].partitions}
        finally:
            consumer.close()

    def cli(self, user: str, *args: str, cwd: Path, password: str | None = None) -> subprocess.CompletedProcess[str]:
        """``rollout-journal ARGS`` as ``user``, in a process of its own, as a user would run it."""
        return subprocess.run(
            [sys.executable, "-m", "rollout_journal.replay.cli.main", *args],
            env=clean_environment() | self.env(user, password),
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=CLI_TIMEOUT_S,
            check=False,
        )


def acl_name(binding: AclBinding) -> str:
    return f"{binding.operation.name} on {binding.restype.name}"


@pytest.fixture(scope="session")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureCluster]:
    state_dir = tmp_path_factory.mktemp("kafka-sasl")
    cluster = SecureCluster(state_dir, "", {})
    up = cluster.kafka("up", "--sasl")
    try:
        if up.returncode != 0:
            pytest.fail(
                f"`kafka up --sasl` could not start a SASL/SCRAM broker with an authorizer: {up.stderr}", pytrace=False
            )
        assert "with SASL/SCRAM-SHA-512 and ACLs" in up.stdout, up.stdout
        config = dict(
            line.split("=", 1)
            for line in (state_dir / "admin-client.properties").read_text().splitlines()
            if "=" in line
        )
        cluster.bootstrap = config.pop("bootstrap.servers")
        cluster.admin_security = config
        yield cluster
    finally:
        down = cluster.kafka("down")
        assert down.returncode == 0, down.stderr


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "w.yaml").write_text(WORKLOAD)
    return tmp_path


def namespace(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:6]}"


def one_line(done: subprocess.CompletedProcess[str], code: int, *names: str) -> str:
    """Assert the CLI ended with ``code`` and exactly one stderr line naming each of ``names``."""
    lines = done.stderr.splitlines()
    assert done.returncode == code, done.stderr
    assert len(lines) == 1, f"expected one line on stderr, got:\n{done.stderr}"
    for name in names:
        assert name in lines[0], f"{name!r} is not named in: {lines[0]}"
    return lines[0]


def b_with_a_journal(secure: SecureCluster, workdir: Path) -> tuple[str, str]:
    """Namespace B, with a journal its own worker wrote, and that worker's user."""
    user_b, ns_b = secure.new_user(), namespace("tb")
    secure.grant(user_b, ns_b)
    done = secure.cli(user_b, "run", "w.yaml", "--journal", secure.url(ns_b), cwd=workdir)
    assert done.returncode == EXIT_OK, done.stderr
    return ns_b, user_b


# -- the launcher, and the right worker gets in -------------------------------------------------


def test_kafka_user_and_grant_let_a_worker_run_resume_and_join_a_fleet(
    secure: SecureCluster,
    workdir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    again = secure.kafka("up", "--sasl")
    assert again.returncode == 0 and "already running" in again.stdout, again.stderr
    plain = secure.kafka("up")
    assert plain.returncode == EXIT_INPUT and "with SASL already runs" in plain.stderr
    assert stat.S_IMODE((secure.state_dir / "admin-client.properties").stat().st_mode) == 0o600
    assert "sasl.password" not in (secure.state_dir / "state.json").read_text()

    user, ns = f"w-{uuid.uuid4().hex[:6]}", namespace("ta")
    secure.passwords[user] = f"pw-{secrets.token_hex(12)}"
    made = secure.kafka("user", user, stdin=secure.passwords[user] + "\n")
    assert made.returncode == 0, made.stderr
    granted = secure.kafka("grant", "--namespace", ns, "--user", user)
    assert granted.returncode == 0, granted.stderr
    # what a worker needs, as the code uses it: its topics, NS.<slot> and NS.p<N>, NS.workers and NS.reader-*
    for rights in (
        f"topics {ns}.* READ, WRITE, DESCRIBE_CONFIGS, CREATE",
        f"transactional ids {ns}.* WRITE",
        f"groups {ns}.* READ",
    ):
        assert rights in granted.stdout, granted.stdout

    ran = secure.cli(user, "run", "w.yaml", "--journal", secure.url(ns), cwd=workdir)
    assert ran.returncode == EXIT_OK, ran.stderr
    listed = secure.cli(user, "list", secure.url(ns), cwd=workdir)
    assert listed.returncode == EXIT_OK, listed.stderr
    assert listed.stdout.count("finished") == 2, listed.stdout
    resumed = secure.cli(user, "resume", "w.yaml", "--journal", secure.url(ns), cwd=workdir)
    assert resumed.returncode == EXIT_OK, resumed.stderr

    # the same grant runs a fleet worker: submit, a worker that finishes the workload, status
    fleet_ns = f"{ns}.fleet"  # nested under the grant's prefix
    fleet = secure.url(fleet_ns)
    submitted = secure.cli(user, "submit", "w.yaml", "--journal", fleet, cwd=workdir)
    assert submitted.returncode == EXIT_OK, submitted.stderr
    worker = subprocess.Popen(
        [sys.executable, "-m", "rollout_journal.replay.cli.main", "worker", "--journal", fleet, "--name", "w1"],
        env=clean_environment() | secure.env(user),
        cwd=workdir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)  # it would name the suite's other broker
        for key, value in secure.env(user).items():  # status, in this process, as the same user
            monkeypatch.setenv(key, value)
        wait_for(
            lambda: fleet_status(fleet).done,
            CLI_TIMEOUT_S,
            "the fleet worker to finish the workload",
            [WorkerProcess("w1", worker, workdir / "unused")],
        )
        status = secure.cli(user, "status", "--journal", fleet, cwd=workdir)
        assert status.returncode == EXIT_OK, status.stderr
        assert "w1" in status.stdout and "DONE" in status.stdout, status.stdout
    finally:
        worker.terminate()
        _, stderr = worker.communicate(timeout=CLI_TIMEOUT_S)
    assert worker.returncode == EXIT_OK, stderr


def test_a_reader_grant_lists_a_journal_but_cannot_write_to_it(secure: SecureCluster, workdir: Path) -> None:
    ns_b, _ = b_with_a_journal(secure, workdir)
    reader = secure.new_user()
    secure.grant(reader, ns_b, role="reader")
    before = secure.journal_state(ns_b)

    listed = secure.cli(reader, "list", secure.url(ns_b), cwd=workdir)
    assert listed.returncode == EXIT_OK, listed.stderr
    assert listed.stdout.count("finished") == 2
    refused = secure.cli(reader, "resume", "w.yaml", "--journal", secure.url(ns_b), cwd=workdir)
    one_line(refused, EXIT_NOT_AUTHORIZED, f"not authorized to WRITE topic {ns_b}.", f"as user {reader}")
    assert secure.journal_state(ns_b) == before


def test_a_worker_needs_no_create_right_where_the_topics_exist(secure: SecureCluster, workdir: Path) -> None:
    ns_b, _ = b_with_a_journal(secure, workdir)
    operator_made = secure.new_user()
    secure.grant(operator_made, ns_b, without={"CREATE on TOPIC"})

    done = secure.cli(operator_made, "resume", "w.yaml", "--journal", secure.url(ns_b), cwd=workdir)
    assert done.returncode == EXIT_OK, done.stderr


# -- the wrong one does not ---------------------------------------------------------------------


def test_a_worker_of_a_is_refused_on_b_topics_and_nothing_reaches_b(secure: SecureCluster, workdir: Path) -> None:
    user_a, ns_a = secure.new_user(), namespace("ta")
    secure.grant(user_a, ns_a)
    ns_b, _ = b_with_a_journal(secure, workdir)
    before = secure.journal_state(ns_b)

    # run is a member of the namespace's group: it first asks who holds the namespace
    run = secure.cli(user_a, "run", "w.yaml", "--journal", secure.url(ns_b), cwd=workdir)
    one_line(
        run,
        EXIT_NOT_AUTHORIZED,
        f"not authorized to DESCRIBE group {ns_b}.workers as user {user_a}",
        f"kafka grant --namespace {ns_b} --user {user_a}",
    )
    listing = secure.cli(user_a, "list", secure.url(ns_b), cwd=workdir)
    one_line(listing, EXIT_NOT_AUTHORIZED, f"not authorized to DESCRIBE topic {ns_b}.events as user {user_a}")
    worker = secure.cli(user_a, "worker", "--journal", secure.url(ns_b), "--progress-lines", cwd=workdir)
    one_line(worker, EXIT_NOT_AUTHORIZED, f"topic {ns_b}.events as user {user_a}")
    assert secure.journal_state(ns_b) == before

    fresh = namespace("tb")  # a namespace nobody created yet stays uncreated
    one_line(
        secure.cli(user_a, "run", "w.yaml", "--journal", secure.url(fresh), cwd=workdir),
        EXIT_NOT_AUTHORIZED,
        f"DESCRIBE group {fresh}.workers",
    )
    assert secure.journal_state(fresh) == {}


def test_a_worker_of_a_is_refused_on_b_transactional_ids(secure: SecureCluster, workdir: Path) -> None:
    ns_b, _ = b_with_a_journal(secure, workdir)
    user_a = secure.new_user()
    # B's topics and groups shared with A, its transactional ids not: A must not write as B's writers
    secure.grant(user_a, ns_b, only={ResourceType.TOPIC, ResourceType.GROUP})
    before = secure.journal_state(ns_b)

    done = secure.cli(user_a, "resume", "w.yaml", "--journal", secure.url(ns_b), cwd=workdir)
    # a member's producer is NS.w.<writer>.<boot> (resume's writer: worker-0)
    one_line(
        done, EXIT_NOT_AUTHORIZED, f"not authorized to WRITE transactional id {ns_b}.w.worker-0.", f"as user {user_a}"
    )
    # a fleet worker joins B's group and may not open its member producer NS.w.<name>.<boot>
    worker = secure.cli(user_a, "worker", "--journal", secure.url(ns_b), "--progress-lines", cwd=workdir)
    one_line(worker, EXIT_NOT_AUTHORIZED, f"not authorized to WRITE transactional id {ns_b}.w.", f"as user {user_a}")
    assert secure.journal_state(ns_b) == before


def test_a_worker_of_a_is_refused_on_b_groups(secure: SecureCluster, workdir: Path) -> None:
    ns_b, _ = b_with_a_journal(secure, workdir)
    user_a = secure.new_user()
    secure.grant(user_a, ns_b, only={ResourceType.TOPIC, ResourceType.TRANSACTIONAL_ID})
    before = secure.journal_state(ns_b)

    done = secure.cli(user_a, "resume", "w.yaml", "--journal", secure.url(ns_b), cwd=workdir)
    # resume is a member: the namespace's worker group is the first group it needs
    one_line(done, EXIT_NOT_AUTHORIZED, f"not authorized to DESCRIBE group {ns_b}.workers", f"as user {user_a}")
    assert secure.journal_state(ns_b) == before


def test_a_fleet_worker_without_read_on_the_worker_group_is_one_line_naming_it(
    secure: SecureCluster,
    workdir: Path,
) -> None:
    ns = namespace("tg")
    user = secure.new_user()
    # everything of a worker but READ on the groups; DESCRIBE lets its readers find their coordinator
    secure.grant(user, ns, without={"READ on GROUP"})
    secure.grant(user, ns, role="reader", only={ResourceType.GROUP})
    done = secure.cli(user, "worker", "--journal", secure.url(ns), "--progress-lines", cwd=workdir)
    one_line(
        done,
        EXIT_NOT_AUTHORIZED,
        f"not authorized to READ group {ns}.workers as user {user}",
        f"kafka grant --namespace {ns} --user {user}",
    )


def test_the_worker_group_refused_while_joining_ends_the_membership_naming_the_group(secure: SecureCluster) -> None:
    """The group itself, without the check at open (a grant revoked between the open and the join):
    the refusal polled from the group stops the membership instead of waiting for an assignment."""
    ns = namespace("tj")
    user = secure.new_user()
    secure.grant(user, ns, only={ResourceType.TOPIC})
    secure.grant(user, ns, role="reader", only={ResourceType.GROUP})  # DESCRIBE finds the coordinator; no READ
    KafkaBackend(
        KafkaSettings(
            bootstrap_servers=secure.bootstrap,
            namespace=ns,
            partitions=2,  # the topics
            librdkafka=secure.admin_security,
        ),
        transactional=False,
    ).close()
    group = WorkerGroup(
        secure.settings(user, ns), "w1", on_assigned=lambda _: None, on_revoked=lambda _: None, on_lost=lambda _: None
    )
    group.start()
    try:
        group._thread.join(CLI_TIMEOUT_S)  # type: ignore[union-attr]
        assert isinstance(group.failure, NotAuthorizedError), group.failure
        assert (group.failure.operation, group.failure.resource_type, group.failure.resource) == (
            "READ",
            "group",
            f"{ns}.workers",
        )
        assert group.owned == set()
    finally:
        group.close()


def test_a_wrong_password_is_one_line_saying_so_without_waiting_out_a_timeout(
    secure: SecureCluster,
    workdir: Path,
) -> None:
    user_a, ns_a = secure.new_user(), namespace("ta")
    secure.grant(user_a, ns_a)
    # With a two-minute operation timeout, a refused login that waited for one would say
    # "no Kafka broker answered" (and take two minutes); the refusal itself is reported at once.
    url = secure.url(ns_a, operation_timeout_ms=120_000)
    done = secure.cli(user_a, "run", "w.yaml", "--journal", url, cwd=workdir, password="not-the-password")
    line = one_line(done, EXIT_NOT_AUTHORIZED, f"SASL authentication failed for user {user_a}", "invalid credentials")
    assert "not-the-password" not in line
    worker = secure.cli(
        user_a, "worker", "--journal", url, "--progress-lines", cwd=workdir, password="not-the-password"
    )
    one_line(worker, EXIT_NOT_AUTHORIZED, f"SASL authentication failed for user {user_a}")
    assert secure.journal_state(ns_a) == {}


# -- the minimal set is minimal -----------------------------------------------------------------


@pytest.mark.parametrize("dropped", [acl_name(binding) for binding in namespace_acls("ns", "u")])
def test_every_acl_of_the_worker_set_is_needed(secure: SecureCluster, dropped: str, caplog) -> None:
    user, ns = secure.new_user(), namespace("tm")
    operation, kind = dropped.split(" on ")
    secure.grant(user, ns, without={dropped})
    settings = secure.settings(user, ns, transactional_id="w0")

    if operation == "DESCRIBE_CONFIGS":  # the one a worker can do without: its topic checks go unchecked, loudly
        with caplog.at_level(logging.WARNING, logger="rollout_journal.journal.kafka.topics"):
            KafkaBackend(settings).close()
        assert f"not authorized to DESCRIBE_CONFIGS topic {ns}.events" in caplog.text
        return
    with pytest.raises(NotAuthorizedError) as refused:
        KafkaBackend(settings)
    expected = {"READ": ("READ", "DESCRIBE"), "WRITE": ("WRITE",), "CREATE": ("CREATE",)}.get(operation, (operation,))
    if kind == "GROUP":
        expected = ("DESCRIBE",)  # READ on a group implies DESCRIBE, which finding its coordinator needs
    assert refused.value.operation in expected
    assert (
        refused.value.resource_type
        == {"TOPIC": "topic", "GROUP": "group", "TRANSACTIONAL_ID": "transactional id"}[kind]
    )
    assert refused.value.resource.startswith(f"{ns}.")
    assert secure.journal_state(ns) == (
        {}
        if operation == "CREATE"
        else {f"{ns}.{t}[{p}]": (0, 0) for t in ("events", "snapshots", "results", "acks") for p in range(2)}
        | {f"{ns}.workloads[0]": (0, 0)}  # one partition: the namespace's registrations
        | {f"{ns}.summaries[0]": (0, 0)}  # one for every 8 of the events
    )


def test_a_write_refused_mid_run_names_the_topic_and_nothing_of_the_batch_is_visible(secure: SecureCluster) -> None:
    user, ns = secure.new_user(), namespace("tr")
    granted = secure.grant(user, ns)
    backend = KafkaBackend(secure.settings(user, ns, transactional_id="w0"))
    try:
        backend.commit([OutRecord(Stream.EVENTS, "r1", b"turn-1", "r1")])
        delete_acls(secure.admin, [b for b in granted if acl_name(b) == "WRITE on TOPIC"])

        with pytest.raises(NotAuthorizedError, match=f"not authorized to WRITE topic {ns}\\."):
            backend.commit([OutRecord(Stream.EVENTS, "r1", b"turn-2", "r1")])
        with pytest.raises(NotAuthorizedError, match=f"WRITE topic {ns}\\."):  # and stays so
            backend.commit([OutRecord(Stream.EVENTS, "r1", b"turn-3", "r1")])
    finally:
        backend.close()
    admin_view = KafkaBackend(
        KafkaSettings(bootstrap_servers=secure.bootstrap, namespace=ns, partitions=2, librdkafka=secure.admin_security),
        transactional=False,
        create_topics=False,
    )
    try:
        values = [r.value for p in range(2) for r in admin_view.read_events(p)]
    finally:
        admin_view.close()
    assert values == [b"turn-1"]


def test_a_read_refused_mid_run_names_the_topic(secure: SecureCluster) -> None:
    """A reader whose READ grant is revoked while it is open (a trainer's, a replay's) is told so,
    naming the topic, at its next read: not a stall blamed on the cluster's reachability."""
    user, ns = secure.new_user(), namespace("rr")
    granted = secure.grant(user, ns)
    writer = KafkaBackend(secure.settings(user, ns, transactional_id="w0"))
    reader = KafkaBackend(secure.settings(user, ns), transactional=False, create_topics=False)
    try:
        writer.commit([OutRecord(Stream.EVENTS, "r1", b"turn-1", "r1")])
        # The commit's markers reach the partition a moment after commit() returns: read until they have.
        wait_for(
            lambda: [r.value for p in range(2) for r in reader.read_events(p)] == [b"turn-1"],
            30,
            "the committed turn, read with the grant",
        )
        delete_acls(secure.admin, [b for b in granted if acl_name(b) == "READ on TOPIC"])

        with pytest.raises(NotAuthorizedError, match=f"not authorized to (READ|DESCRIBE) topic {ns}\\.events"):
            [r.value for p in range(2) for r in reader.read_events(p)]
        with pytest.raises(NotAuthorizedError, match=f"(READ|DESCRIBE) topic {ns}\\.results"):  # a trainer's feed
            reader.follow_results({}).poll(30)
    finally:
        reader.close()
        writer.close()


# -- no secret anywhere -------------------------------------------------------------------------


def test_no_secret_in_logs_output_reprs_or_the_journal(secure: SecureCluster, workdir: Path, caplog) -> None:
    user, ns = secure.new_user(), namespace("ts")
    password = secure.passwords[user]
    admin_password = secure.admin_security["sasl.password"]
    secure.grant(user, ns)
    seen: list[str] = []

    # the CLI with every log line at INFO, a success and each kind of refusal
    for args in (
        ["-v", "run", "w.yaml", "--journal", secure.url(ns)],
        ["-v", "list", secure.url(ns)],
        ["-v", "run", "w.yaml", "--journal", secure.url(namespace("other"))],
    ):
        done = secure.cli(user, *args, cwd=workdir)
        seen += [done.stdout, done.stderr]
    wrong = secure.cli(user, "-v", "list", secure.url(ns), cwd=workdir, password=password + "x")
    seen += [wrong.stdout, wrong.stderr]
    assert "SASL authentication failed" in wrong.stderr

    # in process: every log record of a backend's life, the reprs, the errors
    settings = secure.settings(user, ns, transactional_id="w1")
    with caplog.at_level(logging.DEBUG):
        backend = KafkaBackend(settings)
        backend.commit([OutRecord(Stream.EVENTS, "r9", b"v", "r9")])
        list(backend.read_events(0))
        seen += [repr(settings), str(settings), repr(backend)]
        backend.close()
        try:
            KafkaBackend(secure.settings(user, namespace("other"), transactional_id="w1"))
        except NotAuthorizedError as exc:
            seen.append(str(exc))
    seen += [record.getMessage() for record in caplog.records]
    for text in seen:
        assert password not in text
        assert admin_password not in text

    # the journal's raw records, keys and values, and the broker's own logs and files
    consumer = Consumer(
        {
            "bootstrap.servers": secure.bootstrap,
            "group.id": "admin-probe",
            "logger": PROBE_LOG,
            "enable.partition.eof": True,
            **secure.admin_security,
        }
    )
    try:
        raw = b"".join(_raw_records(consumer, [f"{ns}.events", f"{ns}.snapshots", f"{ns}.results"]))
    finally:
        consumer.close()
    assert b"sec-g0-s0" in raw  # the workload's records are there to search
    assert password.encode() not in raw
    node_dirs = sorted(p.parent for p in secure.state_dir.rglob("server.properties"))
    assert node_dirs, f"no node folder under {secure.state_dir}"
    for node_dir in node_dirs:
        for log_file in (node_dir / "logs").iterdir():
            assert password not in log_file.read_text(errors="replace")
        assert stat.S_IMODE((node_dir / "server.properties").stat().st_mode) == 0o600  # the super user's password
        assert not (node_dir / "format.args").exists()


def _raw_records(consumer: Consumer, topics: list[str]) -> Iterator[bytes]:
    partitions = [TopicPartition(t, p, 0) for t in topics for p in range(2)]
    consumer.assign(partitions)
    pending = {(tp.topic, tp.partition) for tp in partitions}
    while pending:
        msg = consumer.poll(10)
        assert msg is not None, f"no record nor end of partition within 10 s from {sorted(pending)}"
        if msg.error() is not None:
            pending.discard((msg.topic(), msg.partition()))
            continue
        yield (msg.key() or b"") + (msg.value() or b"")
