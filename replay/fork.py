"""``fork``: a new lineage of a rollout that starts from the state after its turn K.

The fork is a rollout of its own, ``<origin>.fork-<n>``, written to the journal
(or to ``--journal-out``) as its first attempt, in one atomic append:

- ``AttemptStarted`` with ``forked_from = "<origin>@<K>"`` (and ``override``
  naming the seed when one is given), starting from the origin's initial
  conversation;
- the origin's turns 0..K of its current lineage: model calls copied as they
  are (so the fork's lineage names the origin's calls, and its first own call's
  parent is the origin's call of turn K), each mutation applied again to the
  fork's own resources (built from the task by the environment; the result and
  state digest must come out as the origin's did), and the turns' commits;
- a snapshot, as every new rollout's first commit has.

A registration record (see ``rollout_journal.participants.workload.specs``) names the fork's workload,
task and seed, so ``rollout-journal resume`` continues it from turn K+1 like
any unfinished rollout of its workload. Without a seed the fork samples with
its origin's turn seeds: it re-runs what the origin did, which is the check
that replay is deterministic; ``--seed`` makes it sample anew.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from rollout_journal.journal.anchoring import HeadSigner
from rollout_journal.journal.events import (
    AttemptStarted,
    Message,
    ModelCall,
    ResourceMutation,
    RolloutEvent,
    RolloutFinished,
    TurnCompleted,
    WorkloadRegistered,
)
from rollout_journal.journal.journal import ReadReport
from rollout_journal.journal.open import open_journal
from rollout_journal.participants.environments import Environment, make_environment
from rollout_journal.participants.resources import MutationRecord, MutationRequest, Recovery
from rollout_journal.participants.rollout import (
    RolloutState,
    StateFoldError,
    head_checkpoint,
    mutation_event,
    mutation_record,
    snapshot_of,
)
from rollout_journal.participants.workload.specs import Fork, forks_in, next_fork_id, resolve_spec
from rollout_journal.replay.errors import ForkError, NoSuchTurnError
from rollout_journal.replay.progress import Progress
from rollout_journal.replay.source import ReplaySource

WRITER_PREFIX = "fork-"  # + a fresh id: the writer slot of one fork command (Kafka: its transactional.id),
# its own so that it fences no worker and no other fork writing to the same cluster


@dataclass
class _Turn:
    events: list[RolloutEvent]  # model calls and mutations, then the TurnCompleted
    last: bool = False  # the rollout finished with it


@dataclass
class ForkResult:
    origin: str
    fork_id: str
    at_turn: int
    seed: int | None
    journal: str
    workload: str
    turns_copied: int
    calls_copied: int
    mutations_reapplied: int
    head_call_id: str | None  # the parent of the fork's first own call
    report: ReadReport = field(default_factory=ReadReport)

    @property
    def forked_from(self) -> str:
        return f"{self.origin}@{self.at_turn}"

    def as_json(self) -> dict[str, Any]:
        doc = {k: v for k, v in self.__dict__.items() if k != "report"}
        return doc | {
            "forked_from": self.forked_from,
            "next_turn": self.at_turn + 1,
            "continue_with": self.continue_with(),
        }

    def continue_with(self) -> str:
        """The command that continues the fork, quoted for pasting into a shell."""
        return f"rollout-journal resume --journal {shlex.quote(self.journal)}"

    def text(self) -> Iterator[str]:
        seeds = (
            f"seed {self.seed}" if self.seed is not None else f"the turn seeds of {self.origin} (re-runs what it did)"
        )
        yield (
            f"forked {self.origin} after turn {self.at_turn} as {self.fork_id} in {self.journal}: turns 0-"
            f"{self.at_turn} copied ({self.calls_copied} model calls, {self.mutations_reapplied} mutations "
            f"applied again to its own resources)"
        )
        yield (
            f"its lineage continues from call {self.head_call_id or '-'}; from turn {self.at_turn + 1} on it "
            f"samples with {seeds}"
        )
        yield f"continue it: {self.continue_with()}"


def fork_rollout(
    source: ReplaySource,
    rollout_id: str,
    at_turn: int,
    *,
    seed: int | None = None,
    journal_out: str | None = None,
    progress: Progress | None = None,
) -> ForkResult:
    """Fork ``rollout_id`` after its turn ``at_turn`` into ``journal_out`` (default: the journal
    read). Raises :class:`NoSuchTurnError` for a turn its current lineage has not committed,
    :class:`ForkError` when there is nothing to re-run after it or its resources cannot be rebuilt."""
    config, origin_spec = resolve_spec(rollout_id, source.registrations())
    report = ReadReport()
    initial, turns, topology = _lineage_through(source, rollout_id, at_turn, report, progress)
    target_location = journal_out or source.location
    writer = WRITER_PREFIX + uuid.uuid4().hex[:12]
    # Blocks as the workload writes them (its snapshot_block_bytes 0 keeps them off the namespace).
    with open_journal(target_location, writer=writer, snapshot_block_bytes=config.snapshot_block_bytes) as target:
        target_index = target.snapshots()
        taken = (
            set(target_index.workloads)
            | set(target_index.snapshots)
            | set(target_index.fences)
            | set(source.registrations())
        )
        fork_id = next_fork_id(rollout_id, taken)
        root = _root_workload(rollout_id, source)
        fork = Fork(fork_id, rollout_id, at_turn, seed, root, config.model_dump_json())
        env = make_environment(origin_spec.environment, fork_id, origin_spec.task_seed)
        try:
            if env.recovery is Recovery.RESTART_ONLY:
                raise ForkError(
                    f"rollout {rollout_id} runs on environment {origin_spec.environment!r}, whose "
                    "resources are restart_only: a fork could not continue from a turn (resume "
                    "would start it over from turn 0)"
                )
            state, events, reapplied = _fork_events(
                fork, origin_spec.group_id, initial, turns, topology, env, writer, HeadSigner.from_environment()
            )
            exports = {rid: r.export_state() for rid, r in env.resources.items() if r.supports_export}
        finally:
            env.close()
        target.append(events, snapshot_of(state, exports, writer, target.snapshot_block_bytes)).result()
        for registration in _registrations_needed(rollout_id, source, target_index.workloads):
            target.register_workload(registration).result()
        target.register_workload(fork.registration(topology, writer)).result()
    calls = sum(isinstance(e, ModelCall) for e in events)
    return ForkResult(
        rollout_id,
        fork_id,
        at_turn,
        seed,
        target_location,
        root,
        len(turns),
        calls,
        reapplied,
        state.head_call_id,
        report,
    )


def _lineage_through(
    source: ReplaySource, rollout_id: str, at_turn: int, report: ReadReport, progress: Progress | None
) -> tuple[list[Message], list[_Turn], str]:
    """The origin's current lineage through ``at_turn``: its initial conversation, its turns'
    events, and its topology."""
    state: RolloutState | None = None
    turns: list[_Turn] = []
    pending: list[RolloutEvent] = []
    topology = ""
    messages_before: list[Message] = []  # the conversation before the lineage's first turn
    for item in source.rollout_events(rollout_id, report, progress):
        event = item.event
        if state is None:
            state = RolloutState(rollout_id, event.header.group_id)
        starts_over = isinstance(event, AttemptStarted) and state.starts_over(event)
        try:
            state.apply(event)
        except StateFoldError as exc:
            raise StateFoldError(f"{exc} at {item.location}") from None
        if isinstance(event, AttemptStarted):
            topology, pending = event.topology, []
            if starts_over or state.next_turn == 0:  # the conversation (re)starts here
                turns, messages_before = [], list(state.messages)
        elif isinstance(event, (ModelCall, ResourceMutation)):
            pending.append(event)
        elif isinstance(event, TurnCompleted):
            turns.append(_Turn([*pending, event]))
            pending = []
        elif isinstance(event, RolloutFinished) and turns:
            turns[-1].last = True
    committed = len(turns)
    if not 0 <= at_turn < committed:
        raise NoSuchTurnError(
            f"rollout {rollout_id} has committed turns 0-{committed - 1} in its current lineage; "
            f"it cannot be forked after turn {at_turn}"
        )
    if turns[at_turn].last:
        raise ForkError(
            f"turn {at_turn} is the last of rollout {rollout_id} (it finished there): nothing would "
            f"run after it; fork after an earlier turn"
        )
    return messages_before, turns[: at_turn + 1], topology


def _fork_events(
    fork: Fork,
    group_id: str,
    initial: list[Message],
    turns: list[_Turn],
    topology: str,
    env: Environment,
    writer: str,
    signer: HeadSigner | None,
) -> tuple[RolloutState, list[RolloutEvent], int]:
    """The fork's first attempt, applied to its state as it is built (as the live path does; with
    a signing key, each turn that mutates is anchored as a live turn is)."""
    state = RolloutState(fork.rollout_id, group_id)
    events: list[RolloutEvent] = []

    def applied(event: RolloutEvent) -> None:
        state.apply(event)
        events.append(event)

    override = None if fork.seed is None else json.dumps({"seed": fork.seed})
    applied(
        AttemptStarted(
            state.header(writer, turn=0, attempt=state.next_attempt, epoch=state.next_epoch),  # 1, 1: a new rollout
            0,
            topology,
            f"fork of {fork.origin} after its turn {fork.at_turn}: turns 0-{fork.at_turn} copied",
            initial,
            override,
            fork.forked_from,
        )
    )
    env.fence(fork.rollout_id, state.epoch)
    reapplied = 0
    for turn in turns:
        for event in turn.events:
            if isinstance(event, ModelCall):
                applied(dataclasses.replace(event, header=state.header(writer)))
            elif isinstance(event, ResourceMutation):
                applied(mutation_event(state.header(writer), _reapply(fork, env, event, state)))
                reapplied += 1
            elif isinstance(event, TurnCompleted):
                if signer is not None and any(isinstance(e, ResourceMutation) for e in turn.events):
                    applied(head_checkpoint(signer, state, env.resources, writer, state.next_turn))
                applied(dataclasses.replace(event, header=state.header(writer), resource_revisions=env.revisions()))
    return state, events, reapplied


def _reapply(fork: Fork, env: Environment, event: ResourceMutation, state: RolloutState) -> MutationRecord:
    """The origin's mutation, applied to the fork's own resource; it must do what it did then."""
    origin = mutation_record(event)
    name = origin.resource_id.rpartition("/")[2]
    resource = env.resources.get(f"{fork.rollout_id}/{name}")
    if resource is None:
        raise ForkError(
            f"the fork's environment has no resource {name!r} for the mutation of {origin.resource_id} "
            f"at revision {origin.revision}"
        )
    key = origin.idempotency_key
    key = fork.rollout_id + key[len(fork.origin) :] if key.startswith(fork.origin + "/") else f"{fork.rollout_id}/{key}"
    request = MutationRequest(fork.rollout_id, state.attempt, state.epoch, key, resource.revision)
    record = resource.mutate(request, origin.op, origin.args)
    if (record.revision, record.result, record.state_digest) != (origin.revision, origin.result, origin.state_digest):
        raise ForkError(
            f"applying {origin.op} of {origin.resource_id} revision {origin.revision} to the fork's "
            f"resource gave revision {record.revision}, result {record.result}, digest "
            f"{record.state_digest[:12]} instead of what the origin journaled; the resource is not "
            "deterministic, so the fork cannot start from this turn"
        )
    return record


def _root_workload(rollout_id: str, source: ReplaySource) -> str:
    """The workload a rollout (or the fork it is) descends from."""
    forks = forks_in(source.registrations())
    while rollout_id in forks:
        if forks[rollout_id].workload:
            return forks[rollout_id].workload
        rollout_id = forks[rollout_id].origin
    for name, registration in source.registrations().items():
        if rollout_id in registration.rollout_ids and Fork.from_registration(registration) is None:
            return name
    raise ForkError(f"no workload registration names rollout {rollout_id}")


def _registrations_needed(
    rollout_id: str, source: ReplaySource, present: Mapping[str, WorkloadRegistered]
) -> list[WorkloadRegistered]:
    """The registrations of the forks the origin descends through (a fork of a fork), which a
    target journal other than the source lacks. The workload's own is not copied: a journal of
    forks only is one `resume` continues the forks of (see ``rollout_journal.participants.workload.runner``)."""
    needed = []
    forks = forks_in(source.registrations())
    name = rollout_id
    while name in forks:
        if name not in present:
            needed.append(source.registrations()[name])
        name = forks[name].origin
    return list(reversed(needed))
