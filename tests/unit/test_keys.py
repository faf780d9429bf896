"""identity/keys and identity/tlscert: node ids, names, key files, signatures, certificates."""

from __future__ import annotations

import hashlib
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given
from hypothesis import strategies as st

from gpumesh.errors import IdentityError, KeyMismatchError
from gpumesh.identity.keys import (
    ID_LENGTH,
    Identity,
    NodeId,
    check_node_name,
    node_id_for,
    verify_signature,
)
from gpumesh.identity.tlscert import public_key_from_spki, self_signed_certificate_pem

ALPHABET = "abcdefghijklmnopqrstuvwxyz234567"


def _fixed_identity(seed: int) -> Identity:
    raw = hashlib.sha256(b"unit-test-seed-%d" % seed).digest()
    return Identity(Ed25519PrivateKey.from_private_bytes(raw))


def _substitutions(text: str) -> list[str]:
    return [
        text[:pos] + char + text[pos + 1 :]
        for pos in range(len(text))
        for char in ALPHABET
        if char != text[pos]
    ]


# --- node ids -----------------------------------------------------------------


def test_node_id_is_26_lowercase_base32_chars(identity: Identity) -> None:
    node_id = identity.node_id
    assert ID_LENGTH == 26
    assert len(node_id) == 26
    assert set(node_id) <= set(ALPHABET)
    assert isinstance(node_id, NodeId)
    assert node_id.short == node_id[:12]


def test_node_id_is_deterministic_per_key(identity: Identity) -> None:
    assert identity.node_id == node_id_for(identity.public_key)
    assert node_id_for(bytes(identity.public_key)) == identity.node_id
    assert _fixed_identity(1).node_id == _fixed_identity(1).node_id


def test_different_keys_have_different_ids() -> None:
    ids = {_fixed_identity(seed).node_id for seed in range(50)}
    assert len(ids) == 50


@given(st.binary(min_size=32, max_size=32))
def test_ids_of_any_32_byte_key_are_well_formed(key: bytes) -> None:
    assert NodeId.is_well_formed(node_id_for(key))


@pytest.mark.parametrize("size", [0, 31, 33, 64])
def test_node_id_refuses_a_key_of_the_wrong_size(size: int) -> None:
    with pytest.raises(IdentityError, match="32 bytes"):
        node_id_for(b"\x01" * size)


@given(
    key=st.binary(min_size=32, max_size=32),
    position=st.integers(min_value=24, max_value=25),
    char=st.sampled_from(ALPHABET),
)
def test_a_typo_in_the_checksum_characters_is_caught(key: bytes, position: int, char: str) -> None:
    node_id = node_id_for(key)
    typo = node_id[:position] + char + node_id[position + 1 :]
    assert NodeId.is_well_formed(typo) == (typo == node_id)


@given(
    key=st.binary(min_size=32, max_size=32),
    position=st.integers(min_value=0, max_value=25),
    char=st.sampled_from("ABCXYZ01890189!-_ .é"),
)
def test_a_character_outside_the_alphabet_is_caught(key: bytes, position: int, char: str) -> None:
    node_id = node_id_for(key)
    assert not NodeId.is_well_formed(node_id[:position] + char + node_id[position + 1 :])


@given(key=st.binary(min_size=32, max_size=32), position=st.integers(min_value=0, max_value=25))
def test_a_dropped_or_doubled_character_is_caught(key: bytes, position: int) -> None:
    node_id = node_id_for(key)
    assert not NodeId.is_well_formed(node_id[:position] + node_id[position + 1 :])
    assert not NodeId.is_well_formed(node_id[: position + 1] + node_id[position:])


def test_body_typos_are_caught_at_the_rate_a_10_bit_checksum_allows() -> None:
    # A missing or degenerate checksum would let most typos through.
    typos = [t for seed in range(20) for t in _substitutions(_fixed_identity(seed).node_id)]
    missed = sum(NodeId.is_well_formed(t) for t in typos)
    assert missed <= len(typos) // 200


def test_every_one_character_typo_of_a_known_id_is_caught() -> None:
    # This one id happens to have no undetected typo: checks is_well_formed
    # rejects all 26 * 31 substitutions for it.
    node_id = _fixed_identity(2).node_id
    assert NodeId.is_well_formed(node_id)
    assert not any(NodeId.is_well_formed(t) for t in _substitutions(node_id))


def test_no_one_character_typo_of_any_id_is_well_formed() -> None:
    missed = [
        typo
        for seed in range(20)
        for typo in _substitutions(_fixed_identity(seed).node_id)
        if NodeId.is_well_formed(typo)
    ]
    assert missed == []


def test_is_well_formed_rejects_wrong_lengths(identity: Identity) -> None:
    assert NodeId.is_well_formed(identity.node_id)
    assert not NodeId.is_well_formed("")
    assert not NodeId.is_well_formed(identity.node_id[:12])
    assert not NodeId.is_well_formed(identity.node_id + "a")


# --- node names ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["a", "alice", "gpu-box_2.lab", "X" * 63, "0day", "A.b-c_d"])
def test_check_node_name_accepts(name: str) -> None:
    assert check_node_name(name) == name


