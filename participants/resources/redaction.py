"""Secrets in mutation arguments: what the journal keeps instead of them.

Argument values named in a resource's ``secret_arg_names`` never reach a
:class:`~rollout_journal.participants.resources.MutationRecord`: they are replaced by
:func:`redact_secret`, i.e. ``"<redacted:" + sha256(value)[:12] + ">"``.
Redacting a placeholder returns it unchanged, so live and replayed runs derive
the same digest.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeGuard

from rollout_journal.participants.resources.canonical import canonical_json, sha256_hex

__all__ = ["MIN_LEAK_CHECK_LEN", "is_redacted", "redact_args", "redact_secret", "secret_values"]

_REDACTED_PREFIX = "<redacted:"
MIN_LEAK_CHECK_LEN = 4  # shorter secrets would match unrelated text by chance


def is_redacted(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and value.startswith(_REDACTED_PREFIX) and value.endswith(">")


def redact_secret(value: Any) -> str:
    """``<redacted:sha256-prefix>`` for a secret; idempotent on placeholders.

    The 12-hex prefix lets an auditor tell two secrets apart without learning
    them; it does not stop a dictionary attack on a weak password.
    """
    if is_redacted(value):
        return value
    text = value if isinstance(value, str) else canonical_json(value)
    return f"{_REDACTED_PREFIX}{sha256_hex(text)[:12]}>"


def redact_args(args: Any, secret_names: Iterable[str]) -> Any:
    """A copy of ``args`` with every value under a secret key (at any depth) redacted."""
    names = frozenset(secret_names)
    if not names:
        return args
    if isinstance(args, dict):
        return {k: (redact_secret(v) if k in names else redact_args(v, names)) for k, v in args.items()}
    if isinstance(args, list):
        return [redact_args(v, names) for v in args]
    return args


def secret_values(args: Any, secret_names: frozenset[str]) -> list[str]:
    """The raw (not yet redacted) values under secret keys, at any depth, as text."""
    found: list[str] = []
    if isinstance(args, dict):
        for k, v in args.items():
            if k in secret_names and not is_redacted(v):
                found.append(v if isinstance(v, str) else canonical_json(v))
            else:
                found.extend(secret_values(v, secret_names))
    elif isinstance(args, list):
        for v in args:
            found.extend(secret_values(v, secret_names))
    return found
