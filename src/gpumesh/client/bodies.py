"""The local API's request bodies: one typed struct per body, shared by the API
(which decodes them), the CLI and :class:`gpumesh.Mesh` (which build them).

Unknown fields are refused (``forbid_unknown_fields``): a typo in a script's
request gets 422 naming the field instead of passing silently. Nothing here
imports a web framework; the answers are the views of
:mod:`gpumesh.client.views`.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec

from gpumesh.errors import ConfigError
from gpumesh.settings import ENV_IMAGE, env
from gpumesh.units import parse_size

if TYPE_CHECKING:
    from gpumesh.client.jobspec import JobSpec, MountSpec

__all__ = [
    "AppPullBody",
    "AppRunBody",
    "CancelBody",
    "ConfigBody",
    "CopyBody",
    "CudaBody",
    "DesktopShareBody",
    "ExchangeBody",
    "GroupBody",
    "InviteBody",
    "JobBody",
    "JoinBody",
    "MemberBody",
    "PairBody",
    "PauseBody",
    "PruneBody",
    "SearchBody",
    "ShareOptions",
    "ShellRequest",
    "SyncBody",
    "SyncPeersBody",
    "TcpBody",
    "TunnelBody",
    "job_body",
    "job_options",
]


def _mount_texts(mounts: Sequence[MountSpec]) -> list[str]:
    """A job spec's mounts as bodies carry them: ``SOURCE:TARGET[:rw]``, as ``--mount``."""
    return [f"{m.source}:{m.target}{':rw' if m.rw else ''}" for m in mounts]


def job_options(spec: JobSpec) -> dict[str, Any]:
    """A job spec's options as keyword arguments of :class:`JobBody` and
    :class:`AppRunBody` (which share them): its image, the caller's default when it
    names none (``$GPUMESH_IMAGE``; the node process's own default is not the
    caller's), env, GPU memory, retries, timeout and mounts."""

    return {
        "image": spec.image or env(ENV_IMAGE),
        "env": spec.env,
        "gpu_memory": spec.gpu_memory,
        "retries": spec.retries,
        "timeout": spec.timeout,
        "mounts": _mount_texts(spec.mounts),
    }


def job_body(spec: JobSpec, *, wait: float | str = 0.0) -> JobBody:
    """What ``run`` (and ``gpumesh.Mesh``) sends the node process for ``spec``, whose
    folders are absolute already (the node process works elsewhere); ``wait``: as
    ``--wait``."""
    return JobBody(
        command=spec.command,
        peer=spec.peer,
        group=spec.group,
        workdir=None if spec.workdir is None else str(spec.workdir),
        **job_options(spec),
        wait=wait,
        max_moves=spec.max_moves if spec.group else None,
        outputs=spec.outputs,
        outputs_to=None if spec.outputs_to is None else str(spec.outputs_to),
        outputs_under=None if spec.outputs_under is None else str(spec.outputs_under),
    )


class PairBody(msgspec.Struct, forbid_unknown_fields=True):
    code: str
    rekey: bool = False
    offline: bool = False
    """Do not dial the peer to check whether it paired this node."""


class JobBody(msgspec.Struct, forbid_unknown_fields=True):
    command: list[str] = []
    peer: str | None = None
    group: str | None = None
    image: str | None = None
    env: dict[str, str] = {}
    gpu_memory: int | str | None = None
    """Bytes, or text such as ``8GB``."""
    retries: int | None = None
    timeout: float | str | None = None
    mounts: list[str] = []
    """``/sandbox/folder:/container/path[:rw]``, as ``--mount``."""
    workdir: str | None = None
    """A local folder to upload (not from a browser session)."""
    wait: float | str = 0.0
    """Seconds (or a duration such as ``10m``) the job may wait in the node process's
    queue when no provider can take it now, or none can when it must move; 0: refused
    at once."""
    max_moves: int | None = None
    """With ``group``: how many times the job may move to another member (default 3,
    at most 10)."""
    outputs: str = ""
    """A container path whose finished files come home as the job runs (``--outputs``)."""
    outputs_to: str | None = None
    """With ``outputs``: the absolute local folder they go to."""
    outputs_under: str | None = None
    """With ``outputs`` and no ``outputs_to``: the absolute folder whose ``JOB_ID``
    subfolder they go to (``run`` sends its ``./gpumesh-outputs``)."""


