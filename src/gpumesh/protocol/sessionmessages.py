"""The messages of a long-lived session on one stream: a shell in a container
(``exec``, ``debug``, ``exec --job``), one TCP connection to the owner's desktop
or to a job's port, a CUDA session. Part of the one union of
:mod:`gpumesh.protocol.messages`, which re-exports them."""

from __future__ import annotations

from typing import Annotated

import msgspec

from gpumesh.protocol.msgbase import Arg, Count, EnvKey, EnvValue, JobId, Name, Text, _Msg

__all__ = [
    "CudaOpen",
    "CudaOpened",
    "DesktopKindName",
    "DesktopOpen",
    "DesktopOpened",
    "ExecExit",
    "ExecResize",
    "ExecStart",
    "ExecStarted",
    "PortOpen",
    "PortOpened",
]


# --- exec: an interactive shell in a fresh container -------------------------------


class ExecStart(_Msg, tag="exec_start", frozen=True):
    """Start a container with a TTY; then DATA frames carry terminal bytes both ways."""

    image: Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
    command: Annotated[list[Arg], msgspec.Meta(max_length=1024)]
    env: Annotated[dict[EnvKey, EnvValue], msgspec.Meta(max_length=256)]
    tty: bool
    rows: Annotated[int, msgspec.Meta(ge=0, le=10000)]
    cols: Annotated[int, msgspec.Meta(ge=0, le=10000)]
    pull_progress: bool = False
    """As ``JobSubmit.pull_progress``, before ``ExecStarted``."""
    gpu_memory: Count = 0
    """GPU memory the shell needs, in bytes, held for it while it is open; 0: no GPU.
    A provider from before this field opens the shell without one: the consumer
    finds that out from ``ExecStarted.gpus``."""
    job: Annotated[str, msgspec.Meta(max_length=64)] = ""
    """A job the consumer submitted to this provider (empty: a fresh container of
    ``image``): with ``twin``, the shell runs in a twin of its last attempt
    (``gpumesh debug``: ``image`` is ignored); without, ``command`` runs in the
    job's own running container (``gpumesh exec --job``). A provider from before
    this field opens a plain shell: the consumer finds that out from
    ``ExecStarted.job``."""
    twin: bool = False


class ExecStarted(_Msg, tag="exec_started", frozen=True):
    provider: Name
    gpus: Annotated[list[Name], msgspec.Meta(max_length=64)] = []
    """GPUs given to the shell (indexes); empty: none."""
    job: Annotated[str, msgspec.Meta(max_length=64)] = ""
    """``ExecStart.job``, as the provider understood it."""
    attempt: Count = 0
    """A twin: the job's attempt it copies."""
    exit_code: int | None = None
    """A twin: how that attempt exited (None: it never ran to an exit)."""
    ended_at: float = 0.0
    """A twin: when the job ended (wall clock, the provider's)."""
    kept_until: float = 0.0
    """A twin: until when the provider keeps what the attempt left."""


class ExecResize(_Msg, tag="exec_resize", frozen=True):
    rows: Annotated[int, msgspec.Meta(ge=1, le=10000)]
    cols: Annotated[int, msgspec.Meta(ge=1, le=10000)]


class ExecExit(_Msg, tag="exec_exit", frozen=True):
    exit_code: int


# --- desktop: one TCP connection to the desktop server the owner shared ---------------

DesktopKindName = Annotated[str, msgspec.Meta(max_length=16)]
"""A :class:`gpumesh.protocol.desktop.DesktopKind`: ``vnc``, ``rdp`` or ``tcp``; a
newer peer's other name is shown as it is."""


class DesktopOpen(_Msg, tag="desktop_open", frozen=True):
    """Consumer -> provider: connect one TCP connection to the desktop server its owner
    shared (never an address the consumer names). After ``DesktopOpened``, DATA frames
    carry the connection's bytes both ways; an empty DATA frame ends that direction
    (TCP half-close); FIN follows once both directions ended."""

    probe: bool = False
    """Only check (allowed, shared, the server listens) and answer, then end: what
    ``desktop connect`` asks first to pick its local port."""
    channel: bool = False
    """Ask for a data channel (TLS on TCP, as ``cp``'s) to carry the connection's bytes
    instead of DATA frames: the path is direct and the consumer has not found the
    provider's channels blocked."""
    framing: int = 0
    """Sealed-frame version 1 (keys bound to the channel's ``tls-unique``), which
    a consumer from before version 2 offers; never agreed now, so always 0 here."""
    sealing: int = 0
    """The sealed-frame version, from 2 on (keys bound to this QUIC session), the
    consumer speaks on that channel after its TLS handshake and ticket (0: TLS
    records only). A field of its own: a provider that knows only ``framing``
    answers it (with 1, whatever higher version is offered) and never reads this."""


class DesktopOpened(_Msg, tag="desktop_opened", frozen=True):
    provider: Name
    kind: DesktopKindName
    """What the owner shared: ``vnc``, ``rdp`` or ``tcp``."""
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    """The provider's local port (for the consumer's messages; it never picks it)."""
    channel_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    """Where the provider listens for this connection's data channel (0: none offered;
    DATA frames carry it). The consumer connects within a few seconds from the
    address of the QUIC session, pins the provider's key, sends ``channel_ticket``
    first; or sends ``ChannelDeclined`` and DATA frames carry it after all."""
    channel_ticket: Annotated[bytes, msgspec.Meta(max_length=64)] = b""
    framing: int = 0
    """Sealed-frame version 1, as a provider from before version 2 agreed to it;
    never agreed now, so always 0 here (a consumer refuses any other answer)."""
    sealing: int = 0
    """The sealed-frame version (2 on) both ends switch the channel to once each sent
    32 random bytes through its TLS (0: TLS records carry it)."""


class PortOpen(_Msg, tag="port_open", frozen=True):
    """Consumer -> provider: connect to 127.0.0.1:``port`` in the network namespace of
    its own job's container, then as ``DesktopOpen``. ``watch``: connect nothing, answer
    ``PortOpened`` now and again once the port listens; the refusal ends with the job."""

    job_id: JobId
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    watch: bool = False
    channel: bool = False
    sealing: int = 0


class PortOpened(_Msg, tag="port_opened", frozen=True):
    """As ``DesktopOpened``; ``listening``: the port listens in the container now."""

    provider: Name
    listening: bool = True
    channel_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    channel_ticket: Annotated[bytes, msgspec.Meta(max_length=64)] = b""
    sealing: int = 0


# --- CUDA remoting: one session per stream ------------------------------------------


class CudaOpen(_Msg, tag="cuda_open", frozen=True):
    """Open a CUDA session on the provider with ``memory`` bytes of device memory
    (held for it while it is open). After ``CudaOpened``, DATA frames carry the
    CUDA call protocol both ways (:mod:`gpumesh.protocol.cuda`); the consumer's
    FIN ends the session and frees its memory."""

    memory: Annotated[int, msgspec.Meta(ge=1)]
    version: int = 1
    """The CUDA call protocol the consumer speaks."""


class CudaOpened(_Msg, tag="cuda_opened", frozen=True):
    provider: Name
    backend: Name
    """``driver`` (a GPU) or ``fallback`` (host memory)."""
    device: Name
    """The GPU's name, or ``host-memory fallback``."""
    memory: Count
    """Bytes held for the session."""
    detail: Text = ""
    """The driver version, or why the fallback."""
    gpus: Annotated[list[Name], msgspec.Meta(max_length=64)] = []
