"""``rollout-journal``: the command line. A thin shell: parse, call one function, print."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Iterable

from journal.errors import (
    AbortableCommitError,
    ClusterUnreachableError,
    ConfigurationError,
    CorruptRecordError,
    FatalJournalError,
    FencedWriteError,
    JournalClosedError,
    JournalDamageError,
    NotInJournalError,
    ProducerFencedError,
    RolloutJournalError,
    UnstableReadError,
    WriterLockedError,
    writer_fenced,
)

DESCRIPTION = """\
Turn-level crash recovery for multi-turn agentic RL rollouts.

Every finished turn, resource mutation and model call is an Avro event in a
journal (a local directory by default, or kafka://host:port/namespace). A
crashed workload resumes each rollout at its last finished turn.

  rollout-journal demo                 crash a workload with SIGKILL, resume it, compare
  rollout-journal run examples/demo.yaml
  rollout-journal resume examples/demo.yaml
  rollout-journal list runs/journal    the rollouts a journal holds
  rollout-journal show runs/journal demo-g0-s0
  rollout-journal audit --journal runs/journal          every mutation; hash chains and signed heads
  rollout-journal verify --journal runs/journal         re-apply event-sourced mutations, compare digests
  rollout-journal replay report demo-g0-s0 --journal runs/journal --html report.html
  rollout-journal kafka up             a local Kafka broker from Maven jars (no Docker)

A fleet of workers on one Kafka namespace (see README, "Running a fleet"):
  rollout-journal submit examples/demo.yaml --journal kafka://host:port/ns
  rollout-journal worker --journal kafka://host:port/ns     (as many as you like, anywhere)
  rollout-journal status --journal kafka://host:port/ns --watch
"""

# Exit codes of run/resume/demo, most specific error first. One table serves the mapping
# and --help, so the two cannot drift apart.
EXIT_OK = 0
EXIT_ROLLOUTS_FAILED = 1
EXIT_USAGE = 2
EXIT_INPUT = 3
EXIT_TOPOLOGY_CHANGED = 4
EXIT_JOURNAL_DAMAGED = 5
EXIT_WRITER_TAKEN = 6
EXIT_JOURNAL_FAILED = 7
EXIT_OTHER = 8
EXIT_INTERRUPTED = 130


def _error_classes() -> list[tuple[tuple[type[BaseException], ...], int]]:
    # imported here: participants is loaded only by the commands that need it
    from participants.config import TopologyChangedError
    from participants.environments import UnknownEnvironmentError
    from participants.rollout_state import StateFoldError

    return [
        ((TopologyChangedError,), EXIT_TOPOLOGY_CHANGED),
        ((ConfigurationError, UnknownEnvironmentError, NotInJournalError), EXIT_INPUT),
        ((WriterLockedError, ProducerFencedError, FencedWriteError), EXIT_WRITER_TAKEN),
        ((CorruptRecordError, JournalDamageError, StateFoldError), EXIT_JOURNAL_DAMAGED),
        ((FatalJournalError, JournalClosedError, AbortableCommitError, UnstableReadError, ClusterUnreachableError,
          OSError), EXIT_JOURNAL_FAILED),
        ((RolloutJournalError,), EXIT_OTHER),
    ]


EXIT_CODES_HELP = f"""\
exit codes (run, resume, demo, submit, worker; an error of any command ends with one of 3-8):
  {EXIT_OK}    done
  {EXIT_ROLLOUTS_FAILED}    the workload ran, but some rollouts failed or were set aside (each named on
       stderr; the others finished); demo: the resumed run differs from the reference
  {EXIT_USAGE}    bad command line
  {EXIT_INPUT}    a workload file, journal location, name or setting was refused (nothing was created)
  {EXIT_TOPOLOGY_CHANGED}    resume refused: the model, sampling, environment or max_turns differ from
       the journal's (see resume --allow-topology-change)
  {EXIT_JOURNAL_DAMAGED}    the journal is damaged or unreadable where the command needs it
  {EXIT_WRITER_TAKEN}    another writer holds this journal or worker slot, or fenced this one
  {EXIT_JOURNAL_FAILED}    the journal failed while writing or reading (I/O error, broker unreachable,
       an open transaction held a restore back)
  {EXIT_OTHER}    any other rollout-journal error
  {EXIT_INTERRUPTED}  interrupted (Ctrl-C)
Errors are one line on stderr: rollout-journal: <what, naming the thing>.
"""


def exit_code_for(exc: BaseException) -> int:
    """The documented exit code of an error the command line reports in one line."""
    if writer_fenced(exc):  # also a journal stopped because its writer was fenced
        return EXIT_WRITER_TAKEN
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


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive number")
    return value


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="workload YAML (see examples/demo.yaml)")
    p.add_argument("--journal", help="override the config's journal: a directory or kafka://host:port/namespace")
    p.add_argument("--writer", help="worker slot name (Kafka transactional.id); default from the config")
    p.add_argument("--progress-lines", action="store_true",
                   help="print one machine-readable line per committed turn instead of a progress bar")
    p.add_argument("--json", action="store_true", help="print the run report as JSON")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout-journal", description=DESCRIPTION, epilog=EXIT_CODES_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run a workload from turn 0 (fails if the journal already holds it)",
                         epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_workload_args(run)
    resume = sub.add_parser("resume", help="continue a crashed workload: attempt N+1 of every unfinished rollout",
                            epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_workload_args(resume)
    resume.add_argument("--allow-topology-change", metavar="WHY",
                        help="resume although the model, sampling, environment or max_turns differ from what the "
                             "journal's unfinished rollouts ran with; WHY is recorded in each resumed attempt")

    demo = sub.add_parser("demo", help="SIGKILL a workload mid-run, resume it, show nothing finished was lost",
                          description="Runs examples/demo.yaml in a child process, kills it with SIGKILL once some "
                                      "turns are committed, resumes, prints per rollout what a restart from turn 1 "
                                      "would redo and what this restart redid, and checks the final tokens, resource "
                                      "states and rewards against an uninterrupted run.",
                          epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_argument("--journal", help="where to journal (default: a fresh directory under runs/; "
                                        "kafka://host:port/namespace for Kafka)")
    demo.add_argument("--seed", type=int, help="seed of the random crash point")
    demo.add_argument("--kill-after", type=_positive_int,
                      help="kill after this many committed turns instead of a random point")
    demo.add_argument("--json", action="store_true", help="print the report as JSON")

    submit = sub.add_parser("submit", help="record a workload in a Kafka namespace for a fleet of workers (once)",
                            description="Records the workload (its settings and every rollout id) in the namespace; "
                                        "workers started with `worker --journal` pick it up. Submitting the same "
                                        "workload again changes nothing; one of the same name with other settings "
                                        "is refused.",
                            epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    submit.add_argument("config", help="workload YAML (see examples/demo.yaml)")
    submit.add_argument("--journal", help="kafka://host:port/namespace (default: the config's journal)")
    submit.add_argument("--json", action="store_true", help="print what was recorded as JSON")
    worker = sub.add_parser("worker", help="join a fleet: drive the rollouts of the partitions Kafka assigns here",
                            description="Joins the namespace's consumer group <namespace>.workers. Kafka assigns "
                                        "this worker partitions; it restores their unfinished rollouts as new "
                                        "attempts and drives every submitted workload's rollouts there. SIGTERM "
                                        "or Ctrl-C: its rollouts stop at a turn boundary, their turns are made "
                                        "durable, and its partitions move to the other workers.",
                            epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    worker.add_argument("--journal", required=True, help="kafka://host:port/namespace")
    worker.add_argument("--name", help="this worker's name in `status` and in the events it writes "
                                       "(default: <host>-<pid>)")
    worker.add_argument("--instance-id", help="static group membership: restarted under the same id within the "
                                              "session timeout, the worker gets its partitions back without a "
                                              "rebalance (but leaving holds them for the session timeout)")
    worker.add_argument("--progress-lines", action="store_true",
                        help="print one machine-readable line per committed turn and per membership change")
    worker.add_argument("--json", action="store_true", help="print the worker's report as JSON when it stops")
    status = sub.add_parser("status", help="per rollout and per partition: owner, attempt, epoch, turns (reads only)")
    status.add_argument("--journal", required=True, help="kafka://host:port/namespace (or a journal directory)")
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    status.add_argument("--watch", nargs="?", type=float, const=2.0, metavar="SECONDS",
                        help="refresh every SECONDS (default 2) until every workload is done, or Ctrl-C")
    status.add_argument("--partitions-only", action="store_true", help="leave out the per-rollout table")

    listing = sub.add_parser("list", help="the rollouts a journal holds (reads only)")
    listing.add_argument("journal", help="a journal directory or kafka://host:port/namespace")
    show = sub.add_parser("show", help="one rollout turn by turn: conversation, model calls, mutations (reads only)")
    show.add_argument("journal", help="a journal directory or kafka://host:port/namespace")
    show.add_argument("rollout", help="rollout id (see `list`)")
    show.add_argument("--tokens", action="store_true", help="also print output token ids and logprobs")

    from . import audit, report_html, verify
    audit.add_command(sub)
    verify.add_command(sub)
    replay = sub.add_parser("replay", help="look back at a journal: report (reads only)")
    replay_sub = replay.add_subparsers(dest="replay_command", required=True, metavar="REPLAY_COMMAND")
    report_html.add_command(replay_sub)

    from compose.cli import register_kafka_commands
    register_kafka_commands(sub)
    return parser


def _workload(args: argparse.Namespace, resume: bool) -> int:
    from participants.config import WorkloadConfig

    # Validated before torch is imported or anything is created: bad input fails at once.
    config = WorkloadConfig.load(args.config, journal=args.journal, writer=args.writer)
    from participants.workload import run_workload

    total = config.groups * config.siblings * config.max_turns
    override = getattr(args, "allow_topology_change", None)
    if args.progress_lines:
        def on_turn(rollout_id: str, turn: int) -> None:
            print(f"turn-committed {rollout_id} {turn}", flush=True)
        report = run_workload(config, resume=resume, on_turn=on_turn, topology_override=override)
    else:
        from tqdm import tqdm
        with tqdm(total=total, unit="turn", desc=config.name, disable=None, file=sys.stderr) as bar:
            report = run_workload(config, resume=resume, on_turn=lambda rollout_id, turn: bar.update(),
                                  topology_override=override)
    summary = {
        "journal": config.journal,
        "rollouts": len(report.rollouts),
        "turns_run": report.turns_run,
        "turns_reused": sum(r.turns_committed_before for r in report.rollouts.values() if not r.restarted_from_zero),
        "results_offered_again": sum(r.reused_result for r in report.rollouts.values()),
        "restore_seconds": round(report.restore_seconds, 4),
        "run_seconds": round(report.run_seconds, 3),
        "mean_reward": mean_reward(report.outcomes().values()),
        "acknowledged": sum(r.acknowledged for r in report.rollouts.values()),
        "set_aside": report.set_aside,
        "failed": report.failed,
    }
    if args.json:
        print(json.dumps(summary | {"outcomes": report.outcomes()}, indent=2))
    elif not args.progress_lines:
        print(f"{'resumed' if resume else 'ran'} {summary['rollouts']} rollouts in {summary['run_seconds']} s: "
              f"{summary['turns_run']} turns run, {summary['turns_reused']} committed turns reused, "
              f"{summary['results_offered_again']} finished results offered again, "
              f"{summary['acknowledged']} already acknowledged; mean reward "
              + ("-" if summary["mean_reward"] is None else f"{summary['mean_reward']:.3f}")
              + f"; journal {config.journal}")
    for rollout_id, why in report.set_aside.items():
        print(f"rollout-journal: rollout {rollout_id} set aside (the others ran): {why}", file=sys.stderr)
    for rollout_id, why in report.failed.items():
        print(f"rollout-journal: rollout {rollout_id} failed (infrastructure, journaled; the others ran; "
              f"resume retries it): {why}", file=sys.stderr)
    return EXIT_ROLLOUTS_FAILED if report.set_aside or report.failed else EXIT_OK


def mean_reward(outcomes: Iterable[dict | None]) -> float | None:
    """Mean reward of the outcomes this run holds (None when it holds none: all acknowledged)."""
    rewards = [o["reward"] for o in outcomes if o is not None and o.get("reward") is not None]
    return sum(rewards) / len(rewards) if rewards else None


def _demo(args: argparse.Namespace) -> int:
    from participants.config import check_journal_location

    from .demo import format_table, run_demo

    if args.journal is not None:
        check_journal_location(args.journal)
    report = run_demo(args.journal, seed=args.seed, kill_after=args.kill_after,
                      say=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps(report.as_json(), indent=2) if args.json else format_table(report))
    good = report.identical_to_uninterrupted and report.as_json()["turns_thrown_away"] == 0
    return EXIT_OK if good else EXIT_ROLLOUTS_FAILED


def _submit(args: argparse.Namespace) -> int:
    from participants.config import WorkloadConfig

    config = WorkloadConfig.load(args.config, journal=args.journal)  # validated before anything is created
    from participants.worker import submit_workload

    registration, new = submit_workload(config, config.journal)
    if args.json:
        print(json.dumps({"journal": config.journal, "workload": registration.name, "submitted": new,
                          "rollouts": len(registration.rollout_ids), "topology": registration.topology}, indent=2))
    elif new:
        print(f"submitted workload {registration.name} ({len(registration.rollout_ids)} rollouts) to {config.journal}; "
              f"start workers with: rollout-journal worker --journal {config.journal}")
    else:
        print(f"workload {registration.name} was already submitted to {config.journal} with these settings; "
              "nothing changed")
    return EXIT_OK


def _worker(args: argparse.Namespace) -> int:
    import asyncio
    import signal

    from participants.config import check_journal_location

    check_journal_location(args.journal)
    from participants.worker import FleetWorker

    def on_turn(rollout_id: str, turn: int) -> None:
        if args.progress_lines:
            print(f"turn-committed {rollout_id} {turn}", flush=True)

    def on_event(line: str) -> None:
        if args.progress_lines:
            print(line, flush=True)
        else:
            print(f"rollout-journal worker: {line}", file=sys.stderr, flush=True)

    worker = FleetWorker(args.journal, name=args.name, instance_id=args.instance_id, on_turn=on_turn,
                         on_event=on_event)

    async def until_stopped():
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):  # both mean: hand the partitions on cleanly
            loop.add_signal_handler(sig, stop.set)
        return await worker.run(stop)

    report = asyncio.run(until_stopped())
    summary = {"worker": report.name, "journal": args.journal, "seconds": round(report.seconds, 3),
               "turns_run": report.turns_run, "finished_here": report.finished_here,
               "partitions_taken": report.partitions_taken, "partitions_released": report.partitions_released,
               "partitions_lost": report.partitions_lost, "dropped": report.dropped,
               "set_aside": {rid: why for r in report.workloads.values() for rid, why in r.set_aside.items()}}
    if args.json and args.progress_lines:  # a line like the others
        print(f"worker-report {json.dumps(summary)}", flush=True)
    elif args.json:
        print(json.dumps(summary, indent=2))
    elif not args.progress_lines:
        print(f"worker {report.name} stopped after {summary['seconds']} s: {report.turns_run} turns run, "
              f"{report.finished_here} rollouts finished here, {report.partitions_taken} partitions taken, "
              f"{report.partitions_released} handed on, {report.partitions_lost} lost, "
              f"{len(report.dropped)} rollouts dropped to their new owners")
    for rollout_id, why in summary["set_aside"].items():
        print(f"rollout-journal: rollout {rollout_id} set aside (the others ran): {why}", file=sys.stderr)
    return EXIT_ROLLOUTS_FAILED if summary["set_aside"] else EXIT_OK


def _status(args: argparse.Namespace) -> int:
    import time

    from participants.config import check_journal_location

    from .status import fleet_status, format_status

    check_journal_location(args.journal)
    while True:
        status = fleet_status(args.journal)
        if args.json:
            print(json.dumps(status.as_json(), indent=None if args.watch else 2), flush=True)
        else:
            if args.watch and sys.stdout.isatty():
                print("\033[H\033[2J", end="")  # a refreshing view: clear the screen first
            print("\n".join(format_status(status, rollouts=not args.partitions_only)), flush=True)
        if not args.watch or status.done:
            return EXIT_OK
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:  # the usual way to leave --watch
            return EXIT_OK


def _inspect(args: argparse.Namespace) -> int:
    from journal.journal import ReadReport
    from journal.open import open_journal
    from participants.tokenizer import default_tokenizer

    from .inspect import list_rollouts, show_rollout

    with open_journal(args.journal, writer="inspect", read_only=True) as journal:
        if args.command == "list":
            listing = list_rollouts(journal)
            print(f"{'rollout':<24} {'group':<18} {'attempts':>8} {'turns':>6} {'calls':>6} {'mutations':>9}  status")
            for row in listing.rollouts.values():
                status = ("acknowledged" if row.acknowledged else "finished") if row.finished else "running"
                if row.rollout_id in listing.damaged:
                    status = "damaged"
                reward = f" reward {row.reward:.3f}" if row.reward is not None else ""
                print(f"{row.rollout_id:<24} {row.group_id:<18} {row.attempt:>8} {row.next_turn:>6} "
                      f"{row.model_calls:>6} {row.mutation_count:>9}  {status}{reward}")
            for rollout_id, why in listing.damaged.items():
                print(f"note: rollout {rollout_id} is damaged: {why}", file=sys.stderr)
            problems = listing.report
        else:
            problems = ReadReport()
            try:
                for line in show_rollout(journal, args.rollout, default_tokenizer(), token_ids=args.tokens,
                                         report=problems):
                    print(line)
            except KeyError as exc:
                raise NotInJournalError(exc.args[0]) from None
    for problem in [*problems.errors, *problems.fenced]:
        print(f"note: {problem}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command in ("run", "resume"):
            return _workload(args, resume=args.command == "resume")
        if args.command == "demo":
            return _demo(args)
        if args.command in ("list", "show"):
            return _inspect(args)
        if args.command == "submit":
            return _submit(args)
        if args.command == "worker":
            return _worker(args)
        if args.command == "status":
            return _status(args)
        if args.command == "audit":
            from . import audit
            return audit.run_command(args)
        if args.command == "verify":
            from . import verify
            return verify.run_command(args)
        if args.command == "replay" and args.replay_command == "report":
            from . import report_html
            return report_html.run_command(args)
        if args.command == "kafka":
            from compose.cli import run_kafka_command
            return run_kafka_command(args)
    except BrokenPipeError:  # `rollout-journal show ... | head`: the reader left, nothing is wrong
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except (RolloutJournalError, OSError) as exc:
        print(f"rollout-journal: {one_line(exc)}", file=sys.stderr)
        return exit_code_for(exc)
    except KeyboardInterrupt:
        print("rollout-journal: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
