"""Is a journal's training data what the model sampled? Measured from the journal itself.

Per finished rollout, folding its committed, unfenced events as restore and ``export-training``
do (:class:`RolloutState`):

* every call with a parent starts with the parent's whole prompt+output (``prefix_len`` equals
  it), unless it says it starts a new sequence: else the call *drifted* and the parent's sampled
  tokens after ``prefix_len`` are missing from the training record;
* every token the calls of the final conversation sampled is under the record's loss mask, at
  a run labelled with its call, with the logprob the call journaled;
* optionally (:class:`LogprobRecompute`), each journaled logprob against one transformers
  forward pass over the call's prompt + output, at the call's own sampling parameters and
  constraint, as the record says they were computed (``processed``: after the mask,
  temperature, top-k and top-p, renormalized; ``raw``: log_softmax of the logits).

``bench/training_data.py`` prints these figures per backend, and the property test of
``tests/participants/model/test_training_data.py`` asserts them on journals of every backend.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rollout_journal.journal.events import (
    CONTINUATION_NEW_SEQUENCE,
    LOGPROB_RAW,
    ModelCall,
    RolloutFinished,
    TrainingRecord,
)
from rollout_journal.journal.journal import ReadReport
from rollout_journal.journal.open import open_journal
from rollout_journal.participants.rollout.state import RolloutState, full_prompt

__all__ = ["CallSample", "LogprobRecompute", "TrainingDataCheck", "check_training_data", "journal_samples"]


@dataclass
class CallSample:
    """One model call of a finished rollout's final conversation, as the journal holds it."""

    rollout_id: str
    call: ModelCall
    prompt: np.ndarray  # the whole prompt
    parent_len: int | None  # the parent's prompt+output length (None: no parent)
    turn_actions: list[str]  # actions of the turns before this call's (to rebuild its constraint)

    @property
    def drifted(self) -> bool:
        return (
            self.parent_len is not None
            and self.call.continuation != CONTINUATION_NEW_SEQUENCE
            and self.call.prefix_len != self.parent_len
        )


# The allowed next ids of a constrained call after ``out`` (None: unconstrained), for the recompute.
AllowedIds = Callable[[CallSample, list[int]], np.ndarray | None]
ActionsOf = Callable[[CallSample], list[str]]


@dataclass
class TrainingDataCheck:
    """The figures of one journal (``bench/training_data.py --json`` prints them per backend)."""

    rollouts: int = 0
    calls: int = 0
    calls_drifted: int = 0
    sampled_tokens: int = 0
    sampled_tokens_in_loss_mask: int = 0
    sampled_tokens_with_their_logprob: int = 0
    logprob_max_abs_error: float | None = None  # None: not recomputed
    continuations: Counter[str] = field(default_factory=Counter)
    logprob_modes: Counter[str] = field(default_factory=Counter)  # of the sampled runs of the records
    template_mismatch_calls: int = 0
    problems: list[str] = field(default_factory=list)  # the first few, for a readable failure

    @property
    def all_sampled_tokens_in_loss_mask(self) -> bool:
        return self.sampled_tokens == self.sampled_tokens_in_loss_mask == self.sampled_tokens_with_their_logprob

    def note(self, problem: str) -> None:
        if len(self.problems) < 20:
            self.problems.append(problem)

    def as_json(self) -> dict[str, Any]:
        return {
            "rollouts": self.rollouts,
            "calls": self.calls,
            "calls_drifted": self.calls_drifted,
            "sampled_tokens": self.sampled_tokens,
            "sampled_tokens_in_loss_mask": self.sampled_tokens_in_loss_mask,
            "sampled_tokens_with_their_logprob": self.sampled_tokens_with_their_logprob,
            "logprob_max_abs_error": self.logprob_max_abs_error,
            "continuations": dict(sorted(self.continuations.items())),
            "logprob_modes": dict(sorted(self.logprob_modes.items())),
            "template_mismatch_calls": self.template_mismatch_calls,
            "problems": self.problems,
        }


def journal_samples(location: str) -> Iterator[tuple[TrainingRecord, list[CallSample]]]:
    """Each finished rollout's training record and the calls of its final conversation (oldest
    first), folded from the journal at ``location`` as ``export-training`` folds it."""
    report = ReadReport()
    states: dict[str, RolloutState] = {}
    calls: dict[str, dict[str, CallSample]] = {}
    with open_journal(location, writer="training-check", read_only=True) as journal:
        for item in journal.scan(report):
            event = item.event
            rollout_id = event.header.rollout_id
            state = states.get(rollout_id)
            if state is None:
                state = states[rollout_id] = RolloutState(rollout_id, event.header.group_id)
            if isinstance(event, ModelCall):
                parent = len(state.head_tokens) if state.head_call_id is not None else None
                sample = CallSample(
                    rollout_id, event, full_prompt(state.head_tokens, event), parent, list(state.actions)
                )
                calls.setdefault(rollout_id, {})[event.call_id] = sample
            state.apply(event)
            if isinstance(event, RolloutFinished):
                chain: list[CallSample] = []
                known = calls.pop(rollout_id, {})
                at = state.head_call_id
                while at is not None and at in known:
                    chain.append(known[at])
                    at = known[at].call.parent_call_id
                yield state.training_record(event.header, group_size=0), chain[::-1]
    if report.errors:
        raise ValueError(f"journal {location}: {len(report.errors)} records unreadable: {report.errors[:3]}")


