"""Which tokenizer wrote a model call's token ids, identified from the journal.

A ``ModelCall`` records the ``policy_version`` that produced it: ``<model folder
name>@<12 hex digits>``, the digest covering the folder's config, weights,
tokenizer and chat template (``rollout_journal.participants.model.tiny_model.policy_version_of``), the
same for every backend that loads the folder. A folder whose own policy version
equals the call's is therefore proven to hold the tokenizer the call was written
with. Candidates are the model folders the user hands in (``--tokenizer``) and,
for the embedded model (``tiny-llama-v<N>-seed<S>@...``), the embedded folder for
that seed where it is cached, else rebuilt by ``build_embedded`` (it is built
deterministically, with torch: the command line hands in the model room's builder,
this module never imports it, so replay runs on the core install). A policy
that no candidate reproduces can only be decoded with a tokenizer the user names,
and the identity then says it was not verified. Nothing is ever decoded with a
tokenizer merely assumed to fit.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_journal.participants.model.folders import BUILDER_VERSION, embedded_model_path, policy_version_of
from rollout_journal.participants.model.tokenizer import ChatTokenizer
from rollout_journal.replay.errors import TokenizerUnavailableError

_EMBEDDED = re.compile(rf"^{re.escape(BUILDER_VERSION)}-seed(?P<seed>-?\d+)@(?P<digest>[0-9a-f]+)$")


@dataclass(frozen=True)
class TokenizerIdentity:
    """The tokenizer a policy's calls decode with, and how sure the match is."""

    policy_version: str
    tokenizer: ChatTokenizer
    verified: bool  # the policy version was reproduced from the folder this tokenizer came from
    source: str  # "embedded" or the path given

    @property
    def fingerprint(self) -> str:
        return self.tokenizer.fingerprint

    def as_json(self) -> dict[str, Any]:
        return {
            "policy_version": self.policy_version,
            "tokenizer_fingerprint": self.fingerprint,
            "verified": self.verified,
            "source": self.source,
        }


@dataclass(frozen=True)
class _Candidate:
    source: str
    folder: Path

    def version(self) -> str:
        return policy_version_of(self.folder)

    def tokenizer(self) -> ChatTokenizer:
        try:
            return ChatTokenizer.from_folder(self.folder)
        except Exception as exc:  # noqa: BLE001 - OSError, ValueError, and what tokenizers raises
            raise TokenizerUnavailableError(f"cannot load the tokenizer of {self.folder}: {exc}") from None


class TokenizerCatalog:
    """Resolves policy versions to the tokenizers that wrote their calls (cached per version)."""

    def __init__(
        self,
        given: list[str | Path] | None = None,
        *,
        builtin: bool = True,
        build_embedded: Callable[[int], Path] | None = None,
    ) -> None:
        """``given``: model folders (or a ``tokenizer.json`` inside one); ``builtin``: also
        consider the embedded model's folders; ``build_embedded``: builds the embedded folder of
        a seed that is not cached here (without it such a folder is not a candidate)."""
        self._given = [_Candidate(str(path), _folder_of(Path(path))) for path in given or []]
        self._builtin = builtin
        self._build_embedded = build_embedded
        self._resolved: dict[str, TokenizerIdentity] = {}

    def identify(self, policy_version: str) -> TokenizerIdentity:
        """The tokenizer ``policy_version`` wrote its ids with; raises
        :class:`TokenizerUnavailableError` when none at hand can be shown (or, for a policy no
        candidate reproduces, was named) to be it."""
        found = self._resolved.get(policy_version)
        if found is None:
            found = self._resolved[policy_version] = self._identify(policy_version)
        return found

    def _identify(self, policy_version: str) -> TokenizerIdentity:
        candidates = list(self._given)
        tried = [c.source for c in candidates]
        embedded = _EMBEDDED.match(policy_version)
        if embedded is not None and self._builtin:
            seed = int(embedded.group("seed"))
            folder = self._embedded_folder(seed)
            if folder is None:
                tried.append(f"embedded (not built at {embedded_model_path(seed)})")
            else:
                candidates.append(_Candidate("embedded", folder))
                tried.append("embedded")
        for candidate in candidates:
            if candidate.version() == policy_version:
                return TokenizerIdentity(policy_version, candidate.tokenizer(), True, candidate.source)
        if embedded is not None or not self._given:
            tried_text = ", ".join(tried) or "none"
            raise TokenizerUnavailableError(
                f"policy {policy_version} was not written by any model folder at hand ({tried_text}): its token ids "
                "would decode wrongly. Pass the policy's model folder with --tokenizer, or --no-decode for token "
                "ids only"
            )
        first = self._given[0]  # a policy no folder reproduces: the one the user named, unverified
        return TokenizerIdentity(policy_version, first.tokenizer(), False, first.source)

    def _embedded_folder(self, seed: int) -> Path | None:
        """The embedded model's folder for ``seed``: the cached one, else a build, else None."""
        folder = embedded_model_path(seed)
        if (folder / "config.json").is_file():
            return folder
        return None if self._build_embedded is None else self._build_embedded(seed)


def _folder_of(path: Path) -> Path:
    return path.parent if path.is_file() else path
