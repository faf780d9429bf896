"""The node's Ed25519 identity and the ids derived from public keys.

A node id is 24 base32 characters of a hash of the public key followed by two
checksum characters, so a fully typed id with a typo is caught. Users may
address a peer by any unambiguous prefix of it.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from gpumesh import platform
from gpumesh.errors import BadNameError, IdentityError

__all__ = [
    "ID_LENGTH",
    "Identity",
    "NodeId",
    "check_node_name",
    "node_id_for",
    "verify_signature",
    "x25519_public_of",
]

PUBLIC_KEY_SIZE = 32
SIGNATURE_SIZE = 64
_HASH_CHARS = 24
ID_LENGTH = _HASH_CHARS + 2
_ALPHABET = "abcdefghijklmnopqrstuvwxyz234567"
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


def _b32(data: bytes) -> str:
    return base64.b32encode(data).decode("ascii").rstrip("=").lower()


def _checksum(body: str) -> str:
    # Position-weighted sum modulo the prime 1021 (fits two base32 characters):
    # any single wrong character or swap of neighbours changes it, so a typed
    # id with one typo never passes as well-formed.
    total = sum((index + 1) * _ALPHABET.index(char) for index, char in enumerate(body)) % 1021
    return _ALPHABET[total >> 5] + _ALPHABET[total & 31]


class NodeId(str):
    """A node id: 26 lowercase base32 characters, the last two a checksum."""

    __slots__ = ()

    @property
    def short(self) -> str:
        """The first 12 characters, enough to tell peers apart in tables."""
        return self[:12]

    @staticmethod
    def is_well_formed(text: str) -> bool:
        """Whether ``text`` is a full id whose checksum matches."""
        return (
            len(text) == ID_LENGTH
            and all(c in _ALPHABET for c in text)
            and _checksum(text[:_HASH_CHARS]) == text[_HASH_CHARS:]
        )


def node_id_for(public_key: bytes) -> NodeId:
    """The node id of a raw 32-byte Ed25519 public key."""
    if len(public_key) != PUBLIC_KEY_SIZE:
        raise IdentityError(f"an Ed25519 public key has 32 bytes, got {len(public_key)}")
    body = _b32(hashlib.sha256(b"gpumesh-node-id" + public_key).digest()[:15])
    return NodeId(body + _checksum(body))


def check_node_name(name: str) -> str:
    """Return ``name`` if it is a valid node name, else raise."""
    if not _NAME_RE.fullmatch(name):
        raise BadNameError(
            f"invalid node name {name!r}: use 1-63 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


def verify_signature(public_key: bytes, signature: bytes, message: bytes) -> bool:
    """Whether ``signature`` is ``public_key``'s Ed25519 signature of ``message``."""
    if len(public_key) != PUBLIC_KEY_SIZE or len(signature) != SIGNATURE_SIZE:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


_P = 2**255 - 19
"""The prime of Curve25519's field, which Ed25519 and X25519 share."""


def x25519_public_of(public_key: bytes) -> bytes:
    """The X25519 public key of an Ed25519 one: the Montgomery u = (1 + y) / (1 - y)
    of its Edwards y (RFC 7748's birational map). An invalid key is IdentityError."""
    if len(public_key) != PUBLIC_KEY_SIZE:
        raise IdentityError(f"an Ed25519 public key has 32 bytes, got {len(public_key)}")
    y = int.from_bytes(public_key, "little") & ((1 << 255) - 1)
    if y >= _P or y == 1:
        raise IdentityError("not a usable Ed25519 public key")
    u = (1 + y) * pow(1 - y, _P - 2, _P) % _P
    return u.to_bytes(32, "little")


@dataclass(frozen=True)
class Identity:
    """This node's signing key and what derives from it."""

    private_key: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @property
    def public_key(self) -> bytes:
        """Raw 32-byte public key."""
        return self.private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    @property
    def node_id(self) -> NodeId:
        return node_id_for(self.public_key)

    def sign(self, message: bytes) -> bytes:
        return self.private_key.sign(message)

    def shared_secret(self, peer_public_key: bytes) -> bytes:
        """32 bytes only this node and the holder of ``peer_public_key`` can compute:
        X25519 of the two Ed25519 keys converted to X25519 (this side's scalar is the
        first half of SHA-512 of the seed, as Ed25519 derives it). Every pair that
        paired already has it, with nothing more exchanged. A key of small order
        (no secret) is IdentityError."""
        seed = self.private_key.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )
        scalar = hashlib.sha512(seed).digest()[:32]
        peer = X25519PublicKey.from_public_bytes(x25519_public_of(peer_public_key))
        try:
            return X25519PrivateKey.from_private_bytes(scalar).exchange(peer)
        except ValueError:
            raise IdentityError("that public key gives no shared secret") from None

    def private_pem(self) -> bytes:
        return self.private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    def save(self, path: Path) -> None:
        """Write the key with mode 0600 from the first byte (never world-readable)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        # Never through a link planted as the temporary file: it would get the key.
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | platform.BINARY | _NOFOLLOW
        try:
            fd = os.open(tmp, flags, 0o600)
        except OSError as exc:
            raise _open_error(tmp, exc) from None
        try:
            os.write(fd, self.private_pem())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> Identity:
        try:
            fd = os.open(path, os.O_RDONLY | platform.BINARY | _NOFOLLOW)
        except FileNotFoundError:
            raise IdentityError(f"no identity key at {path}: run `gpumesh init` first") from None
        except OSError as exc:
            raise _open_error(path, exc) from None
        with open(fd, "rb") as found:
            data = found.read()
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as exc:  # TypeError: the key is password-protected
            raise IdentityError(
                f"the identity key at {path} is unreadable ({exc}); "
                "restore it from a backup or run `gpumesh init --force`"
            ) from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise IdentityError(f"the key at {path} is not an Ed25519 key")
        return cls(key)


_NOFOLLOW = platform.open_flag("O_NOFOLLOW")
"""A key is never read or written through a link: one planted in the home could hand
the node someone else's key, or the key to someone else's file."""


def _open_error(path: Path, exc: OSError) -> IdentityError:
    if exc.errno == errno.ELOOP:
        return IdentityError(
            f"{path} is a link: GPUMesh opens no links in its home; remove it "
            f"(`rm {path}`) and restore the key from a backup, or run `gpumesh init --force`"
        )
    return IdentityError(f"cannot open the identity key at {path}: {exc.strerror or exc}")
