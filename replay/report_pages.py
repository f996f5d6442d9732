"""What the HTML report shows, as plain data for its templates: a rollout's turn grid (readable
at hundreds of turns), the tokens of each model call (who made each, with what logprob), and
side-by-side diffs of a redone turn or a fork's turn against the version it replaced.

Everything comes from the :class:`~rollout_journal.replay.timeline.Timeline` that ``replay show``
prints, so the page and the text agree on every turn's fate (ran, reused, discarded, redone,
copied by a fork) and on every crash.
"""

from __future__ import annotations

import bisect
import difflib
import hashlib
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from rollout_journal.journal.whole_numbers import whole_number
from rollout_journal.participants.model.tokenizer import ChatTokenizer
from rollout_journal.replay.errors import TokenizerUnavailableError
from rollout_journal.replay.timeline import (
    COMMITTED,
    COPIED,
    CRASH,
    DISCARDED,
    FINISHED,
    REDONE,
    REUSED,
    CallView,
    Timeline,
    TurnView,
)
from rollout_journal.replay.tokenizers import TokenizerCatalog

BAND = 50  # turns per band of the grid: 200 turns are four bands, each fits a page's width

# turn-map mark -> (css class, what it means)
CELLS = {
    COMMITTED: ("ran", "ran in this attempt"),
    FINISHED: ("finished", "ran in this attempt; the rollout finished with it"),
    REUSED: ("reused", "reused from an earlier attempt (not run again)"),
    DISCARDED: ("discarded", "discarded: the rollout started over (restart-only resource)"),
    REDONE: ("redone", "redone after a restart discarded it"),
    COPIED: ("copied", "copied from the fork's origin (not run)"),
    CRASH: ("crash", "crashed during it"),
}