def check_training_data(location: str, recompute: LogprobRecompute | None = None) -> TrainingDataCheck:
    """The figures of the journal at ``location`` (see the module's docstring)."""
    check = TrainingDataCheck()
    errors: list[float] = []
    for record, chain in journal_samples(location):
        check.rollouts += 1
        rollout_id = record.rollout_id
        by_call = {s.call_id: s for s in record.token_segments if s.generated}
        for sample in chain:
            call = sample.call
            check.calls += 1
            check.calls_drifted += sample.drifted
            check.continuations[call.continuation] += 1
            check.template_mismatch_calls += call.template_check is not None and not call.template_check.agrees
            if sample.drifted:
                check.note(f"{call.call_id}: prefix_len {call.prefix_len} of its parent's {sample.parent_len} tokens")
            n = len(call.output_ids)
            check.sampled_tokens += n
            segments = [s for s in record.token_segments if s.generated and s.call_id == call.call_id]
            covered = sum(s.end - s.start for s in segments)
            if not segments or covered != n:
                check.note(f"{call.call_id}: {covered} of its {n} sampled tokens are under the loss mask")
                continue
            start = segments[0].start
            ids, mask = record.input_ids[start : start + n], record.loss_mask[start : start + n]
            if not (np.array_equal(ids, call.output_ids) and mask.all()):
                check.note(f"{call.call_id}: the record's tokens at [{start}, {start + n}) are not its sampled ids")
                continue
            check.sampled_tokens_in_loss_mask += n
            same = np.asarray(record.logprobs[start : start + n]) == np.asarray(call.logprobs)
            check.sampled_tokens_with_their_logprob += int(same.sum())
            for s in segments:
                check.logprob_modes[s.logprob_mode] += s.end - s.start
            if recompute is not None and n:
                errors.append(recompute.max_error(sample))
        if by_call.keys() - {s.call.call_id for s in chain}:
            check.note(f"{rollout_id}: sampled runs of calls outside its final conversation")
    if recompute is not None:
        check.logprob_max_abs_error = max(errors, default=0.0)
    return check


