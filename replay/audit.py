"""``rollout-journal audit [RESOURCE]``: every resource mutation, its hash chain checked
life by life, and the chain heads checked against their signed checkpoints.

What is checked, per resource and per life (a restart-only resource begins a new
chain each time its rollout starts over, which ``RolloutProgress.starts_over``
decides, as it did live):

- each mutation follows its predecessor (``prev_revision``): a hole is a *gap*, a
  revision that comes back is a *duplicate*, one that turns up after its successor
  is *reordered*;
- each mutation's chain hash is ``sha256(previous hash || its own content)``: a
  record whose content no longer matches is *altered* (only that record is named:
  the chain goes on from the journaled hash);
- no mutation comes from a fenced epoch (the readers' fence drops them: listed);
- every ``TurnCompleted`` names the revisions the chain has reached: a turn that
  names a later revision means mutations were dropped (a *dropped tail*);
- every ``HeadCheckpoint`` verifies under the auditor's public key and signs the
  heads the chain has at that point. A chain recomputed without the key no longer
  matches its signed heads; mutations after the last checkpoint are *unanchored*;
- with ``--witness`` (the JSON of an earlier audit), every head seen then is still
  there, unchanged. Nothing inside a journal shows that it was cut back at a commit
  boundary, signed heads and all; a transparency log's witnesses answer that, and so
  does this.

Problems name the exact record (topic/partition/offset or file/position). Memory
stays bounded by the number of resources and rollouts, not by the journal's length.
"""

from __future__ import annotations

import argparse
import json
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rollout_journal.journal.anchoring import VERIFY_KEY_ENV, HeadVerifier
from rollout_journal.journal.errors import ConfigurationError, NotInJournalError
from rollout_journal.journal.events import HeadCheckpoint, ResourceMutation, RolloutFinished, TurnCompleted
from rollout_journal.journal.journal import JournaledEvent, ReadReport
from rollout_journal.participants.resources import genesis_hash, link_hash
from rollout_journal.participants.rollout import RolloutProgress, StateFoldError, mutation_record

__all__ = ["AuditSummary", "AuditedMutation", "ChainAuditor", "ChainLife", "Problem", "audit_events"]

_RECENT = 32  # heads remembered per life, to name a duplicate's original and check a late record's link


@dataclass(frozen=True)
class AuditedMutation:
    """One journaled mutation as the audit lists it (arguments as journaled: secrets stay redacted)."""

    location: str
    ts_ms: int
    rollout_id: str
    attempt: int
    epoch: int
    turn: int
    resource_id: str
    kind: str
    op: str
    args: dict[str, Any]
    prev_revision: int
    revision: int
    life: int
    chain_hash: str
    status: str  # "ok", or the kind of the first problem found at this record

    @property
    def time(self) -> str:
        return datetime.fromtimestamp(self.ts_ms / 1000, tz=UTC).isoformat(timespec="milliseconds")


@dataclass
class Problem:
    """Something the audit found wrong, naming the record."""

    kind: str  # gap | duplicate | reordered | altered | fenced_epoch | sequence | dropped_tail | inserted |
    #            unanchored | anchor_mismatch | bad_signature | corrupt | truncated | rewritten (against a witness)
    message: str
    location: str | None = None
    resource_id: str | None = None
    rollout_id: str | None = None
    revision: int | None = None

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


