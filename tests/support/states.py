"""Comparing two rollout states field by field: every dataclass field, so a field added to the
aggregate is compared from the day it exists (a hand list of names would miss it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

import numpy as np

from rollout_journal.participants.rollout.state import RolloutProgress

# What a state restored from a snapshot may hold otherwise than the live one it was taken of: the
# resource exports, when the live state's were recorded at another snapshot than the one restored.
EXPORTS = ("resource_states", "mutations_since_export")


def differences(a: object, b: object, path: str) -> list[str]:
    """Where ``a`` and ``b`` differ, as ``path`` names: numpy arrays by value (and dtype kind),
    dataclasses field by field, objects without an ``__eq__`` of their own (a token lineage, the
    effect log) attribute by attribute, containers item by item. Every attribute, so one added to
    a class is compared the day it exists (the lineage compared by two named attributes missed
    its closed sequences)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        same = (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype.kind == b.dtype.kind
            and np.array_equal(a, b)
        )
        return [] if same else [f"{path}: {a!r} != {b!r}"]
    if type(a) is not type(b):
        return [f"{path}: {type(a).__name__} {a!r} != {type(b).__name__} {b!r}"]
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return [
            found
            for f in dataclasses.fields(a)
            for found in differences(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
        ]
    if hasattr(a, "__dict__") and type(a).__eq__ is object.__eq__:  # TokenLineage, EffectLog: == is identity
        mine, theirs = vars(a), vars(b)
        if mine.keys() != theirs.keys():
            return [f"{path}: attributes {sorted(mine)} != {sorted(theirs)}"]
        return [found for k in mine for found in differences(mine[k], theirs[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple))
        if len(a) != len(b):
            return [f"{path}: {len(a)} items != {len(b)} items ({a!r} != {b!r})"]
        return [found for i, (x, y) in enumerate(zip(a, b)) for found in differences(x, y, f"{path}[{i}]")]
    if isinstance(a, dict):
        assert isinstance(b, dict)
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(a)} != {sorted(b)}"]
        return [found for k in a for found in differences(a[k], b[k], f"{path}[{k!r}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def assert_same_state(expected: RolloutProgress, actual: RolloutProgress, *, ignoring: Collection[str] = ()) -> None:
    """``actual`` holds what ``expected`` does in every field of its dataclass but ``ignoring``."""
    assert type(actual) is type(expected), f"{type(actual).__name__} is not a {type(expected).__name__}"
    names = {f.name for f in dataclasses.fields(expected)}
    unknown = set(ignoring) - names
    assert not unknown, f"no such field to ignore: {sorted(unknown)}"
    found = [
        difference
        for name in sorted(names - set(ignoring))
        for difference in differences(getattr(expected, name), getattr(actual, name), name)
    ]
    assert not found, "the states differ:\n  " + "\n  ".join(found)
