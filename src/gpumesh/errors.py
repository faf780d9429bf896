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
    │   ├── FrameTooLargeError        frame_too_large
    │   └── StaleRecordError          stale_record
    ├── RuntimeUnavailableError       runtime
    │   └── ImageMissingError         image_missing
    ├── LimitError                    limit
    ├── NotFoundError                 not_found
    ├── InUseError                    in_use
    ├── AgentError                    agent
    ├── BadRequestError               bad_request
    ├── CudaError                     cuda
    └── RegistryError                 registry

Each class also carries the ``exit_code`` the CLI ends with; :class:`ExitCode`
is the one table of those codes (with the ones jobs end with), which
``gpumesh --help`` and the README show.
"""

from __future__ import annotations

from enum import IntEnum
from typing import ClassVar


class ExitCode(IntEnum):
    """What ``gpumesh`` exits with. :data:`EXIT_MEANINGS` says what each means."""

    OK = 0
    FAILED = 1
    USAGE = 2
    DENIED = 3
    UNREACHABLE = 4
    PROTOCOL = 5
    RUNTIME = 6
    IN_USE = 7
    INTERNAL = 70
    JOB_TIMED_OUT = 124
    JOB_NOT_RUN = 125
    NOT_EXECUTABLE = 126
    NOT_FOUND = 127
    INTERRUPTED = 130
    PREEMPTED = 143


EXIT_MEANINGS: dict[ExitCode, str] = {
    ExitCode.OK: "success",
    ExitCode.FAILED: "failed for another reason (the error line says why)",
    ExitCode.USAGE: (
        "bad input: a flag, setting or code, an unknown peer or job, a provider's limit"
    ),
    ExitCode.DENIED: "refused: the peer has not paired you or denied you",
    ExitCode.UNREACHABLE: "the peer or relay could not be reached, or the link dropped",
    ExitCode.PROTOCOL: "the peer sent something malformed or speaks another protocol version",
    ExitCode.RUNTIME: "Docker is not available, or the image is not there and cannot be pulled",
    ExitCode.IN_USE: (
        "already in use: this home shares with other options, or its UDP port is taken"
    ),
    ExitCode.INTERNAL: "internal failure, a bug (details in the debug log)",
    ExitCode.JOB_TIMED_OUT: "the job ran past its --timeout",
    ExitCode.JOB_NOT_RUN: "the job could not run (its container did not start)",
    ExitCode.NOT_EXECUTABLE: "the job's command is not executable in the image",
    ExitCode.NOT_FOUND: "the job's command is not in the image",
    ExitCode.INTERRUPTED: "cancelled, or interrupted with Ctrl-C",
    ExitCode.PREEMPTED: (
        "preempted: the provider's owner took the machine back (paused it or reclaimed its GPU)"
    ),
}

JOB_CODES_NOTE = (
    "Jobs: run, exec, logs -f and app run exit with the job's own code once it ran; "
    "gpumesh's own failures print a line starting `error:` on stderr"
)
"""Said under the table: a job's own code can be any of the numbers above."""


def exit_code_rows() -> list[tuple[int, str]]:
    """The table of exit codes, in order: code and meaning."""
    return [(int(code), EXIT_MEANINGS[code]) for code in ExitCode]


__all__ = [
    "EXIT_MEANINGS",
    "JOB_CODES_NOTE",
    "AccessDeniedError",
    "AgentError",
    "AmbiguousPeerError",
    "BadNameError",
    "BadRequestError",
    "ConfigError",
    "ConnectionLostError",
    "CudaError",
    "ExitCode",
    "ExpiredCodeError",
    "FrameTooLargeError",
    "GPUMeshError",
    "IdentityError",
    "ImageMissingError",
    "InUseError",
    "KeyMismatchError",
    "LimitError",
    "NodeUnavailableError",
    "NotFoundError",
    "NotInitializedError",
    "NotPairedError",
    "PairingCodeError",
    "PeerError",
    "PeerKeyChangedError",
    "ProtocolError",
    "RegistryError",
    "RelayError",
    "RuntimeUnavailableError",
    "StaleRecordError",
    "TransportError",
    "UnknownPeerError",
    "UnreachableError",
    "error_from_code",
    "exit_code_rows",
]