@dataclass
class ChainLife:
    """One life of one resource's chain: where it stands, and how far it is anchored."""

    resource_id: str
    life: int
    rollout_id: str
    revision: int = 0
    head: str = ""
    first_revision: int | None = None
    mutations: int = 0
    last_location: str | None = None
    anchored_revision: int = 0  # the highest revision a (verified, if a key was given) checkpoint signed
    anchor_location: str | None = None
    recent: OrderedDict[int, tuple[str, str]] = field(default_factory=OrderedDict)  # revision -> (hash, location)
    missing: dict[int, Problem] = field(default_factory=dict)  # revisions of an open gap -> that gap
    keys: dict[str, tuple[int, str]] | None = field(default_factory=dict)  # idempotency key -> (revision, location);
    # None once the rollout finished: no more mutations are expected, and memory stays bounded

    def __post_init__(self) -> None:
        if not self.head:
            self.head = genesis_hash(self.resource_id)

    def summary(self) -> dict[str, Any]:
        return {
            "resource_id": self.resource_id,
            "life": self.life,
            "rollout_id": self.rollout_id,
            "first_revision": self.first_revision,
            "revision": self.revision,
            "head": self.head,
            "mutations": self.mutations,
            "anchored_revision": self.anchored_revision,
            "anchor_location": self.anchor_location,
        }


@dataclass
class AuditSummary:
    """What ``audit --json`` reports besides the mutations themselves."""

    chain_ok: bool
    anchored: str  # "yes": every mutation is covered by a checkpoint; "partly"; "no": no checkpoints at all
    anchors_verified: bool | None  # None: no public key was given, signatures unchecked
    key_id: str | None  # the auditor's key id
    checkpoints: int
    checkpoints_verified: int
    mutation_count: int
    resources: list[dict[str, Any]]
    problems: list[Problem]
    fenced: list[str]  # every event a reader dropped as fenced, described

    def as_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["problems"] = [asdict(p) for p in self.problems]
        return doc

    @property
    def status_line(self) -> str:
        chain = "chain ok" if self.chain_ok else f"chain NOT ok: {len(self.problems)} problem(s)"
        if self.anchored == "no":
            anchors = "heads are not anchored (no signed checkpoints)"
        elif self.anchors_verified is None:
            anchors = (
                f"heads anchored ({self.anchored}) by {self.checkpoints} checkpoints, signatures not "
                "checked (give --public-key)"
            )
        else:
            verdict = "all verify" if self.anchors_verified else "NOT all verify"
            key = "" if self.key_id is None else f" under key {self.key_id[:16]}"
            anchors = f"heads anchored ({self.anchored}) by {self.checkpoints} signed checkpoints, {verdict}{key}"
        return f"{chain}; {len(self.resources)} resource lives, {self.mutation_count} mutations; {anchors}"


