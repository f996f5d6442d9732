"""Faults under a transactional writer: a partition leader SIGKILLed on a real 3-broker
cluster, and real processes racing on one writer slot.

What must hold afterwards: every batch whose ``commit`` returned is readable in
full; no batch is partly visible; no record appears twice, even for a batch that
was redone after an ambiguous failure.

How the writer redoes a batch (the policy a rollout worker follows):

- ``AbortableCommitError``: the transaction was aborted, nothing is visible:
  redo the same batch on the same backend;
- ``FatalJournalError`` (incl. ``ProducerFencedError``): the outcome of the open
  commit may be unknown (a fatal error during ``commit_transaction``). Open a new
  backend with the same ``transactional.id``: its ``init_transactions`` completes
  or aborts the previous producer's transaction, so afterwards a read_committed
  read shows whether the batch landed. Redo it only if it did not.

Retriable errors (leader elections, a coordinator moving, request timeouts) are
retried inside the backend, ``commit_transaction`` included, and never reach the
writer.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from journal.backend import OutRecord, Stream, partition_for
from journal.errors import AbortableCommitError, FatalJournalError, JournalError
from journal.kafka_backend import KafkaBackend
from journal.kafka_config import KafkaSettings
from replay.exit_codes import EXIT_WRITER_TAKEN as EXIT_FENCED

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(300)]

log = logging.getLogger(__name__)

ROLLOUTS = [f"rollout-{i}" for i in range(6)]
RECORDS_PER_BATCH = 4


@dataclass
class WriterLog:
    committed: list[int] = field(default_factory=list)  # batch ids whose commit returned
    committed_at: list[float] = field(default_factory=list)
    found_after_fatal: list[int] = field(default_factory=list)  # ambiguous commits that had landed
    abortable: int = 0
    fatal: int = 0
    errors: list[str] = field(default_factory=list)
    failure: BaseException | None = None


def batch_records(batch: int) -> list[OutRecord]:
    """A few records on two rollouts; every record carries a globally unique sequence number."""
    out = []
    for i in range(RECORDS_PER_BATCH):
        rollout = ROLLOUTS[(batch + i % 2) % len(ROLLOUTS)]
        seq = batch * RECORDS_PER_BATCH + i
        out.append(OutRecord(Stream.EVENTS, rollout, json.dumps({"batch": batch, "seq": seq}).encode(), rollout))
    return out


def batch_landed(backend: KafkaBackend, batch: int) -> bool:
    partitions = {partition_for(r.partition_key, backend.partitions) for r in batch_records(batch)}
    return any(
        json.loads(r.value)["batch"] == batch for p in partitions for r in backend.read_events(p) if r.value
    )


def open_backend(settings: KafkaSettings, deadline: float) -> KafkaBackend:
    while True:
        try:
            return KafkaBackend(settings, create_topics=False)
        except JournalError as exc:
            if time.monotonic() > deadline:
                raise
            log.warning("reopening the writer failed (%s); retrying", exc)
            time.sleep(0.5)


def writer(settings: KafkaSettings, stop: threading.Event, out: WriterLog) -> None:
    try:
        backend = open_backend(settings, time.monotonic() + 60)
        batch = 0
        while not stop.is_set():
            records = batch_records(batch)
            while True:
                try:
                    backend.commit(records)
                    out.committed.append(batch)
                    out.committed_at.append(time.monotonic())
                    break
                except AbortableCommitError as exc:
                    out.abortable += 1
                    out.errors.append(f"batch {batch}: abortable: {exc}")
                except FatalJournalError as exc:
                    out.fatal += 1
                    out.errors.append(f"batch {batch}: fatal: {exc}")
                    backend.close()
                    backend = open_backend(settings, time.monotonic() + 60)  # fences the old producer
                    if batch_landed(backend, batch):
                        out.found_after_fatal.append(batch)
                        out.committed.append(batch)
                        out.committed_at.append(time.monotonic())
                        break
            batch += 1
            time.sleep(0.01)
        backend.close()
    except BaseException as exc:  # surfaced by the test thread
        out.failure = exc


def test_a_killed_partition_leader_loses_no_committed_batch_and_duplicates_none(kafka_cluster3) -> None:
    leader_kill_drill(kafka_cluster3)


def leader_kill_drill(cluster) -> None:
    """The drill on any 3-broker cluster with ``bootstrap_servers``, ``partition_leader``,
    ``kill_node`` and ``restart_node`` (the jar launcher's, or compose's in test_docker_path)."""
    settings = KafkaSettings(
        bootstrap_servers=cluster.bootstrap_servers, namespace="faults", partitions=3,
        replication_factor=3, min_insync_replicas=2, transactional_id="fault-writer-0",
        transaction_timeout_ms=30_000, operation_timeout_ms=30_000,
    )
    with KafkaBackend(settings, transactional=False):  # create the topics
        pass

    stop = threading.Event()
    out = WriterLog()
    thread = threading.Thread(target=writer, args=(settings, stop, out), name="journal-writer", daemon=True)
    thread.start()
    try:
        _wait_for(lambda: len(out.committed) >= 20 or out.failure is not None, 60, "the first 20 commits")
        victim_partition = partition_for(ROLLOUTS[0], settings.partitions)
        victim = cluster.partition_leader(settings.events_topic, victim_partition)
        assert victim is not None
        killed_at = time.monotonic()
        cluster.kill_node(victim)
        log.info("killed node %d, leader of %s[%d]", victim, settings.events_topic, victim_partition)

        # Keep appending with one broker down (2 in-sync replicas remain); the writer usually
        # commits again within seconds, once leadership and the transaction coordinator move.
        _wait_for(lambda: any(t > killed_at + 1 for t in out.committed_at) or out.failure is not None
                  or time.monotonic() > killed_at + 20, 30, "the outage window")
        restarted_at = time.monotonic()
        cluster.restart_node(victim)
        _wait_for(lambda: any(t > restarted_at for t in out.committed_at) or out.failure is not None,
                  90, "a commit after the restart")
    finally:
        stop.set()
        thread.join(90)
    assert not thread.is_alive(), "the writer did not stop"
    if out.failure is not None:
        raise out.failure

    during_outage = [t for t in out.committed_at if killed_at + 1 < t < restarted_at]
    after_kill = [t for t in out.committed_at if t > killed_at + 1]
    assert after_kill, f"no commit succeeded after node {victim} was killed; errors: {out.errors[-5:]}"

    with KafkaBackend(settings, transactional=False, create_topics=False) as reader:
        seen: dict[int, int] = {}
        batches: dict[int, set[int]] = {}
        for p in range(reader.partitions):
            for record in reader.read_events(p):
                assert record.error is None, record.error
                body = json.loads(record.value)
                seen[body["seq"]] = seen.get(body["seq"], 0) + 1
                batches.setdefault(body["batch"], set()).add(body["seq"])

    duplicated = sorted(seq for seq, count in seen.items() if count > 1)
    assert not duplicated, f"records written twice: {duplicated[:20]}"
    missing = [b for b in out.committed if b not in batches]
    assert not missing, f"batches whose commit returned are not readable: {missing[:20]}"
    partial = {b: sorted(s) for b, s in batches.items() if len(s) != RECORDS_PER_BATCH}
    assert not partial, f"batches only partly visible: {partial}"
    assert len(set(out.committed)) == len(out.committed)
    assert set(batches) == set(out.committed), "a batch is visible although its commit never returned"
    log.info(
        "fault run: %d batches committed (%d during the outage), %d abortable redos, %d fatal reopenings "
        "(%d of them had landed)", len(out.committed), len(during_outage), out.abortable, out.fatal,
        len(out.found_after_fatal),
    )


def _wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


# -- a fenced process stops, promptly and clearly --------------------------------------------------


# Paced so that no process can finish the workload while the race is on: 400 turns at 250 ms
# take 100 s or more, while five interpreters starting on a loaded 2-core machine can take
# many seconds (at 20 ms, 8 s). One that finished first would exit 0 unfenced: a second "survivor".
RACE_WORKLOAD = """\
name: race
groups: 2
siblings: 2
max_turns: 400
environment: counter
seed: 3
allow_early_submit: false
turn_delay_ms: 250
snapshot_every_turns: 2
journal: {journal}
writer: slot-0
"""


def _cli(args: list[str], out_dir: Path, name: str) -> subprocess.Popen:
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen(
        [sys.executable, "-m", "replay.cli", *args, "--progress-lines"], cwd=repo, env=env,
        stdout=(out_dir / f"{name}.out").open("w"), stderr=(out_dir / f"{name}.err").open("w"),
        stdin=subprocess.DEVNULL,
    )


def test_resumes_racing_on_one_slot_all_but_one_exit_fenced_with_one_line(
    kafka_bootstrap: str, kafka_namespace: str, tmp_path: Path
) -> None:
    """Real `rollout-journal` processes on one Kafka writer slot: each newer one fences the older.
    Every loser stops on its own with EXIT_FENCED and a one-line reason, never a traceback or a hang."""
    config = tmp_path / "race.yaml"
    config.write_text(RACE_WORKLOAD.format(journal=f"kafka://{kafka_bootstrap}/{kafka_namespace}"))
    procs = {"run": _cli(["run", str(config)], tmp_path, "run")}
    try:
        _wait_for(lambda: (tmp_path / "run.out").read_text().count("turn-committed") >= 8
                  or procs["run"].poll() is not None, 120, "the first run's turns")
        assert procs["run"].poll() is None, (tmp_path / "run.err").read_text()
        for i in range(4):
            procs[f"resume-{i}"] = _cli(["resume", str(config)], tmp_path, f"resume-{i}")
        # Only the newest producer of the slot may go on; every other process must end by itself.
        _wait_for(lambda: sum(p.poll() is None for p in procs.values()) <= 1, 240, "every fenced process to exit")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)
    survivors = [name for name, p in procs.items() if p.returncode in (0, -signal.SIGKILL)]
    losers = {name: p.returncode for name, p in procs.items() if name not in survivors}
    assert len(survivors) == 1, {name: p.returncode for name, p in procs.items()}
    assert len(losers) == 4
    for name, code in losers.items():
        err = (tmp_path / f"{name}.err").read_text()
        assert code == EXIT_FENCED, f"{name} exited {code}:\n{err}"
        lines = err.rstrip("\n").splitlines()
        assert len(lines) == 1, f"{name} said more than one line:\n{err}"  # no traceback, no log noise
        assert lines[0].startswith("rollout-journal: ") and "fenced" in lines[0] and f"{kafka_namespace}.slot-0" in lines[0]