class GPUMeshError(Exception):
    """Root of every error GPUMesh raises on purpose."""

    code: ClassVar[str] = "error"
    exit_code: ClassVar[ExitCode] = ExitCode.FAILED

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class ConfigError(GPUMeshError):
    code = "config"
    exit_code = ExitCode.USAGE


class NotInitializedError(ConfigError):
    code = "not_initialized"


class IdentityError(GPUMeshError):
    code = "identity"


class BadNameError(IdentityError):
    code = "bad_name"
    exit_code = ExitCode.USAGE


class PairingCodeError(IdentityError):
    code = "bad_code"
    exit_code = ExitCode.USAGE


class ExpiredCodeError(PairingCodeError):
    code = "expired_code"


class PeerError(GPUMeshError):
    code = "peer"
    exit_code = ExitCode.USAGE


class UnknownPeerError(PeerError):
    code = "unknown_peer"


class AmbiguousPeerError(PeerError):
    code = "ambiguous_peer"


class PeerKeyChangedError(PeerError):
    code = "peer_key_changed"


class AccessDeniedError(GPUMeshError):
    code = "denied"
    exit_code = ExitCode.DENIED


class NotPairedError(AccessDeniedError):
    code = "not_paired"


class TransportError(GPUMeshError):
    code = "transport"
    exit_code = ExitCode.UNREACHABLE

    def __init__(self, message: str, *, why: str = "") -> None:
        super().__init__(message)
        self.why = why or message
        """What failed, without the advice after it: one part of a message that
        names every path a dial tried."""


class UnreachableError(TransportError):
    code = "unreachable"

    def __init__(self, message: str, *, refused: bool = False, why: str = "") -> None:
        super().__init__(message, why=why)
        self.refused = refused
        """The host answered that nothing listens on that port (ICMP port unreachable)."""


class KeyMismatchError(TransportError):
    code = "key_mismatch"


class ConnectionLostError(TransportError):
    code = "connection_lost"


class RelayError(TransportError):
    """The relay refused or ended something (its named refusal is in the message)."""

    code = "relay"


class ProtocolError(GPUMeshError):
    code = "protocol"
    exit_code = ExitCode.PROTOCOL


class FrameTooLargeError(ProtocolError):
    code = "frame_too_large"


class StaleRecordError(ProtocolError):
    """A peer's address record is not newer than the one already taken for its node."""

    code = "stale_record"


class RuntimeUnavailableError(GPUMeshError):
    code = "runtime"
    exit_code = ExitCode.RUNTIME


class ImageMissingError(RuntimeUnavailableError):
    code = "image_missing"


class LimitError(GPUMeshError):
    """A request over a provider's limit (VRAM, upload size, quota)."""

    code = "limit"
    exit_code = ExitCode.USAGE


class NotFoundError(GPUMeshError):
    code = "not_found"
    exit_code = ExitCode.USAGE


class InUseError(GPUMeshError):
    """Something this node needs is taken: its home by a running ``gpumesh share``,
    or the UDP port it would listen on; or, refused by a provider, a job id it
    holds under another fencing epoch (a copy of the job ran there before)."""

    code = "in_use"
    exit_code = ExitCode.IN_USE


class NodeUnavailableError(GPUMeshError):
    """Nothing answers on the home's control socket (none runs, or it just died)."""

    code = "node_unavailable"

    def __init__(self, message: str, *, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail or message
        """What went wrong, without the sentence around it."""

    @classmethod
    def because(cls, detail: str) -> NodeUnavailableError:
        return cls(f"the node process did not answer: {detail}", detail=detail)


class AgentError(GPUMeshError):
    code = "agent"


class BadRequestError(GPUMeshError):
    """A control API request that is malformed: its body, a parameter, a missing field."""

    code = "bad_request"
    exit_code = ExitCode.USAGE


class CudaError(GPUMeshError):
    """A remote CUDA call failed; ``name`` is CUDA's error name when it has one."""

    code = "cuda"

    def __init__(self, message: str, name: str = "") -> None:
        super().__init__(message)
        self.name = name


class RegistryError(GPUMeshError):
    """A public registry refused a record (stale, rate limit, too large) or sent
    something that does not verify; the message names the registry and why."""

    code = "registry"


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
