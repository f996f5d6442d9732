"""``rollout-journal``: the command line. A thin shell: parse, call one function, print."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
from collections.abc import Iterable

from journal.errors import RolloutJournalError

from .exit_codes import (
    EXIT_CODES_HELP,
    EXIT_INTERRUPTED,
    EXIT_JOURNAL_DAMAGED,
    EXIT_OK,
    EXIT_ROLLOUTS_FAILED,
    EXIT_USAGE,
    exit_code_for,
    one_line,
)
from .terminal import BarProgress, emit

DESCRIPTION = """\
Turn-level crash recovery for multi-turn agentic RL rollouts.

Every finished turn, resource mutation and model call is an Avro event in a
journal (a local directory by default, or kafka://host:port/namespace). A
crashed workload resumes each rollout at its last finished turn.

  rollout-journal demo                 crash a workload with SIGKILL, resume it, compare
  rollout-journal run examples/demo.yaml
  rollout-journal resume examples/demo.yaml
  rollout-journal replay list --journal runs/journal          the rollouts a journal holds
  rollout-journal replay show demo-g0-s0 --journal runs/journal   one rollout turn by turn
  rollout-journal replay state demo-g0-s0/mail --revision 2 --journal runs/journal
  rollout-journal replay report demo-g0-s0 --journal runs/journal --html report.html
  rollout-journal audit --journal runs/journal          every mutation; hash chains and signed heads
  rollout-journal verify --journal runs/journal         re-apply event-sourced mutations, compare digests
  rollout-journal export --journal kafka://host:9092/ns --out runs/copy
  rollout-journal export-training --journal runs/journal --out rollouts.pt
  rollout-journal fork demo-g0-s0 --at-turn 2 --journal runs/journal
  rollout-journal kafka up             a local Kafka broker from Maven jars (no Docker)
  rollout-journal serve-resources --environment workplace --port 8700
                                       a resource server: that environment's resources behind HTTP

A fleet of workers on one Kafka namespace (see README, "Running a fleet"):
  rollout-journal submit examples/demo.yaml --journal kafka://host:port/ns
  rollout-journal worker --journal kafka://host:port/ns     (as many as you like, anywhere)
  rollout-journal status --journal kafka://host:port/ns --watch
"""

# Exit codes of run/resume/demo, most specific error first. One table serves the mapping
# and --help, so the two cannot drift apart.


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive number")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds (0 or more)")
    return value


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="workload YAML (see examples/demo.yaml)")
    p.add_argument("--journal", help="override the config's journal: a directory or kafka://host:port/namespace")
    p.add_argument("--writer", help="worker slot name (Kafka transactional.id); default from the config")
    p.add_argument("--progress-lines", action="store_true",
                   help="print one machine-readable line per committed turn instead of a progress bar")
    p.add_argument("--json", action="store_true", help="print the run report as JSON")
    p.add_argument("--crash-after", type=_positive_int, metavar="N",
                   help="crash drill: SIGKILL this process once N turns are durable (what `demo` does to its "
                        "child), then try `resume`; with `resume`, N counts the turns this process makes durable")
    p.add_argument("--crash-delay", type=_seconds, default=0.0, metavar="SECONDS",
                   help="with --crash-after: kill this long after the Nth turn, wherever the workload then is")


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

    replay = add_replay_commands(sub)
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

    from . import audit, report_html, verify
    audit.add_command(sub)
    verify.add_command(sub)
    report_html.add_command(replay)

    serve = sub.add_parser(
        "serve-resources", help="serve one environment kind's resources over HTTP, for many rollouts",
        description="A resource server: hosts the environments of one kind (a built-in name, package.module:Class, "
                    "or an entry point of rollout_journal.environments) for every rollout whose workload names it "
                    "in resource_servers. Requests must carry the bearer token in ROLLOUT_JOURNAL_RESOURCE_TOKEN "
                    "(the same value for server and workers). Prints 'serving ENV at URL' once it listens; stops "
                    "on SIGINT or SIGTERM.")
    serve.add_argument("--environment", required=True, help="the environment kind to host")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8700, help="port (default 8700; 0 picks a free one)")
    serve.add_argument("--fault-injection", action="store_true",
                       help="accept POST /v1/faults (drills: make the next requests of a route fail)")

    from compose.cli import register_kafka_commands
    register_kafka_commands(sub)
    return parser


def _serve_resources(args: argparse.Namespace) -> int:
    from participants.environments import environment_class
    from participants.resource_protocol import ServiceToken
    from participants.resource_server import serve_resources

    environment_class(args.environment)  # an unknown or broken environment is refused before the port opens
    token = ServiceToken.from_environment("serve-resources")
    serve_resources(args.environment, host=args.host, port=args.port, token=token, faults=args.fault_injection,
                    ready=lambda url: print(f"serving {args.environment} at {url}", flush=True))
    return EXIT_OK


def _workload(args: argparse.Namespace, resume: bool) -> int:
    from participants.config import WorkloadConfig

    if args.crash_delay and not args.crash_after:
        print("rollout-journal: --crash-delay needs --crash-after (the turn it counts from)", file=sys.stderr)
        return EXIT_USAGE
    # Validated before torch is imported or anything is created: bad input fails at once.
    config = WorkloadConfig.load(args.config, journal=args.journal, writer=args.writer)
    from participants.workload import run_workload

    from .crash import PROGRESS_LINE, SelfKill

    total = config.groups * config.siblings * config.max_turns
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
    if crash is not None:
        print(f"rollout-journal: --crash-after {args.crash_after}: {crash.disarm()}", file=sys.stderr)
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

    from .crash import PROGRESS_LINE

    def on_turn(rollout_id: str, turn: int) -> None:
        if args.progress_lines:
            print(f"{PROGRESS_LINE} {rollout_id} {turn}", flush=True)

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


# -- replay commands: each parses its arguments, calls one library function, prints ---------------

def _journal_arguments(p: argparse.ArgumentParser, *, positional: bool = False) -> None:
    p.add_argument("--journal", metavar="PATH_OR_URL", help="a file journal directory or kafka://host:port/namespace")
    if positional:  # `list JOURNAL` / `show JOURNAL ROLLOUT`, as before --journal existed
        p.add_argument("journal_path", nargs="?", metavar="JOURNAL", help="the journal, as --journal")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def _source(args: argparse.Namespace):
    from .source import open_replay

    location = args.journal or getattr(args, "journal_path", None)
    if not location:
        raise RolloutJournalError("name the journal: --journal PATH_OR_URL (a directory or kafka://host:port/ns)")
    return open_replay(location)


def add_replay_commands(sub: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """``list``, ``show``, ``export``, ``export-training``, ``fork``, and ``replay list|show|state``;
    returns the ``replay`` group, for more of its commands. A command sets ``run`` (its handler:
    open the journal with ``_source``, call one library function, ``emit`` the result)."""
    replay = sub.add_parser("replay", help="look at a journal: list, show, state, report (reads only)").add_subparsers(
        dest="replay_command", required=True, metavar="COMMAND")
    for group in (sub, replay):
        p = group.add_parser("list", help="every rollout: group, status, attempts, turns, reward, policy versions")
        _journal_arguments(p, positional=True)
        p.add_argument("--status", action="append", choices=["running", "finished", "acknowledged", "damaged"],
                       help="only rollouts in this status (repeat for several)")
        p.add_argument("--group", help="only this prompt group")
        p.add_argument("--min-attempts", type=int, default=0, metavar="N", help="only rollouts with N attempts or more")
        p.add_argument("--crashed", action="store_true",
                       help="only rollouts a crash hit (an attempt superseded, or the last one unfinished)")
        p.add_argument("--jobs", type=_positive_int, metavar="N",
                       help="scan the partitions in N worker processes (default: one a CPU core and a partition "
                            "on a Kafka journal of 200,000 records or more, else 1); the rows are the same")
        p.set_defaults(run=_list)
        p = group.add_parser("show", help="one rollout turn by turn: attempts, crash points, calls, mutations")
        _journal_arguments(p, positional=True)
        p.add_argument("rollout", help="rollout id (see `list`)")
        p.add_argument("--turn", type=int, metavar="K", help="only turn K (every attempt's version), with token detail")
        p.add_argument("--tokens", action="store_true", help="token ids, logprobs and who made each token, every call")
        p.add_argument("--tokenizer", action="append", metavar="PATH",
                       help="tokenizer.json of a policy the built-in tokenizer did not write (checked if it can be)")
        p.add_argument("--no-decode", action="store_true", help="token ids only, no text")
        p.set_defaults(run=_show)
    p = replay.add_parser("state", help="a resource's state at a revision, rebuilt from the journal")
    _journal_arguments(p)
    p.add_argument("resource", help="resource id: <rollout>/<name>, e.g. demo-g0-s0/mail (see `show`)")
    p.add_argument("--revision", type=int, required=True, metavar="R")
    p.add_argument("--life", type=int, metavar="N", help="which life of a restart-only resource (default: the last)")
    p.set_defaults(run=_state)
    p = sub.add_parser("export", help="copy a journal (a Kafka namespace) into a file journal, verified")
    _journal_arguments(p)
    p.add_argument("--out", required=True, metavar="DIR", help="a new directory for the file journal")
    p.set_defaults(run=_export)
    p = sub.add_parser("export-training", help="torch tensors for a trainer: tokens, logprobs, loss mask, reward")
    _journal_arguments(p)
    p.add_argument("--out", required=True, metavar="FILE", help="where to torch.save them")
    p.add_argument("--unfinished", action="store_true", help="also rollouts that have not finished (reward NaN)")
    p.set_defaults(run=_export_training)
    p = sub.add_parser("fork", help="a new lineage of a rollout from the state after turn K; `resume` continues it")
    _journal_arguments(p)
    p.add_argument("rollout", help="rollout id to fork")
    p.add_argument("--at-turn", type=int, required=True, metavar="K", help="the fork keeps turns 0..K, runs K+1 on")
    p.add_argument("--seed", type=int, help="sample with this seed (default: the origin's turn seeds)")
    p.add_argument("--journal-out", metavar="PATH_OR_URL", help="write the fork there (default: --journal)")
    p.set_defaults(run=_fork)
    return replay


def _list(args: argparse.Namespace) -> int:
    from .listing import RolloutFilter, list_rollouts

    where = RolloutFilter(frozenset(args.status or ()), args.group, args.min_attempts, args.crashed)
    with _source(args) as source:
        return emit(list_rollouts(source, where, BarProgress("list"), jobs=args.jobs), as_json=args.json)


def _show(args: argparse.Namespace) -> int:
    from .timeline import build_timeline
    from .tokenizers import TokenizerCatalog

    catalog = None if args.no_decode else TokenizerCatalog(args.tokenizer)
    with _source(args) as source:
        timeline = build_timeline(source, args.rollout, catalog=catalog, turn=args.turn, progress=BarProgress("show"))
    return emit(timeline, as_json=args.json, lines=timeline.text(tokens=args.tokens))


def _state(args: argparse.Namespace) -> int:
    from .resource_state import resource_state

    with _source(args) as source:
        found = resource_state(source, args.resource, args.revision, life=args.life, progress=BarProgress("state"))
    return emit(found, as_json=args.json)


def _export(args: argparse.Namespace) -> int:
    from .export import export_journal

    with _source(args) as source:
        report = export_journal(source, args.out, progress=BarProgress("export"))
    code = emit(report, as_json=args.json)
    if not report.verified:
        print(f"rollout-journal: the copy at {args.out} does not match the source (see the counts and checksums above)",
              file=sys.stderr)
        return EXIT_JOURNAL_DAMAGED
    return code


def _export_training(args: argparse.Namespace) -> int:
    from .training import export_training

    with _source(args) as source:
        return emit(export_training(source, args.out, unfinished=args.unfinished,
                                    progress=BarProgress("export-training")), as_json=args.json)


def _fork(args: argparse.Namespace) -> int:
    from .fork import fork_rollout

    with _source(args) as source:
        return emit(fork_rollout(source, args.rollout, args.at_turn, seed=args.seed, journal_out=args.journal_out,
                                 progress=BarProgress("fork")), as_json=args.json)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command in ("run", "resume"):
            return _workload(args, resume=args.command == "resume")
        if args.command == "demo":
            return _demo(args)
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
        if hasattr(args, "run"):
            return args.run(args)
        if args.command == "kafka":
            from compose.cli import run_kafka_command
            return run_kafka_command(args)
        if args.command == "serve-resources":
            return _serve_resources(args)
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
