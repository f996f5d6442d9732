"""The offline commands: ``list``, ``show``, ``state``, ``status``, ``audit``, ``verify``, ``export``,
``export-training``, ``fork`` and ``report``. Each opens its journal read-only, calls one library
function and prints the result (``rollout_journal.replay.terminal.emit``). Nothing here, nor
anything it imports, runs a rollout: ``tests/replay/cli/test_layers.py`` checks it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rollout_journal.replay.exit_codes import EXIT_JOURNAL_DAMAGED, EXIT_OK
from rollout_journal.replay.source import ReplaySource

if TYPE_CHECKING:
    from rollout_journal.replay.status import FleetStatus
    from rollout_journal.replay.tokenizers import TokenizerCatalog
from rollout_journal.replay.terminal import BarProgress, emit, warn


def audit(args: argparse.Namespace) -> int:
    from rollout_journal.replay import audit

    return audit.run_command(args)


def verify(args: argparse.Namespace) -> int:
    from rollout_journal.replay import verify

    return verify.run_command(args)


def status(args: argparse.Namespace) -> int:
    import shutil
    import time

    from rollout_journal.participants.workload.config import check_journal_location
    from rollout_journal.replay.cli.options import journal_location
    from rollout_journal.replay.status import Pace, fleet_status, format_status

    location = check_journal_location(journal_location(args))
    previous: tuple[float, FleetStatus] | None = None
    warned: set[str] = set()  # each warning once per command, however often --watch reads
    while True:
        read_at = time.monotonic()
        status = fleet_status(location)
        for line in status.held_back:
            if line not in warned:
                warned.add(line)
                warn(line)
        pace = Pace.between(previous[1], status, read_at - previous[0]) if previous is not None else None
        previous = (read_at, status)
        if args.json:
            doc = status.as_json() | ({"turns_per_s": pace.turns_per_s, "eta_s": pace.eta_s} if pace else {})
            print(json.dumps(doc, indent=None if args.watch else 2), flush=True)
        else:
            screen = args.watch and sys.stdout.isatty()
            if screen:
                print("\033[H\033[2J", end="")  # a refreshing view: clear the screen first
            height = shutil.get_terminal_size().lines if screen else None
            print(
                "\n".join(format_status(status, rollouts=not args.partitions_only, height=height, pace=pace)),
                flush=True,
            )
        if not args.watch or status.done:
            return EXIT_OK
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:  # the usual way to leave --watch
            return EXIT_OK


def source_of(args: argparse.Namespace) -> ReplaySource:
    from rollout_journal.replay.cli.options import journal_location
    from rollout_journal.replay.source import open_replay

    return open_replay(journal_location(args))


def list_rollouts(args: argparse.Namespace) -> int:
    from rollout_journal.replay.listing import RolloutFilter, list_rollouts

    where = RolloutFilter(frozenset(args.status or ()), args.group, args.min_attempts, args.crashed)
    with source_of(args) as source:
        return emit(
            list_rollouts(source, where, BarProgress("list"), jobs=args.jobs, scan=args.scan), as_json=args.json
        )


def tokenizer_catalog(args: argparse.Namespace) -> TokenizerCatalog:
    """The ``--tokenizer`` folders, and the embedded model's, rebuilt where this machine lacks one."""
    from rollout_journal.replay.tokenizers import TokenizerCatalog

    return TokenizerCatalog(args.tokenizer, build_embedded=build_embedded_model)


def build_embedded_model(weights_seed: int) -> Path:
    """The embedded model's folder for ``weights_seed``, built here (deterministically, with torch)
    to prove which tokenizer wrote a journal made on another machine. The only edge from an
    offline command into the model room, taken only for such a journal."""
    try:
        from rollout_journal.participants.model.tiny_model import tiny_model_dir

        return tiny_model_dir(weights_seed)
    except ImportError as exc:  # the core install: no torch
        from rollout_journal.replay.errors import TokenizerUnavailableError

        raise TokenizerUnavailableError(
            f"decoding the embedded model's token ids needs its folder (seed {weights_seed}), and building it "
            f"needs {exc.name or 'torch'}: pip install 'rollout-journal[torch]', pass the folder with --tokenizer, "
            "or --no-decode for token ids only"
        ) from None


def show(args: argparse.Namespace) -> int:
    from rollout_journal.replay.timeline import build_timeline

    catalog = None if args.no_decode else tokenizer_catalog(args)
    with source_of(args) as source:
        timeline = build_timeline(source, args.rollout, catalog=catalog, turn=args.turn, progress=BarProgress("show"))
    return emit(timeline, as_json=args.json, lines=timeline.text(tokens=args.tokens))


def state(args: argparse.Namespace) -> int:
    from rollout_journal.replay.resource_at_revision import resource_state

    with source_of(args) as source:
        found = resource_state(source, args.resource, args.revision, life=args.life, progress=BarProgress("state"))
    return emit(found, as_json=args.json)


def export(args: argparse.Namespace) -> int:
    from rollout_journal.replay.export import export_journal

    with source_of(args) as source:
        report = export_journal(source, args.out, progress=BarProgress("export"))
    code = emit(report, as_json=args.json)
    if not report.verified:
        print(
            f"rollout-journal: the copy at {args.out} does not match the source (see the counts and checksums above)",
            file=sys.stderr,
        )
        return EXIT_JOURNAL_DAMAGED
    return code


def export_training(args: argparse.Namespace) -> int:
    from rollout_journal.replay.training import export_training
    from rollout_journal.replay.training_formats import format_for

    form = format_for(args.out, args.format)  # before the journal is read
    with source_of(args) as source:
        return emit(
            export_training(
                source, args.out, format=form, unfinished=args.unfinished, progress=BarProgress("export-training")
            ),
            as_json=args.json,
        )


def report(args: argparse.Namespace) -> int:
    from rollout_journal.replay import report_html

    with source_of(args) as source:
        result = report_html.run_command(args, source, BarProgress("report"), tokenizer_catalog(args))
        return emit(result, as_json=args.json)


def fork(args: argparse.Namespace) -> int:
    from rollout_journal.replay.fork import fork_rollout

    with source_of(args) as source:
        return emit(
            fork_rollout(
                source,
                args.rollout,
                args.at_turn,
                seed=args.seed,
                journal_out=args.journal_out,
                progress=BarProgress("fork"),
            ),
            as_json=args.json,
        )
