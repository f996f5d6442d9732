"""The one JSON spelling of resource data: digests, chain hashes and journaled args/results."""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["canonical_json", "sha256_hex"]


def canonical_json(obj: Any) -> str:
    """The one JSON spelling used for digests, chain hashes and journaled args/results."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
