"""The runtime interface the agent's job and exec services talk to.

Every method is blocking (the Docker SDK is); the agent calls them from worker
threads. Implementations raise only :mod:`gpumesh.errors` exceptions:
``RuntimeUnavailableError`` when the engine is down, ``ImageMissingError``
when an image is neither present nor pullable, ``NotFoundError`` for an
unknown container.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from gpumesh.protocol.messages import MAX_JOB_MOUNTS
from gpumesh.runtime.pull import PullProgress

__all__ = [
    "MAX_MOUNTS",
    "NO_GPU_RUNTIME",
    "NO_GPU_RUNTIME_NOTE",
    "ContainerSpec",
    "ContainerState",
    "EngineIsolation",
    "JobRuntime",
    "LogCursor",
    "LogLine",
    "Mount",
    "Terminal",
    "mount_target_problem",
]

NO_GPU_RUNTIME = (
    "this machine's Docker cannot give GPUs to containers (no NVIDIA container toolkit)"
)
"""What a provider says when its engine has no way to give containers GPUs."""
NO_GPU_RUNTIME_NOTE = (
    f"{NO_GPU_RUNTIME}: jobs run without GPUs, and those that ask for GPU memory fail; "
    "install nvidia-container-toolkit and restart Docker"
)
"""The owner's line about it, in the share's output."""

LABEL_PREFIX = "io.gpumesh"
LABEL_JOB = f"{LABEL_PREFIX}.job"
"""Label holding the job id."""
LABEL_PEER = f"{LABEL_PREFIX}.peer"
"""Label holding the submitting peer's node id."""
LABEL_NODE = f"{LABEL_PREFIX}.node"
"""Label holding the provider's node id: two nodes on one engine never touch
each other's containers."""
LABEL_ATTEMPT = f"{LABEL_PREFIX}.attempt"
LABEL_IMAGE = f"{LABEL_PREFIX}.image"
"""Label holding the image as the job named it: the container is created from
that image's id (see DockerRuntime.create), which is all the engine keeps."""
LABEL_KIND = f"{LABEL_PREFIX}.kind"
"""Label saying what a container is for when it is not a job: ``exec`` for an
interactive shell."""
KIND_EXEC = "exec"
WORKDIR_MOUNT = "/workspace"
DEFAULT_HOME = "/home/gpumesh"
GiB = 1024**3
MAX_MOUNTS = MAX_JOB_MOUNTS
"""Most sandbox folders one job may mount."""
SYSTEM_PATHS = ("/proc", "/sys", "/dev")
"""What the engine itself mounts: nothing of a job's may stand there or below."""

Stream = Literal["stdout", "stderr"]


@dataclass(frozen=True)
class Mount:
    """A host folder bind-mounted into a job's container (a folder of the
    submitting peer's sandbox, checked by the agent)."""

    source: str
    """Absolute host path of the folder."""
    target: str
    """Where it appears in the container (see :func:`mount_target_problem`)."""
    rw: bool = False
    """False: mounted read-only."""
    below_workdir: bool = False
    """It may lie inside the workdir (a job's outputs at ``/workspace/out``)."""


def _overlaps(a: str, b: str) -> bool:
    """Whether one of two absolute container paths is the other or lies in it."""
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")


def mount_target_problem(
    target: str, others: Sequence[str] = (), *, below_workdir: bool = False
) -> str | None:
    """Why a job may not mount a folder at ``target`` (None: it may).

    A plain absolute path (no ``..``, ``.`` or doubled ``/``), not the root nor
    at, above or below a path the container already has (/proc, /sys, /dev, the
    workdir, /tmp, the home) nor any of ``others`` (the job's other mounts).
    ``below_workdir``: a folder inside the workdir may be (a job's outputs at
    ``/workspace/out``: the engine mounts it over the workdir's, deepest last).
    """
    if not target.startswith("/") or posixpath.normpath(target) != target or "//" in target:
        return "must be a plain absolute path such as /data (no .., no trailing /)"
    if target == "/" or any(ch in target for ch in ":,\0\n"):
        return "must name a folder below / (and hold no ':', ',' or control characters)"
    for path in SYSTEM_PATHS:
        if _overlaps(target, path):
            return f"overlaps {path}, which the container's system needs"
    inside = below_workdir and target.startswith(WORKDIR_MOUNT + "/")
    for path in ("/tmp", DEFAULT_HOME) if inside else (WORKDIR_MOUNT, "/tmp", DEFAULT_HOME):
        if _overlaps(target, path):
            return f"overlaps {path}, which the job already has"
    for path in others:
        if _overlaps(target, path):
            return f"overlaps {path}, another of the job's mounts"
    return None


