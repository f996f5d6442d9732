"""Signed chain heads: the writer anchors every resource's hash chain, an auditor checks it.

A hash chain alone is tamper-evident only against someone who cannot recompute it:
whoever can rewrite the journal can change a mutation and recompute every later
chain hash. So, as Certificate Transparency and Sigstore Rekor sign their tree
heads, the writer signs the chain heads of a rollout's resources in every commit
that mutates them (a :class:`~rollout_journal.journal.events.HeadCheckpoint`, in the same atomic
append). Rewriting the chain then needs the private key. The signature is Ed25519,
not an HMAC: the auditor holds only the public key, so whoever verifies cannot
forge.

Keys are PEM files, as ``openssl`` writes them::

    openssl genpkey -algorithm ed25519 -out signing.pem       # the writer's (secret)
    openssl pkey -in signing.pem -pubout -out verify.pem      # all an auditor needs

The writer reads its key from ``ROLLOUT_JOURNAL_SIGNING_KEY`` (a path to the PEM
file, or the PEM text itself); without it, no checkpoints are journaled. An
auditor names the public key with ``--public-key`` or ``ROLLOUT_JOURNAL_VERIFY_KEY``.
A key id is the SHA-256 of the key's DER SubjectPublicKeyInfo (CT's log id).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from rollout_journal.journal.errors import ConfigurationError
from rollout_journal.journal.events import ChainHead, HeadCheckpoint, Header

__all__ = [
    "ALGORITHM",
    "SIGNING_KEY_ENV",
    "VERIFY_KEY_ENV",
    "HeadSigner",
    "HeadVerifier",
    "SigningKeyError",
    "checkpoint_message",
    "key_id_of",
]

ALGORITHM = "ed25519"
SIGNING_KEY_ENV = "ROLLOUT_JOURNAL_SIGNING_KEY"
VERIFY_KEY_ENV = "ROLLOUT_JOURNAL_VERIFY_KEY"
_DOMAIN = b"rollout-journal head checkpoint v1\n"  # a signature over these bytes means nothing in any other protocol


class SigningKeyError(ConfigurationError):
    """A signing or verifying key cannot be loaded; the message names the setting, never the key."""


def key_id_of(public_key: Ed25519PublicKey) -> str:
    """SHA-256 (hex) of the key's DER SubjectPublicKeyInfo: the id a checkpoint records."""
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


def checkpoint_message(header: Header, life: int, heads: Sequence[ChainHead], algorithm: str, key_id: str) -> bytes:
    """The bytes a checkpoint's signature covers: every field but the signature.

    Canonical JSON (sorted keys, no spaces) of plain values, so any language can
    rebuild it; the header's ``seq`` binds the checkpoint to its place in the rollout.
    """
    body = {
        "rollout_id": header.rollout_id,
        "group_id": header.group_id,
        "attempt": header.attempt,
        "epoch": header.epoch,
        "turn": header.turn,
        "seq": header.seq,
        "ts_ms": header.ts_ms,
        "writer": header.writer,
        "life": life,
        "algorithm": algorithm,
        "key_id": key_id,
        "heads": [[h.resource_id, h.revision, h.chain_hash] for h in heads],
    }
    return _DOMAIN + json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _pem_of(value: str, setting: str) -> bytes:
    """PEM text given inline, or read from the file ``value`` names."""
    if value.lstrip().startswith("-----BEGIN"):
        return value.encode()
    path = Path(value).expanduser()
    try:
        return path.read_bytes()
    except OSError as exc:
        raise SigningKeyError(
            f"{setting}: cannot read key file {path} ({exc.strerror}); set it to the path of a PEM "
            "key file or to the PEM text"
        ) from None


