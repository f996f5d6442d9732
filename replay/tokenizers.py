"""Which tokenizer wrote a model call's token ids, identified from the journal.

A ``ModelCall`` records the ``policy_version`` that produced it. For the embedded
torch policy that string is ``tiny-torch-v1-seed<S>-<digest>``, and the digest
covers the weights *and the tokenizer's fingerprint*: rebuilding the policy for
seed S with a candidate tokenizer and getting the same version proves that
tokenizer is the one the call was written with. Candidates are the built-in
tokenizer and any ``tokenizer.json`` the user hands in (``--tokenizer``). A
policy of another family cannot be checked that way: only a tokenizer the user
names is used for it, and the identity says it was not verified. Nothing is
ever decoded with a tokenizer merely assumed to fit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from participants.tokenizer import ChatTokenizer, default_tokenizer

from .errors import TokenizerUnavailableError

_TINY_TORCH = re.compile(r"^tiny-torch-v1-seed(?P<seed>-?\d+)-(?P<digest>[0-9a-f]+)$")


@dataclass(frozen=True)
class TokenizerIdentity:
    """The tokenizer a policy's calls decode with, and how sure the match is."""

    policy_version: str
    tokenizer: ChatTokenizer
    verified: bool  # the policy version was rebuilt from this tokenizer
    source: str  # "built-in" or the path given

    @property
    def fingerprint(self) -> str:
        return self.tokenizer.fingerprint

    def as_json(self) -> dict:
        return {"policy_version": self.policy_version, "tokenizer_fingerprint": self.fingerprint,
                "verified": self.verified, "source": self.source}


class TokenizerCatalog:
    """Resolves policy versions to the tokenizers that wrote their calls (cached per version)."""

    def __init__(self, given: list[str | Path] | None = None, *, builtin: bool = True) -> None:
        self._candidates: list[tuple[str, ChatTokenizer]] = []
        for path in given or []:
            self._candidates.append((str(path), _load(Path(path))))
        if builtin:
            self._candidates.append(("built-in", default_tokenizer()))
        self._resolved: dict[str, TokenizerIdentity] = {}

    def identify(self, policy_version: str) -> TokenizerIdentity:
        """The tokenizer ``policy_version`` wrote its ids with; raises
        :class:`TokenizerUnavailableError` when none at hand can be shown (or, for an unknown
        policy family, was named) to be it."""
        found = self._resolved.get(policy_version)
        if found is None:
            found = self._resolved[policy_version] = self._identify(policy_version)
        return found

    def _identify(self, policy_version: str) -> TokenizerIdentity:
        tiny = _TINY_TORCH.match(policy_version)
        if tiny is not None:
            from participants.torch_policy import (
                TinyTorchPolicy,  # torch: only when a call needs decoding
            )

            seed = int(tiny.group("seed"))
            for source, tokenizer in self._candidates:
                if TinyTorchPolicy(tokenizer, weights_seed=seed).policy_version == policy_version:
                    return TokenizerIdentity(policy_version, tokenizer, True, source)
            raise TokenizerUnavailableError(
                f"policy {policy_version} was not built with any tokenizer at hand "
                f"({', '.join(s for s, _ in self._candidates) or 'none'}): its token ids would decode wrongly. "
                "Pass the policy's tokenizer.json with --tokenizer, or --no-decode for token ids only")
        given = [(s, t) for s, t in self._candidates if s != "built-in"]
        if not given:
            raise TokenizerUnavailableError(
                f"policy {policy_version} is of a family this version cannot identify a tokenizer for; pass its "
                "tokenizer.json with --tokenizer (used as given, unverified), or --no-decode for token ids only")
        source, tokenizer = given[0]
        return TokenizerIdentity(policy_version, tokenizer, False, source)


def _load(path: Path) -> ChatTokenizer:
    file = path / "tokenizer.json" if path.is_dir() else path
    try:
        return ChatTokenizer(file.read_text(encoding="utf-8"))
    except Exception as exc:  # noqa: BLE001 - OSError, ValueError, and the plain Exception tokenizers raises
        raise TokenizerUnavailableError(f"cannot load tokenizer {file}: {exc}") from None
