"""Exactly one writer per rollout, whatever a user starts on one Kafka namespace.

Real ``rollout-journal`` processes, raced with random start offsets: two ``resume`` with different
``--writer``, a ``run`` and a ``resume`` of another writer, a fleet's ``worker`` and a ``run``. Each
combination is either refused before it writes anything (exit 6, one line naming who holds the
namespace) or made safe by the group's partition ownership (both drive, each its own partitions).
Afterwards, whatever happened: every rollout's training record is published once, every turn
written once, no resource mutation applied twice, and the outcomes are those of an uninterrupted run.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from rollout_journal.journal.open import open_backend
from rollout_journal.journal.results import ResultsDecoder
from rollout_journal.participants.workload.config import WorkloadConfig
from rollout_journal.participants.workload.specs import workload_specs
from rollout_journal.replay.exit_codes import EXIT_INPUT, EXIT_OK, EXIT_WRITER_TAKEN
from tests.support.fleet_support import (
    audit_journal,
    child_environment,
    start_worker,
    wait_for,
    workload_done,
    workload_yaml,
)
from tests.support.paths import REPO_ROOT
from tests.support.recovery_support import assert_no_mutation_applied_twice, reference_outcomes

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(900)]

ROUNDS = 3


def race_workload(url: str) -> WorkloadConfig:
    return WorkloadConfig(
        name="race",
        groups=2,
        siblings=2,
        max_turns=4,
        environment="workplace,counter",
        seed=11,
        allow_early_submit=False,
        turn_delay_ms=300,
        snapshot_every_turns=2,
        journal=url,
    )


def cli(args: list[str], out_dir: Path, name: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "rollout_journal.replay.cli.main", *args, "--progress-lines"],
        cwd=REPO_ROOT,
        env=child_environment(),
        stdout=(out_dir / f"{name}.out").open("w"),
        stderr=(out_dir / f"{name}.err").open("w"),
        stdin=subprocess.DEVNULL,
    )


def training_records(url: str) -> Counter:
    """Rollout -> TrainingRecords on the results topic."""
    backend = open_backend(url, read_only=True)
    decoder = ResultsDecoder()
    found: Counter = Counter()
    try:
        for partition in range(backend.partitions):
            for stored in backend.read_results(partition):
                published = decoder.add(stored)
                if published is not None:
                    found[published.record.rollout_id] += 1
    finally:
        backend.close()
    assert not decoder.errors, decoder.errors
    return found


def assert_one_writer_held(config: WorkloadConfig, reference: dict, names: list[str], codes: dict[str, int], out: Path):
    for name in names:
        err = (out / f"{name}.err").read_text()
        assert codes[name] in (EXIT_OK, EXIT_INPUT, EXIT_WRITER_TAKEN), f"{name} exited {codes[name]}:\n{err}"
        if codes[name] != EXIT_OK:
            lines = err.rstrip("\n").splitlines()
            assert len(lines) == 1 and lines[0].startswith("rollout-journal: "), f"{name}:\n{err}"
    ids = {s.rollout_id for s in workload_specs(config)}
    records = training_records(config.journal)
    assert set(records) == ids and set(records.values()) == {1}, f"training records per rollout: {dict(records)}"
    audit = audit_journal(config.journal, config)
    assert audit.outcomes == reference, "a rollout differs from the uninterrupted run"
    twice = sorted(turn for turn, count in audit.turns_written.items() if count > 1)
    assert not twice, f"turns written twice: {twice}"
    assert not audit.fenced and not audit.by_writer_after_takeover
    assert_no_mutation_applied_twice(config)


@pytest.fixture
def namespace_url(kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)

    def fresh() -> str:
        return f"kafka://{kafka_bootstrap}/race{uuid.uuid4().hex[:8]}?partitions=4"

    return fresh


@pytest.mark.parametrize(
    "first, second",
    [
        (["resume", "--writer", "a"], ["resume", "--writer", "b"]),
        (["run", "--writer", "a"], ["resume", "--writer", "b"]),
    ],
    ids=["two-resumes", "run-and-resume"],
)
def test_two_slots_racing_on_one_namespace_never_write_a_rollout_twice(
    first: list[str], second: list[str], namespace_url, tmp_path: Path
) -> None:
    reference: dict | None = None
    for round_ in range(ROUNDS):
        config = race_workload(namespace_url())
        reference = reference if reference is not None else reference_outcomes(config)
        path = workload_yaml(
            tmp_path / f"race{round_}.yaml", **config.model_dump(mode="json") | {"journal": config.journal}
        )
        out = tmp_path / f"round{round_}"
        out.mkdir()
        procs = {"first": cli([first[0], str(path), *first[1:]], out, "first")}
        time.sleep(random.uniform(0.0, 0.5))
        procs["second"] = cli([second[0], str(path), *second[1:]], out, "second")
        codes = {name: proc.wait(600) for name, proc in procs.items()}
        assert EXIT_OK in codes.values(), {n: (out / f"{n}.err").read_text() for n in procs}
        for name, code in codes.items():
            if code == EXIT_WRITER_TAKEN:
                line = (out / f"{name}.err").read_text()
                assert "is held by" in line and "--writer" in line, line
        assert_one_writer_held(config, reference, list(procs), codes, out)


def test_a_run_beside_a_fleet_is_refused_or_drives_its_own_partitions(namespace_url, tmp_path: Path) -> None:
    reference: dict | None = None
    for round_ in range(ROUNDS):
        config = race_workload(namespace_url())
        reference = reference if reference is not None else reference_outcomes(config)
        out = tmp_path / f"round{round_}"
        out.mkdir()
        code = fleet_round(config, out, race_the_start=round_ == 0)
        assert_one_writer_held(config, reference, ["run"], {"run": code}, out)


def fleet_round(config: WorkloadConfig, out: Path, *, race_the_start: bool) -> int:
    """A worker, and a ``run`` started beside it (racing its start, or once it is in the group): the
    run's exit code, once the workload is done (submitted to the fleet if the run was refused)."""
    path = workload_yaml(out / "race.yaml", **config.model_dump(mode="json") | {"journal": config.journal})
    worker = start_worker(config.journal, "w0", out)
    try:
        if not race_the_start:
            wait_for(lambda: bool(worker.seen("worker-joined")), 240, "the worker to join", [worker])
            time.sleep(random.uniform(0.0, 3.0))
        code = cli(["run", str(path), "--writer", "a"], out, "run").wait(600)
        if code == EXIT_WRITER_TAKEN:
            line = (out / "run.err").read_text()
            assert "run by a fleet" in line and "w0" in line, line
            done = subprocess.run(  # refused before it wrote anything: the fleet's once submitted
                [sys.executable, "-m", "rollout_journal.replay.cli.main", "submit", str(path)],
                cwd=REPO_ROOT,
                env=child_environment(),
                capture_output=True,
                text=True,
            )
            assert done.returncode == EXIT_OK, done.stderr
        wait_for(lambda: workload_done(config.journal), 600, "every rollout to finish", [worker])
    finally:
        worker.signal(signal.SIGTERM)
        worker.process.wait(120)
    return code
