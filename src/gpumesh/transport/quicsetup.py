"""QUIC settings and TLS key export: how a connection is configured, the secrets both
ends derive from its session, and how a close carries its reason.

qh3 offers no TLS exporter, so :func:`session_binding` and :func:`fec_secret`
derive one the way TLS 1.3 derives its own; an application close carries
``code: message`` in the reason phrase so a refusal survives the trip (see
:func:`close_reason` and :func:`error_from_close`).
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence

from qh3 import QuicConfiguration, QuicConnection
from qh3.quic import events as qe
from qh3.tls import (
    SignatureAlgorithm,
    hkdf_expand_label,
    load_pem_private_key,
    load_pem_x509_certificates,
)

from gpumesh import settings
from gpumesh.errors import ConnectionLostError, GPUMeshError, ProtocolError, error_from_code
from gpumesh.identity.keys import Identity
from gpumesh.identity.tlscert import self_signed_certificate_pem
from gpumesh.protocol import fec
from gpumesh.protocol.handshake import BINDING_SIZE
from gpumesh.protocol.messages import ALPNS
from gpumesh.version import __version__

__all__ = [
    "APP_ERROR",
    "CID_LENGTH",
    "FEC_DEFAULT",
    "IDLE_TIMEOUT",
    "MAX_DATAGRAM",
    "client_configuration",
    "close_reason",
    "error_from_close",
    "fec_mode",
    "fec_secret",
    "server_configuration",
    "session_binding",
]

CID_LENGTH = 8
APP_ERROR = 0x100
"""Application close code: the reason phrase is ``code: message``."""
MAX_DATAGRAM = 1452 - 8 - fec.TAG
"""QUIC's datagram size: an IPv6 packet of 1500 bytes holds 1452 bytes of UDP
payload, less room for the FEC frame header (6, and a parity symbol's 2) and tag."""
IDLE_TIMEOUT = 60.0
FEC_MODES = ("auto", "on", "off")
_STREAM_WINDOW = 16 * 1024 * 1024
_CONNECTION_WINDOW = 64 * 1024 * 1024


def _base_configuration(is_client: bool, alpns: Sequence[str]) -> QuicConfiguration:
    return QuicConfiguration(
        is_client=is_client,
        alpn_protocols=list(alpns),
        connection_id_length=CID_LENGTH,
        idle_timeout=IDLE_TIMEOUT,
        max_datagram_size=MAX_DATAGRAM,
        max_stream_data=_STREAM_WINDOW,
        max_data=_CONNECTION_WINDOW,
    )


def server_configuration(identity: Identity, alpns: Sequence[str] = ALPNS) -> QuicConfiguration:
    """``alpns``: the connection protocols accepted, preferred first."""
    config = _base_configuration(is_client=False, alpns=alpns)
    config.certificate = load_pem_x509_certificates(self_signed_certificate_pem(identity))[0]
    config.private_key = load_pem_private_key(identity.private_pem())
    return config


def client_configuration(alpns: Sequence[str] = ALPNS) -> QuicConfiguration:
    """``alpns``: the connection protocols offered, preferred first."""
    config = _base_configuration(is_client=True, alpns=alpns)
    # No CA: the certificate is self-signed and the caller pins its key instead.
    config.verify_mode = ssl.CERT_NONE
    config.server_name = "gpumesh"
    # qh3 leaves EdDSA out of its default list; our nodes only have Ed25519 keys.
    config.signature_algorithms = [SignatureAlgorithm.ED25519]
    return config


_BINDING_LABEL = b"gpumesh auth"
_FEC_LABEL = b"gpumesh fec"


def session_binding(quic: QuicConnection) -> bytes:
    """A secret of this TLS session that both ends hold once its handshake is done.

    ``HKDF-Expand-Label(master secret, "gpumesh auth", Transcript-Hash(ClientHello
    .. client Finished), 32)``: how TLS 1.3 derives its exporter and resumption
    secrets (RFC 8446 sections 7.1 and 7.5), under a label of our own, because
    qh3 offers no exporter. It depends on both ends' key shares and randoms and on
    the certificate the server sent, so a man in the middle, who runs two sessions
    with different keys, cannot make them share one, and a passive observer never
    learns it. Both ends' key schedules stop at this point after the handshake
    (qh3's server has already hashed the client Finished it expects).
    """
    return _exported(quic, _BINDING_LABEL)


def fec_secret(quic: QuicConnection) -> bytes:
    """The secret this TLS session's FEC keys come from (:class:`fec.FecKeys`).

    Derived as :func:`session_binding` is, under a label of its own, so it shares
    nothing with the binding that the identity proofs sign: a passive observer, or a
    peer's other sessions, never learns it.
    """
    return _exported(quic, _FEC_LABEL)


def _exported(quic: QuicConnection, label: bytes) -> bytes:
    """``HKDF-Expand-Label(master secret, label, Transcript-Hash(ClientHello ..
    client Finished), 32)``, once the handshake is done."""
    tls = quic.tls
    schedule = None if tls is None else tls.key_schedule
    if schedule is None or schedule.generation != 3:  # 3: the master secret
        raise ProtocolError("the TLS handshake did not finish: no session binding")
    return hkdf_expand_label(
        schedule.algorithm,
        schedule.secret,
        label,
        schedule.hash.copy().digest(),
        BINDING_SIZE,
    )


def close_reason(error: GPUMeshError) -> str:
    """The reason phrase of an application close (:data:`APP_ERROR`) for ``error``."""
    return f"{error.code}: {error.message}"[:1000]


_TLS_HANDSHAKE_FAILURE = 0x100 + 40
"""QUIC's CRYPTO_ERROR for the TLS alert handshake_failure (RFC 9001, 4.8)."""
_NO_COMMON_ALPN = "No common ALPN protocols"
"""qh3's reason when the two sides share no connection protocol (it sends
handshake_failure, not no_application_protocol, so only the words tell)."""


def error_from_close(event: qe.ConnectionTerminated) -> GPUMeshError:
    """The error a connection's close stands for (the peer's own, from
    :func:`close_reason`, where it sent one)."""
    if event.error_code == APP_ERROR and ": " in event.reason_phrase:
        code, message = event.reason_phrase.split(": ", 1)
        return error_from_code(code, message)
    if event.error_code == _TLS_HANDSHAKE_FAILURE and _NO_COMMON_ALPN in event.reason_phrase:
        return ProtocolError(
            f"the peer speaks none of this node's GPUMesh protocol versions "
            f"({', '.join(ALPNS)}; GPUMesh {__version__}): it runs a much newer or "
            "older GPUMesh; upgrade GPUMesh on the older side"
        )
    if event.reason_phrase:
        return ConnectionLostError(f"connection closed by peer: {event.reason_phrase}")
    if event.error_code == 0:
        return ConnectionLostError("connection closed")
    return ConnectionLostError(f"connection lost (QUIC error {event.error_code:#x})")


FEC_DEFAULT = "off"
"""Measured on an idle machine (docs/architecture.md, "Parity is off by default"),
parity made no copy faster at 50 ms / 0.5%, 100 ms / 1% or 100 ms / 2%: it is
there for whoever asks (``auto`` or ``on``), not sent by default."""


def fec_mode() -> str:
    """``auto``, ``on`` or ``off`` (:data:`FEC_DEFAULT`): when links send parity
    (see :class:`~gpumesh.transport.quic.QuicLink`)."""
    mode = (settings.env(settings.ENV_FEC) or FEC_DEFAULT).lower()
    return mode if mode in FEC_MODES else FEC_DEFAULT
