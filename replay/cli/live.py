"""The live commands: ``run``, ``resume``, ``demo``, ``submit``, ``worker``, ``serve-resources``
and ``kafka``, which run rollouts (or the servers and brokers they need). The command line
imports this module only when one of them runs; the offline commands (``rollout_journal.replay.cli.offline``)
never load what runs a rollout."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shlex
import sys
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from rollout_journal.journal.errors import ConfigurationError, RolloutJournalError
from rollout_journal.replay.cli.logs import EVENTS
from rollout_journal.replay.cli.options import JOURNAL_ENV, journal_location
from rollout_journal.replay.exit_codes import EXIT_OK, EXIT_ROLLOUTS_FAILED, EXIT_USAGE

if TYPE_CHECKING:
    from rollout_journal.participants.workload.config import WorkloadConfig
    from rollout_journal.participants.workload.worker import WorkerReport


def run(args: argparse.Namespace) -> int:
    return workload(args, resume=False)


def resume(args: argparse.Namespace) -> int:
    return workload(args, resume=True)


def with_default_journal(config: WorkloadConfig) -> WorkloadConfig:
    """``config``, journaled at ``$ROLLOUT_JOURNAL_URL`` when neither its file nor ``--journal`` named one."""
    location = os.environ.get(JOURNAL_ENV)
    if "journal" in config.model_fields_set or not location:
        return config
    from rollout_journal.participants.workload.config import check_journal_location

    return config.model_copy(update={"journal": check_journal_location(location)})


def registered_config(location: str, name: str | None, *, writer: str | None = None) -> WorkloadConfig:
    """The config of the workload the journal at ``location`` registered (``name``: which, where it
    holds several), journaled there: what ``resume`` continues without a YAML."""
    from rollout_journal.participants.workload.config import WorkloadConfig, check_journal_location
    from rollout_journal.participants.workload.specs import Fork
    from rollout_journal.replay.source import open_replay

    check_journal_location(location)
    with open_replay(location) as source:
        registrations = source.registrations()
    recorded: dict[str, str] = {}
    for registration in registrations.values():
        fork = Fork.from_registration(registration)
        if fork is None:
            recorded[registration.name] = registration.spec_json
        elif fork.workload_config:  # a journal of forks (fork --journal-out) knows its origin's workload
            recorded.setdefault(fork.workload, fork.workload_config)
    if not recorded:
        raise ConfigurationError(
            f"journal {location} holds no workload registration to resume; name the workload's YAML: "
            f"rollout-journal resume CONFIG --journal {shlex.quote(location)}"
        )
    if name is None and len(recorded) > 1:
        raise ConfigurationError(
            f"journal {location} holds workloads {', '.join(sorted(recorded))}: name one with --workload NAME"
        )
    name = name or next(iter(recorded))
    if name not in recorded:
        raise ConfigurationError(
            f"journal {location} holds no workload {name!r} (it holds {', '.join(sorted(recorded))})"
        )
    settings = json.loads(recorded[name]) | {"journal": location}
    if writer is not None:
        settings["writer"] = writer
    try:
        return WorkloadConfig.model_validate(settings)
    except ValidationError as exc:
        from rollout_journal.participants.workload.config import validation_problems

        raise ConfigurationError(
            f"journal {location}: workload {name!r} as registered: {validation_problems(exc)}"
        ) from None


log = logging.getLogger("rollout_journal.cli")

# The fields of a fleet worker's membership events (``--progress-lines`` prints them as they come).
EVENT_FIELDS: dict[str, tuple[str, ...]] = {
    "worker-joined": ("worker", "group"),
    "worker-left": ("worker",),
    "workload-picked-up": ("workload", "rollouts"),
    "partitions-assigned": ("partitions",),
    "partitions-revoked": ("partitions",),
    "partitions-lost": ("partitions",),
    "rollouts-admitted": ("workload", "partition", "rollouts"),
    "rollouts-dropped": ("rollouts",),
    "takeover-seconds": ("partitions", "read_seconds", "restore_seconds"),
    "restore-held-back": ("topic", "partition"),
    "result-published": ("rollout",),  # its training record is durable on <namespace>.results
    "acknowledged": ("rollout",),  # an acknowledgement from <namespace>.acks applied by this owner
    "metrics-serving": ("port",),  # --metrics-port: Prometheus scrapes http://<host>:<port>/metrics
}


def worker_event(line: str) -> tuple[str, dict[str, str]]:
    """A worker event line (``takeover-seconds 0,3 1.176 3.334``) as a message and named fields
    (``takeover``, ``partitions=0,3 read_seconds=1.176 restore_seconds=3.334``)."""
    kind, *values = line.split()
    names = EVENT_FIELDS.get(kind, ())
    fields = dict(zip(names, values))
    if len(values) > len(names):
        fields["detail"] = " ".join(values[len(names) :])
    return kind.removesuffix("-seconds").replace("-", " "), fields


def kafka(args: argparse.Namespace) -> int:
    from rollout_journal.compose.broker.daemon import ClusterConflictError
    from rollout_journal.compose.cli import indent_details, run_kafka_command
    from rollout_journal.compose.errors import LocalBrokerError
    from rollout_journal.replay.exit_codes import EXIT_INPUT, EXIT_JOURNAL_FAILED, exit_code_for

    try:
        return run_kafka_command(args)
    except (LocalBrokerError, RolloutJournalError) as exc:
        print(f"kafka {args.kafka_command}: error: {indent_details(str(exc))}", file=sys.stderr)
        if isinstance(exc, RolloutJournalError):
            return exit_code_for(exc)
        # the documented codes: a cluster other than the running one was asked for (nothing
        # started) is 3, a refused setting; one that is not there or did not start is 7
        return EXIT_INPUT if isinstance(exc, ClusterConflictError) else EXIT_JOURNAL_FAILED


def serve_resources(args: argparse.Namespace) -> int:
    from rollout_journal.participants.environments import environment_class
    from rollout_journal.participants.remote.protocol import ServiceToken
    from rollout_journal.participants.remote.server import serve_resources

    environment_class(args.environment)  # an unknown or broken environment is refused before the port opens
    token = ServiceToken.from_environment("serve-resources")
    serve_resources(
        args.environment,
        host=args.host,
        port=args.port,
        token=token,
        faults=args.fault_injection,
        ready=lambda url: print(f"serving {args.environment} at {url}", flush=True),
    )
    return EXIT_OK


def workload(args: argparse.Namespace, resume: bool) -> int:
    from rollout_journal.participants.workload.config import WorkloadConfig

    if args.crash_delay and not args.crash_after:
        print("rollout-journal: --crash-delay needs --crash-after (the turn it counts from)", file=sys.stderr)
        return EXIT_USAGE
    # Validated before torch is imported or anything is created: bad input fails at once.
    if args.config is None:  # resume: the journal's own registration says what the workload is
        config = registered_config(journal_location(args), args.workload, writer=args.writer)
    else:
        config = with_default_journal(WorkloadConfig.load(args.config, journal=args.journal, writer=args.writer))
    from rollout_journal.participants.workload.run import run_workload
    from rollout_journal.replay.cli.crash import PROGRESS_LINE, SelfKill

    started = time.perf_counter()
    total = config.groups * config.siblings * config.max_turns
    log.info(
        "resuming workload" if resume else "running workload",
        extra={"fields": {"workload": config.name, "journal": config.journal, "turns": total}},
    )
    override = getattr(args, "allow_topology_change", None)
    crash = SelfKill(args.crash_after, args.crash_delay) if args.crash_after else None
    with contextlib.ExitStack() as stack:
        if args.progress_lines:

            def show(rollout_id: str, turn: int) -> None:
                print(f"{PROGRESS_LINE} {rollout_id} {turn}", flush=True)
        else:
            from tqdm import tqdm

            bar = stack.enter_context(tqdm(total=total, unit="turn", desc=config.name, disable=None, file=sys.stderr))

            def show(rollout_id: str, turn: int) -> None:
                bar.update()

        on_turn = show if crash is None else crash.counting(show)
        report = run_workload(config, resume=resume, on_turn=on_turn, topology_override=override)
    seconds = time.perf_counter() - started  # what the progress bar showed: loading the model and restoring too
    if crash is not None:
        print(f"rollout-journal: --crash-after {args.crash_after}: {crash.disarm()}", file=sys.stderr)
    summary = {
        "journal": config.journal,
        "rollouts": len(report.rollouts),
        "turns_run": report.turns_run,
        "turns_reused": sum(r.turns_committed_before for r in report.rollouts.values() if not r.restarted_from_zero),
        "results_offered_again": sum(r.reused_result for r in report.rollouts.values()),
        "seconds": round(seconds, 3),
        "restore_seconds": round(report.restore_seconds, 4),
        "run_seconds": round(report.run_seconds, 3),
        "mean_reward": mean_reward(report.outcomes().values()),
        "acknowledged": sum(r.acknowledged for r in report.rollouts.values()),
        "set_aside": report.set_aside,
        "failed": report.failed,
        "given_up": report.given_up,
    }
    log.info("workload done", extra={"fields": {k: v for k, v in summary.items() if not isinstance(v, dict)}})
    if args.json:
        print(json.dumps(summary | {"outcomes": report.outcomes()}, indent=2))
    elif not args.progress_lines:
        print(
            f"{'resumed' if resume else 'ran'} {summary['rollouts']} rollouts in {summary['seconds']} s "
            f"({summary['run_seconds']} s driving them): "
            f"{summary['turns_run']} turns run, {summary['turns_reused']} committed turns reused, "
            f"{summary['results_offered_again']} finished results offered again, "
            f"{summary['acknowledged']} already acknowledged; mean reward "
            + ("-" if summary["mean_reward"] is None else f"{summary['mean_reward']:.3f}")
            + f"; journal {config.journal}"
        )
    for rollout_id, why in report.set_aside.items():
        print(f"rollout-journal: rollout {rollout_id} set aside (the others ran): {why}", file=sys.stderr)
    for rollout_id, why in report.failed.items():
        print(
            f"rollout-journal: rollout {rollout_id} failed (infrastructure, journaled; the others ran; "
            f"resume retries it): {why}",
            file=sys.stderr,
        )
    for rollout_id, why in report.given_up.items():
        print(
            f"rollout-journal: rollout {rollout_id} given up: its infrastructure failures reached "
            f"failure_policy.max_failures ({config.failure_policy.max_failures}; journaled; the others ran; "
            f"its group: {config.failure_policy.group}); the last: {why}",
            file=sys.stderr,
        )
    return EXIT_ROLLOUTS_FAILED if report.set_aside or report.failed or report.given_up else EXIT_OK


def mean_reward(outcomes: Iterable[dict[str, Any] | None]) -> float | None:
    """Mean reward of the outcomes this run holds (None when it holds none: all acknowledged)."""
    rewards = [o["reward"] for o in outcomes if o is not None and o.get("reward") is not None]
    return sum(rewards) / len(rewards) if rewards else None


def demo(args: argparse.Namespace) -> int:
    from rollout_journal.participants.workload.config import check_journal_location
    from rollout_journal.replay.cli.demo import format_table, run_demo

    if args.journal is not None:
        check_journal_location(args.journal)
    report = run_demo(
        args.journal,
        seed=args.seed,
        kill_after=args.kill_after,
        say=lambda line: print(line, file=sys.stderr, flush=True),
    )
    print(json.dumps(report.as_json(), indent=2) if args.json else format_table(report))
    good = report.identical_to_uninterrupted and report.as_json()["turns_thrown_away"] == 0
    return EXIT_OK if good else EXIT_ROLLOUTS_FAILED


def submit(args: argparse.Namespace) -> int:
    from rollout_journal.participants.workload.config import WorkloadConfig

    # validated before anything is created
    config = with_default_journal(WorkloadConfig.load(args.config, journal=args.journal))
    from rollout_journal.participants.workload.worker import submit_workload

    registration, new = submit_workload(config, config.journal)
    if args.json:
        print(
            json.dumps(
                {
                    "journal": config.journal,
                    "workload": registration.name,
                    "submitted": new,
                    "rollouts": len(registration.rollout_ids),
                    "topology": registration.topology,
                },
                indent=2,
            )
        )
    elif new:
        print(
            f"submitted workload {registration.name} ({len(registration.rollout_ids)} rollouts) to {config.journal}; "
            f"start workers with: rollout-journal worker --journal {shlex.quote(config.journal)}"
        )
    else:
        print(
            f"workload {registration.name} was already submitted to {config.journal} with these settings; "
            "nothing changed"
        )
    return EXIT_OK


def worker(args: argparse.Namespace) -> int:
    import asyncio
    import signal

    from rollout_journal.participants.workload.config import check_journal_location

    args.journal = check_journal_location(journal_location(args))
    from rollout_journal.participants.workload.worker import FleetWorker
    from rollout_journal.replay.cli.crash import PROGRESS_LINE

    def on_turn(rollout_id: str, turn: int) -> None:
        if args.progress_lines:
            print(f"{PROGRESS_LINE} {rollout_id} {turn}", flush=True)

    def on_event(line: str) -> None:
        if args.progress_lines:
            print(line, flush=True)
        else:
            what, fields = worker_event(line)
            logging.getLogger(EVENTS).info(what, extra={"fields": fields})

    worker = FleetWorker(
        args.journal,
        name=args.name,
        instance_id=args.instance_id,
        on_turn=on_turn,
        on_event=on_event,
        metrics_port=args.metrics_port,
        commit_interval_ms=args.commit_interval_ms,
        acknowledgement_bucket_size=args.acknowledgement_bucket_size,
        **({} if args.snapshot_block_bytes is None else {"snapshot_block_bytes": args.snapshot_block_bytes}),
    )

    async def until_stopped() -> WorkerReport:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):  # both mean: hand the partitions on cleanly
            loop.add_signal_handler(sig, stop.set)
        return await worker.run(stop)

    report = asyncio.run(until_stopped())
    summary = {
        "worker": report.name,
        "journal": args.journal,
        "seconds": round(report.seconds, 3),
        "turns_run": report.turns_run,
        "finished_here": report.finished_here,
        "partitions_taken": report.partitions_taken,
        "partitions_released": report.partitions_released,
        "partitions_lost": report.partitions_lost,
        "dropped": report.dropped,
        "set_aside": {rid: why for r in report.workloads.values() for rid, why in r.set_aside.items()},
        "given_up": {rid: why for r in report.workloads.values() for rid, why in r.given_up.items()},
    }
    if args.json and args.progress_lines:  # a line like the others
        print(f"worker-report {json.dumps(summary)}", flush=True)
    elif args.json:
        print(json.dumps(summary, indent=2))
    elif not args.progress_lines:
        print(
            f"worker {report.name} stopped after {summary['seconds']} s: {report.turns_run} turns run, "
            f"{report.finished_here} rollouts finished here, {report.partitions_taken} partitions taken, "
            f"{report.partitions_released} handed on, {report.partitions_lost} lost, "
            f"{len(report.dropped)} rollouts dropped to their new owners"
        )
    for rollout_id, why in summary["set_aside"].items():
        print(f"rollout-journal: rollout {rollout_id} set aside (the others ran): {why}", file=sys.stderr)
    return EXIT_ROLLOUTS_FAILED if summary["set_aside"] else EXIT_OK