class LogprobRecompute:
    """Each sampled token's logprob from one transformers forward pass (float32) over a call's
    prompt + output, at the call's sampling parameters and under its constraint.

    ``allowed``: the ids a constrained call allowed after ``out`` (for the torch backend's
    action trie, :meth:`trie`; for vLLM's structured-output choice, :meth:`choice_grammar`);
    None leaves every call unconstrained. ``weights``: the model folder of each policy
    version (default: ``model_dir`` for all)."""

    def __init__(
        self,
        model_dir: str | Path,
        allowed: AllowedIds | None = None,
        weights: dict[str, str | Path] | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.allowed = allowed
        self.weights = {k: Path(v) for k, v in (weights or {}).items()}
        self._models: dict[Path, Any] = {}

    def _model(self, policy_version: str) -> Any:
        import torch
        from transformers import AutoModelForCausalLM

        folder = self.weights.get(policy_version, self.model_dir)
        model = self._models.get(folder)
        if model is None:
            model = self._models[folder] = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        return model

    def logprobs(self, sample: CallSample) -> np.ndarray:
        """The recomputed logprob of every sampled token of the call (run by run: a call continued
        under other weights is scored by the weights each run names)."""
        import torch

        from rollout_journal.participants.model.sampling import processed_logprobs

        call = sample.call
        out = call.output_ids.tolist()
        ids = torch.tensor([[*sample.prompt.tolist(), *out]])
        scores = np.empty(len(out), dtype=np.float64)
        position = 0
        for run in call.output_segments():
            with torch.inference_mode():
                rows = self._model(run.policy_version)(input_ids=ids).logits[0, len(sample.prompt) - 1 : -1]
            for i in range(position, position + run.tokens):
                allowed = self.allowed(sample, out[:i]) if self.allowed and call.constrained else None
                if run.logprob_mode == LOGPROB_RAW:
                    row = rows[i] if allowed is None else rows[i].masked_fill(~_mask(allowed, rows.shape[-1]), -np.inf)
                    scores[i] = float(torch.log_softmax(row.float(), -1)[out[i]])
                else:
                    scores[i] = float(processed_logprobs(rows[i], call.sampling, allowed)[out[i]])
            position += run.tokens
        return scores

    def max_error(self, sample: CallSample) -> float:
        return float(np.max(np.abs(self.logprobs(sample) - np.asarray(sample.call.logprobs, dtype=np.float64))))

    @staticmethod
    def trie(tokenizer: Any, actions_of: ActionsOf) -> AllowedIds:
        """The torch backend's constraint: the trie of the actions offered at the call's turn."""
        from rollout_journal.participants.model.constraints import ActionTrie

        tries: dict[tuple[str, ...], ActionTrie] = {}

        def allowed(sample: CallSample, out: list[int]) -> np.ndarray | None:
            key = tuple(actions_of(sample))
            trie = tries.get(key) or tries.setdefault(key, ActionTrie.from_strings(tokenizer, list(key)))
            return trie.allowed(out)

        return allowed

    @staticmethod
    def choice_grammar(tokenizer: Any, actions_of: ActionsOf) -> AllowedIds:
        """vLLM's structured-output ``choice``: the ids whose bytes keep the output a byte prefix
        of some choice, and the eos once it equals one."""
        table = _token_bytes(tokenizer)

        def allowed(sample: CallSample, out: list[int]) -> np.ndarray | None:
            choices = [c.encode() for c in actions_of(sample)]
            done = b"".join(table.get(t) or b"" for t in out)
            ids = [t for t, b in table.items() if b is not None and any(c.startswith(done + b) for c in choices)]
            if done in choices:
                ids.append(tokenizer.eos_id)
            return np.asarray(sorted(ids), dtype=np.int64)

        return allowed


def _mask(allowed: np.ndarray, size: int) -> Any:
    import torch

    keep = torch.zeros(size, dtype=torch.bool)
    keep[torch.as_tensor(np.array(allowed)).long()] = True
    return keep


def _token_bytes(tokenizer: Any) -> dict[int, bytes | None]:
    """Every id's bytes under a byte-level BPE (GPT-2's byte <-> character table); None for added tokens."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    byte_of = {chr(c): b for b, c in zip(printable, chars)}
    raw = tokenizer._tok  # the tokenizers.Tokenizer
    added = {t.content for t in raw.get_added_tokens_decoder().values()}
    return {
        i: (None if text in added else bytes(byte_of[ch] for ch in text))
        for text, i in raw.get_vocab(with_added_tokens=True).items()
    }


def _requests(rollout_id: str, turn: int) -> Callable[[Any], Any]:
    """Mutation requests for re-running one turn of a rollout's environment (keys of its own)."""
    from rollout_journal.participants.resources import MutationRequest

    counter = iter(range(1 << 20))
    return lambda resource: MutationRequest(rollout_id, 1, 1, f"k{turn}/m{next(counter)}", resource.revision)


def workload_actions(config: Any) -> ActionsOf:
    """The actions the agent offered at a call's turn in a workload (``WorkloadConfig``): its
    rollout's environment brought to that turn by the journaled actions before it, with
    ``submit()`` held back as the agent holds it back (``allow_early_submit: false``)."""
    from rollout_journal.participants.environments import make_environment
    from rollout_journal.participants.workload.specs import workload_specs

    specs = {s.rollout_id: s for s in workload_specs(config)}
    memo: dict[tuple[str, tuple[str, ...]], list[str]] = {}

    def actions_of(sample: CallSample) -> list[str]:
        rollout_id, before = sample.rollout_id, tuple(sample.turn_actions)
        key = (rollout_id, before)
        if key not in memo:
            spec = specs[rollout_id]
            env = make_environment(spec.environment, spec.rollout_id, spec.environment_task())
            try:
                for turn, action in enumerate(before):
                    env.step(action, _requests(rollout_id, turn))
                actions = env.action_space()
            finally:
                env.close()
            turn = len(before)
            if not config.allow_early_submit and turn + 1 < config.max_turns and len(actions) > 1:
                actions = [a for a in actions if a != "submit()"]
            memo[key] = actions
        return memo[key]

    return actions_of


def recompute_for(config: Any) -> LogprobRecompute:
    """The recompute of a workload's calls (``WorkloadConfig``): its model folder, and the
    constraint its backend enforced (the trie on torch, vLLM's choice grammar otherwise)."""
    from rollout_journal.participants.model.tiny_model import model_folder
    from rollout_journal.participants.model.tokenizer import ChatTokenizer

    folder = model_folder(config.model)
    tokenizer = ChatTokenizer.from_folder(folder)
    actions = workload_actions(config)
    maker = LogprobRecompute.trie if config.model.backend == "torch" else LogprobRecompute.choice_grammar
    return LogprobRecompute(folder, maker(tokenizer, actions) if config.constrained_actions else None)