def page_name(rollout_id: str) -> str:
    """A file name for a rollout's page: its id where that is safe, else made safe and told apart."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", rollout_id)
    if safe != rollout_id or safe.startswith("."):
        safe = f"{safe.lstrip('.')}-{hashlib.sha256(rollout_id.encode()).hexdigest()[:8]}"
    return f"{safe}.html"


def when(ts_ms: int) -> str:
    return datetime.fromtimestamp(ts_ms / 1000, tz=UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


def card_id(turn: TurnView) -> str:
    return f"turn-a{turn.attempt}-t{turn.turn}"


class Decoder:
    """Token text for the pages, with the tokenizer each policy was built with. A policy whose
    tokenizer is not at hand is shown as token ids (and named in :attr:`missing`), never guessed."""

    def __init__(self, catalog: TokenizerCatalog | None) -> None:
        self.catalog = catalog
        self.missing: dict[str, str] = {}  # policy -> why its tokens are not decoded
        self._tokenizers: dict[str, ChatTokenizer | None] = {}
        self._pieces: dict[tuple[str, int], str] = {}

    def tokenizer(self, policy: str) -> ChatTokenizer | None:
        if policy not in self._tokenizers:
            found = None
            if self.catalog is not None:
                try:
                    found = self.catalog.identify(policy).tokenizer
                except TokenizerUnavailableError as exc:
                    self.missing[policy] = str(exc)
            self._tokenizers[policy] = found
        return self._tokenizers[policy]

    def piece(self, policy: str, token: int) -> str:
        key = (policy, token)
        text = self._pieces.get(key)
        if text is None:
            tokenizer = self.tokenizer(policy)
            text = f"⟨{token}⟩" if tokenizer is None else tokenizer.decode([token], skip_special_tokens=False)
            self._pieces[key] = text
        return text

    def text(self, policy: str, ids: Iterable[int]) -> str | None:
        tokenizer = self.tokenizer(policy)
        return None if tokenizer is None else tokenizer.decode(list(ids), skip_special_tokens=False)


# -- the turn grid -------------------------------------------------------------------------


@dataclass
class Cell:
    turn: int
    css: str  # "" for an empty cell
    mark: str
    title: str = ""
    target: str | None = None  # the id of the turn card it jumps to


@dataclass
class Lane:
    attempt: int
    label: str
    detail: str
    cells: list[Cell]


@dataclass
class Band:
    first: int
    last: int  # inclusive
    lanes: list[Lane]


def grid(timeline: Timeline) -> list[Band]:
    """The turn map (attempt x turn) cut into bands of :data:`BAND` turns, every cell a fate."""
    rows = timeline.turn_map()
    width = len(rows[0][1]) if rows else 0
    attempts = {a.attempt: a for a in timeline.attempts}
    versions = {(t.attempt, t.turn): t for t in timeline.turns}
    lanes: list[tuple[int, str, str, list[Cell]]] = []
    for attempt, marks in rows:
        view = attempts[attempt]
        detail = f"epoch {view.epoch} · from turn {view.resumed_from_turn}"
        if view.starts_over:
            detail += " · starts over"
        if view.forked_from:
            detail += f" · fork of {view.forked_from}"
        cells = []
        for turn, mark in enumerate(marks):
            if mark == " ":
                cells.append(Cell(turn, "", ""))
                continue
            css, meaning = CELLS[mark]
            target = None
            version = versions.get((attempt, turn))
            if mark == REUSED:
                version = next((t for t in timeline.turns if t.turn == turn and attempt in t.reused_by), None)
            if version is not None:
                target = card_id(version)
            title = f"turn {turn}, attempt {attempt}: {meaning}"
            if mark == CRASH:
                title += f"; attempt {view.superseded_by} took over"
            elif version is not None:
                title += "\n" + _turn_gist(version)
            cells.append(Cell(turn, css, mark, title, target))
        lanes.append((attempt, f"attempt {attempt}", detail, cells))
    bands = []
    for first in range(0, max(width, 1), BAND):
        last = min(first + BAND, width) - 1
        bands.append(Band(first, last, [Lane(a, lab, det, cells[first : last + 1]) for a, lab, det, cells in lanes]))
    return bands if width else []


def _turn_gist(turn: TurnView, limit: int = 160) -> str:
    lines = []
    for m in turn.messages:
        content = m.content if len(m.content) <= limit else m.content[: limit - 3] + "..."
        lines.append(f"{m.role}: {content}")
    lines += [f"{m.resource_id} r{m.prev_revision}->r{m.revision} {m.op}" for m in turn.mutations]
    return "\n".join(lines)


# -- tokens of a call ----------------------------------------------------------------------


@dataclass
class TokenTable:
    """The token views of a page, compact: each call lists its new tokens (prompt delta, then
    output) as [piece, logprob or None, attempt, policy index, turn]; pieces are shared."""

    pieces: list[str] = field(default_factory=list)
    policies: list[str] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    _piece_index: dict[str, int] = field(default_factory=dict)

    def _piece(self, text: str) -> int:
        index = self._piece_index.get(text)
        if index is None:
            index = self._piece_index[text] = len(self.pieces)
            self.pieces.append(text)
        return index

    def _policy(self, policy: str) -> int:
        if policy not in self.policies:
            self.policies.append(policy)
        return self.policies.index(policy)

    def add(self, call: CallView, decoder: Decoder) -> int:
        """The call's index in :attr:`calls`."""
        ids = [*call.prompt_delta.tolist(), *call.output_ids.tolist()]
        start, new = call.prefix_len, len(call.prompt_delta)
        logprobs = call.logprobs.tolist()
        segments = [s for s in call.segments if s.end > start]  # only the new tokens' (in order)
        starts = [s.start for s in segments]
        tokens = []
        for offset, token in enumerate(ids):
            at = bisect.bisect_right(starts, start + offset) - 1
            segment = segments[at] if at >= 0 and start + offset < segments[at].end else None
            logprob = logprobs[offset - new] if offset >= new else None
            policy = segment.policy_version if segment is not None else call.policy_version
            tokens.append(
                [
                    token,
                    self._piece(decoder.piece(call.policy_version, token)),
                    None if logprob is None or not math.isfinite(logprob) else round(logprob, 4),
                    segment.attempt if segment is not None else call.attempt,
                    self._policy(policy),
                    segment.turn if segment is not None else call.turn,
                ]
            )
        self.calls.append(
            {
                "call_id": call.call_id,
                "turn": call.turn,
                "attempt": call.attempt,
                "policy": call.policy_version,
                "prefix_len": call.prefix_len,
                "prompt_new": len(call.prompt_delta),
                # a 64-bit seed as text: JavaScript's numbers hold 53 bits
                "sampling": {
                    k: str(v) if isinstance(v, int) and not isinstance(v, bool) else v for k, v in call.sampling.items()
                },
                "finish_reason": call.finish_reason,
                "tokens": tokens,
            }
        )
        return len(self.calls) - 1

    def as_json(self) -> dict[str, Any]:
        return {"pieces": self.pieces, "policies": self.policies, "calls": self.calls}


# -- side-by-side diffs --------------------------------------------------------------------


