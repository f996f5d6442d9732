"""Constrained decoding over a finite action space.

A ``TokenConstraint`` tells a backend which token ids may come next given what
it has generated so far. ``ActionTrie`` is the one the agent uses: the valid
actions of a turn (tool-call strings), tokenized, stored as a trie, so whatever
the policy samples is exactly one valid action followed by EOS.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from rollout_journal.journal.errors import RolloutJournalError

if TYPE_CHECKING:
    from rollout_journal.participants.model.tokenizer import ChatTokenizer


class ConstraintViolation(RolloutJournalError, ValueError):
    """Generated ids left the constraint's language (a backend bug, or ids
    decoded under a different tokenizer than the one the constraint was built with)."""


@runtime_checkable
class TokenConstraint(Protocol):
    def allowed(self, generated_so_far: Sequence[int]) -> np.ndarray | None:
        """Allowed next token ids (int32, sorted), or None for no constraint."""
        ...

    def is_complete(self, generated_so_far: Sequence[int]) -> bool:
        """True once the generated ids form a finished sentence of the constraint."""
        ...


class _Node:
    __slots__ = ("allowed", "children", "terminal")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.terminal: int | None = None  # index of the action that ends here
        self.allowed: np.ndarray = np.zeros(0, dtype=np.int32)


_DONE = np.zeros(0, dtype=np.int32)


class ActionTrie:
    """Trie of the token sequences of valid actions; each must end in EOS.

    At a node where an action ends only EOS is allowed, unless that action's
    ids are also a prefix of a longer action: then EOS and the continuations are
    both allowed, so every listed action stays reachable. After EOS nothing is
    allowed and ``is_complete`` is True. Allowed-id arrays are built once per node,
    so a decoding step costs one dict walk over the ids generated so far.
    Duplicate actions are kept once (the first index).
    """

    def __init__(self, actions: Sequence[np.ndarray], eos_id: int, labels: Sequence[str] | None = None) -> None:
        if labels is not None and len(labels) != len(actions):
            raise ValueError(f"got {len(labels)} labels for {len(actions)} actions")
        if not actions:
            raise ValueError("an ActionTrie needs at least one action")
        self.eos_id = int(eos_id)
        self._root = _Node()
        self._actions: list[np.ndarray] = []
        self._labels: list[str] | None = [] if labels is not None else None
        for i, action in enumerate(actions):
            ids = np.asarray(action, dtype=np.int32)
            if ids.ndim != 1 or ids.size == 0:
                raise ValueError(f"action {i} must be a non-empty 1-D id sequence, got shape {ids.shape}")
            if (ids == self.eos_id).any():
                raise ValueError(f"action {i} contains the eos id {self.eos_id}; EOS may only end an action")
            node = self._root
            for t in ids.tolist():
                node = node.children.setdefault(t, _Node())
            if node.terminal is None:
                node.terminal = len(self._actions)
                self._actions.append(ids)
                if self._labels is not None and labels is not None:  # both or neither: set together above
                    self._labels.append(labels[i])
        self._freeze(self._root)

    @classmethod
    def from_strings(cls, tokenizer: ChatTokenizer, actions: Sequence[str]) -> ActionTrie:
        """Build from action strings, encoded exactly as ``tokenizer.encode`` does."""
        return cls([tokenizer.encode(a) for a in actions], tokenizer.eos_id, labels=list(actions))

    def __len__(self) -> int:
        return len(self._actions)

    @property
    def choices(self) -> list[str] | None:
        """The action strings (for a server's structured outputs), if built ``from_strings``."""
        return list(self._labels) if self._labels is not None else None

    @property
    def actions(self) -> list[np.ndarray]:
        """The distinct actions' token ids, in first-seen order (without EOS)."""
        return list(self._actions)

    def allowed(self, generated_so_far: Sequence[int]) -> np.ndarray:
        ids = _as_list(generated_so_far)
        if ids and ids[-1] == self.eos_id:
            self._walk(ids[:-1], require_terminal=True)
            return _DONE
        return self._walk(ids, require_terminal=False).allowed

    def is_complete(self, generated_so_far: Sequence[int]) -> bool:
        ids = _as_list(generated_so_far)
        return self.match(ids) is not None and bool(ids) and ids[-1] == self.eos_id

    def match(self, output_ids: Sequence[int] | np.ndarray) -> int | None:
        """Index of the action the ids spell (trailing EOS optional), else None."""
        ids = _as_list(output_ids)
        if ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        node = self._root
        for t in ids:
            child = node.children.get(t)
            if child is None:
                return None
            node = child
        return node.terminal

    def decode_action(self, output_ids: Sequence[int] | np.ndarray) -> str:
        """The action string a generation chose; needs a trie built ``from_strings``."""
        action = self.label_of(output_ids)
        if action is None:
            raise ConstraintViolation(f"ids {_as_list(output_ids)} are not one of the {len(self)} valid actions")
        return action

    def label_of(self, output_ids: Sequence[int] | np.ndarray) -> str | None:
        """The action string the ids spell (trailing EOS optional), or None when they spell none
        (a generation cut short by ``max_tokens``); needs a trie built ``from_strings``."""
        if self._labels is None:
            raise ValueError("this ActionTrie was built from ids; build it with ActionTrie.from_strings to decode")
        index = self.match(output_ids)
        return None if index is None else self._labels[index]

    def _walk(self, ids: list[int], require_terminal: bool) -> _Node:
        node = self._root
        for pos, t in enumerate(ids):
            nxt = node.children.get(t)
            if nxt is None:
                raise ConstraintViolation(f"token {t} at position {pos} is not allowed by the action trie")
            node = nxt
        if require_terminal and node.terminal is None:
            raise ConstraintViolation(f"EOS after position {len(ids)} ends no complete action")
        return node

    def _freeze(self, root: _Node) -> None:
        stack = [root]
        while stack:
            node = stack.pop()
            ids = sorted(node.children)
            if node.terminal is not None:
                ids.append(self.eos_id)
                ids.sort()
            node.allowed = np.asarray(ids, dtype=np.int32)
            node.allowed.flags.writeable = False
            stack.extend(node.children.values())


def _as_list(ids: Sequence[int] | np.ndarray) -> list[int]:
    return ids.tolist() if isinstance(ids, np.ndarray) else [int(t) for t in ids]
