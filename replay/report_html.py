"""``rollout-journal replay report``: self-contained HTML pages of a journal, for people who would
rather look than read.

- ``replay report --html DIR``: ``DIR/index.html`` lists every rollout (status, attempts, crashes,
  turns, reward, policy versions; sortable and filterable in the page) and links to one page per
  rollout under ``DIR/rollouts/``.
- ``replay report ROLLOUT --html FILE``: that rollout's page alone.

A rollout's page holds its turn grid (attempt x turn, in bands of 50 turns, so a 200-turn rollout
stays readable), the token view of any model call (each token coloured by its logprob, with the
attempt and policy that made it), side-by-side diffs of a redone turn or a fork's turn against the
version it replaced, the audit status of its resources, and the conversation. Everything is drawn
from the :class:`~rollout_journal.replay.timeline.Timeline` that ``replay show`` prints. Pages have
no external assets (CSS, JavaScript and data inline): mail one, attach it to a bug, open it offline.

The whole-journal report reads the journal once and holds the timelines of its rollouts while it
writes (memory grows with the journal; the pages are written one at a time).
"""

from __future__ import annotations

import argparse
import functools
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from markupsafe import Markup

from rollout_journal.journal.anchoring import HeadVerifier
from rollout_journal.journal.journal import JournaledEvent, ReadReport
from rollout_journal.replay.audit import AuditedMutation, AuditSummary, ChainAuditor, public_key_verifier
from rollout_journal.replay.errors import NoSuchRolloutError
from rollout_journal.replay.progress import Progress
from rollout_journal.replay.report_pages import CELLS, Decoder, TokenTable, card_id, diffs, grid, page_name, when
from rollout_journal.replay.rollout_status import STATUSES
from rollout_journal.replay.source import ReplaySource
from rollout_journal.replay.timeline import Timeline, build_timeline, build_timelines
from rollout_journal.replay.tokenizers import TokenizerCatalog

__all__ = ["ReportResult", "render_index", "render_rollout", "write_journal_report", "write_rollout_report"]

TEMPLATES = Path(__file__).with_name("templates")


@dataclass
class ReportResult:
    """What ``replay report`` wrote."""

    location: str
    out: str
    pages: int = 0
    rollouts: int = 0
    audit: dict[str, str] = field(default_factory=dict)  # rollout -> its audit's status line
    undecoded: dict[str, str] = field(default_factory=dict)  # policy -> why its tokens show as ids
    report: ReadReport = field(default_factory=ReadReport)

    def as_json(self) -> dict[str, Any]:
        return {
            "journal": self.location,
            "out": self.out,
            "pages": self.pages,
            "rollouts": self.rollouts,
            "audit": self.audit,
            "undecoded": self.undecoded,
        }

    def text(self) -> list[str]:
        lines = [f"wrote {self.out}: {self.pages} page(s) of {self.rollouts} rollout(s) of {self.location}"]
        if len(self.audit) == 1:
            lines.append(next(iter(self.audit.values())))
        else:
            bad = [rid for rid, line in self.audit.items() if "NOT" in line]
            lines.append(f"audit: {len(bad)} rollout(s) with problems" + (f": {', '.join(bad[:10])}" if bad else ""))
        lines += [f"note: tokens of policy {p} shown as ids: {why}" for p, why in self.undecoded.items()]
        return lines


@functools.cache
def _environment() -> Any:
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        autoescape=jinja2.select_autoescape(["html", "j2"], default_for_string=True),
        trim_blocks=True,
        lstrip_blocks=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters["when"] = when
    env.filters["reward"] = lambda r: "–" if r is None else f"{r:.3f}"
    return env


def _script_json(data: Any) -> Markup:
    """JSON safe inside <script>: no "</script>" can close it early."""
    return Markup(json.dumps(data, separators=(",", ":")).replace("<", "\\u003c").replace("\u2028", "\\u2028"))


def _generated() -> str:
    return when(int(datetime.now(UTC).timestamp() * 1000))


def index_row(timeline: Timeline, href: str | None) -> dict[str, Any]:
    return {
        "rollout_id": timeline.rollout_id,
        "href": href,
        "group_id": timeline.group_id,
        "status": timeline.status,
        "attempts": len(timeline.attempts),
        "crashes": len(timeline.crashes),
        "crashed": timeline.crashed,
        "turns": timeline.committed_turns,
        "reward": timeline.reward,
        "policy_versions": timeline.policy_versions,
        "forked_from": timeline.forked_from,
        "damaged": timeline.damaged,
    }


