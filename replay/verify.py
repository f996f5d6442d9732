"""``rollout-journal verify [RESOURCE]``: re-apply the journaled mutations of event-sourced
resources to fresh resources and compare what they produce with what was journaled.

A rollout's environment is rebuilt from the workload that registered it (the
``WorkloadRegistered`` record's spec gives its environment and task seed), so the
resources start exactly where the live ones did. Each journaled mutation is then
re-applied with ``Resource.replay``, the same code restore uses, which compares the
revision, the state digest, the result and the chain hash with the journal's. A
rollout that starts over (``RolloutProgress.starts_over``) gets a fresh environment:
a new life. At ``RolloutFinished`` the rebuilt digests are compared with the ones the
finished rollout recorded. The first divergence of each resource is reported, naming
the record; that resource is not followed further.

Only event-sourced resources are verified: the state of an exportable or restart-only
resource is not a fold of its mutations (``audit`` still checks their chains).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from rollout_journal.journal.errors import NotInJournalError
from rollout_journal.journal.events import AttemptStarted, ResourceMutation, RolloutFinished, WorkloadRegistered
from rollout_journal.journal.journal import JournaledEvent, ReadReport
from rollout_journal.participants.environments import Environment, make_environment
from rollout_journal.participants.resources import Recovery, ResourceError
from rollout_journal.participants.rollout import RolloutProgress, StateFoldError, mutation_record
from rollout_journal.participants.workload.specs import RolloutSpec, registered_specs
from rollout_journal.replay.progress import Progress
from rollout_journal.replay.source import open_replay

__all__ = ["Divergence", "MutationVerifier", "VerifyReport", "rollout_specs"]


@dataclass(frozen=True)
class Divergence:
    """Where re-applying a resource's mutations first differed from the journal."""

    resource_id: str
    rollout_id: str
    revision: int
    location: str
    reason: str

    def __str__(self) -> str:
        return f"{self.resource_id} r{self.revision} at {self.location}: {self.reason}"


@dataclass
class VerifyReport:
    rollouts: int = 0  # rollouts with at least one event-sourced resource re-applied
    resource_lives: int = 0  # resource lives re-applied
    mutations_replayed: int = 0
    divergences: list[Divergence] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # resource or rollout -> why it was not verified
    read_problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.divergences and not self.read_problems

    def as_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["ok"] = self.ok
        doc["first_divergence"] = asdict(self.divergences[0]) if self.divergences else None
        return doc


def rollout_specs(workloads: Mapping[str, WorkloadRegistered]) -> dict[str, RolloutSpec]:
    """Each registered rollout's spec (environment, task seed), from its workload's registration
    (a fork's: from its own, see ``rollout_journal.participants.workload.specs``)."""
    return registered_specs(workloads)


@dataclass
class _Rollout:
    progress: RolloutProgress
    env: Environment | None = None
    replayed: set[str] = field(default_factory=set)  # resources re-applied in this life


