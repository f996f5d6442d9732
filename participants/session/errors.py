"""What the session API refuses, each error naming the rollout, the attempt and the position.

The gateway turns each into one HTTP answer (``participants.remote.gateway.errors``); an
in-process agent catches them by type.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollout_journal.journal.errors import RolloutJournalError

__all__ = [
    "EffectNotDurableError",
    "NondeterminismError",
    "NotOwnerError",
    "OwnerMovingError",
    "RequestSummary",
    "RolloutFinishedError",
    "RolloutNotFoundError",
    "SessionError",
    "StaleAttemptError",
]


class SessionError(RolloutJournalError):
    """Base of the session API's refusals."""


@dataclass(frozen=True)
class RequestSummary:
    """One request as an error shows it: kind, digest and a short description."""

    kind: str  # "model" or "tool"
    digest: str
    describe: str

    def as_json(self) -> dict[str, str]:
        return {"kind": self.kind, "digest": self.digest, "describe": self.describe}

    @property
    def spelled(self) -> str:
        """How a message names it: the description, then the digest when there is one (a request
        whose prompt was not built has none)."""
        return f"{self.describe} (digest {self.digest[:12]})" if self.digest else self.describe


class NondeterminismError(SessionError):
    """A re-driven agent's effect at a position differs from the one the journal holds there
    (Temporal's TMPRL1100, DBOS's unexpected step): another kind, another request, or an effect
    past the end of a committed turn. Nothing was journaled or called; the session stays at that
    position, so a corrected agent can re-drive again."""

    def __init__(
        self,
        rollout_id: str,
        attempt: int,
        epoch: int,
        position: tuple[int, int],
        journaled: RequestSummary | None,
        now: RequestSummary,
        first_difference: str,
        journaled_ref: str = "",
        journaled_attempt: int = 0,
    ) -> None:
        turn, step = position
        where = f"the agent's {now.kind} call at turn {turn}, step {step}"
        if journaled is None:
            head = (
                f"rollout {rollout_id} attempt {attempt} (epoch {epoch}): {where} is past the end of committed "
                f"turn {turn}; the journal holds no effect there."
            )
            lines = [head, f"  this request: {now.spelled}"]
        else:
            head = f"rollout {rollout_id} attempt {attempt} (epoch {epoch}): {where} differs from the journal."
            lines = [
                head,
                f"  journaled (attempt {journaled_attempt}, {journaled_ref}): {journaled.kind} {journaled.spelled}",
                f"  this request: {now.kind} {now.spelled}",
            ]
        if first_difference:
            lines.append(f"  first difference: {first_difference}")
        lines.append(
            "An agent must make the same calls in the same order on a resumed attempt (README, 'Bring your own "
            "agent: the determinism contract'). Fix the agent and re-drive, fork the rollout with "
            f"`rollout-journal fork {rollout_id} --at-turn {turn}`, or restart it from turn 0."
        )
        super().__init__("\n".join(lines))
        self.rollout_id = rollout_id
        self.attempt = attempt
        self.epoch = epoch
        self.position = position
        self.journaled = journaled
        self.now = now
        self.first_difference = first_difference


class StaleAttemptError(SessionError):
    """The session's attempt was superseded: a newer attempt (``current_epoch``) fenced it. Its
    effects are refused from then on; nothing of this call was journaled."""

    def __init__(self, rollout_id: str, attempt: int, epoch: int, current_epoch: int, by: str = "") -> None:
        who = f" (by {by})" if by else ""
        super().__init__(
            f"rollout {rollout_id}: attempt {attempt} (epoch {epoch}) was fenced by epoch {current_epoch}{who}; "
            "its calls are refused: drive the newer attempt"
        )
        self.rollout_id = rollout_id
        self.attempt = attempt
        self.epoch = epoch
        self.current_epoch = current_epoch


class RolloutFinishedError(SessionError):
    """An effect past the end of a finished rollout (its journaled calls still replay)."""

    def __init__(self, rollout_id: str, turns: int, reward: float | None) -> None:
        super().__init__(
            f"rollout {rollout_id} is finished ({turns} turns, reward {reward}); a call past its end is refused "
            "(its journaled calls are still answered from the journal)"
        )
        self.rollout_id = rollout_id
        self.turns = turns
        self.reward = reward


class RolloutNotFoundError(SessionError):
    """No rollout of that id is open here, and sessions are not opened on first use."""

    def __init__(self, rollout_id: str) -> None:
        super().__init__(f"rollout {rollout_id} is not open here; open it first (POST /r/{rollout_id}/open)")
        self.rollout_id = rollout_id


class NotOwnerError(SessionError):
    """Another process owns the rollout's partition: only it writes the rollout."""

    def __init__(self, rollout_id: str, owner_url: str | None, owner_member: str = "") -> None:
        if owner_url:
            where = f"at {owner_url}; send its requests there"
        elif owner_member:
            # A group member that advertises no address is a fleet worker (or run/resume): it serves
            # no HTTP, and drives only the rollouts of the workloads it runs.
            where = (
                f"{owner_member}, a group member that serves no HTTP (a fleet worker, or run/resume): "
                "rollouts an agent drives through gateways need a namespace of their own, not one "
                "shared with workers"
            )
        else:
            where = "elsewhere (its address is unknown here); send its requests there"
        super().__init__(f"rollout {rollout_id} is owned by another writer {where}")
        self.rollout_id = rollout_id
        self.owner_url = owner_url
        self.owner_member = owner_member


class OwnerMovingError(SessionError):
    """The rollout's partition is changing owner; retry after ``retry_after_s``."""

    def __init__(self, rollout_id: str, retry_after_s: float) -> None:
        super().__init__(f"rollout {rollout_id}: its partition is changing owner; retry in {retry_after_s:g} s")
        self.rollout_id = rollout_id
        self.retry_after_s = retry_after_s


class EffectNotDurableError(SessionError):
    """The journal refused (or failed) the write of an effect: the call fails, and its result is
    never handed to the agent (only durable answers are)."""

    def __init__(self, rollout_id: str, what: str, cause: BaseException) -> None:
        super().__init__(f"rollout {rollout_id}: {what} could not be made durable ({type(cause).__name__}: {cause})")
        self.rollout_id = rollout_id
        self.cause = cause