def render_index(rows: list[dict[str, Any]], *, journal: str, notes: list[str]) -> str:
    counts = {s: sum(1 for r in rows if r["status"] == s) for s in STATUSES}
    return str(
        _environment()
        .get_template("index.html.j2")
        .render(
            rows=rows,
            journal=journal,
            counts=counts,
            crashed=sum(1 for r in rows if r["crashed"]),
            notes=notes,
            generated=_generated(),
        )
    )


def render_rollout(
    timeline: Timeline,
    audit_rows: list[AuditedMutation],
    summary: AuditSummary,
    *,
    decoder: Decoder,
    origin: Timeline | None = None,
    index_href: str | None = None,
    origin_href: str | None = None,
) -> str:
    """One rollout's page, as one string."""
    tokens = TokenTable()
    call_index: dict[str, int] = {}
    for turn in timeline.turns:
        for call in turn.calls:
            call_index[call.call_id] = tokens.add(call, decoder)
    kept = sorted((t for t in timeline.turns if t.discarded_by is None), key=lambda t: t.turn)
    lost = [t for t in timeline.turns if t.discarded_by is not None]
    comparisons = diffs(timeline, decoder, origin)
    diff_of = {d.anchor.removeprefix("diff-"): d.anchor for d in comparisons}
    final = timeline.final
    cards = [
        ("status", timeline.status),
        ("reward", "–" if timeline.reward is None else f"{timeline.reward:.3f}"),
        (
            "attempts",
            f"{len(timeline.attempts)} ({len(timeline.crashes)} crash{'es' if len(timeline.crashes) != 1 else ''})",
        ),
        ("turns", str(timeline.committed_turns)),
        ("reused after a crash", str(sum(len(a.reused) for a in timeline.attempts))),
        ("discarded", str(len(lost))),
        ("audit", "ok" if summary.chain_ok and summary.anchors_verified is not False else "problems"),
    ]
    return str(
        _environment()
        .get_template("rollout.html.j2")
        .render(
            t=timeline,
            cards=cards,
            bands=grid(timeline),
            legend=[(css, meaning) for css, meaning in CELLS.values()],
            kept=kept,
            lost=lost,
            initial=next((a.messages for a in reversed(timeline.attempts) if a.messages), []),
            lives=sorted({t.life for t in lost}),
            card_id=card_id,
            call_index=call_index,
            diff_of=diff_of,
            diffs=comparisons,
            audit_rows=audit_rows,
            summary=summary,
            failure=final.failure if final is not None else None,
            given_up=final.failures if final is not None and final.given_up else None,
            tokens_json=_script_json(tokens.as_json()),
            undecoded=decoder.missing,
            index_href=index_href,
            origin_href=origin_href,
            generated=_generated(),
        )
    )


def _audited(events: list[JournaledEvent], verifier: HeadVerifier | None) -> tuple[list[AuditedMutation], ChainAuditor]:
    auditor = ChainAuditor(verifier)
    rows = [row for item in events if (row := auditor.feed(item)) is not None]
    return rows, auditor


def write_rollout_report(
    source: ReplaySource,
    rollout_id: str,
    out: Path,
    *,
    public_key: str | None = None,
    catalog: TokenizerCatalog | None = None,
    progress: Progress | None = None,
) -> ReportResult:
    """``out``: the page of ``rollout_id`` (a fork is compared with its origin when the journal holds it)."""
    verifier = public_key_verifier(public_key)
    result = ReportResult(source.location, str(out), report=ReadReport())
    timeline = build_timeline(source, rollout_id, catalog=None, progress=progress)
    events = list(source.rollout_events(rollout_id, result.report))  # again, for the audit: one rollout is small
    origin = None
    if timeline.forked_from:
        try:
            origin = build_timeline(source, timeline.forked_from.rpartition("@")[0], catalog=None)
        except NoSuchRolloutError:
            origin = None  # forked into another journal: nothing to compare with here
    rows, auditor = _audited(events, verifier)
    summary = auditor.finish(result.report)
    decoder = Decoder(catalog or TokenizerCatalog())
    html = render_rollout(timeline, rows, summary, decoder=decoder, origin=origin)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(html, encoding="utf-8")
    result.pages = result.rollouts = 1
    result.audit[rollout_id] = summary.status_line
    result.undecoded = decoder.missing
    return result