class MutationVerifier:
    """Feed it a journal's events in log order (fenced); ``finish`` it with the read report."""

    def __init__(self, specs: Mapping[str, RolloutSpec], resource: str | None = None) -> None:
        self.specs = specs
        self.resource = resource
        self.report = VerifyReport()
        self.seen_resource = resource is None
        self._rollouts: dict[str, _Rollout] = {}
        self._broken: set[str] = set()  # resources that diverged (or cannot be followed)
        self._recovery_of_kind: dict[str, Recovery] = {}  # learned from environments built so far
        self._verified_rollouts: set[str] = set()

    def feed(self, item: JournaledEvent) -> None:
        event, h = item.event, item.event.header
        rollout = self._rollouts.get(h.rollout_id)
        if rollout is None:
            rollout = self._rollouts[h.rollout_id] = _Rollout(RolloutProgress(h.rollout_id, h.group_id))
        if isinstance(event, AttemptStarted) and rollout.progress.starts_over(event):
            self._end_life(rollout)
        try:
            rollout.progress.apply(event)
        except StateFoldError as exc:
            self.report.skipped[h.rollout_id] = f"{exc} at {item.location}; run `rollout-journal audit`"
            self._end_life(rollout)
            return
        if isinstance(event, ResourceMutation):
            self._mutation(rollout, event, str(item.location))
        elif isinstance(event, RolloutFinished):
            self._finished(rollout, event, str(item.location))

    def _mutation(self, rollout: _Rollout, event: ResourceMutation, where: str) -> None:
        rid, rollout_id = event.resource_id, event.header.rollout_id
        if self.resource is not None and rid != self.resource:
            return
        self.seen_resource = True
        if rid in self._broken or rollout_id in self.report.skipped:
            return
        if self._recovery_of_kind.get(event.kind, Recovery.EVENT_SOURCED) is not Recovery.EVENT_SOURCED:
            self._skip(rid, self._recovery_of_kind[event.kind])
            return
        env = self._environment(rollout, rollout_id)
        if env is None:
            return
        resource = env.resources.get(rid)
        if resource is None:
            self._diverged(
                rid,
                rollout_id,
                event.revision,
                where,
                f"environment {self.specs[rollout_id].environment!r} of rollout {rollout_id} has no "
                f"resource {rid!r} (known: {', '.join(sorted(env.resources))})",
            )
            return
        if resource.recovery is not Recovery.EVENT_SOURCED:
            self._skip(rid, resource.recovery)
            return
        try:
            resource.replay(mutation_record(event))
        except ResourceError as exc:
            self._diverged(rid, rollout_id, event.revision, where, str(exc))
            return
        self.report.mutations_replayed += 1
        rollout.replayed.add(rid)
        self._verified_rollouts.add(rollout_id)

    def _finished(self, rollout: _Rollout, event: RolloutFinished, where: str) -> None:
        """The finished rollout recorded every resource's digest: the rebuilt ones must match."""
        if rollout.env is not None:
            try:
                recorded = json.loads(event.result_json).get("resource_digests", {})
            except (ValueError, AttributeError):
                recorded = {}
            for rid, resource in rollout.env.resources.items():
                if (
                    rid not in recorded
                    or rid in self._broken
                    or resource.recovery is not Recovery.EVENT_SOURCED
                    or (self.resource is not None and rid != self.resource)
                ):
                    continue
                if resource.state_digest() != recorded[rid]:
                    self._diverged(
                        rid,
                        event.header.rollout_id,
                        resource.revision,
                        where,
                        f"the rebuilt state digest {resource.state_digest()[:12]} differs from the digest "
                        f"{recorded[rid][:12]} the finished rollout recorded",
                    )
        self._end_life(rollout)

    def _environment(self, rollout: _Rollout, rollout_id: str) -> Environment | None:
        if rollout.env is None:
            spec = self.specs.get(rollout_id)
            if spec is None:
                self.report.skipped[rollout_id] = (
                    "no WorkloadRegistered record names this rollout, so its environment is unknown"
                )
                return None
            rollout.env = make_environment(spec.environment, rollout_id, spec.environment_task())
            for resource in rollout.env.resources.values():
                self._recovery_of_kind[resource.kind] = resource.recovery
        return rollout.env

    def _skip(self, resource_id: str, recovery: Recovery) -> None:
        self.report.skipped.setdefault(
            resource_id, f"{recovery.value}: its state is not a fold of its mutations (audit checks its chain)"
        )

    def _diverged(self, resource_id: str, rollout_id: str, revision: int, where: str, reason: str) -> None:
        self.report.divergences.append(Divergence(resource_id, rollout_id, revision, where, reason))
        self._broken.add(resource_id)

    def _end_life(self, rollout: _Rollout) -> None:
        if rollout.env is not None:
            rollout.env.close()  # a sandbox's subprocess, say
            rollout.env = None
        self.report.resource_lives += len(rollout.replayed - self._broken)
        rollout.replayed = set()

    def finish(self, read: ReadReport) -> VerifyReport:
        for rollout in self._rollouts.values():
            self._end_life(rollout)
        self.report.rollouts = len(self._verified_rollouts)
        self.report.read_problems = [str(e) for e in read.errors]
        return self.report


def verify_journal(
    location: str, resource: str | None = None, progress: Progress | None = None
) -> tuple[VerifyReport, bool]:
    """Verify a whole journal; (report, whether ``resource`` was found)."""
    read = ReadReport()
    with open_replay(location) as source:
        verifier = MutationVerifier(rollout_specs(source.registrations()), resource)
        try:
            for item in source.scan(read, progress):
                verifier.feed(item)
        finally:
            report = verifier.finish(read)
    return report, verifier.seen_resource


# -- the command line ---------------------------------------------------------------


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "verify",
        help="re-apply event-sourced resources' mutations and compare state digests (reads only)",
        description="Rebuilds each rollout's environment from its workload's registration, re-applies the "
        "journaled mutations of every event-sourced resource and compares revisions, state digests, "
        "results and chain hashes with the journal's. Reports the first divergence of each resource, "
        "naming the record. Exit code 1 when one is found.",
    )
    p.add_argument("resource", nargs="?", help="verify only this resource (e.g. demo-g0-s0/mail)")
    from rollout_journal.replay.cli.options import add_journal_argument

    add_journal_argument(p)
    p.add_argument("--json", action="store_true", help="the report as JSON")


def run_command(args: argparse.Namespace) -> int:
    from rollout_journal.replay.cli.options import journal_location
    from rollout_journal.replay.terminal import BarProgress

    location = journal_location(args)
    report, found = verify_journal(location, args.resource, BarProgress("verify"))
    if not found:
        raise NotInJournalError(
            f"no mutation of resource {args.resource!r} in journal {location} "
            "(`rollout-journal audit` lists every resource)"
        )
    if args.json:
        print(json.dumps(report.as_json(), indent=1))
        return 0 if report.ok else 1
    by_reason: dict[str, list[str]] = {}
    for what, why in sorted(report.skipped.items()):
        by_reason.setdefault(why, []).append(what)
    for why, skipped in by_reason.items():  # thousands of sandbox rollouts make one line, not thousands
        more = f" and {len(skipped) - 3} more" if len(skipped) > 3 else ""
        print(f"skipped {', '.join(skipped[:3])}{more}: {why}")
    for problem in report.read_problems:
        print(f"PROBLEM {problem}")
    if report.divergences:
        print(f"first divergence: {report.divergences[0]}")
        for other in report.divergences[1:]:
            print(f"also diverged: {other}")
    verdict = "no divergence" if report.ok else f"{len(report.divergences)} resource(s) DIVERGED"
    print(
        f"{verdict}: {report.mutations_replayed} mutations of {report.resource_lives} event-sourced resource "
        f"lives re-applied over {report.rollouts} rollouts; state digests match the journal's"
        if report.ok
        else f"{verdict}; {report.mutations_replayed} mutations re-applied in all"
    )
    return 0 if report.ok else 1
