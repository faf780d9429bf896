"""The one exception tree of GPUMesh.

Every failure a user or a remote peer can cause is one of these. Each class
has a stable ``code`` that travels over the wire (in a ``Refusal``) and through
the HTTP API, so the far side can rebuild the same exception; the message is
written for people and says what to do next. Only the CLI turns these into
exit codes; nothing here prints.

::

    GPUMeshError                      code
    ├── ConfigError                   config
    │   └── NotInitializedError       not_initialized
    ├── IdentityError                 identity
    │   └── PairingCodeError          bad_code
    │       └── ExpiredCodeError      expired_code
    ├── PeerError                     peer
    │   ├── UnknownPeerError          unknown_peer
    │   ├── AmbiguousPeerError        ambiguous_peer
    │   └── PeerKeyChangedError       peer_key_changed
    ├── AccessDeniedError             denied
    │   └── NotPairedError            not_paired
    ├── TransportError                transport
    │   ├── UnreachableError          unreachable
    │   ├── KeyMismatchError          key_mismatch
    │   ├── ConnectionLostError       connection_lost
    │   └── RelayError                relay
    ├── ProtocolError                 protocol
    │   └── FrameTooLargeError        frame_too_large
    ├── RuntimeUnavailableError       runtime
    │   └── ImageMissingError         image_missing
    ├── LimitError                    limit
    ├── NotFoundError                 not_found
    └── AgentError                    agent
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "AccessDeniedError",
    "AgentError",
    "AmbiguousPeerError",
    "ConfigError",
    "ConnectionLostError",
    "ExpiredCodeError",
    "FrameTooLargeError",
    "GPUMeshError",
    "IdentityError",
    "ImageMissingError",
    "KeyMismatchError",
    "LimitError",
    "NotFoundError",
    "NotInitializedError",
    "NotPairedError",
    "PairingCodeError",
    "PeerError",
    "PeerKeyChangedError",
    "ProtocolError",
    "RelayError",
    "RuntimeUnavailableError",
    "TransportError",
    "UnknownPeerError",
    "UnreachableError",
    "error_from_code",
]


class GPUMeshError(Exception):
    """Root of every error GPUMesh raises on purpose."""

    code: ClassVar[str] = "error"
    exit_code: ClassVar[int] = 1

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class ConfigError(GPUMeshError):
    code = "config"
    exit_code = 2


class NotInitializedError(ConfigError):
    code = "not_initialized"


class IdentityError(GPUMeshError):
    code = "identity"


class PairingCodeError(IdentityError):
    code = "bad_code"
    exit_code = 2


class ExpiredCodeError(PairingCodeError):
    code = "expired_code"


class PeerError(GPUMeshError):
    code = "peer"
    exit_code = 2


class UnknownPeerError(PeerError):
    code = "unknown_peer"


class AmbiguousPeerError(PeerError):
    code = "ambiguous_peer"


class PeerKeyChangedError(PeerError):
    code = "peer_key_changed"


class AccessDeniedError(GPUMeshError):
    code = "denied"
    exit_code = 3


class NotPairedError(AccessDeniedError):
    code = "not_paired"


class TransportError(GPUMeshError):
    code = "transport"
    exit_code = 4


class UnreachableError(TransportError):
    code = "unreachable"


class KeyMismatchError(TransportError):
    code = "key_mismatch"


class ConnectionLostError(TransportError):
    code = "connection_lost"


class RelayError(TransportError):
    """The relay refused or ended something (its named refusal is in the message)."""

    code = "relay"


class ProtocolError(GPUMeshError):
    code = "protocol"
    exit_code = 5


class FrameTooLargeError(ProtocolError):
    code = "frame_too_large"


class RuntimeUnavailableError(GPUMeshError):
    code = "runtime"
    exit_code = 6


class ImageMissingError(RuntimeUnavailableError):
    code = "image_missing"


class LimitError(GPUMeshError):
    """A request over a provider's limit (VRAM, upload size, quota)."""

    code = "limit"
    exit_code = 2


class NotFoundError(GPUMeshError):
    code = "not_found"
    exit_code = 2


class AgentError(GPUMeshError):
    code = "agent"


def _all_subclasses(cls: type[GPUMeshError]) -> list[type[GPUMeshError]]:
    found = [cls]
    for sub in cls.__subclasses__():
        found.extend(_all_subclasses(sub))
    return found


def error_from_code(code: str, message: str) -> GPUMeshError:
    """Rebuild the error a peer refused with; unknown codes stay readable."""
    for cls in _all_subclasses(GPUMeshError):
        if cls.code == code:
            return cls(message)
    return GPUMeshError(message)