def write_journal_report(
    source: ReplaySource,
    out: Path,
    *,
    public_key: str | None = None,
    catalog: TokenizerCatalog | None = None,
    progress: Progress | None = None,
) -> ReportResult:
    """``out/index.html`` and a page per rollout under ``out/rollouts/``, from one scan of the journal."""
    verifier = public_key_verifier(public_key)
    result = ReportResult(source.location, str(out))
    auditors: dict[str, ChainAuditor] = {}
    audit_rows: dict[str, list[AuditedMutation]] = {}

    def audit(item: JournaledEvent) -> None:
        rid = item.event.header.rollout_id
        auditor = auditors.get(rid)
        if auditor is None:
            auditor = auditors[rid] = ChainAuditor(verifier)
            audit_rows[rid] = []
        row = auditor.feed(item)
        if row is not None:
            audit_rows[rid].append(row)

    timelines = build_timelines(source, catalog=None, report=result.report, progress=progress, feed=audit)
    pages = out / "rollouts"
    pages.mkdir(parents=True, exist_ok=True)
    decoder = Decoder(catalog or TokenizerCatalog())
    rows = []
    if progress is not None:  # the scan's bar is done: one for the pages
        progress.start(len(timelines), " pages")
    for rid, timeline in timelines.items():
        name = page_name(rid)
        summary = auditors[rid].finish(ReadReport())
        origin = timeline.forked_from.rpartition("@")[0] if timeline.forked_from else None
        html = render_rollout(
            timeline,
            audit_rows[rid],
            summary,
            decoder=decoder,
            origin=timelines.get(origin) if origin else None,
            index_href="../index.html",
            origin_href=page_name(origin) if origin in timelines else None,
        )
        (pages / name).write_text(html, encoding="utf-8")
        result.audit[rid] = summary.status_line
        rows.append(index_row(timeline, f"rollouts/{name}"))
        if progress is not None:
            progress.advance(1)
    if progress is not None:
        progress.finish()
    notes = [str(e) for e in result.report.errors]
    (out / "index.html").write_text(render_index(rows, journal=source.location, notes=notes), encoding="utf-8")
    result.pages = len(rows) + 1
    result.rollouts = len(rows)
    result.undecoded = decoder.missing
    return result


# -- the command line ---------------------------------------------------------------


def add_command(replay_sub: argparse._SubParsersAction[argparse.ArgumentParser], journal_arguments: Any) -> None:
    p = replay_sub.add_parser(
        "report",
        help="self-contained HTML: an index of every rollout and a page per rollout (or one rollout's page)",
        description="Without ROLLOUT: writes DIR/index.html (every rollout: status, attempts, crashes, turns, "
        "reward, policy versions; sort and filter in the page) and a page per rollout under DIR/rollouts/. With "
        "ROLLOUT: that rollout's page, to FILE. A page has the turn grid across attempts (crash points, reused, "
        "discarded, redone and copied turns), a token view of every model call (coloured by logprob, with the "
        "attempt and policy of each token), side-by-side diffs of redone turns and of a fork against its "
        "origin, the audit status of the rollout's resources and the conversation. No external assets.",
    )
    p.add_argument("rollout", nargs="?", help="one rollout id (see `rollout-journal list`); default: every rollout")
    journal_arguments(p)
    p.add_argument(
        "--html", required=True, type=Path, metavar="DIR_OR_FILE", help="a folder for the report (a file with ROLLOUT)"
    )
    p.add_argument(
        "--tokenizer",
        action="append",
        metavar="PATH",
        help="tokenizer.json of a policy the built-in tokenizer did not write (its tokens show as ids otherwise)",
    )
    from rollout_journal.replay.audit import add_public_key_argument

    add_public_key_argument(p)


def run_command(
    args: argparse.Namespace, source: ReplaySource, progress: Progress, catalog: TokenizerCatalog
) -> ReportResult:
    if args.rollout:
        return write_rollout_report(
            source, args.rollout, args.html, public_key=args.public_key, catalog=catalog, progress=progress
        )
    if args.html.exists() and not args.html.is_dir():
        from rollout_journal.journal.errors import ConfigurationError

        raise ConfigurationError(
            f"--html {args.html} is a file: the whole journal's report is a folder (or name ROLLOUT)"
        )
    return write_journal_report(source, args.html, public_key=args.public_key, catalog=catalog, progress=progress)