class ChainAuditor:
    """Feed it a journal's events in log order (fenced, as ``Journal.scan`` yields them);
    ``finish`` it with the read report. ``resource`` restricts the audit to one resource."""

    def __init__(
        self,
        verifier: HeadVerifier | None = None,
        resource: str | None = None,
        witness: Mapping[tuple[str, int], tuple[int, str]] | None = None,
    ) -> None:
        """``witness``: heads an earlier audit saw, ``(resource, life) -> (revision, head)``
        (:func:`load_witness`): each must still be in the journal, unchanged."""
        self.verifier = verifier
        self.resource = resource
        self.witness = {k: v for k, v in (witness or {}).items() if resource is None or k[0] == resource}
        self._witnessed: set[tuple[str, int]] = set()
        self.problems: list[Problem] = []
        self._rollouts: dict[str, RolloutProgress] = {}
        self._chains: dict[str, ChainLife] = {}  # resource -> its current life
        self._ended: list[ChainLife] = []  # earlier lives
        self._mutators: dict[str, set[str]] = {}  # resource -> rollouts that mutated it
        self._touched: dict[str, set[str]] = {}  # rollout -> resources it mutated
        self._checkpoints = self._checkpoints_verified = self._mutations = 0
        self.seen_resource = resource is None

    # -- feeding -------------------------------------------------------------------
    def feed(self, item: JournaledEvent) -> AuditedMutation | None:
        """Audit one event; the mutation's row if it is one (of the audited resource)."""
        event, where = item.event, str(item.location)
        progress = self._progress(item)
        if isinstance(event, ResourceMutation):
            return self._mutation(event, where, progress.restarts)
        if isinstance(event, TurnCompleted):
            self._turn(event, where, progress.restarts)
        elif isinstance(event, RolloutFinished):
            for rid in self._touched.get(event.header.rollout_id, ()):
                if rid in self._chains:
                    self._chains[rid].keys = None
        elif isinstance(event, HeadCheckpoint):
            self._checkpoint(event, where, progress.restarts)
        return None

    def _progress(self, item: JournaledEvent) -> RolloutProgress:
        """Apply the event to its rollout's fold (the one rule for epochs and restarts); a seq
        that does not follow is reported once and the fold resynchronised on it."""
        h = item.event.header
        progress = self._rollouts.get(h.rollout_id)
        if progress is None:
            progress = self._rollouts[h.rollout_id] = RolloutProgress(h.rollout_id, h.group_id)
        try:
            progress.apply(item.event)
        except StateFoldError as exc:
            if self.resource is None or self.resource in self._touched.get(h.rollout_id, ()):
                self._problem("sequence", f"{exc} at {item.location}", str(item.location), rollout_id=h.rollout_id)
            if h.seq > progress.next_seq:  # a hole: carry on from here; a repeat is not applied twice
                progress.next_seq = h.seq
                progress.apply(item.event)
        return progress

    def _life(self, resource_id: str, life: int, rollout_id: str) -> ChainLife:
        """The resource's chain in ``life``; a later life ends the current one."""
        chain = self._chains.get(resource_id)
        if chain is None or chain.life < life:
            if chain is not None:
                self._end(chain)
            chain = self._chains[resource_id] = ChainLife(resource_id, life, rollout_id)
        return chain

    def _mutation(self, event: ResourceMutation, where: str, life: int) -> AuditedMutation | None:
        record = mutation_record(event)
        rid = record.resource_id
        self._mutators.setdefault(rid, set()).add(record.rollout_id)
        self._touched.setdefault(record.rollout_id, set()).add(rid)
        if self.resource is not None and rid != self.resource:
            return None
        self.seen_resource = True
        self._mutations += 1
        chain = self._life(rid, life, record.rollout_id)
        chain.mutations += 1
        found = len(self.problems)
        if chain.first_revision is None:
            chain.first_revision = record.revision
        if record.revision != record.prev_revision + 1:
            self._problem(
                "gap",
                f"{rid} record at {where} claims r{record.prev_revision} -> r{record.revision}, not one revision",
                where,
                rid,
                record.rollout_id,
                record.revision,
            )
        if chain.keys is not None and record.revision > chain.revision:
            first = chain.keys.setdefault(record.idempotency_key, (record.revision, where))
            if first[0] != record.revision:
                self._problem(
                    "duplicate",
                    f"{rid} r{record.revision} at {where} applies idempotency key "
                    f"{record.idempotency_key!r} a second time (first as r{first[0]} at "
                    f"{first[1]}): a mutation applied twice",
                    where,
                    rid,
                    record.rollout_id,
                    record.revision,
                )
        if record.prev_revision == chain.revision:
            if link_hash(chain.head, record.chain_payload()) != record.chain_hash:
                self._problem(
                    "altered",
                    f"{rid} r{record.revision} at {where}: its content no longer matches its "
                    f"chain hash {record.chain_hash[:12]} (the record was changed after it was "
                    "written)",
                    where,
                    rid,
                    record.rollout_id,
                    record.revision,
                )
            self._advance(chain, record.revision, record.chain_hash, where)
            self._against_witness(chain, where)
        elif record.prev_revision > chain.revision:
            after = f"after r{chain.revision} at {chain.last_location}" if chain.last_location else "at its start"
            gap = self._problem(
                "gap",
                f"{rid}: {_span(chain.revision + 1, record.prev_revision)} missing {after}, "
                f"before r{record.prev_revision} -> r{record.revision} at {where}",
                where,
                rid,
                record.rollout_id,
                chain.revision + 1,
            )
            for revision in range(chain.revision + 1, min(record.prev_revision, chain.revision + _RECENT) + 1):
                chain.missing[revision] = gap  # bounded: a forged huge gap must not cost memory
            self._advance(chain, record.revision, record.chain_hash, where)
            self._against_witness(chain, where)
        else:
            self._late(chain, record.revision, record.chain_hash, record.rollout_id, where)
        status = self.problems[found].kind if len(self.problems) > found else "ok"
        h = event.header
        return AuditedMutation(
            where,
            h.ts_ms,
            h.rollout_id,
            h.attempt,
            h.epoch,
            h.turn,
            rid,
            record.kind,
            record.op,
            record.args,
            record.prev_revision,
            record.revision,
            life,
            record.chain_hash,
            status,
        )

    def _late(self, chain: ChainLife, revision: int, chain_hash: str, rollout_id: str, where: str) -> None:
        """A revision at or below the chain's: a reordered record, or a duplicate."""
        rid = chain.resource_id
        gap = chain.missing.pop(revision, None)
        if gap is not None:  # the hole it left is explained: it comes late
            if not any(p is gap for p in chain.missing.values()):
                self.problems = [p for p in self.problems if p is not gap]
            self._problem(
                "reordered",
                f"{rid} r{revision - 1} -> r{revision} at {where} comes after r{chain.revision} "
                f"(at {chain.last_location}): records reordered",
                where,
                rid,
                rollout_id,
                revision,
            )
            return
        seen = chain.recent.get(revision)
        if seen is not None and seen[0] == chain_hash:
            self._problem(
                "duplicate",
                f"{rid} r{revision} at {where} repeats the record at {seen[1]}",
                where,
                rid,
                rollout_id,
                revision,
            )
        else:
            other = f" (r{revision} is at {seen[1]})" if seen is not None else ""
            self._problem(
                "duplicate",
                f"{rid}: a second r{revision - 1} -> r{revision} at {where}, after the chain "
                f"reached r{chain.revision}{other}: a fork of the chain",
                where,
                rid,
                rollout_id,
                revision,
            )

    @staticmethod
    def _advance(chain: ChainLife, revision: int, chain_hash: str, where: str) -> None:
        chain.revision, chain.head, chain.last_location = revision, chain_hash, where
        chain.recent[revision] = (chain_hash, where)
        while len(chain.recent) > _RECENT:
            chain.recent.popitem(last=False)

    def _against_witness(self, chain: ChainLife, where: str) -> None:
        """The chain reached a revision an earlier audit saw: its head must be the one seen then."""
        key = (chain.resource_id, chain.life)
        seen = self.witness.get(key)
        if seen is None or seen[0] != chain.revision:
            return
        self._witnessed.add(key)
        if seen[1] != chain.head:
            self._problem(
                "rewritten",
                f"{chain.resource_id} life {chain.life} r{chain.revision} at {where}: head "
                f"{chain.head[:12]}, but an earlier audit saw {seen[1][:12]}: the journal "
                "was rewritten since",
                where,
                chain.resource_id,
                chain.rollout_id,
                chain.revision,
            )

    def _turn(self, event: TurnCompleted, where: str, life: int) -> None:
        """A committed turn names the revision each resource reached: the chain must be there."""
        for rid, revision in event.resource_revisions.items():
            if self.resource is not None and rid != self.resource:
                continue
            chain = self._chains.get(rid)
            at = chain.revision if chain is not None and chain.life == life else 0
            if revision > at:
                self._problem(
                    "dropped_tail",
                    f"turn {event.header.turn} of {event.header.rollout_id} at {where} "
                    f"says {rid} reached r{revision}, but its chain holds r{at} only: "
                    f"{_span(at + 1, revision)} dropped",
                    where,
                    rid,
                    event.header.rollout_id,
                    at + 1,
                )
            elif revision < at:
                # below r0, a resource may have no chain at all (a forged or corrupt revision)
                last = chain.last_location if chain is not None else "no mutation of it read"
                self._problem(
                    "inserted",
                    f"turn {event.header.turn} of {event.header.rollout_id} at {where} says "
                    f"{rid} reached r{revision}, but its chain is at r{at} "
                    f"({last}): mutations were inserted",
                    where,
                    rid,
                    event.header.rollout_id,
                    revision + 1,
                )

    def _checkpoint(self, event: HeadCheckpoint, where: str, life: int) -> None:
        rollout_id = event.header.rollout_id
        heads = [h for h in event.heads if self.resource is None or h.resource_id == self.resource]
        if self.resource is not None and not heads:
            return
        self.seen_resource = True
        self._checkpoints += 1
        verified = True
        if self.verifier is not None:
            why = self.verifier.problem(event)
            if why is not None:
                verified = False
                self._problem(
                    "bad_signature", f"checkpoint of {rollout_id} at {where}: {why}", where, rollout_id=rollout_id
                )
            else:
                self._checkpoints_verified += 1
        if event.life != life:
            self._problem(
                "anchor_mismatch",
                f"checkpoint of {rollout_id} at {where} signs life {event.life}, but the rollout is in life {life}",
                where,
                rollout_id=rollout_id,
            )
            return
        for head in heads:
            chain = self._chains.get(head.resource_id)
            if chain is None or chain.life != life:
                chain = ChainLife(head.resource_id, life, rollout_id)  # not mutated in this life: the genesis head
                if head.revision > 0:
                    chain = self._life(head.resource_id, life, rollout_id)
            if head.revision > chain.revision:
                self._problem(
                    "dropped_tail",
                    f"checkpoint at {where} signs {head.resource_id} at r{head.revision}, "
                    f"but its chain holds r{chain.revision} only: "
                    f"{_span(chain.revision + 1, head.revision)} dropped",
                    where,
                    head.resource_id,
                    rollout_id,
                    chain.revision + 1,
                )
            elif head.revision < chain.revision:
                self._problem(
                    "inserted",
                    f"{head.resource_id} {_span(head.revision + 1, chain.revision)} (last at "
                    f"{chain.last_location}) precede the checkpoint at {where}, which signs "
                    f"r{head.revision}: mutations were inserted",
                    where,
                    head.resource_id,
                    rollout_id,
                    head.revision + 1,
                )
            elif head.chain_hash != chain.head:
                self._problem(
                    "anchor_mismatch",
                    f"{head.resource_id} r{head.revision}: the chain's head "
                    f"{chain.head[:12]} differs from the head {head.chain_hash[:12]} "
                    f"signed at {where}: the chain was recomputed or altered",
                    where,
                    head.resource_id,
                    rollout_id,
                    head.revision,
                )
            elif verified and head.revision > chain.anchored_revision:
                chain.anchored_revision, chain.anchor_location = head.revision, where

    # -- ending ----------------------------------------------------------------------
    def _problem(
        self,
        kind: str,
        message: str,
        location: str | None = None,
        resource_id: str | None = None,
        rollout_id: str | None = None,
        revision: int | None = None,
    ) -> Problem:
        problem = Problem(kind, message, location, resource_id, rollout_id, revision)
        self.problems.append(problem)
        return problem

    def _end(self, chain: ChainLife) -> None:
        chain.keys, chain.recent, chain.missing = None, OrderedDict(), {}  # nothing more can join an ended life
        self._ended.append(chain)

    def finish(self, report: ReadReport) -> AuditSummary:
        """Check what only the end shows (unanchored tails), add what the reader stepped over."""
        for error in report.errors:
            self._problem("corrupt", str(error), str(getattr(error, "location", "")) or None)
        fenced_lines = []
        for dropped in report.fenced:
            fenced_lines.append(str(dropped))
            if dropped.record == "ResourceMutation" and (
                self.resource is None or dropped.rollout_id in self._mutators.get(self.resource, ())
            ):
                self._problem(
                    "fenced_epoch",
                    f"a mutation from a fenced epoch: {dropped}",
                    str(dropped.location),
                    rollout_id=dropped.rollout_id,
                )
        lives = [*self._ended, *self._chains.values()]
        lives.sort(key=lambda c: (c.resource_id, c.life))
        reached = {(c.resource_id, c.life): c for c in lives}
        for (rid, life), (revision, head) in sorted(self.witness.items()):
            if (rid, life) in self._witnessed:
                continue
            chain = reached.get((rid, life))
            holds = (
                f"its chain ends at r{chain.revision} ({chain.last_location})"
                if chain is not None
                else "the journal holds none of it"
            )
            self._problem(
                "truncated",
                f"{rid} life {life}: an earlier audit saw r{revision} (head {head[:12]}), but "
                f"{holds}: the journal was cut back or rewritten since",
                chain.last_location if chain is not None else None,
                rid,
                chain.rollout_id if chain is not None else None,
                revision,
            )
        expect_anchors = self.verifier is not None or self._checkpoints > 0
        anchored_lives = 0
        for chain in lives:
            if chain.anchored_revision >= chain.revision:
                anchored_lives += 1
            elif expect_anchors:
                since = (
                    f"after the last checkpoint at {chain.anchor_location}"
                    if chain.anchor_location
                    else "and no checkpoint signs any of them"
                )
                self._problem(
                    "unanchored",
                    f"{chain.resource_id} life {chain.life}: "
                    f"{_span(chain.anchored_revision + 1, chain.revision)} (last at {chain.last_location}) are not covered by a "
                    f"{'verified ' if self.verifier else ''}signed checkpoint, {since}: "
                    "a checkpoint was dropped, or they were written without the key",
                    chain.last_location,
                    chain.resource_id,
                    chain.rollout_id,
                    chain.anchored_revision + 1,
                )
        if self._checkpoints == 0:
            anchored = "no"
        else:
            anchored = "yes" if anchored_lives == len(lives) else "partly"
        verified = (
            None
            if self.verifier is None
            else (self._checkpoints > 0 and self._checkpoints_verified == self._checkpoints)
        )
        return AuditSummary(
            chain_ok=not self.problems,
            anchored=anchored,
            anchors_verified=verified,
            key_id=self.verifier.key_id if self.verifier is not None else None,
            checkpoints=self._checkpoints,
            checkpoints_verified=self._checkpoints_verified,
            mutation_count=self._mutations,
            resources=[c.summary() for c in lives],
            problems=list(self.problems),
            fenced=fenced_lines,
        )


