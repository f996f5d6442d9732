"""``rollout-journal replay report ROLLOUT --html FILE``: one self-contained HTML page
about one rollout, for people who would rather look than read.

The page holds a timeline picture (turns across attempts: what each attempt ran, the
turns a resumed attempt reused, the crash points, the turns a restart threw away), the
audit status of the rollout's resources (hash chains and signed heads), and the
conversation turn by turn. It has no external assets: CSS, SVG and the few lines of
JavaScript (click a turn in the picture to jump to it) are inline, so the file can be
mailed, attached to a bug or opened offline.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from datetime import UTC, datetime
from html import escape
from pathlib import Path

from journal.errors import NotInJournalError
from journal.journal import ReadReport

from .audit import AuditedMutation, AuditSummary, add_public_key_argument, audit_events, public_key_verifier
from .report_timeline import RolloutTimeline, TurnView, build_timeline
from .scanning import add_journal_argument, open_for_reading

__all__ = ["UnknownRolloutError", "render_report", "timeline_svg", "write_report"]


class UnknownRolloutError(NotInJournalError):
    """The journal holds no event of the rollout asked for."""


# -- picture geometry ---------------------------------------------------------------
_LABEL_W, _ROW_H, _TOP, _BOX_H, _RIGHT = 200, 64, 44, 32, 190
_TURNS_W = 700  # what the turn columns share; a column is 54..110 px wide

_CSS = """
:root { --ink:#1d2330; --muted:#5b6475; --line:#d9dee7; --bg:#f6f7f9; --card:#fff;
        --ran:#2e7d32; --ran-bg:#d7efd9; --reused:#1565c0; --reused-bg:#e3eefc; --lost:#8a8f98; --lost-bg:#eceef1;
        --crash:#c62828; --warn:#b26a00; --warn-bg:#fff3e0; --ok-bg:#e6f4ea; --bad-bg:#fdecea; }
* { box-sizing: border-box; }
body { margin:0; font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif;
       color:var(--ink); background:var(--bg); }
main { max-width:1180px; margin:0 auto; padding:24px 28px 48px; }
h1 { font-size:24px; margin:0 0 4px; } h2 { font-size:18px; margin:28px 0 10px; }
.sub { color:var(--muted); margin:0 0 16px; }
code, pre, .mono { font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,"Liberation Mono",monospace; font-size:13px; }
.cards { display:flex; gap:12px; flex-wrap:wrap; }
.card { background:var(--card); border:1px solid var(--line); border-radius:10px; padding:8px 12px; min-width:118px; }
.card .k { color:var(--muted); font-size:12px; text-transform:uppercase; letter-spacing:.04em; }
.card .v { font-size:20px; font-weight:600; }
.panel { background:var(--card); border:1px solid var(--line); border-radius:12px; padding:14px 16px; overflow-x:auto; }
.badge { display:inline-block; padding:3px 10px; border-radius:999px; font-weight:600; font-size:13px; margin:2px 6px 2px 0; }
.ok { background:var(--ok-bg); color:var(--ran); } .bad { background:var(--bad-bg); color:var(--crash); }
.warn { background:var(--warn-bg); color:var(--warn); }
svg text { font-family:system-ui,-apple-system,"Segoe UI",Roboto,Arial,sans-serif; }
.turn { cursor:pointer; } .turn:hover rect, .turn:focus rect { stroke-width:3; } .turn:focus { outline:none; }
.legend { display:flex; gap:18px; flex-wrap:wrap; color:var(--muted); font-size:13px; margin-top:8px; }
.legend span::before { content:""; display:inline-block; width:14px; height:14px; border-radius:3px; margin-right:6px;
                       vertical-align:-2px; border:2px solid; }
.legend .l-ran::before { background:var(--ran-bg); border-color:var(--ran); }
.legend .l-reused::before { background:var(--reused-bg); border-color:var(--reused); border-style:dashed; }
.legend .l-lost::before { background:var(--lost-bg); border-color:var(--lost); }
.legend .l-crash::before { background:var(--crash); border-color:var(--crash); border-radius:50%; }
.legend .l-signed::before { background:#6a1b9a; border-color:#6a1b9a; border-radius:50%; width:8px; height:8px; }
table { border-collapse:collapse; width:100%; font-size:13px; }
th, td { text-align:left; padding:5px 8px; border-bottom:1px solid var(--line); vertical-align:top; }
th { color:var(--muted); font-weight:600; }
.problems li { margin:4px 0; }
.turn-card { background:var(--card); border:1px solid var(--line); border-left:6px solid var(--ran); border-radius:10px;
             padding:10px 14px; margin:10px 0; transition: box-shadow .3s; }
.turn-card.reused { border-left-color:var(--reused); } .turn-card.lost { border-left-color:var(--lost); opacity:.8; }
.turn-card.flash { box-shadow:0 0 0 4px #ffd54f; }
.turn-head { display:flex; gap:10px; align-items:baseline; flex-wrap:wrap; }
.turn-head b { font-size:16px; } .chip { font-size:12px; color:var(--muted); background:var(--bg); border-radius:6px;
                                         padding:1px 8px; }
.msg { display:grid; grid-template-columns:86px 1fr; gap:8px; margin:6px 0; }
.role { font-size:12px; font-weight:700; text-transform:uppercase; color:var(--muted); padding-top:3px; }
.msg pre { margin:0; white-space:pre-wrap; word-break:break-word; background:var(--bg); border-radius:6px; padding:6px 9px; }
.msg.assistant pre { background:#eef4ff; } .msg.system pre, .msg.user pre { background:#f3f0fa; }
.meta { color:var(--muted); font-size:12.5px; margin-top:4px; }
details > summary { cursor:pointer; color:var(--muted); margin:8px 0; }
footer { color:var(--muted); font-size:12px; margin-top:32px; }
"""

_JS = """
(function () {
  function jump(el) {
    var target = document.getElementById(el.getAttribute('data-target'));
    if (!target) { return; }
    var closed = target.closest('details');
    if (closed) { closed.open = true; }
    target.scrollIntoView({behavior: 'smooth', block: 'center'});
    target.classList.add('flash');
    setTimeout(function () { target.classList.remove('flash'); }, 1400);
  }
  var turns = document.querySelectorAll('[data-target]');
  turns.forEach(function (el) {
    el.addEventListener('click', function () { jump(el); });
    el.addEventListener('keydown', function (e) { if (e.key === 'Enter' || e.key === ' ') { jump(el); } });
  });
  document.body.setAttribute('data-ready', String(turns.length));
})();
"""


def _t(text: object) -> str:
    return escape(str(text), quote=True)


def _when(ts_ms: int) -> str:
    return datetime.fromtimestamp(ts_ms / 1000, tz=UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


def _turn_id(turn: TurnView) -> str:
    return f"turn-l{turn.life}-t{turn.turn}"


class _Grid:
    """Column geometry for a given number of turns: wide boxes for a short rollout, narrow for a long one."""

    def __init__(self, columns: int) -> None:
        self.col = max(54, min(110, _TURNS_W // max(columns, 1)))
        self.box = min(self.col - 14, 72)

    def x(self, turn: int) -> int:
        return _LABEL_W + turn * self.col


def _y(row: int) -> int:
    return _TOP + row * _ROW_H


def _box(grid: _Grid, turn: TurnView, row: int, kind: str, title: str) -> str:
    """One turn in an attempt's lane: ran here (kind "ran"), reused ("reused") or thrown away ("lost")."""
    x, y = grid.x(turn.turn) + (grid.col - grid.box) // 2, _y(row) + (_ROW_H - _BOX_H) // 2
    fill, stroke = {"ran": ("var(--ran-bg)", "var(--ran)"), "reused": ("var(--reused-bg)", "var(--reused)"),
                    "lost": ("var(--lost-bg)", "var(--lost)")}[kind]
    dash = ' stroke-dasharray="5 3"' if kind == "reused" else ""
    parts = [f'<g class="turn {kind}" tabindex="0" data-target="{_turn_id(turn)}" role="button">',
             f"<title>{_t(title)}</title>",
             f'<rect x="{x}" y="{y}" width="{grid.box}" height="{_BOX_H}" rx="6" fill="{fill}" stroke="{stroke}" '
             f'stroke-width="2"{dash}/>',
             f'<text x="{x + grid.box / 2}" y="{y + _BOX_H / 2 + 5}" text-anchor="middle" font-size="14" '
             f'font-weight="600" fill="{stroke}">{turn.turn}</text>']
    if kind == "lost":
        parts.append(f'<line x1="{x + 4}" y1="{y + _BOX_H - 4}" x2="{x + grid.box - 4}" y2="{y + 4}" '
                     f'stroke="var(--lost)" stroke-width="2"/>')
    if turn.signed and kind != "reused":
        parts.append(f'<circle cx="{x + grid.box - 5}" cy="{y + 5}" r="4" fill="#6a1b9a"><title>its commit carries '
                     "signed chain heads</title></circle>")
    parts.append("</g>")
    return "".join(parts)


def _turn_title(turn: TurnView, how: str) -> str:
    lines = [f"turn {turn.turn}: {how}"]
    for message in turn.messages:
        content = message.content if len(message.content) <= 160 else message.content[:157] + "..."
        lines.append(f"{message.role}: {content}")
    for m in turn.mutations:
        lines.append(f"{m.resource_id} r{m.prev_revision}->r{m.revision} {m.op}")
    return "\n".join(lines)


def timeline_svg(timeline: RolloutTimeline) -> str:
    """The picture: a lane per attempt, a column per turn."""
    columns = max(timeline.turn_count, 1)
    grid = _Grid(columns)
    width = _LABEL_W + columns * grid.col + _RIGHT
    height = _TOP + len(timeline.attempts) * _ROW_H + 16
    by_attempt: dict[int, list[TurnView]] = {}
    latest: dict[tuple[int, int], TurnView] = {}  # (life, turn) -> the committed turn
    for turn in timeline.turns:
        by_attempt.setdefault(turn.attempt, []).append(turn)
        latest[(turn.life, turn.turn)] = turn
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" id="timeline-svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="turns of {_t(timeline.rollout_id)} across attempts">',
           '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
           'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="var(--crash)"/></marker></defs>']
    out.append(f'<text x="{_LABEL_W - 12}" y="{_TOP - 18}" text-anchor="end" font-size="12" fill="var(--muted)">'
               "turn</text>")
    for column in range(columns):
        out.append(f'<text x="{grid.x(column) + grid.col / 2}" y="{_TOP - 18}" text-anchor="middle" font-size="12" '
                   f'fill="var(--muted)">{column}</text>')
        out.append(f'<line x1="{grid.x(column) + grid.col / 2}" y1="{_TOP - 10}" x2="{grid.x(column) + grid.col / 2}" '
                   f'y2="{height - 12}" stroke="var(--line)" stroke-dasharray="2 4"/>')
    final_life = timeline.final.restarts
    overlay: list[str] = []  # drawn last, over the lanes: the arrows from a crash to the next attempt
    for row, attempt in enumerate(timeline.attempts):
        y = _y(row)
        out.append(f'<rect x="4" y="{y + 4}" width="{width - 8}" height="{_ROW_H - 8}" rx="8" '
                   f'fill="{"#fbfcfd" if row % 2 else "#f3f5f8"}"/>')
        label = f"attempt {attempt.attempt}"
        detail = (f"epoch {attempt.epoch} · from turn {attempt.resumed_from_turn}"
                  + (" · restart" if attempt.starts_over else ""))
        out.append(f'<text x="16" y="{y + 27}" font-size="15" font-weight="700">{_t(label)}</text>')
        out.append(f'<text x="16" y="{y + 45}" font-size="12" fill="var(--muted)">{_t(detail)}</text>')
        for turn_no in attempt.reused:
            reused = latest.get((attempt.life, turn_no))
            if reused is not None:
                out.append(_box(grid, reused, row, "reused", _turn_title(
                    reused, f"committed by attempt {reused.attempt}, reused by attempt {attempt.attempt} (not run again)")))
        for turn in by_attempt.get(attempt.attempt, []):
            kind = "lost" if turn.thrown_away or turn.life != final_life else "ran"
            how = (f"ran in attempt {turn.attempt}, thrown away when the rollout started over" if kind == "lost"
                   else f"ran in attempt {turn.attempt} (epoch {turn.epoch})")
            out.append(_box(grid, turn, row, kind, _turn_title(turn, how)))
        crashed = attempt.crashed_after
        if crashed is not None:
            cx, cy = grid.x(crashed + 1) + 8, y + _ROW_H / 2
            out.append(f'<g class="crash"><title>attempt {attempt.attempt} crashed after turn {crashed}: superseded by '
                       f'attempt {attempt.superseded_by}</title>'
                       f'<path d="M{cx - 2},{cy - 15} L{cx + 7},{cy - 2} L{cx + 1},{cy - 1} L{cx + 6},{cy + 14} '
                       f'L{cx - 7},{cy - 1} L{cx - 1},{cy - 2} Z" fill="var(--crash)"/>'
                       f'<text x="{cx + 12}" y="{cy + 5}" font-size="13" font-weight="700" fill="var(--crash)">'
                       "crash</text></g>")
            nxt = timeline.attempts[row + 1] if row + 1 < len(timeline.attempts) else None
            if nxt is not None:  # to the top of the turn the next attempt starts at
                tx, ty = grid.x(nxt.resumed_from_turn) + grid.col / 2, _y(row + 1) + (_ROW_H - _BOX_H) / 2 - 2
                mid = (cy + 16 + ty) / 2
                how = "restarts from turn 0" if nxt.starts_over else f"resumes at turn {nxt.resumed_from_turn}"
                overlay.append(f'<path d="M{cx},{cy + 16} C{cx},{mid} {tx},{mid} {tx},{ty}" fill="none" '
                           f'stroke="var(--crash)" stroke-width="2" stroke-dasharray="5 3" marker-end="url(#arrow)">'
                           f"<title>attempt {nxt.attempt} {how}</title></path>")
        if row == len(timeline.attempts) - 1 and timeline.final.finished:
            fx = grid.x(max(attempt.turns[-1] if attempt.turns else 0, timeline.turn_count - 1) + 1) + 8
            reward = "" if timeline.final.reward is None else f", reward {timeline.final.reward:.3f}"
            out.append(f'<text x="{fx}" y="{y + _ROW_H / 2 + 5}" font-size="13" font-weight="700" fill="var(--ran)">'
                       f"✓ finished{_t(reward)}</text>")
    out.extend(overlay)
    out.append("</svg>")
    return "".join(out)


def _audit_html(rows: list[AuditedMutation], summary: AuditSummary) -> str:
    if summary.mutation_count == 0:
        chain = '<span class="badge warn">no resource mutations</span>'
    elif summary.chain_ok:
        chain = '<span class="badge ok">hash chains OK</span>'
    else:
        chain = f'<span class="badge bad">hash chains: {len(summary.problems)} problem(s)</span>'
    if summary.anchored == "no":
        anchors = '<span class="badge warn">heads not anchored (no signed checkpoints)</span>'
    elif summary.anchors_verified is None:
        anchors = (f'<span class="badge warn">heads anchored ({_t(summary.anchored)}) by {summary.checkpoints} '
                   "checkpoints, signatures not checked (no public key given)</span>")
    elif summary.anchors_verified:
        key = "" if summary.key_id is None else f", key {_t(summary.key_id[:16])}"
        anchors = f'<span class="badge ok">signed heads verify: {summary.checkpoints} checkpoints{key}</span>'
    else:
        anchors = (f'<span class="badge bad">signed heads do NOT verify: {summary.checkpoints_verified} of '
                   f"{summary.checkpoints}</span>")
    lives = ", ".join(f"{_t(life['resource_id'])} life {life['life']} r{life['first_revision']}..r{life['revision']}"
                      for life in summary.resources)
    parts = [f"<p>{chain}{anchors}</p>"]
    if lives:
        parts.append(f'<p class="meta">resource chains: {lives}</p>')
    if summary.problems:
        parts.append('<ul class="problems">' + "".join(
            f"<li><b>{_t(p.kind)}</b>: {_t(p.message)}</li>" for p in summary.problems) + "</ul>")
    if rows:
        parts.append("<table><tr><th>turn</th><th>attempt</th><th>epoch</th><th>resource</th><th>revision</th>"
                     "<th>life</th><th>operation</th><th>status</th></tr>")
        for r in rows:
            status = "ok" if r.status == "ok" else f'<span class="badge bad">{_t(r.status)}</span>'
            parts.append(f"<tr><td>{r.turn}</td><td>{r.attempt}</td><td>{r.epoch}</td><td>{_t(r.resource_id)}</td>"
                         f"<td>r{r.prev_revision}→r{r.revision}</td><td>{r.life}</td>"
                         f'<td class="mono">{_t(r.op)}({_t(json.dumps(r.args, ensure_ascii=False))})</td>'
                         f"<td>{status}</td></tr>")
        parts.append("</table>")
    return "".join(parts)


def _messages_html(messages: Iterable) -> str:
    return "".join(f'<div class="msg {_t(m.role)}"><div class="role">{_t(m.role)}</div><pre>{_t(m.content)}</pre></div>'
                   for m in messages)


def _turn_card(turn: TurnView, timeline: RolloutTimeline) -> str:
    reused_by = [a.attempt for a in timeline.attempts if turn.turn in a.reused and a.life == turn.life
                 and a.attempt > turn.attempt]
    lost = turn.thrown_away or turn.life != timeline.final.restarts
    css = "lost" if lost else ("reused" if reused_by else "")
    chips = [f"attempt {turn.attempt}", f"epoch {turn.epoch}", _when(turn.ts_ms)]
    if reused_by:
        chips.append(f"reused after the crash by attempt {', '.join(map(str, reused_by))}")
    if lost:
        chips.append("thrown away: the rollout started over")
    if turn.signed:
        chips.append("signed heads")
    if turn.reward is not None:
        chips.append(f"reward {turn.reward:.3f}")
    meta = [f"model call {_t(c.call_id)} · prompt {c.prompt_tokens} tokens · {c.output_tokens} generated · "
            f"logprob {c.logprob:.3f} · {_t(c.policy_version)}" for c in turn.calls]
    meta += [f"{_t(m.resource_id)} r{m.prev_revision}→r{m.revision} <code>{_t(m.op)}({_t(m.args_json)})</code>"
             for m in turn.mutations]
    return (f'<div class="turn-card {css}" id="{_turn_id(turn)}"><div class="turn-head"><b>Turn {turn.turn}</b>'
            + "".join(f'<span class="chip">{_t(c)}</span>' for c in chips) + "</div>"
            + _messages_html(turn.messages)
            + "".join(f'<div class="meta">{line}</div>' for line in meta) + "</div>")


def render_report(timeline: RolloutTimeline, rows: list[AuditedMutation], summary: AuditSummary, *,
                  journal: str) -> str:
    """The whole page, as one string."""
    final = timeline.final
    status = ("acknowledged" if final.acknowledged else "finished") if final.finished else "running"
    kept = [t for t in timeline.turns if not t.thrown_away and t.life == final.restarts]
    lost = [t for t in timeline.turns if t.thrown_away or t.life != final.restarts]
    reused = sum(len(a.reused) for a in timeline.attempts)
    audit_ok = summary.chain_ok and summary.anchors_verified is not False
    cards = [("status", status), ("reward", "–" if final.reward is None else f"{final.reward:.3f}"),
             ("attempts", f"{len(timeline.attempts)} ({timeline.crashes} crash{'es' if timeline.crashes != 1 else ''})"),
             ("turns", f"{len(kept)} kept"), ("reused after a crash", str(reused)),
             ("thrown away", str(len(lost))), ("audit", "ok" if audit_ok else "problems")]
    lives = sorted({t.life for t in lost})
    lost_html = "".join(
        f"<details><summary>life {life}: {sum(1 for t in lost if t.life == life)} turns thrown away when the rollout "
        "started over from turn 0 (a restart-only environment cannot be rebuilt)</summary>"
        + "".join(_turn_card(t, timeline) for t in lost if t.life == life) + "</details>"
        for life in lives)
    body = [
        f"<header><h1>Rollout {_t(timeline.rollout_id)}</h1>"
        f'<p class="sub">group {_t(timeline.group_id)} · journal <code>{_t(journal)}</code></p>'
        '<div class="cards">' + "".join(f'<div class="card"><div class="k">{_t(k)}</div><div class="v">{_t(v)}</div>'
                                        "</div>" for k, v in cards) + "</div></header>",
        '<section id="timeline"><h2>Timeline: turns across attempts</h2><div class="panel">'
        + timeline_svg(timeline)
        + '<div class="legend"><span class="l-ran">ran in this attempt</span>'
          '<span class="l-reused">reused from an earlier attempt (not run again)</span>'
          '<span class="l-lost">thrown away (restart from turn 0)</span><span class="l-crash">crash point</span>'
          '<span class="l-signed">signed chain heads</span></div>'
          '<p class="meta">Click a turn to jump to it in the conversation.</p></div></section>',
        '<section id="audit"><h2>Audit of resource mutations</h2><div class="panel">'
        + _audit_html(rows, summary) + "</div></section>",
        '<section id="conversation"><h2>Conversation</h2>'
        + _messages_html(timeline.initial_messages)
        + "".join(_turn_card(t, timeline) for t in sorted(kept, key=lambda t: t.turn))
        + lost_html + "</section>",
        f"<footer>rollout-journal report · generated {_t(_when(int(datetime.now(UTC).timestamp() * 1000)))} · "
        "self-contained: no external assets</footer>",
    ]
    return ("<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            '<link rel="icon" href="data:,">'
            f"<title>{_t(timeline.rollout_id)} · rollout-journal report</title><style>{_CSS}</style></head>"
            f"<body><main>{''.join(body)}</main><script>{_JS}</script></body></html>\n")


def write_report(location: str, rollout_id: str, out: Path, *, public_key: str | None = None) -> AuditSummary:
    """Read one rollout from the journal at ``location`` and write its report to ``out``."""
    report = ReadReport()
    with open_for_reading(location) as journal:
        events = list(journal.read_rollout(rollout_id, report=report))  # one rollout: small
    if not events:
        raise UnknownRolloutError(f"no events of rollout {rollout_id!r} in journal {location} "
                             "(`rollout-journal list` shows the rollouts it holds)")
    timeline = build_timeline(rollout_id, events)
    rows, summary = audit_events(events, report, public_key_verifier(public_key))
    out.write_text(render_report(timeline, rows, summary, journal=location), encoding="utf-8")
    return summary


# -- the command line ---------------------------------------------------------------

def add_command(replay_sub: argparse._SubParsersAction) -> None:
    p = replay_sub.add_parser(
        "report", help="one self-contained HTML page: timeline, crash points, conversation, audit status",
        description="Writes one HTML file (inline CSS, SVG and JavaScript; no external assets) with a timeline "
                    "picture of the rollout's turns across attempts, its crash points and reused turns, the audit "
                    "status of its resources and the conversation.")
    p.add_argument("rollout", help="rollout id (see `rollout-journal list`)")
    add_journal_argument(p)
    p.add_argument("--html", required=True, type=Path, metavar="FILE", help="where to write the page")
    add_public_key_argument(p)


def run_command(args: argparse.Namespace) -> int:
    summary = write_report(args.journal, args.rollout, args.html, public_key=args.public_key)
    print(f"wrote {args.html}: {summary.status_line}", file=sys.stderr)
    return 0