class CancelBody(msgspec.Struct, forbid_unknown_fields=True):
    peer: str | None = None
    """The provider, for a job not in this node's store."""


class GroupBody(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    """The new group's name."""


class InviteBody(msgspec.Struct, forbid_unknown_fields=True):
    expires: float = 24 * 3600.0
    """Seconds the invite stays valid (more than 0, at most 7 days)."""


class JoinBody(msgspec.Struct, forbid_unknown_fields=True):
    code: str
    """A member's invite."""


class MemberBody(msgspec.Struct, forbid_unknown_fields=True):
    peer: str
    """A paired peer: its name or a node id prefix."""


class SearchBody(msgspec.Struct, forbid_unknown_fields=True):
    """``gpumesh search``'s filters: the registry's, checked there too."""

    gpu: str = ""
    """Part of a GPU model name."""
    vram: Annotated[int, msgspec.Meta(ge=0)] = 0
    """Bytes a GPU has at least (free, or with ``vram_total`` in all)."""
    vram_total: bool = False
    idle: bool = False
    region: str = ""
    limit: Annotated[int, msgspec.Meta(ge=1, le=100)] = 20
    cursor: str = ""
    """Where the previous page ended."""


class SyncPeersBody(msgspec.Struct, forbid_unknown_fields=True):
    timeout: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    """Seconds to wait per peer."""
    dial: bool = True
    """Dial every peer to check the path that works (false: only look addresses up)."""


class PruneBody(msgspec.Struct, forbid_unknown_fields=True):
    older_than: Annotated[float, msgspec.Meta(ge=0)]
    """Seconds: only finished jobs created longer ago than this go."""
    dry_run: bool = False
    """List what would go, remove nothing."""


class CopyBody(msgspec.Struct, forbid_unknown_fields=True):
    source: str
    destination: str
    """Exactly one of the two is ``PEER:PATH``, the other a local path."""
    cwd: str | None = None
    """The caller's working folder: a relative local path is taken from there (and
    shown as written)."""
    retries: int | None = None
    fast_path: bool = True
    """False: keep file bytes on QUIC (``cp --no-fast-path``)."""


class SyncBody(msgspec.Struct, forbid_unknown_fields=True):
    peer: str
    dir: str
    name: str | None = None
    dry_run: bool = False


class AppRunBody(msgspec.Struct, forbid_unknown_fields=True):
    peer: str
    dir: str
    """The local folder to sync and run in (absolute)."""
    command: list[str] = []
    out: str | None = None
    """A local folder (absolute) to pull the app's folder of its name back into."""
    image: str | None = None
    env: dict[str, str] = {}
    gpu_memory: int | str | None = None
    retries: int | None = None
    timeout: float | str | None = None
    mounts: list[str] = []


class AppPullBody(msgspec.Struct, forbid_unknown_fields=True):
    job: str
    """The job's id, or a prefix of it (4+ characters) when this node started it."""
    dir: str
    """The local folder (absolute) to pull the job's app folder into."""
    folder: str = ""
    """Only this folder of the app's folder (``app run --out``'s name), if given."""
    peer: str = ""
    """The provider; found from this node's record of the job when left out."""


class ExchangeBody(msgspec.Struct, forbid_unknown_fields=True):
    code: str


class TcpBody(msgspec.Struct, forbid_unknown_fields=True):
    listen: str = ""
    """``host:port`` on loopback; empty: the node process's ``GPUMESH_API_ADDR``
    (default 127.0.0.1:8080)."""


class ConfigBody(msgspec.Struct, forbid_unknown_fields=True):
    value: str
    """As ``gpumesh config set KEY VALUE`` takes it (checked by the key's rules)."""


class DesktopShareBody(msgspec.Struct, forbid_unknown_fields=True):
    kind: Literal["vnc", "rdp", "tcp"]
    """``tcp``: a port that is not a usual VNC or RDP one."""
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    """The desktop server's TCP port on 127.0.0.1."""


class TunnelBody(msgspec.Struct, forbid_unknown_fields=True):
    """``desktop connect``: a peer's desktop on a loopback port of this machine."""

    peer: str
    bind: str | None = None
    """``[HOST:]PORT`` on loopback; None: 127.0.0.1 and the port of the desktop's kind."""


class CudaBody(msgspec.Struct, forbid_unknown_fields=True):
    """A CUDA session on a peer: ``cuda demo``, ``cuda bench``, ``cuda bridge``."""

    peer: str
    memory: Annotated[int, msgspec.Meta(ge=1)] | None = None
    """Bytes of device memory held for the session (None: 1 GiB)."""
    bind: str | None = None
    """The bridge's ``HOST:PORT`` on loopback, or ``unix:PATH`` (an absolute path)."""


class ShellRequest(msgspec.Struct, forbid_unknown_fields=True):
    peer: str
    command: list[str] = []
    """Empty: ``sh``."""
    image: str | None = None
    env: dict[str, str] = {}
    gpu_memory: int = 0
    """Bytes of GPU memory to hold for the shell (0: no GPU)."""
    tty: bool = False
    rows: int = 0
    cols: int = 0


class PauseBody(msgspec.Struct, forbid_unknown_fields=True):
    grace: float = 30.0
    """Seconds guest jobs get between SIGTERM and SIGKILL (0 to 1 day)."""


class ShareOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """What ``gpumesh share`` takes (its flags), as ``POST /api/v1/share``'s body."""

    host: str | None = None
    """Address to listen on (config listen_host)."""
    port: int | None = None
    """UDP port (config listen_port); 0: any free one."""
    max_vram: str | None = None
    """Most GPU memory one job may ask for, e.g. ``16GB``."""
    public: bool = False
    """List this node's GPUs in the registry at rendezvous_url while sharing."""
    region: str | None = None
    contact: str = ""
    show_addresses: bool = False

    def check(self) -> int | None:
        """Refuse a bad value in one line (:class:`ConfigError`); the GPU memory cap
        in bytes."""

        if self.port is not None and not 0 <= self.port <= 65535:
            raise ConfigError(f"port {self.port}: give a UDP port from 1 to 65535")
        if not self.public:
            for flag, given in (
                ("--show-addresses", self.show_addresses),
                ("--region", bool(self.region)),
                ("--contact", bool(self.contact)),
            ):
                if given:
                    raise ConfigError(
                        f"{flag} is for the public listing: use it with --public (it would "
                        "change nothing without it)"
                    )
        if len(self.contact) > 200:
            raise ConfigError("contact: at most 200 characters")
        if self.max_vram is None or self.max_vram == "":
            return None
        try:
            return parse_size(self.max_vram)
        except ValueError as exc:
            raise ConfigError(f"max_vram {self.max_vram!r}: {exc}") from None

    def flags(self) -> list[str]:
        """The command-line flags that give these options (``share``, ``daemon run``)."""
        argv: list[str] = []
        for flag, value in (
            ("--host", self.host),
            ("--port", self.port),
            ("--max-vram", self.max_vram),
        ):
            if value is not None:
                argv += [flag, str(value)]
        if self.public:
            argv.append("--public")
        if self.region is not None:
            argv += ["--region", self.region]
        if self.contact:
            argv += ["--contact", self.contact]
        if self.show_addresses:
            argv.append("--show-addresses")
        return argv

    def describe(self) -> str:
        """How people would type these options (``the defaults`` for none)."""

        flags = self.flags()
        return " ".join(shlex.quote(f) for f in flags) if flags else "the defaults"