class HeadSigner:
    """The writer's side: signs a rollout's chain heads into a :class:`HeadCheckpoint`."""

    algorithm = ALGORITHM

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._private_key = private_key
        self.public_key = private_key.public_key()
        self.key_id = key_id_of(self.public_key)

    def __repr__(self) -> str:  # never the key itself
        return f"HeadSigner(key_id={self.key_id[:16]}...)"

    @classmethod
    def generate(cls) -> HeadSigner:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_pem(cls, pem: bytes, setting: str = "signing key") -> HeadSigner:
        try:
            key = serialization.load_pem_private_key(pem, password=None)
        except (ValueError, TypeError) as exc:
            raise SigningKeyError(
                f"{setting}: not an unencrypted PEM private key ({type(exc).__name__}); "
                "create one with `openssl genpkey -algorithm ed25519 -out signing.pem`"
            ) from None
        if not isinstance(key, Ed25519PrivateKey):
            raise SigningKeyError(
                f"{setting}: the key is {type(key).__name__}, not Ed25519; "
                "create one with `openssl genpkey -algorithm ed25519 -out signing.pem`"
            )
        return cls(key)

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> HeadSigner | None:
        """The signer ``ROLLOUT_JOURNAL_SIGNING_KEY`` names; None when it is unset (no checkpoints)."""
        value = environ.get(SIGNING_KEY_ENV, "").strip()
        if not value:
            return None
        return cls.from_pem(_pem_of(value, SIGNING_KEY_ENV), SIGNING_KEY_ENV)

    def private_pem(self) -> bytes:
        return self._private_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    def public_pem(self) -> bytes:
        return self.public_key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)

    def checkpoint(self, header: Header, life: int, heads: Sequence[ChainHead]) -> HeadCheckpoint:
        """A signed checkpoint of ``heads`` (every resource of the rollout, in a stable order)."""
        heads = list(heads)
        message = checkpoint_message(header, life, heads, self.algorithm, self.key_id)
        return HeadCheckpoint(header, life, heads, self.algorithm, self.key_id, self._private_key.sign(message))


class HeadVerifier:
    """The auditor's side: checks checkpoints against one public key."""

    def __init__(self, public_key: Ed25519PublicKey) -> None:
        self.public_key = public_key
        self.key_id = key_id_of(public_key)

    def __repr__(self) -> str:
        return f"HeadVerifier(key_id={self.key_id[:16]}...)"

    @classmethod
    def from_pem(cls, pem: bytes, setting: str = "public key") -> HeadVerifier:
        try:
            key = serialization.load_pem_public_key(pem)
        except (ValueError, TypeError) as exc:
            raise SigningKeyError(
                f"{setting}: not a PEM public key ({type(exc).__name__}); derive one with "
                "`openssl pkey -in signing.pem -pubout -out verify.pem`"
            ) from None
        if not isinstance(key, Ed25519PublicKey):
            raise SigningKeyError(f"{setting}: the key is {type(key).__name__}, not Ed25519")
        return cls(key)

    @classmethod
    def from_setting(cls, value: str, setting: str) -> HeadVerifier:
        """A verifier from a path to a PEM file or the PEM text, ``setting`` naming where it came from."""
        return cls.from_pem(_pem_of(value, setting), setting)

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> HeadVerifier | None:
        value = environ.get(VERIFY_KEY_ENV, "").strip()
        return cls.from_setting(value, VERIFY_KEY_ENV) if value else None

    def problem(self, checkpoint: HeadCheckpoint) -> str | None:
        """Why ``checkpoint`` does not verify under this key; None when it does."""
        if checkpoint.algorithm != ALGORITHM:
            return f"signed with {checkpoint.algorithm!r}, not {ALGORITHM}"
        if checkpoint.key_id != self.key_id:
            return (
                f"signed by key {checkpoint.key_id[:16]}, not the auditor's key {self.key_id[:16]}: forged, "
                "or written by a writer with another key"
            )
        message = checkpoint_message(
            checkpoint.header, checkpoint.life, checkpoint.heads, checkpoint.algorithm, checkpoint.key_id
        )
        try:
            self.public_key.verify(checkpoint.signature, message)
        except InvalidSignature:
            return "its signature does not verify: the checkpoint was altered, or signed without the writer's key"
        return None
