"""``rollout-journal``: the command line. A thin shell: parse, call one function, print."""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import os
import sys
from collections.abc import Callable
from importlib import import_module

from rollout_journal.journal.errors import RolloutJournalError
from rollout_journal.journal.extras import missing_extra
from rollout_journal.replay.exit_codes import (
    EXIT_CODES_HELP,
    EXIT_INTERRUPTED,
    EXIT_OK,
    exit_code_for,
    one_line,
)
from rollout_journal.replay.rollout_status import STATUSES

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
  rollout-journal replay report --journal runs/journal --html report/   every rollout, one page each
  rollout-journal audit --journal runs/journal          every mutation; hash chains and signed heads
  rollout-journal verify --journal runs/journal         re-apply event-sourced mutations, compare digests
  rollout-journal export --journal kafka://host:9092/ns --out runs/copy
  rollout-journal export-training --journal runs/journal --out rollouts.pt
  rollout-journal fork demo-g0-s0 --at-turn 2 --journal runs/journal
  rollout-journal kafka up             a local Kafka broker from Maven jars (no Docker)
  rollout-journal serve-resources --environment workplace --port 8700
                                       a resource server: that environment's resources behind HTTP
  rollout-journal gateway --upstream http://127.0.0.1:8000 --journal runs/gw --port 8100
                                       an OpenAI-compatible gateway journaling every call of any agent

A fleet of workers on one Kafka namespace (see README, "Running a fleet"):
  rollout-journal submit examples/demo.yaml --journal kafka://host:port/ns
  rollout-journal worker --journal kafka://host:port/ns     (as many as you like, anywhere)
  rollout-journal status --journal kafka://host:port/ns --watch