def _span(first: int, last: int) -> str:
    return f"r{first}" if first == last else f"r{first}..r{last}"


def audit_events(
    events: Iterable[JournaledEvent],
    report: ReadReport,
    verifier: HeadVerifier | None = None,
    resource: str | None = None,
    witness: Mapping[tuple[str, int], tuple[int, str]] | None = None,
) -> tuple[list[AuditedMutation], AuditSummary]:
    """Audit a whole stream at once (for a single rollout or a test; the CLI streams rows)."""
    auditor = ChainAuditor(verifier, resource, witness)
    rows = [row for item in events if (row := auditor.feed(item)) is not None]
    return rows, auditor.finish(report)


def row_json(row: AuditedMutation) -> str:
    doc = asdict(row)
    doc["time"] = row.time
    return json.dumps(doc)


def load_witness(path: str | None) -> dict[tuple[str, int], tuple[int, str]]:
    """The heads an earlier ``audit --json`` printed (its ``resources``), as a witness keeps them."""
    if not path:
        return {}
    try:
        doc = json.loads(Path(path).read_text())
        return {(r["resource_id"], int(r["life"])): (int(r["revision"]), str(r["head"])) for r in doc["resources"]}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigurationError(
            f"--witness {path}: not the JSON of an earlier `rollout-journal audit --json` ({type(exc).__name__}: {exc})"
        ) from None