@pytest.mark.parametrize(
    "name",
    ["", "x" * 64, "-alice", ".hidden", "_x", "has space", "semi;colon", "naïve", "a/b", "\nalice"],
)
def test_check_node_name_refuses(name: str) -> None:
    with pytest.raises(IdentityError, match="invalid node name") as info:
        check_node_name(name)
    assert "1-63 letters" in str(info.value)


@pytest.mark.parametrize("name", ["alice\n", "x" * 63 + "\n"])
def test_check_node_name_refuses_a_trailing_newline(name: str) -> None:
    with pytest.raises(IdentityError):
        check_node_name(name)


# --- key files ----------------------------------------------------------------


def test_save_writes_mode_0600(identity: Identity, tmp_path: Path) -> None:
    path = tmp_path / "home" / "identity.key"
    identity.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not path.with_name("identity.key.tmp").exists()


def test_save_over_a_world_readable_file_makes_it_0600(identity: Identity, tmp_path: Path) -> None:
    path = tmp_path / "identity.key"
    path.write_text("old")
    path.chmod(0o644)
    identity.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_load_round_trips(identity: Identity, tmp_path: Path) -> None:
    path = tmp_path / "identity.key"
    identity.save(path)
    loaded = Identity.load(path)
    assert loaded.public_key == identity.public_key
    assert loaded.node_id == identity.node_id
    message = b"hello"
    assert verify_signature(identity.public_key, loaded.sign(message), message)


def test_load_of_a_missing_file_says_to_run_init(tmp_path: Path) -> None:
    with pytest.raises(IdentityError, match="gpumesh init"):
        Identity.load(tmp_path / "nothing.key")


@pytest.mark.parametrize("content", [b"", b"garbage\x00\xff", b"-----BEGIN PRIVATE KEY-----\nxx\n"])
def test_load_of_garbage_explains_how_to_recover(content: bytes, tmp_path: Path) -> None:
    path = tmp_path / "identity.key"
    path.write_bytes(content)
    with pytest.raises(IdentityError) as info:
        Identity.load(path)
    message = str(info.value)
    assert str(path) in message
    assert "unreadable" in message
    assert "gpumesh init --force" in message


def test_load_of_a_non_ed25519_key_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "identity.key"
    key = ec.generate_private_key(ec.SECP256R1())
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    with pytest.raises(IdentityError, match="not an Ed25519 key"):
        Identity.load(path)


def test_load_of_an_encrypted_key_raises_identity_error(identity: Identity, tmp_path: Path) -> None:
    path = tmp_path / "identity.key"
    path.write_bytes(
        identity.private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    with pytest.raises(IdentityError):
        Identity.load(path)


# --- signatures ---------------------------------------------------------------


def test_verify_signature_accepts_a_genuine_signature(identity: Identity) -> None:
    assert verify_signature(identity.public_key, identity.sign(b"msg"), b"msg")


def test_verify_signature_rejects_another_message(identity: Identity) -> None:
    assert not verify_signature(identity.public_key, identity.sign(b"msg"), b"msg2")


def test_verify_signature_rejects_another_key(identity: Identity, other_identity: Identity) -> None:
    assert not verify_signature(other_identity.public_key, identity.sign(b"msg"), b"msg")


def test_verify_signature_rejects_a_flipped_bit(identity: Identity) -> None:
    signature = bytearray(identity.sign(b"msg"))
    signature[10] ^= 1
    assert not verify_signature(identity.public_key, bytes(signature), b"msg")


@pytest.mark.parametrize("key_size", [0, 31, 33])
def test_verify_signature_rejects_wrong_key_length(identity: Identity, key_size: int) -> None:
    key = (identity.public_key * 2)[:key_size]
    assert not verify_signature(key, identity.sign(b"msg"), b"msg")


@pytest.mark.parametrize("sig_size", [0, 63, 65, 128])
def test_verify_signature_rejects_wrong_signature_length(identity: Identity, sig_size: int) -> None:
    signature = (identity.sign(b"msg") * 2)[:sig_size]
    assert not verify_signature(identity.public_key, signature, b"msg")


def test_verify_signature_rejects_an_invalid_point() -> None:
    assert not verify_signature(b"\xff" * 32, b"\x00" * 64, b"msg")


# --- TLS certificate ----------------------------------------------------------


def test_certificate_carries_the_identity_key(identity: Identity) -> None:
    cert = x509.load_pem_x509_certificate(self_signed_certificate_pem(identity))
    spki = cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    assert public_key_from_spki(spki) == identity.public_key
    assert identity.node_id in cert.subject.rfc4514_string()


def test_spki_garbage_is_a_key_mismatch() -> None:
    with pytest.raises(KeyMismatchError, match="unreadable"):
        public_key_from_spki(b"\x30\x03garbage")


def test_spki_of_a_non_ed25519_key_is_a_key_mismatch() -> None:
    spki = (
        ec.generate_private_key(ec.SECP256R1())
        .public_key()
        .public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    with pytest.raises(KeyMismatchError, match="not Ed25519"):
        public_key_from_spki(spki)