@dataclass(frozen=True)
class ContainerSpec:
    """Everything needed to create one locked-down job container."""

    image: str
    command: list[str]
    """argv; empty means the image's default command."""
    env: dict[str, str]
    labels: dict[str, str]
    """Must include LABEL_JOB, LABEL_PEER, LABEL_NODE and LABEL_ATTEMPT."""
    name: str
    """Container name, e.g. ``gpumesh-<job>-<attempt>``."""
    memory: int
    """Memory limit in bytes (also the swap limit: no swap beyond it)."""
    pids_limit: int
    """Process limit; 0 means Docker's default (unlimited)."""
    cpus: float = 0.0
    """CPU limit (NanoCpus); 0 means no limit."""
    network: str = "bridge"
    """``bridge``: Docker's default bridge; ``none``: no network; else a job network
    of :mod:`gpumesh.runtime.jobnet` (filtered; the container's IPv6 is off)."""
    dns: tuple[str, ...] = ()
    """Name servers the container is given (only on a job network, whose rules open
    port 53 of exactly these); empty: the engine's choice."""
    workdir: str | None = None
    """Host folder bind-mounted read-write at /workspace and made the working
    directory."""
    mounts: list[Mount] = field(default_factory=list)
    """Folders of the submitting peer's sandbox, bind-mounted (read-only unless
    ``rw``); with the workdir, the only host paths a job ever sees."""
    gpu_ids: list[str] = field(default_factory=list)
    """GPU indexes or UUIDs given to the container through a device request;
    empty: no GPU (and NVIDIA_VISIBLE_DEVICES=void so the image cannot widen it)."""
    user: str | None = None
    """``UID:GID`` (numbers) the container's processes run as; None: the image's
    own user (often root). See :func:`gpumesh.runtime.users.job_identity`."""
    home: str = DEFAULT_HOME
    """A private, writable folder (a tmpfs of ``tmp_size``, mode 0700, owned by
    ``user``; world-writable 1777 when ``user`` is None, whose uid is not known
    here); HOME points at it unless ``env`` sets HOME."""
    tmp_size: int = GiB
    """Bytes of the tmpfs mounted at /tmp (mode 1777) and of the one at ``home``
    (each), and of one at each VOLUME path of the image. Mounted ``exec`` (tools
    load compiled code from /tmp and ~/.cache), ``nosuid``, ``nodev``. tmpfs pages
    are charged to the container's memory cgroup, so they count against
    ``memory``: a full /tmp leaves that much less for the job."""
    shm_size: int = 2 * GiB
    """Bytes of /dev/shm (clamped to ``memory``); PyTorch's data loaders pass
    tensors through it. Also a tmpfs charged to ``memory``."""
    writable_root: bool = False
    """False: the root filesystem is read-only, and only /tmp, ``home``,
    /dev/shm, the workdir and the image's VOLUME paths (all tmpfs but the
    workdir) can be written. True only when the provider allowed it (config
    ``job_root``); then ``storage_size`` bounds it where the engine can."""
    storage_size: int = 0
    """Bytes the container's writable root may grow to (Docker's ``storage_opt
    size``); applied only with ``writable_root``, when non-zero and when the
    engine supports it (:attr:`EngineIsolation.storage_size`)."""


@dataclass(frozen=True)
class EngineIsolation:
    """What the engine itself does to keep a container's users off the host's."""

    userns_remap: bool
    """The daemon runs with ``userns-remap``: root in a container is an
    unprivileged uid on the host."""
    rootless: bool
    """The daemon itself runs as an ordinary user (rootless Docker): root in a
    container is that user on the host."""
    remapped_root: tuple[int, int] | None
    """Under ``userns-remap``, the host uid:gid that container root maps to;
    None otherwise or when it cannot be told."""
    storage_size: bool
    """Whether the engine can bound a container's writable layer
    (``storage_opt size``): overlay2 on xfs with pquota, btrfs, zfs, ..."""


@dataclass(frozen=True)
class ContainerState:
    container_id: str
    labels: dict[str, str]
    status: str
    """Docker's status: created, running, exited, dead, ..."""
    exit_code: int | None
    """Set once the container has exited."""
    oom_killed: bool = False
    error: str = ""
    """Docker's State.Error (e.g. why start failed)."""
    image: str = ""
    """The image as the container was created from it (``busybox:1``)."""


@dataclass(frozen=True)
class LogCursor:
    """Where a log stream was read up to, to resume without loss or repeats.

    Docker stamps each log entry with a fixed-width RFC 3339 nanosecond time;
    ``count`` entries with exactly ``timestamp`` were already consumed.
    """

    timestamp: str = ""
    count: int = 0


@dataclass(frozen=True)
class LogLine:
    stream: Stream
    data: bytes
    """The entry's bytes, newline included when the program wrote one."""
    cursor: LogCursor
    """The cursor to resume from after this entry."""
    lost: bool = False
    """The engine no longer had what came between the cursor the read started from
    and this entry (it rotated out of the engine's log before it was read): some
    output may be missing before it, how much is not known."""


