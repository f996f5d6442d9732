"""Signing keys and checkpoints: what the writer reads from its environment, what an
auditor accepts, and errors that name the setting without showing the key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from rollout_journal.journal.anchoring import SIGNING_KEY_ENV, VERIFY_KEY_ENV, HeadSigner, HeadVerifier, SigningKeyError
from rollout_journal.journal.events import ChainHead, Header

HEADER = Header("r", "g", 2, 2, 3, 11, 1_700_000_000_000, "worker-0")
HEADS = [ChainHead("r/calendar", 3, "c" * 64), ChainHead("r/mail", 0, "a" * 64)]


def test_no_key_in_the_environment_means_no_signer() -> None:
    assert HeadSigner.from_environment({}) is None and HeadVerifier.from_environment({}) is None


def test_a_key_from_a_file_or_inline_pem_signs_what_its_public_key_verifies(tmp_path: Path) -> None:
    writer = HeadSigner.generate()
    (tmp_path / "signing.pem").write_bytes(writer.private_pem())
    (tmp_path / "verify.pem").write_bytes(writer.public_pem())
    from_file = HeadSigner.from_environment({SIGNING_KEY_ENV: str(tmp_path / "signing.pem")})
    inline = HeadSigner.from_environment({SIGNING_KEY_ENV: writer.private_pem().decode()})
    verifier = HeadVerifier.from_environment({VERIFY_KEY_ENV: str(tmp_path / "verify.pem")})
    assert from_file.key_id == inline.key_id == verifier.key_id == writer.key_id
    assert verifier.problem(from_file.checkpoint(HEADER, 0, HEADS)) is None
    assert writer.key_id[:16] in repr(writer) and "PRIVATE" not in repr(writer)  # a repr names, never shows


@pytest.mark.parametrize("field", ["header", "life", "heads", "key_id"])
def test_any_signed_field_changed_breaks_the_signature(field: str) -> None:
    writer = HeadSigner.generate()
    checkpoint = writer.checkpoint(HEADER, 0, HEADS)
    changed = {
        "header": dataclasses.replace(HEADER, seq=12),
        "life": 1,
        "heads": [ChainHead("r/calendar", 3, "d" * 64), HEADS[1]],
        "key_id": "0" * 64,
    }[field]
    problem = HeadVerifier(writer.public_key).problem(dataclasses.replace(checkpoint, **{field: changed}))
    assert problem is not None and ("does not verify" in problem or "not the auditor's key" in problem)


def test_a_public_key_given_as_the_signing_key_is_named_without_showing_it(tmp_path: Path) -> None:
    public = HeadSigner.generate().public_pem().decode()
    with pytest.raises(SigningKeyError) as caught:
        HeadSigner.from_environment({SIGNING_KEY_ENV: public})
    assert SIGNING_KEY_ENV in str(caught.value) and "BEGIN" not in str(caught.value)


def test_a_key_of_another_algorithm_is_refused(tmp_path: Path) -> None:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    (tmp_path / "rsa.pem").write_bytes(pem)
    with pytest.raises(SigningKeyError, match="not Ed25519"):
        HeadSigner.from_environment({SIGNING_KEY_ENV: str(tmp_path / "rsa.pem")})
    with pytest.raises(SigningKeyError, match="cannot read key file"):
        HeadSigner.from_environment({SIGNING_KEY_ENV: str(tmp_path / "missing.pem")})