def public_key_verifier(path_or_pem: str | None) -> HeadVerifier | None:
    """The auditor's key: ``--public-key`` if given, else ``ROLLOUT_JOURNAL_VERIFY_KEY``, else none."""
    if path_or_pem:
        return HeadVerifier.from_setting(path_or_pem, "--public-key")
    return HeadVerifier.from_environment()


# -- the command line ---------------------------------------------------------------


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "audit",
        help="every resource mutation; verify the hash chains and their signed heads (reads only)",
        description="Lists every resource mutation (time, rollout, attempt, epoch, operation, arguments as "
        "journaled, revision before and after), verifies each resource's hash chain life by life, "
        "and checks the signed chain-head checkpoints. Exit code 1 when a problem is found.",
    )
    p.add_argument("resource", nargs="?", help="audit only this resource (e.g. demo-g0-s0/mail)")
    from rollout_journal.replay.cli.options import add_journal_argument

    add_journal_argument(p)
    add_public_key_argument(p)
    p.add_argument(
        "--witness",
        metavar="JSON",
        help="the output of an earlier `audit --json`: every head it saw must still be in the journal, "
        "unchanged (catches a journal cut back at a commit boundary, which no chain can)",
    )
    p.add_argument("--json", action="store_true", help="one JSON document: mutations, chain_ok, problems, anchors")