class Terminal(Protocol):
    """The attached stdin and output of an interactive container.

    Blocking, like the rest of the runtime: one thread may read while another
    writes, and :meth:`close` from any thread ends a blocked :meth:`read`.
    """

    def read(self) -> bytes:
        """The next output bytes (stdout and stderr together); ``b""`` once it ended."""

    def write(self, data: bytes) -> None:
        """Send all of ``data`` to the container's stdin."""

    def close_input(self) -> None:
        """End the container's stdin (the program reads EOF); output stays open.

        Only for a container without a TTY: with one, the engine would end the
        output too."""

    def close(self) -> None:
        """Detach; the container is not touched."""


class JobRuntime(Protocol):
    """Runs job containers. Implemented by ``DockerRuntime``."""

    def version(self) -> str:
        """Engine version and API version, e.g. ``Docker 20.10.24 (API 1.41)``."""

    def gpu_runtime_available(self) -> bool:
        """Whether the engine has the NVIDIA container runtime."""

    def image_present(self, image: str) -> bool:
        """Whether ``image`` is already on this machine (no pull)."""

    def ensure_image(
        self, image: str, progress: Callable[[PullProgress], None] | None = None
    ) -> bool:
        """Make sure ``image`` is present, pulling it if needed; whether it was pulled.

        ``progress`` hears how the pull goes (from the pulling thread, only when a
        figure changed; never after the pull was given up). Raises ImageMissingError
        when it is neither present nor pullable (the reason says what kind of
        failure, never the engine's network details)."""

    def image_size(self, image: str) -> int | None:
        """The image's size on disk in bytes; None when it is not here."""

    def remove_image(self, image: str) -> bool:
        """Remove the image unless a container uses it; whether it is gone."""

    def create(self, spec: ContainerSpec) -> str:
        """Create (not start) the container; return its id."""

    def start(self, container_id: str) -> None:
        """Start it. A missing executable is not an error here: the container
        exits with 127 (126 when not executable), as ``docker run`` reports."""

    def wait(self, container_id: str) -> ContainerState:
        """Block until the container exits; return its final state."""

    def inspect(self, container_id: str) -> ContainerState: ...

    def job_logs(
        self,
        container_id: str,
        cursors: dict[Stream, LogCursor],
        follow: bool,
        *,
        state: ContainerState | None = None,
    ) -> Iterator[LogLine]:
        """Entries of each stream in ``cursors`` after its cursor (in its own order;
        the streams read together); with ``follow`` until the container exits.
        ``state``: the container as the caller just saw it (None: asked first)."""

    def stop(self, container_id: str, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; no error if already stopped."""

    def remove(self, container_id: str) -> None:
        """Remove the container (force); no error if already gone."""

    def list_jobs(self, node_id: str) -> list[ContainerState]:
        """Every container labelled with LABEL_NODE == node_id, running or not."""

    def prepare(self, network: str, dns: tuple[str, ...], node_id: str, *, wait: float = 0) -> bool:
        """Get ready, in the background, what the next container of ``node_id`` on
        ``network`` (with name servers ``dns``) needs, waiting up to ``wait``
        seconds for it; whether it is ready."""

    def sweep_holders(self, node_id: str) -> None:
        """Remove what an earlier run for ``node_id`` left of the engine's ready
        network namespaces that no container listed by :meth:`list_jobs` uses."""

    def pids(self, container_id: str) -> list[int]:
        """Host process ids of the container's processes (empty when it is not running)."""

    def close(self) -> None:
        """Release connections to the engine; no job's container is touched."""

    def host_config(self, container_id: str) -> dict[str, object]:
        """The container's inspected HostConfig (for checks and tests)."""

    def isolation(self, image: str | None = None) -> EngineIsolation:
        """How the engine isolates containers; asked once, then cached.

        Whether container filesystems can be size-limited is probed by creating
        (never starting) a throwaway container of ``image``, which must be
        present; without one that answer is False and not cached."""

    def is_rootless(self) -> bool:
        """Whether the engine runs rootless (its networks are then out of our reach)."""

    def ensure_network(self, name: str, bridge: str) -> None:
        """Make the job network ``name`` with the bridge interface ``bridge`` unless it
        is there: no traffic between its containers, no IPv6
        (:mod:`gpumesh.runtime.jobnet` filters the rest)."""

    # --- interactive containers (``gpumesh exec``) ----------------------------------------

    def create_interactive(self, spec: ContainerSpec, tty: bool) -> str:
        """Create (not start) a container whose stdin stays open, with a TTY when
        ``tty``; same lockdown as a job's. ``spec.labels`` must include
        LABEL_PEER, LABEL_NODE and LABEL_KIND; it may not have a workdir."""

    def attach(self, container_id: str, tty: bool) -> Terminal:
        """Attach to a created container's stdin and output; attach before
        :meth:`start` so no output is missed. ``tty`` as it was created."""

    def resize(self, container_id: str, rows: int, cols: int) -> None:
        """Set the TTY size of a running interactive container."""
