"""A self-signed X.509 certificate made from the node's Ed25519 key.

QUIC needs TLS, and TLS needs a certificate. Nobody checks a chain here: the
dialer compares the certificate's public key with the key it paired with.
"""

from __future__ import annotations

import datetime

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.x509.oid import NameOID

from gpumesh.errors import KeyMismatchError
from gpumesh.identity.keys import Identity

__all__ = ["public_key_from_spki", "self_signed_certificate_pem"]


def self_signed_certificate_pem(identity: Identity) -> bytes:
    """PEM certificate for ``identity``, valid from yesterday for ten years."""
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"gpumesh-{identity.node_id}")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(identity.private_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .sign(identity.private_key, None)
    )
    return cert.public_bytes(serialization.Encoding.PEM)


def public_key_from_spki(spki_der: bytes) -> bytes:
    """The raw Ed25519 key in a certificate's SubjectPublicKeyInfo."""
    try:
        key = serialization.load_der_public_key(spki_der)
    except ValueError as exc:
        raise KeyMismatchError("the peer presented an unreadable key") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise KeyMismatchError("the peer presented a key that is not Ed25519")
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