def add_public_key_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--public-key",
        metavar="PEM",
        help=f"the writer's Ed25519 public key (a PEM file) to verify signed heads with; default ${VERIFY_KEY_ENV}",
    )


def run_command(args: argparse.Namespace) -> int:
    verifier = public_key_verifier(args.public_key)
    auditor = ChainAuditor(verifier, args.resource, load_witness(args.witness))
    report = ReadReport()
    from rollout_journal.replay.cli.options import journal_location
    from rollout_journal.replay.source import open_replay
    from rollout_journal.replay.terminal import BarProgress

    location = journal_location(args)
    with open_replay(location) as source:
        rows: Iterable[AuditedMutation] = (
            row for item in source.scan(report, BarProgress("audit")) if (row := auditor.feed(item)) is not None
        )
        if args.resource is not None:  # one resource's rows: few; held so an unknown resource prints no table
            rows = list(rows)
            if not auditor.seen_resource:
                raise NotInJournalError(
                    f"no mutation of resource {args.resource!r} in journal {location} "
                    "(`rollout-journal audit` without a resource lists every one)"
                )
        if args.json:
            print('{"mutations": [')
            for i, row in enumerate(rows):
                print(("," if i else "") + row_json(row))
            summary = auditor.finish(report)
            print("], " + json.dumps(summary.as_json(), indent=1)[1:])
        else:
            print(
                f"{'time (UTC)':<23} {'rollout':<18} {'att':>3} {'ep':>3} {'resource':<24} {'revision':>10} "
                f"{'life':>4}  operation"
            )
            for row in rows:
                args_text = json.dumps(row.args, ensure_ascii=False)
                args_text = args_text if len(args_text) <= 60 else args_text[:57] + "..."
                flag = "" if row.status == "ok" else f"   <- {row.status}"
                print(
                    f"{row.time[:23]:<23} {row.rollout_id:<18} {row.attempt:>3} {row.epoch:>3} {row.resource_id:<24} "
                    f"{f'r{row.prev_revision}->r{row.revision}':>10} {row.life:>4}  {row.op}({args_text}){flag}"
                )
            summary = auditor.finish(report)
            print()
            for life in summary.resources:
                anchor = (
                    f"anchored at r{life['anchored_revision']} ({life['anchor_location']})"
                    if life["anchor_location"]
                    else "not anchored"
                )
                print(
                    f"{life['resource_id']} life {life['life']}: r{life['first_revision']}..r{life['revision']} "
                    f"({life['mutations']} mutations), head {life['head'][:12]}, {anchor}"
                )
            for problem in summary.problems:
                print(f"PROBLEM {problem}")
            print(summary.status_line)
    return 0 if summary.chain_ok else 1
