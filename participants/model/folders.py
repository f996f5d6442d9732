"""Model folders by name and digest: where the embedded model's folder lives, and what a folder's
``policy_version`` is. Torch-free on purpose: offline replay proves which tokenizer wrote a
journal's token ids with these alone, on an install without the model extras; building the
embedded model's weights (``tiny_model``) is the live path's job.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

__all__ = [
    "BUILDER_VERSION",
    "MODEL_FILES",
    "embedded_model_path",
    "folder_digest",
    "model_cache_root",
    "policy_version_of",
]

BUILDER_VERSION = "tiny-llama-v1"  # bump when the embedded folder's content would change
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja")


def model_cache_root() -> Path:
    """``$ROLLOUT_JOURNAL_MODEL_CACHE`` if set (the tests point it at one folder per session), else
    ``$XDG_CACHE_HOME/rollout-journal/models``."""
    override = os.environ.get("ROLLOUT_JOURNAL_MODEL_CACHE")
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rollout-journal" / "models"


def embedded_model_path(weights_seed: int = 0, root: str | Path | None = None) -> Path:
    """Where the embedded model's folder for ``weights_seed`` is (or will be, once built)."""
    cache = Path(root) if root is not None else model_cache_root()
    return cache / f"{BUILDER_VERSION}-seed{weights_seed}"


def folder_digest(folder: str | Path) -> str:
    """SHA-256 over a model folder's config, weights, tokenizer and chat template: what
    ``policy_version`` names, the same for every backend that loads the folder."""
    path = Path(folder)
    digest = hashlib.sha256()
    names = sorted(
        {p.name for p in path.glob("*.safetensors")}
        | {p.name for p in path.glob("*.bin")}
        | {n for n in MODEL_FILES if (path / n).is_file()}
        | {"tokenizer_config.json"}
    )
    for name in names:
        file = path / name
        if not file.is_file():
            continue
        digest.update(name.encode())
        with file.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def policy_version_of(folder: str | Path) -> str:
    """``<folder name>@<12 hex digits of its digest>``."""
    path = Path(folder)
    return f"{path.name}@{folder_digest(path)[:12]}"