"""

# Exit codes of run/resume/demo, most specific error first. One table serves the mapping
# and --help, so the two cannot drift apart.


# Each command's handler, "module:function" of this package: live.py runs rollouts, offline.py reads
# journals. The replay group's commands name theirs with set_defaults(run=...).
COMMANDS = {
    "run": "live:run",
    "resume": "live:resume",
    "demo": "live:demo",
    "submit": "live:submit",
    "worker": "live:worker",
    "serve-resources": "live:serve_resources",
    "kafka": "live:kafka",
    "status": "offline:status",
    "audit": "offline:audit",
    "verify": "offline:verify",
}


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


def _add_workload_args(p: argparse.ArgumentParser, *, registered: bool = False) -> None:
    if registered:
        p.add_argument(
            "config",
            nargs="?",
            help="workload YAML (see examples/demo.yaml); default: the workload the journal registered (--workload "
            "names one where it holds several)",
        )
        p.add_argument("--workload", metavar="NAME", help="without a YAML: which registered workload to resume")
    else:
        p.add_argument("config", help="workload YAML (see examples/demo.yaml)")
    p.add_argument(
        "--journal",
        help="override the config's journal: a directory or kafka://host:port/namespace (without one in the "
        "config: $ROLLOUT_JOURNAL_URL, else runs/journal)",
    )
    p.add_argument("--writer", help="worker slot name (Kafka transactional.id); default from the config")
    p.add_argument(
        "--progress-lines",
        action="store_true",
        help="print one machine-readable line per committed turn instead of a progress bar",
    )
    p.add_argument("--json", action="store_true", help="print the run report as JSON")
    p.add_argument(
        "--crash-after",
        type=_positive_int,
        metavar="N",
        help="crash drill: SIGKILL this process once N turns are durable (what `demo` does to its "
        "child), then try `resume`; with `resume`, N counts the turns this process makes durable",
    )
    p.add_argument(
        "--crash-delay",
        type=_seconds,
        default=0.0,
        metavar="SECONDS",
        help="with --crash-after: kill this long after the Nth turn, wherever the workload then is",
    )


DISTRIBUTION = "rollout-journal"


def installed_version() -> str:
    """The version of the installed ``rollout-journal`` distribution (its metadata, not a constant
    kept by hand); "unknown" for code run from a source tree that was never installed."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollout-journal",
        description=DESCRIPTION,
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level (anywhere on the line)")
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {installed_version()}", help="print the version and exit"
    )
    parser.add_argument(
        "--log-format",
        choices=["text", "json"],
        default="text",
        help="text: logfmt lines (ts=... level=... logger=... msg=... and named fields); json: one object a line",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser(
        "run",
        help="run a workload from turn 0 (fails if the journal already holds it)",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_workload_args(run)
    resume = sub.add_parser(
        "resume",
        help="continue a crashed workload: attempt N+1 of every unfinished rollout",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_workload_args(resume, registered=True)
    resume.add_argument(
        "--allow-topology-change",
        metavar="WHY",
        help="resume although the model, sampling, environment or max_turns differ from what the "
        "journal's unfinished rollouts ran with; WHY is recorded in each resumed attempt",
    )

    demo = sub.add_parser(
        "demo",
        help="SIGKILL a workload mid-run, resume it, show nothing finished was lost",
        description="Runs examples/demo.yaml in a child process, kills it with SIGKILL once some "
        "turns are committed, resumes, prints per rollout what a restart from turn 1 "
        "would redo and what this restart redid, and checks the final tokens, resource "
        "states and rewards against an uninterrupted run.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument(
        "--journal",
        help="where to journal (default: a fresh directory under runs/; kafka://host:port/namespace for Kafka)",
    )
    demo.add_argument("--seed", type=int, help="seed of the random crash point")
    demo.add_argument(
        "--kill-after", type=_positive_int, help="kill after this many committed turns instead of a random point"
    )
    demo.add_argument("--json", action="store_true", help="print the report as JSON")

    replay = add_replay_commands(sub)
    submit = sub.add_parser(
        "submit",
        help="record a workload in a Kafka namespace for a fleet of workers (once)",
        description="Records the workload (its settings and every rollout id) in the namespace; "
        "workers started with `worker --journal` pick it up. Submitting the same "
        "workload again changes nothing; one of the same name with other settings "
        "is refused.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    submit.add_argument("config", help="workload YAML (see examples/demo.yaml)")
    submit.add_argument("--journal", help="kafka://host:port/namespace (default: the config's journal)")
    submit.add_argument("--json", action="store_true", help="print what was recorded as JSON")
    worker = sub.add_parser(
        "worker",
        help="join a fleet: drive the rollouts of the partitions Kafka assigns here",
        description="Joins the namespace's consumer group <namespace>.workers. Kafka assigns "
        "this worker partitions; it restores their unfinished rollouts as new "
        "attempts and drives every submitted workload's rollouts there. SIGTERM "
        "or Ctrl-C: its rollouts stop at a turn boundary, their turns are made "
        "durable, and its partitions move to the other workers.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    worker.add_argument("--journal", help="kafka://host:port/namespace (default: $ROLLOUT_JOURNAL_URL)")
    worker.add_argument(
        "--name", help="this worker's name in `status` and in the events it writes (default: <host>-<pid>)"
    )
    worker.add_argument(
        "--instance-id",
        help="static group membership: restarted under the same id within the "
        "session timeout, the worker gets its partitions back without a "
        "rebalance (but leaving holds them for the session timeout)",
    )
    worker.add_argument(
        "--progress-lines",
        action="store_true",
        help="print one machine-readable line per committed turn and per membership change",
    )
    worker.add_argument(
        "--metrics-port",
        type=int,
        metavar="N",
        help="serve Prometheus metrics at http://<host>:N/metrics (turns, commit latency, transactions, "
        "owned partitions, restores, rebalances, fenced appends; see docs/scaling.md); default: off",
    )
    worker.add_argument(
        "--commit-interval-ms",
        type=float,
        default=100.0,
        metavar="MS",
        help="the least time between two of the worker's commits, each one Kafka transaction over every "
        "partition it owns: transactions grow with time, not with turns (Kafka Streams' commit.interval.ms; "
        "0: commit as soon as a turn is waited for). Default: %(default)s",
    )
    worker.add_argument(
        "--acknowledgement-bucket-size",
        type=int,
        default=256,
        metavar="N",
        help="fold the fences of acknowledged rollouts into one snapshot-topic record per N of a partition, so "
        "a restore does not grow with history (0: never fold, while workers or tools of a version without "
        "these buckets still read the namespace: they would run a folded rollout again). Default: %(default)s",
    )
    worker.add_argument(
        "--snapshot-block-bytes",
        type=int,
        metavar="N",
        help="write a snapshot's growing parts (the head of tokens, the conversation) in blocks of N bytes, "
        "each once, so a long rollout's snapshots do not rewrite every token (0: no blocks, while workers or "
        "tools of a version without them still read the namespace: they could not read such a snapshot and "
        "would replay the rollout from its first event or set it aside). Default: 16384 (the journal's)",
    )
    worker.add_argument("--json", action="store_true", help="print the worker's report as JSON when it stops")
    status = sub.add_parser("status", help="per rollout and per partition: owner, attempt, epoch, turns (reads only)")
    status.add_argument(
        "--journal", help="kafka://host:port/namespace (or a journal directory; default: $ROLLOUT_JOURNAL_URL)"
    )
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    status.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        metavar="SECONDS",
        help="refresh every SECONDS (default 2) until every workload is done, or Ctrl-C",
    )
    status.add_argument("--partitions-only", action="store_true", help="leave out the per-rollout table")

    from rollout_journal.replay import audit, report_html, verify

    audit.add_command(sub)
    verify.add_command(sub)
    report_html.add_command(replay, _journal_arguments)
    replay.choices["report"].set_defaults(run="offline:report")

    serve = sub.add_parser(
        "serve-resources",
        help="serve one environment kind's resources over HTTP, for many rollouts",
        description="A resource server: hosts the environments of one kind (a built-in name, package.module:Class, "
        "or an entry point of rollout_journal.environments) for every rollout whose workload names it "
        "in resource_servers. Requests must carry the bearer token in ROLLOUT_JOURNAL_RESOURCE_TOKEN "
        "(the same value for server and workers). Prints 'serving ENV at URL' once it listens; stops "
        "on SIGINT or SIGTERM.",
    )
    serve.add_argument("--environment", required=True, help="the environment kind to host")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8700, help="port (default 8700; 0 picks a free one)")
    serve.add_argument(
        "--fault-injection",
        action="store_true",
        help="accept POST /v1/faults (drills: make the next requests of a route fail)",
    )

    from rollout_journal.replay.cli import gateway

    gateway.add_command(sub)

    from rollout_journal.compose.cli import register_kafka_commands

    register_kafka_commands(sub)
    return parser


# -- replay commands: each parses its arguments, calls one library function, prints ---------------


def _journal_arguments(p: argparse.ArgumentParser, *, positional: bool = False) -> None:
    from rollout_journal.replay.cli.options import add_journal_argument

    add_journal_argument(p)
    if positional:  # `list JOURNAL` / `show JOURNAL ROLLOUT`, as before --journal existed
        p.add_argument("journal_path", nargs="?", metavar="JOURNAL", help="the journal, as --journal")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def add_replay_commands(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse._SubParsersAction[argparse.ArgumentParser]:
    """``list``, ``show``, ``export``, ``export-training``, ``fork``, and ``replay list|show|state``;
    returns the ``replay`` group, for more of its commands. A command sets ``run`` (its handler:
    open the journal with ``_source``, call one library function, ``emit`` the result)."""
    replay: argparse._SubParsersAction[argparse.ArgumentParser] = sub.add_parser(
        "replay", help="look at a journal: list, show, state, report (reads only)"
    ).add_subparsers(dest="replay_command", required=True, metavar="COMMAND")
    for group in (sub, replay):
        p = group.add_parser(
            "list",
            help="every rollout (by id, numbers as numbers): group, status, attempts, turns, reward, policy versions",
        )
        _journal_arguments(p, positional=True)
        p.add_argument(
            "--status",
            action="append",
            choices=STATUSES,
            type=lambda text: text.replace("-", " "),  # --status given-up, without quotes
            help="only rollouts in this status (repeat for several; given-up for given up)",
        )
        p.add_argument("--group", help="only this prompt group")
        p.add_argument("--min-attempts", type=int, default=0, metavar="N", help="only rollouts with N attempts or more")
        p.add_argument(
            "--crashed",
            action="store_true",
            help="only rollouts a crash hit (an attempt superseded, or the last one unfinished)",
        )
        p.add_argument(
            "--jobs",
            type=_positive_int,
            metavar="N",
            help="scan the partitions in N worker processes (default: one a CPU core and a partition "
            "on a Kafka journal of 200,000 records or more, else 1); the rows are the same",
        )
        p.add_argument(
            "--scan",
            action="store_true",
            help="fold every event, not the rollouts' summaries (a Kafka namespace keeps one per rollout, "
            "written with its turns): slower, the same rows, and damage to the events shows",
        )
        p.set_defaults(run="offline:list_rollouts")
        p = group.add_parser("show", help="one rollout turn by turn: attempts, crash points, calls, mutations")
        _journal_arguments(p, positional=True)
        p.add_argument("rollout", help="rollout id (see `list`)")
        p.add_argument("--turn", type=int, metavar="K", help="only turn K (every attempt's version), with token detail")
        p.add_argument("--tokens", action="store_true", help="token ids, logprobs and who made each token, every call")
        p.add_argument(
            "--tokenizer",
            action="append",
            metavar="PATH",
            help="tokenizer.json of a policy the built-in tokenizer did not write (checked if it can be)",
        )
        p.add_argument("--no-decode", action="store_true", help="token ids only, no text")
        p.set_defaults(run="offline:show")
    p = replay.add_parser("state", help="a resource's state at a revision, rebuilt from the journal")
    _journal_arguments(p)
    p.add_argument("resource", help="resource id: <rollout>/<name>, e.g. demo-g0-s0/mail (see `show`)")
    p.add_argument("--revision", type=int, required=True, metavar="R")
    p.add_argument("--life", type=int, metavar="N", help="which life of a restart-only resource (default: the last)")
    p.set_defaults(run="offline:state")
    p = sub.add_parser("export", help="copy a journal (a Kafka namespace) into a file journal, verified")
    _journal_arguments(p)
    p.add_argument("--out", required=True, metavar="DIR", help="a new directory for the file journal")
    p.set_defaults(run="offline:export")
    p = sub.add_parser(
        "export-training",
        help="training rows for a trainer (pt, parquet, jsonl, hf): tokens, logprobs, loss mask, reward",
        description="One row per finished rollout: prompt and response token ids, the logprob of each sampled "
        "token, the loss mask, the reward, the group, and per segment the attempt, policy version and sampling "
        "parameters that made it. Columns are named as verl's AgentLoopOutput and TRL's pre-tokenized datasets "
        "name them (README, 'Training on the results').",
    )
    _journal_arguments(p)
    p.add_argument(
        "--out",
        required=True,
        metavar="PATH",
        help="the file to write (a folder for --format hf); replaced whole, never half written",
    )
    p.add_argument(
        "--format",
        choices=["pt", "parquet", "jsonl", "hf"],
        help="pt (torch.save), parquet, jsonl, or hf (a datasets folder for load_from_disk); "
        "default: from the suffix of --out (.pt, .parquet, .jsonl)",
    )
    p.add_argument("--unfinished", action="store_true", help="also rollouts that have not finished (reward NaN)")
    p.set_defaults(run="offline:export_training")
    p = sub.add_parser("fork", help="a new lineage of a rollout from the state after turn K; `resume` continues it")
    _journal_arguments(p)
    p.add_argument("rollout", help="rollout id to fork")
    p.add_argument("--at-turn", type=int, required=True, metavar="K", help="the fork keeps turns 0..K, runs K+1 on")
    p.add_argument("--seed", type=int, help="sample with this seed (default: the origin's turn seeds)")
    p.add_argument("--journal-out", metavar="PATH_OR_URL", help="write the fork there (default: --journal)")
    p.set_defaults(run="offline:fork")
    return replay


def main(argv: list[str] | None = None) -> int:
    from rollout_journal.replay.cli.logs import configure, split_logging_options

    # -v and --log-format may stand anywhere, before or after the command (and its subcommand)
    rest, verbose, log_format = split_logging_options(sys.argv[1:] if argv is None else list(argv))
    parser = build_parser()
    args = parser.parse_args(rest)
    if log_format not in ("text", "json"):
        parser.error(f"--log-format {log_format!r}: text or json")
    configure(verbose or args.verbose, log_format)
    try:
        handler = getattr(args, "run", None) or COMMANDS[args.command]
        module, function = handler.split(":")
        # only now is the command's module imported: an offline command never loads the live path
        command: Callable[[argparse.Namespace], int] = getattr(import_module(f"{__package__}.{module}"), function)
        return command(args)
    except BrokenPipeError:  # `rollout-journal show ... | head`: the reader left, nothing is wrong
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except ModuleNotFoundError as exc:  # a command that needs an extra this install lacks: name it
        words = (args.command, getattr(args, "replay_command", None), getattr(args, "kafka_command", None))
        missing = missing_extra(exc, f"`{' '.join(filter(None, words))}`")
        if missing is None:
            raise
        print(f"rollout-journal: {one_line(missing)}", file=sys.stderr)
        return exit_code_for(missing)
    except (RolloutJournalError, OSError) as exc:
        print(f"rollout-journal: {one_line(exc)}", file=sys.stderr)
        return exit_code_for(exc)
    except KeyboardInterrupt:
        print("rollout-journal: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
