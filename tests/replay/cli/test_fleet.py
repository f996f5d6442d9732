"""The fleet's commands refuse what they cannot do in one line and a documented exit code:
a bad workload to ``submit``, a ``worker`` against a cluster that does not answer or a
namespace whose topics were made otherwise; and ``status`` of a submitted workload."""

from __future__ import annotations

import json
import shlex
import socket

import pytest
from confluent_kafka.admin import AdminClient

from rollout_journal.journal.kafka.backend import KafkaBackend
from rollout_journal.journal.kafka.config import KafkaSettings
from rollout_journal.replay.cli.main import main
from rollout_journal.replay.exit_codes import EXIT_INPUT, EXIT_JOURNAL_FAILED, EXIT_OK

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]

GOOD = "name: fl\ngroups: 2\nsiblings: 2\nmax_turns: 2\nenvironment: counter\n"


def refused(capsys: pytest.CaptureFixture[str], argv: list[str], code: int, *names: str) -> str:
    assert main(argv) == code
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("rollout-journal: "), lines
    for name in names:
        assert name in lines[0], f"{name!r} is not named in: {lines[0]}"
    return lines[0]


def topics_of(bootstrap: str, namespace: str) -> list[str]:
    names = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=20).topics
    return sorted(t for t in names if t.startswith(namespace + "."))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def url(kafka_bootstrap: str, kafka_namespace: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)  # the URL names the servers
    return f"kafka://{kafka_bootstrap}/{kafka_namespace}?partitions=4"


def test_submit_of_a_bad_workload_is_one_line_and_creates_nothing(
    url, tmp_path, capsys, kafka_bootstrap, kafka_namespace
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(GOOD.replace("counter", "no-such-env"))
    refused(capsys, ["submit", str(bad), "--journal", url], EXIT_INPUT, "no-such-env")
    typo = tmp_path / "typo.yaml"
    typo.write_text(GOOD + "max_turn: 3\n")
    refused(capsys, ["submit", str(typo), "--journal", url], EXIT_INPUT, "max_turn")
    assert topics_of(kafka_bootstrap, kafka_namespace) == []


def test_submit_to_a_file_journal_or_twice_with_other_settings_is_refused(url, tmp_path, capsys) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(GOOD)
    refused(capsys, ["submit", str(good), "--journal", str(tmp_path / "j")], EXIT_INPUT, "kafka://", "run")
    capsys.readouterr()
    assert main(["submit", str(good), "--journal", f"{url}&group_session_timeout_ms=6000"]) == EXIT_OK
    # the worker command it prints pastes into a shell as it is: the URL's & does not background anything
    printed = capsys.readouterr().out.split("start workers with: ", 1)[1].strip()
    assert shlex.split(printed) == ["rollout-journal", "worker", "--journal", f"{url}&group_session_timeout_ms=6000"]
    assert (
        main(["submit", str(good), "--journal", f"{url}&group_session_timeout_ms=6000"]) == EXIT_OK
    )  # again: no change
    assert "already submitted" in capsys.readouterr().out
    other = tmp_path / "other.yaml"
    other.write_text(GOOD.replace("max_turns: 2", "max_turns: 3"))
    refused(capsys, ["submit", str(other), "--journal", url], EXIT_INPUT, "already submitted", "max_turns 2 -> 3")


def test_a_resubmit_that_changes_only_the_turn_delay_is_refused_naming_it(url, tmp_path, capsys) -> None:
    """Issue 17 (7): it said "nothing changed" and dropped the new value."""
    good = tmp_path / "good.yaml"
    good.write_text(GOOD + "turn_delay_ms: 800\n")
    assert main(["submit", str(good), "--journal", url]) == EXIT_OK
    faster = tmp_path / "faster.yaml"
    faster.write_text(GOOD + "turn_delay_ms: 100\n")
    refused(capsys, ["submit", str(faster), "--journal", url], EXIT_INPUT, "already submitted", "turn_delay_ms")


def test_a_worker_against_a_cluster_that_does_not_answer_is_one_line(capsys, monkeypatch) -> None:
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)
    address = f"127.0.0.1:{free_port()}"
    refused(
        capsys,
        ["worker", "--journal", f"kafka://{address}/ns?operation_timeout_ms=2000"],
        EXIT_JOURNAL_FAILED,
        "cannot reach the Kafka cluster",
        address,
    )


def test_a_worker_on_a_namespace_with_other_topic_settings_is_one_line(
    url, capsys, kafka_bootstrap, kafka_namespace
) -> None:
    made = KafkaSettings(bootstrap_servers=kafka_bootstrap, namespace=kafka_namespace, partitions=3)
    KafkaBackend(made, transactional=False).close()  # somebody made the topics with 3 partitions
    refused(
        capsys,
        ["worker", "--journal", url],
        EXIT_INPUT,
        f"{kafka_namespace}.events has 3 partitions",
        "settings.partitions is 4",
    )


def test_status_of_a_submitted_workload_lists_every_rollout_pending(url, tmp_path, capsys) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(GOOD)
    assert main(["submit", str(good), "--journal", url]) == EXIT_OK
    capsys.readouterr()
    assert main(["status", "--journal", url, "--json"]) == EXIT_OK
    status = json.loads(capsys.readouterr().out)
    assert [(w["name"], w["rollouts"], w["pending"], w["done"]) for w in status["workloads"]] == [("fl", 4, 4, False)]
    assert {r["status"] for r in status["rollouts"]} == {"pending"} and len(status["partitions"]) == 4
    assert status["workers"] == [] and status["group"].endswith(".workers")