@dataclass
class DiffSide:
    text: list[tuple[str, bool]]  # fragments of a line: (text, changed)
    css: str  # "", "del", "ins", "empty"


@dataclass
class Diff:
    title: str
    left_title: str
    right_title: str
    rows: list[tuple[DiffSide, DiffSide]]
    same: bool
    anchor: str


def turn_lines(turn: TurnView, decoder: Decoder) -> list[str]:
    """A turn as lines to compare: each call's output (decoded, or its ids), then its messages."""
    lines = []
    for call in turn.calls:
        text = decoder.text(call.policy_version, call.output_ids.tolist())
        lines.append(f"model output: {text if text is not None else call.output_ids.tolist()}")
    for m in turn.messages:
        for i, line in enumerate(m.content.splitlines() or [""]):
            lines.append(f"{m.role}: {line}" if i == 0 else f"    {line}")
    if turn.reward is not None:
        lines.append(f"reward {turn.reward:.4f}")
    return lines


def side_by_side(left: list[str], right: list[str]) -> list[tuple[DiffSide, DiffSide]]:
    rows: list[tuple[DiffSide, DiffSide]] = []
    for op, a0, a1, b0, b1 in difflib.SequenceMatcher(None, left, right, autojunk=False).get_opcodes():
        if op == "equal":
            rows += [(DiffSide([(line, False)], ""), DiffSide([(line, False)], "")) for line in left[a0:a1]]
            continue
        olds, news = left[a0:a1], right[b0:b1]
        for i in range(max(len(olds), len(news))):
            old = olds[i] if i < len(olds) else None
            new = news[i] if i < len(news) else None
            if old is not None and new is not None:
                a, b = _words(old, new)
                rows.append((DiffSide(a, "del"), DiffSide(b, "ins")))
            elif old is not None:
                rows.append((DiffSide([(old, True)], "del"), DiffSide([], "empty")))
            elif new is not None:
                rows.append((DiffSide([], "empty"), DiffSide([(new, True)], "ins")))
    return rows


def _words(old: str, new: str) -> tuple[list[tuple[str, bool]], list[tuple[str, bool]]]:
    """Both lines as fragments, the words that differ marked."""
    a, b = re.split(r"(\s+|[(){}\[\],.:;=\"'])", old), re.split(r"(\s+|[(){}\[\],.:;=\"'])", new)
    left: list[tuple[str, bool]] = []
    right: list[tuple[str, bool]] = []
    for op, a0, a1, b0, b1 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if a1 > a0:
            left.append(("".join(a[a0:a1]), op != "equal"))
        if b1 > b0:
            right.append(("".join(b[b0:b1]), op != "equal"))
    return left, right


def diffs(timeline: Timeline, decoder: Decoder, origin: Timeline | None) -> list[Diff]:
    """A diff per redone turn (against the version a restart discarded) and per turn a fork ran
    after its fork point (against its origin's turn of that index, if the origin is in this journal)."""
    out = []
    for turn in timeline.turns:
        if turn.redo_of is None:
            continue
        old = next(
            (t for t in timeline.turns if t.turn == turn.turn and t.attempt == turn.redo_of and t.discarded_by),
            None,
        )
        if old is None:
            continue
        left, right = turn_lines(old, decoder), turn_lines(turn, decoder)
        out.append(
            Diff(
                f"turn {turn.turn}: redone by attempt {turn.attempt} after a restart discarded attempt "
                f"{old.attempt}'s version",
                f"attempt {old.attempt} (discarded)",
                f"attempt {turn.attempt} (redone)",
                side_by_side(left, right),
                left == right,
                f"diff-{card_id(turn)}",
            )
        )
    forked = timeline.forked_from
    if forked and origin is not None:
        at = whole_number(forked.rpartition("@")[2])
        at = -1 if at is None else at
        kept = {t.turn: t for t in origin.turns if t.discarded_by is None}
        for turn in timeline.turns:
            if turn.copied_from is not None or turn.turn <= at or turn.discarded_by is not None:
                continue
            theirs = kept.get(turn.turn)
            if theirs is None:
                continue
            left, right = turn_lines(theirs, decoder), turn_lines(turn, decoder)
            out.append(
                Diff(
                    f"turn {turn.turn}: the fork against its origin {origin.rollout_id}",
                    f"{origin.rollout_id} (origin), attempt {theirs.attempt}",
                    f"{timeline.rollout_id} (fork), attempt {turn.attempt}",
                    side_by_side(left, right),
                    left == right,
                    f"diff-{card_id(turn)}",
                )
            )
    return out
