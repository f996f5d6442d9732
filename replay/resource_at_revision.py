"""``replay state``: a resource's state at any revision, rebuilt from the journal.

The resource is built fresh from the workload's environment (the task the
journal's registration names) and brought to the revision by the resource's own
code: journaled mutations re-applied with ``Resource.replay``, which checks each
one's revision, state digest, result and chain hash against the journal. So the
state shown is the state the live resource had then, or an error naming the
revision where the journal and the resource disagree.

- event-sourced and restart-only resources: the fold of their mutations from the
  task's initial state (a restart-only resource's revisions count from 0 again
  in each life: each start over of the rollout; ``life`` picks one, the last by
  default);
- exportable resources: the export in the rollout's newest snapshot if it is at
  or below the revision (same life), then the mutations after it; otherwise the
  fold from the initial state.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from rollout_journal.journal.events import ResourceMutation
from rollout_journal.journal.journal import ReadReport
from rollout_journal.participants.environments import make_environment
from rollout_journal.participants.resources import MutationRecord, Recovery, Resource
from rollout_journal.participants.rollout import RolloutState, StateFoldError, mutation_record
from rollout_journal.participants.workload.specs import resolve_spec
from rollout_journal.replay.errors import NoSuchResourceError, NoSuchRevisionError
from rollout_journal.replay.progress import Progress
from rollout_journal.replay.source import ReplaySource


@dataclass
class ResourceAtRevision:
    """What ``replay state`` found."""

    resource_id: str
    rollout_id: str
    kind: str
    recovery: str
    life: int
    lives: int
    revision: int
    latest_revision: int  # the highest revision of that life the journal holds
    state: object
    state_digest: str
    chain_hash: str
    base: str  # what the fold started from
    replayed: int  # mutations re-applied on top of the base
    mutation: dict[str, Any] | None  # the mutation that made this revision (None: the initial state)
    report: ReadReport = field(default_factory=ReadReport)

    def as_json(self) -> dict[str, Any]:
        doc = dict(self.__dict__)
        del doc["report"]
        return doc

    def text(self) -> Iterator[str]:
        life = f" (life {self.life} of {self.lives})" if self.lives > 1 else ""
        yield (
            f"resource {self.resource_id} ({self.kind}, {self.recovery}) at revision {self.revision} of "
            f"{self.latest_revision}{life}"
        )
        yield f"rebuilt from {self.base}, then {self.replayed} journaled mutations re-applied and checked"
        if self.mutation is not None:
            m = self.mutation
            yield (
                f"made by {m['op']}({json.dumps(m['args'])}) in turn {m['turn']} of attempt {m['attempt']} "
                f"(epoch {m['epoch']}), key {m['idempotency_key']}"
            )
        yield f"state digest {self.state_digest}  chain {self.chain_hash}"
        yield json.dumps(self.state, indent=2, sort_keys=True)


def resource_state(
    source: ReplaySource, resource_id: str, revision: int, *, life: int | None = None, progress: Progress | None = None
) -> ResourceAtRevision:
    """The state of ``resource_id`` (``<rollout>/<name>``) at ``revision``. Raises
    ``NoSuchRolloutError``, :class:`NoSuchResourceError` or :class:`NoSuchRevisionError`
    naming what the journal holds, and ``ReplayDivergenceError`` naming the revision where
    re-applying a journaled mutation does not give what the journal recorded."""
    rollout_id, _, name = resource_id.rpartition("/")
    if not rollout_id or not name:
        raise NoSuchResourceError(f"resource id {resource_id!r} is not of the form <rollout>/<resource>")
    report = ReadReport()
    lives: list[list[MutationRecord]] = [[]]
    state: RolloutState | None = None
    turns: dict[tuple[int, int], int] = {}  # (life, revision) -> the turn of the mutation that made it
    for item in source.rollout_events(rollout_id, report, progress):
        event = item.event
        if state is None:
            state = RolloutState(rollout_id, event.header.group_id)
        try:
            state.apply(event)
        except StateFoldError as exc:
            raise StateFoldError(f"{exc} at {item.location}") from None
        while len(lives) <= state.restarts:  # the rollout started over: the resource's next life
            lives.append([])
        if isinstance(event, ResourceMutation) and event.resource_id == resource_id:
            lives[state.restarts].append(mutation_record(event))
            turns[(state.restarts, event.revision)] = event.header.turn
    _, spec = resolve_spec(rollout_id, source.registrations())
    env = make_environment(spec.environment, spec.rollout_id, spec.task_seed)
    try:
        resource = env.resources.get(resource_id)
        if resource is None:
            raise NoSuchResourceError(
                f"rollout {rollout_id} (environment {spec.environment!r}) has no resource "
                f"{resource_id!r}; its resources: {', '.join(sorted(env.resources))}"
            )
        chosen = len(lives) - 1 if life is None else life
        if not 0 <= chosen < len(lives):
            raise NoSuchRevisionError(
                f"rollout {rollout_id} has lives 0..{len(lives) - 1} (it started over "
                f"{len(lives) - 1} times); there is no life {chosen}"
            )
        records = lives[chosen]
        latest = records[-1].revision if records else 0
        if not 0 <= revision <= latest:
            raise NoSuchRevisionError(
                f"resource {resource_id} has revisions 0..{latest} in life {chosen} of this journal; "
                f"there is no revision {revision}"
            )
        base, base_revision = _base(source, rollout_id, resource, chosen, revision)
        replayed = 0
        for record in records:
            if base_revision < record.revision <= revision:
                resource.replay(record)
                replayed += 1
        made_by = next((r for r in records if r.revision == revision), None)
        return ResourceAtRevision(
            resource_id,
            rollout_id,
            resource.kind,
            resource.recovery.value,
            chosen,
            len(lives),
            revision,
            latest,
            resource.canonical_state(),
            resource.state_digest(),
            resource.chain_hash,
            base,
            replayed,
            None if made_by is None else made_by.to_dict() | {"turn": turns[(chosen, revision)]},
            report,
        )
    finally:
        env.close()


def _base(source: ReplaySource, rollout_id: str, resource: Resource, life: int, revision: int) -> tuple[str, int]:
    """Bring ``resource`` to its starting point; (what that was, its revision)."""
    if resource.recovery is Recovery.EXPORTABLE:
        loaded = source.snapshot_index().snapshots.get(rollout_id)
        if loaded is not None:
            snapshot = RolloutState.from_bytes(loaded.state, loaded.location)
            exported = snapshot.resource_states.get(resource.resource_id)
            if exported is not None and snapshot.restarts == life:
                exported_revision = int(json.loads(exported)["revision"])
                if exported_revision <= revision:
                    resource.import_state(exported)
                    return (
                        f"its export at revision {exported_revision} in the snapshot at {loaded.location}",
                        exported_revision,
                    )
    return "the task's initial state (revision 0)", 0
