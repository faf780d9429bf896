"""The Docker implementation of :class:`~gpumesh.runtime.base.JobRuntime`.

Owns everything GPUMesh says to a Docker engine: the locked-down shape of a
job container (and of an interactive one for ``gpumesh exec``, attached
through a raw socket), image checks and pulls, start-failure exit codes, log reading
with resumable cursors, and the translation of every Docker, requests and
socket failure into a :mod:`gpumesh.errors` exception with a one-line message
that says what to do.

It talks to the engine only through the Engine API (the ``docker`` SDK),
never through the docker CLI, and must never give a job the host's network,
privileges, capabilities or any host path other than its own workdir. Our
settings win over the image's: its labels, ``NVIDIA_*`` variables and VOLUME
lines never reach a container unless we set them, and nothing a job writes
lands on the host's disk but its workdir.

Thread safety: one ``DockerRuntime`` is shared by every job's worker threads.
The SDK client is a requests session over a pool of connections; each request
(including a long ``wait`` or a followed log stream) takes its own connection,
and this class keeps no per-call state on the client, so concurrent calls do
not interfere. The only shared mutable state here is the lazily created
client, guarded by a lock, the cached answer of :meth:`isolation`, guarded
by another, and the network holders (:mod:`gpumesh.runtime.holders`), which
guard their own.
"""

from __future__ import annotations

import calendar
import contextlib
import dataclasses
import logging
import math
import os
import posixpath
import re
import secrets
import shutil
import socket
import threading
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

import docker
import docker.errors
import docker.types
import requests.exceptions
import urllib3.exceptions

from gpumesh.errors import (
    AgentError,
    ConfigError,
    ExitCode,
    GPUMeshError,
    ImageMissingError,
    NotFoundError,
    RuntimeUnavailableError,
)
from gpumesh.runtime.base import (
    LABEL_ATTEMPT,
    LABEL_IMAGE,
    LABEL_JOB,
    LABEL_KIND,
    LABEL_NODE,
    LABEL_PEER,
    MAX_MOUNTS,
    NO_GPU_RUNTIME,
    SYSTEM_PATHS,
    WORKDIR_MOUNT,
    ContainerSpec,
    ContainerState,
    EngineIsolation,
    LogCursor,
    LogLine,
    Stream,
    mount_target_problem,
)
from gpumesh.runtime.holders import Holders, Placement
from gpumesh.runtime.jobnet import is_job_network
from gpumesh.runtime.pull import PullProgress, PullTracker

__all__ = ["DockerRuntime", "shell_output_in_our_words"]

logger = logging.getLogger(__name__)

_DEFAULT_ENDPOINT = "unix:///var/run/docker.sock"
_START_HINT = "start it with `sudo systemctl start docker`"

# Every job holds up to three long requests at once (wait plus two followed
# log streams); a bigger pool keeps those connections reusable instead of
# being opened and discarded beyond the SDK's default of 10.
_MAX_POOL_SIZE = 64

# The "local" log driver stores entries as bytes (json-file turns invalid
# UTF-8 into U+FFFD), works whatever the daemon's default driver is, and is
# bounded: 5 files of 20 MB per container. Rotated files stay uncompressed: a
# reader that fell behind reads them from its cursor, and a compressed one would
# be decompressed again for each such read.
_LOG_CONFIG = {"max-size": "20m", "max-file": "5", "compress": "false"}

# Docker cuts output without a newline into entries of this size that share
# one timestamp; the "local" driver then drops the newline that ended the
# series (json-file keeps it).
_LOG_PIECE = 16 * 1024
# While a container's log grows, it is read without follow at most this often
# (see DockerRuntime._log_lines).
_LOG_POLL = 0.02
# How long ensure_image's inspection of an image stands in for the one before
# creating a container from it (a job's check and its container come within
# milliseconds; a later attempt inspects again).
_INSPECTION_REUSE = 2.0
# Bytes read at once from a log response without follow.
_LOG_BLOCK = 256 * 1024
_NVIDIA_HOOK = "nvidia-container-runtime-hook"
"""NVIDIA's OCI hook, which Docker runs for a container given GPUs."""

_REQUIRED_LABELS = (LABEL_JOB, LABEL_PEER, LABEL_NODE, LABEL_ATTEMPT)
_INTERACTIVE_LABELS = (LABEL_PEER, LABEL_NODE, LABEL_KIND)
_ATTACH_READ = 64 * 1024
_REREAD_BYTES = 64 * 1024
"""Most bytes of a log read from its start that a reader reads again, rather than
reading a stream with a cursor and one without apart (see _read_logs)."""
_STREAM_IDS: dict[Stream, int] = {"stdout": 1, "stderr": 2}
"""The stream byte of a multiplexed log frame."""
_ALIVE = frozenset({"running", "paused", "restarting"})

# Docker's --tmpfs defaults to noexec, which breaks whatever loads compiled
# code from /tmp or ~/.cache (Triton, torch.compile, pip builds); nosuid and
# nodev keep a tmpfs from becoming a way up.
_TMPFS_OPTIONS = "rw,exec,nosuid,nodev"
# Paths a job's tmpfs mounts must not take: the root, what Docker mounts
# itself, and the kernel's.
# Given with GPUs: what CUDA programs need, not graphics, video or display.
_DRIVER_CAPABILITIES = "compute,utility"
_PROBE_SIZE = "1G"
_IPV6_SYSCTLS = "/proc/sys/net/ipv6"
"""Missing where the kernel has no IPv6 (then there is none to switch off)."""
_USER_IDS = re.compile(r"(\d+):(\d+)")
# Under userns-remap Docker keeps its data in <data root>/<uid>.<gid>.
_REMAPPED_ROOT_DIR = re.compile(r"/(\d+)\.(\d+)/*$")

# Docker's log timestamps: RFC 3339 in UTC with a fixed 9-digit fraction.
_TIMESTAMP = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?Z")

# Failures of the connection to the engine, as opposed to answers from it.
_CONNECTION_ERRORS = (
    docker.errors.DockerException,
    requests.exceptions.RequestException,
    urllib3.exceptions.HTTPError,
    OSError,
)


class _PullFailed(Exception):
    """An error message inside Docker's pull progress stream."""


class DockerRuntime:
    """Runs job containers on the local Docker engine.

    ``client`` is used as given (and never closed here); without one, a client
    is made from the environment (``DOCKER_HOST`` and friends) on first use, so
    an agent without Docker still starts. ``pull_timeout`` bounds
    :meth:`ensure_image`'s pull. ``init`` runs Docker's init (tini) as PID 1 so
    zombies are reaped and SIGTERM reaches the job; turn it off only for an
    engine without ``docker-init``.
    """

    def __init__(
        self,
        client: docker.DockerClient | None = None,
        *,
        pull_timeout: float = 600,
        init: bool = True,
    ) -> None:
        self._client = client
        self._owns_client = client is None
        self._pull_timeout = pull_timeout
        self._init = init
        self._lock = threading.Lock()
        self._isolation_lock = threading.Lock()
        self._inspected: dict[str, tuple[float, dict[str, Any]]] = {}
        """An image's inspection by :meth:`ensure_image` (monotonic time, attrs), for
        the container created from it right after. Guarded by ``_lock``."""
        self._stopped: dict[str, threading.Event] = {}
        """Set for a container once :meth:`wait` saw it stop (cleared when a wait
        begins): a log reader pausing between reads (see :meth:`_log_lines`) goes
        on at once, and takes it as stopped without asking. Guarded by ``_lock``."""
        self._isolation: EngineIsolation | None = None
        self._storage_size: bool | None = None
        self._holders = Holders(self._engine, self._arch)
        """Spare network namespaces for the next container on a network (see
        :mod:`gpumesh.runtime.holders`)."""

    def close(self) -> None:
        """Remove the spare network holders; close the client this runtime made
        itself (an injected one is the caller's)."""
        self._holders.close()
        if not self._owns_client:
            return
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    # --- engine -------------------------------------------------------------------------

    def _arch(self) -> str:
        with self._engine("report its architecture") as api:
            return str(api.version().get("Arch") or "")

    def version(self) -> str:
        with self._engine("report its version") as api:
            info = api.version()
        return f"Docker {info.get('Version', '?')} (API {info.get('ApiVersion', '?')})"

    def gpu_runtime_available(self) -> bool:
        with self._engine("describe itself") as api:
            info = api.info()
        if "nvidia" in (info.get("Runtimes") or {}):
            return True
        # Docker gives GPUs (--gpus, device requests) through NVIDIA's prestart hook
        # when it finds it on its PATH, with or without the "nvidia" runtime entry.
        return shutil.which(_NVIDIA_HOOK) is not None

    def isolation(self, image: str | None = None) -> EngineIsolation:
        # One lock for the whole answer: a second caller waits for the first
        # one's probe instead of making its own throwaway container.
        with self._isolation_lock:
            if self._isolation is None:
                with self._engine("describe itself") as api:
                    info = api.info()
                self._isolation = _engine_isolation(info)
            if self._storage_size is None and image:
                self._storage_size = self._probe_storage_size(image)
            return dataclasses.replace(self._isolation, storage_size=bool(self._storage_size))

    def _probe_storage_size(self, image: str) -> bool | None:
        """Whether the engine accepts ``storage_opt size``: it says so when a
        container is created, so create one (never started) and remove it.
        None when ``image`` is not here to tell."""
        name = f"gpumesh-probe-{secrets.token_hex(6)}"
        with self._engine("create a probe container") as api:
            host_config = api.create_host_config(
                network_mode="none", storage_opt={"size": _PROBE_SIZE}
            )
            try:
                created = api.create_container(
                    image=image,
                    command=["true"],  # never run; only an image without CMD needs one
                    name=name,
                    labels={LABEL_KIND: "probe"},
                    host_config=host_config,
                    detach=True,
                )
            except docker.errors.ImageNotFound:
                return None
            except docker.errors.APIError as exc:
                # On ext4: "--storage-opt is supported only for overlay over xfs
                # with 'pquota' mount option".
                logger.info("Docker cannot limit container filesystems: %s", _explanation(exc))
                return False
            # v=True: also the anonymous volumes of the image's VOLUME lines.
            api.remove_container(created["Id"], force=True, v=True)
        return True

    def is_rootless(self) -> bool:
        return self.isolation().rootless

    def ensure_network(self, name: str, bridge: str) -> None:
        """Make the job network ``name`` (bridge interface ``bridge``) unless it is
        there: containers on it cannot talk to each other (icc off) and get no
        IPv6 from it."""
        with self._engine(f"make the job network {name!r}") as api:
            if api.networks(names=[name]):
                return
            try:
                api.create_network(
                    name,
                    driver="bridge",
                    check_duplicate=True,
                    enable_ipv6=False,
                    options={
                        "com.docker.network.bridge.name": bridge,
                        "com.docker.network.bridge.enable_icc": "false",
                    },
                    labels={LABEL_KIND: "job-network"},
                )
            except docker.errors.APIError as exc:
                if exc.status_code != 409:  # another agent made it just now
                    raise
        logger.info("made the job network %s (bridge %s)", name, bridge)

    # --- images -------------------------------------------------------------------------

    def image_present(self, image: str) -> bool:
        with self._engine(f"look up image {image!r}") as api:
            try:
                api.inspect_image(image)
            except docker.errors.APIError:
                return False
        return True

    def ensure_image(
        self, image: str, progress: Callable[[PullProgress], None] | None = None
    ) -> bool:
        with self._engine(f"look up image {image!r}") as api:
            try:
                attrs = api.inspect_image(image)
            except docker.errors.ImageNotFound:
                pass
            except docker.errors.APIError as exc:
                # e.g. an invalid reference: no pull can fix that either
                raise ImageMissingError(_missing_image(image, _explanation(exc))) from exc
            else:
                with self._lock:
                    self._inspected[image] = (time.monotonic(), attrs)
                return False
        self._pull(image, progress)
        with self._engine(f"look up image {image!r}") as api:
            try:
                api.inspect_image(image)
            except docker.errors.APIError as exc:
                reason = "the pull finished but the image is still not there"
                raise ImageMissingError(_missing_image(image, reason)) from exc
        return True

    def image_size(self, image: str) -> int | None:
        with self._engine(f"look up image {image!r}") as api:
            try:
                attrs = api.inspect_image(image)
            except docker.errors.APIError:
                return None
        return int(attrs.get("Size") or 0)

    def remove_image(self, image: str) -> bool:
        with self._engine(f"remove image {image!r}") as api:
            try:
                api.remove_image(image)  # never forced: an image a container uses stays
            except docker.errors.ImageNotFound:
                return True
            except docker.errors.APIError as exc:
                logger.info("keeping image %s: %s", image, _explanation(exc))
                return False
        return True

    def _pull(self, image: str, progress: Callable[[PullProgress], None] | None) -> None:
        api = self._api()
        failures: list[Exception] = []
        finished = threading.Event()
        tracker = PullTracker(image)

        def pull() -> None:
            try:
                for message in api.pull(image, stream=True, decode=True):
                    if not isinstance(message, dict):
                        continue
                    if message.get("error"):
                        raise _PullFailed(str(message["error"]))
                    if tracker.feed(message) and progress is not None and not finished.is_set():
                        progress(tracker.progress())
            except Exception as exc:  # handed over to the waiting thread
                failures.append(exc)
            finally:
                finished.set()

        # The SDK has no deadline for a whole pull (its timeout is per read),
        # so the pull runs in its own thread and this one waits at most
        # pull_timeout. Docker finishes an abandoned pull in the background;
        # a later ensure_image then finds the image.
        logger.info("pulling image %s", image)
        threading.Thread(target=pull, name=f"docker pull {image}", daemon=True).start()
        if not finished.wait(self._pull_timeout):
            reason = f"the pull did not finish within {self._pull_timeout:g} s (pull_timeout)"
            raise ImageMissingError(_missing_image(image, reason))
        if failures:
            failure = failures[0]
            if isinstance(failure, _PullFailed):
                detail = _one_line(str(failure))
            elif isinstance(failure, docker.errors.APIError):
                detail = _explanation(failure)
            else:
                raise _connection_error(failure, _endpoint(api)) from failure
            # The engine's words may name this machine's resolver, proxy or
            # addresses: the peer hears only what kind of failure it was.
            logger.info("pulling %s failed: %s", image, detail)
            raise ImageMissingError(_missing_image(image, pull_failure(detail))) from failure

    # --- containers ---------------------------------------------------------------------

    def create(self, spec: ContainerSpec) -> str:
        _check_spec(spec, interactive=False)
        return self._create(spec, interactive=False, tty=False)

    def _create(self, spec: ContainerSpec, *, interactive: bool, tty: bool) -> str:
        """The one place that shapes a container: the lockdown is the same for jobs
        and shells; they differ only in GPUs, the workdir, logs and stdin.

        Docker merges the image's labels, ENV and VOLUME lines into the
        container and can only override them, never drop them; so the image is
        inspected first and each of those is overridden (labels and ``NVIDIA_*``
        with empty values, volumes with tmpfs mounts). The container is created
        from the inspected image's id, not its name: a tag moved in between (a
        pull, a build) cannot let another image's labels, env and volumes
        through, and no inspection of the container is needed to be sure. The
        name the job gave is kept in the LABEL_IMAGE label."""
        image = self._inspect_image(spec.image)
        image_id = str(image.get("Id") or "")
        if not image_id:
            raise AgentError(f"Docker described image {spec.image!r} without an id: try again")
        image_config = image.get("Config") or {}
        env = _container_env(spec, image_config.get("Env"))
        labels = _container_labels(spec, image_config.get("Labels"))
        labels[LABEL_IMAGE] = spec.image
        tmpfs = _tmpfs_mounts(spec, image_config.get("Volumes"))
        storage_opt = None
        if spec.writable_root and spec.storage_size > 0 and self.isolation(spec.image).storage_size:
            storage_opt = {"size": str(spec.storage_size)}
        device_requests = None
        if spec.gpu_ids:
            device_requests = [
                docker.types.DeviceRequest(
                    driver="nvidia", device_ids=list(spec.gpu_ids), capabilities=[["gpu"]]
                )
            ]
        binds = None
        if spec.workdir is not None:
            binds = {spec.workdir: {"bind": WORKDIR_MOUNT, "mode": "rw"}}
        # Mount, not Binds: the engine refuses a source that is not there
        # instead of making one, and no path is parsed out of a string.
        mounts = [
            docker.types.Mount(m.target, m.source, type="bind", read_only=not m.rw)
            for m in spec.mounts
        ]
        if interactive:
            # What is typed and shown in a shell stays off the provider's disk.
            log_config = docker.types.LogConfig(type="none")
        else:
            log_config = docker.types.LogConfig(type="local", config=dict(_LOG_CONFIG))
        kind = "exec" if interactive else "job"
        placement, holder = self._take_holder(spec)
        network_mode, dns, sysctls = spec.network, list(spec.dns) or None, None
        if holder is not None:  # its namespace was made as this container's would be
            network_mode, dns = Holders.network_mode(holder), None
        elif placement is not None:
            sysctls = placement.sysctls
        with (
            self._holders.unless_made(holder),
            self._engine(f"create container {spec.name!r}") as api,
        ):
            host_config = api.create_host_config(
                privileged=False,
                cap_drop=["ALL"],
                security_opt=["no-new-privileges"],
                read_only=not spec.writable_root,
                tmpfs=tmpfs,
                shm_size=min(spec.shm_size, spec.memory),
                storage_opt=storage_opt,
                pids_limit=spec.pids_limit or None,
                mem_limit=spec.memory,
                memswap_limit=spec.memory,
                nano_cpus=round(spec.cpus * 1e9) if spec.cpus > 0 else None,
                network_mode=network_mode,
                dns=dns,
                sysctls=sysctls,
                binds=binds,
                mounts=mounts or None,
                init=self._init,
                device_requests=device_requests,
                log_config=log_config,
            )
            try:
                created = api.create_container(
                    image=image_id,
                    command=list(spec.command) or None,
                    environment=[f"{key}={value}" for key, value in env.items()],
                    labels=labels,
                    name=spec.name,
                    user=spec.user,
                    working_dir=WORKDIR_MOUNT if spec.workdir is not None else None,
                    host_config=host_config,
                    # A shell is not detached: the SDK then also sets StdinOnce, so
                    # ending our attached stdin (close_input) closes the program's.
                    detach=not interactive,
                    stdin_open=interactive,
                    tty=tty,
                )
            except docker.errors.ImageNotFound as exc:
                raise ImageMissingError(_not_here(spec.image)) from exc
            except docker.errors.APIError as exc:
                if exc.status_code == 409:
                    raise AgentError(
                        f"a container named {spec.name!r} already exists: remove it with "
                        f"`docker rm -f {spec.name}` if nothing uses it"
                    ) from exc
                raise
            container_id = str(created["Id"])
        if holder is not None:
            self._holders.joined(container_id, holder)
        if placement is not None:
            self._holders.replenish(placement)
        label = spec.labels.get(LABEL_JOB, spec.name)
        for warning in created.get("Warnings") or []:
            logger.warning("[%s %s] Docker: %s", kind, label, warning)
        logger.debug("[%s %s] created container %s", kind, label, container_id)
        return container_id

    def _take_holder(self, spec: ContainerSpec) -> tuple[Placement | None, str | None]:
        """Where ``spec``'s container goes (None: no network) and the spare holder
        it joins there, if one is ready (see :mod:`gpumesh.runtime.holders`)."""
        if spec.network == "none":
            return None, None
        placement = _placement(spec.network, spec.dns, spec.labels[LABEL_NODE])
        return placement, self._holders.take(placement)

    def _inspect_image(self, name: str) -> dict[str, Any]:
        """The image a container is about to be created from: the inspection
        :meth:`ensure_image` just made of it (at most _INSPECTION_REUSE old, used
        once), else a new one. Either way the container is created from exactly
        the image inspected, by its id (see :meth:`_create`)."""
        with self._lock:
            inspected = self._inspected.pop(name, None)
        if inspected is not None and time.monotonic() - inspected[0] <= _INSPECTION_REUSE:
            return inspected[1]
        with self._engine(f"look up image {name!r}") as api:
            try:
                return dict(api.inspect_image(name))
            except docker.errors.ImageNotFound as exc:
                raise ImageMissingError(_not_here(name)) from exc

    def start(self, container_id: str) -> None:
        with self._engine("start container", container_id) as api:
            try:
                api.start(container_id)
            except docker.errors.NotFound:
                raise
            except docker.errors.APIError as exc:
                message = _explanation(exc)
                # Like `docker run`, a missing or non-executable command is the
                # job failing with 127/126, not the runtime. Docker keeps the
                # message in State.Error (across agent restarts too), so
                # inspect() and wait() report it from there.
                with contextlib.suppress(GPUMeshError):
                    if self.inspect(container_id).status == "exited":
                        logger.info("container %s did not start: %s", container_id[:12], message)
                        return
                if "could not select device driver" in message:
                    raise RuntimeUnavailableError(
                        f"{NO_GPU_RUNTIME}: install nvidia-container-toolkit and restart Docker"
                    ) from exc
                raise AgentError(
                    f"Docker could not start container {container_id[:12]}: {message}"
                ) from exc

    def wait(self, container_id: str) -> ContainerState:
        stopped = self._stop_event(container_id)
        stopped.clear()  # (started again since an earlier wait)
        with self._engine("wait for container", container_id) as api:
            # No HTTP timeout: a job may run for days.
            api.wait(container_id, timeout=None)
        stopped.set()
        return self.inspect(container_id)

    def _stop_event(self, container_id: str) -> threading.Event:
        with self._lock:
            return self._stopped.setdefault(container_id, threading.Event())

    def inspect(self, container_id: str) -> ContainerState:
        with self._engine("inspect container", container_id) as api:
            attrs = api.inspect_container(container_id)
        return _state(attrs)

    def stop(self, container_id: str, timeout: float = 10.0) -> None:
        with (
            contextlib.suppress(NotFoundError),
            self._engine("stop container", container_id) as api,
        ):
            # Docker takes whole seconds; round up so the job gets at least `timeout`.
            api.stop(container_id, timeout=max(0, math.ceil(timeout)))

    def remove(self, container_id: str) -> None:
        with self._lock:
            self._stopped.pop(container_id, None)
        with (
            contextlib.suppress(NotFoundError),
            self._engine("remove container", container_id) as api,
        ):
            try:
                # v=True: also the anonymous volumes an image's VOLUME lines made.
                api.remove_container(container_id, force=True, v=True)
            except docker.errors.APIError as exc:
                if exc.status_code == 409 and "already in progress" in _explanation(exc):
                    return
                raise
        self._holders.removed(container_id)

    def list_jobs(self, node_id: str) -> list[ContainerState]:
        with self._engine("list containers") as api:
            found = api.containers(all=True, filters={"label": f"{LABEL_NODE}={node_id}"})
        states = []
        for summary in found:
            container_id = str(summary["Id"])
            # A container removed between the listing and here is simply gone.
            with (
                contextlib.suppress(NotFoundError),
                self._engine("inspect container", container_id) as api,
            ):
                attrs = api.inspect_container(container_id)
                states.append(_state(attrs))
                network_mode = (attrs.get("HostConfig") or {}).get("NetworkMode") or ""
                self._holders.adopt(container_id, str(network_mode))
        return states

    def sweep_holders(self, node_id: str) -> None:
        self._holders.sweep(node_id)

    def prepare(self, network: str, dns: tuple[str, ...], node_id: str, *, wait: float = 0) -> bool:
        """Have a network namespace ready for the next container of ``node_id`` on
        ``network`` with name servers ``dns`` (made in the background; waited
        for up to ``wait`` seconds). Whether one is ready."""
        return self._holders.replenish(_placement(network, dns, node_id), wait=wait)

    def host_config(self, container_id: str) -> dict[str, object]:
        with self._engine("inspect container", container_id) as api:
            attrs = api.inspect_container(container_id)
        return dict(attrs.get("HostConfig") or {})

    def pids(self, container_id: str) -> list[int]:
        with self._engine("list container processes", container_id) as api:
            try:
                top = api.top(container_id, ps_args="-o pid")
            except docker.errors.APIError:
                return []  # not running (any more)
        titles = [t.upper() for t in top.get("Titles") or []]
        column = titles.index("PID") if "PID" in titles else 0
        found = []
        for row in top.get("Processes") or []:
            with contextlib.suppress(ValueError, IndexError):
                found.append(int(row[column]))
        return found

    # --- interactive containers ---------------------------------------------------------

    def create_interactive(self, spec: ContainerSpec, tty: bool) -> str:
        _check_spec(spec, interactive=True)
        return self._create(spec, interactive=True, tty=tty)

    def attach(self, container_id: str, tty: bool) -> _AttachedTerminal:
        params = {"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}
        with self._engine("attach to container", container_id) as api:
            sock = api.attach_socket(container_id, params=params)
        return _AttachedTerminal(sock, tty)

    def resize(self, container_id: str, rows: int, cols: int) -> None:
        with self._engine("resize the terminal of container", container_id) as api:
            api.resize(container_id, height=rows, width=cols)

    # --- logs ---------------------------------------------------------------------------

    def logs(
        self, container_id: str, stream: Stream, cursor: LogCursor, follow: bool
    ) -> Iterator[LogLine]:
        return self.job_logs(container_id, {stream: cursor}, follow)

    def job_logs(
        self,
        container_id: str,
        cursors: dict[Stream, LogCursor],
        follow: bool,
        *,
        state: ContainerState | None = None,
    ) -> Iterator[LogLine]:
        """The entries of the streams in ``cursors``, each after its cursor and in
        its own order, from one read of the engine's log at a time (the agent's
        reader of a job: half the requests of a reader per stream, and one
        thread). ``state``: the container as the caller just saw it (None: ask
        the engine first)."""
        for stream, cursor in cursors.items():
            if stream not in ("stdout", "stderr"):
                raise ConfigError(f"unknown log stream {stream!r}: use 'stdout' or 'stderr'")
            if cursor.timestamp and _timestamp_key(cursor.timestamp) is None:
                raise ConfigError(
                    f"log cursor {cursor.timestamp!r} is not a Docker log timestamp: "
                    "resume from an empty cursor to read from the start"
                )
        if state is None:
            # Fail now (unknown container, engine down), not at the first next().
            state = self.inspect(container_id)
        lines = self._log_lines(container_id, dict(cursors), follow, state.status in _ALIVE)
        # tini's own line is tini's, not the job's: only a container it started has one.
        if self._init and "stderr" in cursors:
            return _tini_in_our_words(lines, state.image)
        return lines

    def _log_lines(
        self,
        container_id: str,
        cursors: dict[Stream, LogCursor],
        follow: bool,
        alive: bool,
    ) -> Generator[LogLine, None, None]:
        """The log after ``cursors``; with ``follow``, until the container stops.
        ``alive``: whether it was running just now (saves asking again first)."""
        if not follow:
            yield from self._read_logs(container_id, cursors, False)
            return
        # Docker's follower moves to the new file when the log rotates and skips
        # whatever it had not read of the old one (20.10), so a reader behind a fast
        # job would lose lines. Entries are therefore only ever taken from reads
        # without follow (from the cursor; they read the rotated files too, and
        # cost the engine little when they return little), one every _LOG_POLL
        # while the log grows. A quiet log is waited on with a followed stream and
        # only its first entry taken, which the follower sends as soon as it is
        # written, before it could have moved on to a newer file. A read that
        # began after the container stopped is the last one: nothing is written
        # after it.
        stopped = self._stop_event(container_id)
        # Read from the start until now (no cursor was set): while what was read is
        # small, reading it all again is cheaper than a request per stream.
        read = 0 if not any(cursor.timestamp for cursor in cursors.values()) else None
        while True:
            got = False
            whole = read is not None and read <= _REREAD_BYTES
            for line in self._read_logs(container_id, cursors, False, whole=whole):
                got = True
                cursors[line.stream] = line.cursor
                if read is not None:
                    read += len(line.data)
                yield line
            if not alive:
                return
            ended = False
            if got:
                stopped.wait(_LOG_POLL)  # a growing log: let it gather a batch
            else:
                whole = read is not None and read <= _REREAD_BYTES
                waiting = self._read_logs(container_id, cursors, True, whole=whole)
                try:
                    # Ends at the next entry, or when the stream does (the container
                    # stopped, or the connection dropped: the SDK reports both alike).
                    first = next(waiting, None)
                    if first is not None and not first.lost:  # else read again, to be sure
                        cursors[first.stream] = first.cursor
                        if read is not None:
                            read += len(first.data)
                        yield first
                finally:
                    waiting.close()
                ended = first is None
            # Known before the next read begins, so that a stopped container's
            # next read is its last: from the wait that saw it stop, else asked.
            if stopped.is_set():
                alive = False
            else:
                try:
                    alive = self.inspect(container_id).status in _ALIVE
                except NotFoundError:
                    return
            if ended and alive:
                stopped.wait(_LOG_POLL)  # an engine that keeps ending the stream: don't spin

    def _read_logs(
        self,
        container_id: str,
        cursors: dict[Stream, LogCursor],
        follow: bool,
        *,
        whole: bool = False,
    ) -> Generator[LogLine, None, None]:
        """One read of the engine's log after ``cursors``. Each stream starts at the
        entry at its cursor; when its first line comes without that entry before
        it, the entry was rotated out of the engine's log (and maybe more after
        it) before it was read: that line is marked ``lost``.

        The streams are read in one request when their cursors bound it alike
        (all empty, or all set: each stream's entries are written in the order
        of their timestamps, so the oldest cursor bounds them all), or with
        ``whole``: from the log's start, each stream passing over what lies
        before its cursor. Otherwise a stream without a cursor next to one with
        a cursor is read from the start, on its own, rather than from the
        other's cursor: an entry of one stream may reach the log after a newer
        one of the other. A followed read of such a pair waits from the cursor
        that is set; an entry it brings of the stream without one is marked
        ``lost`` (a wake-up only: the next read takes it)."""
        set_keys = [
            key
            for cursor in cursors.values()
            if (key := _timestamp_key(cursor.timestamp) if cursor.timestamp else None)
        ]
        if whole:
            set_keys = []
        if not follow and 0 < len(set_keys) < len(cursors):
            for stream, cursor in cursors.items():
                yield from self._read_logs(container_id, {stream: cursor}, False)
            return
        readers: dict[int, _EntryReader] = {}
        for stream, cursor in cursors.items():
            after = _timestamp_key(cursor.timestamp) if cursor.timestamp else None
            readers[_STREAM_IDS[stream]] = _EntryReader(stream, after, cursor.count)
        unbounded = {
            _STREAM_IDS[stream]
            for stream, cursor in cursors.items()
            if set_keys and not cursor.timestamp
        }
        since = _since(min(set_keys)) if set_keys else None
        with self._engine("read the logs of container", container_id) as api:
            response = _log_response(api, container_id, list(cursors), follow, since)
            try:
                # One frame is one log entry; a followed one is delivered as soon as
                # Docker has it, and a read without follow goes by blocks.
                frames = _followed_frames(response) if follow else _frames_in_blocks(response)
                for kind, frame in frames:
                    reader = readers.get(kind)
                    if reader is None:
                        continue
                    line = reader.entry(frame)
                    if line is None:
                        continue
                    if kind in unbounded:
                        line = dataclasses.replace(line, lost=True)
                    elif not reader.reached:
                        reader.reached = True
                        line = dataclasses.replace(line, lost=True)
                    yield line
            finally:
                _close_response(response)

    # --- plumbing -----------------------------------------------------------------------

    def _docker(self) -> Any:
        with self._lock:
            if self._client is None:
                try:
                    self._client = docker.from_env(max_pool_size=_MAX_POOL_SIZE)
                except _CONNECTION_ERRORS as exc:
                    where = os.environ.get("DOCKER_HOST") or _DEFAULT_ENDPOINT
                    raise _connection_error(exc, where) from exc
            return self._client

    def _api(self) -> Any:
        return self._docker().api

    @contextlib.contextmanager
    def _engine(self, action: str, container_id: str = "") -> Iterator[Any]:
        """Yield the low-level API client; turn what goes wrong into GPUMesh errors."""
        api = self._api()
        try:
            yield api
        except GPUMeshError:
            raise
        except docker.errors.NotFound as exc:
            if container_id:
                raise NotFoundError(
                    f"no container {container_id[:12]} on this machine's Docker: "
                    "it was removed, or never created here"
                ) from exc
            raise AgentError(f"Docker could not {action}: {_explanation(exc)}") from exc
        except docker.errors.APIError as exc:
            raise AgentError(f"Docker could not {action}: {_explanation(exc)}") from exc
        except _CONNECTION_ERRORS as exc:
            raise _connection_error(exc, _endpoint(api)) from exc


# What tini (Docker's init, PID 1 of every job) writes when it cannot start the
# job's command (tini.c: PRINT_FATAL("exec %s failed: %s", ...), then exit 127
# for ENOENT, 126 for EACCES).
_TINI_EXEC = re.compile(rb"\[FATAL tini \(\d+\)\] exec (.*) failed: (.*?)\r?\n?")
_TINI_REASONS = {
    b"No such file or directory": f"not found in image {{image}} (exit {ExitCode.NOT_FOUND:d})",
    b"Permission denied": f"not executable in image {{image}} (exit {ExitCode.NOT_EXECUTABLE:d})",
}
_START_FAILURES = (ExitCode.NOT_EXECUTABLE, ExitCode.NOT_FOUND)


def _placement(network: str, dns: tuple[str, ...], node_id: str) -> Placement:
    # The job network's rules are IPv4 rules: a container there gets no IPv6 at
    # all (not even a link-local address to reach this machine by).
    ipv6_off = is_job_network(network) and os.path.isdir(_IPV6_SYSCTLS)
    return Placement(network, dns, ipv6_off, node_id)


def _tini_in_our_words(
    lines: Generator[LogLine, None, None], image: str
) -> Generator[LogLine, None, None]:
    """The job's stderr with tini's line about a command it could not start
    replaced by ours: ``gpumesh: nvidia-smi: not found in image busybox:1 (exit 127)``."""
    with contextlib.closing(lines):
        yield from (_reworded(line, image) if line.stream == "stderr" else line for line in lines)


def _reworded(line: LogLine, image: str) -> LogLine:
    if not line.data.startswith(b"[FATAL tini"):
        return line
    match = _TINI_EXEC.fullmatch(line.data)
    if match is None:
        return line
    return dataclasses.replace(line, data=_in_our_words(match, image) + b"\n")


def _in_our_words(match: re.Match[bytes], image: str) -> bytes:
    command = match.group(1).decode("utf-8", "replace")
    where = image or "?"
    reason = _TINI_REASONS.get(match.group(2))
    if reason is not None:
        said = reason.format(image=where)
    else:
        said = f"cannot be started in image {where}: {match.group(2).decode('utf-8', 'replace')}"
    return f"gpumesh: {command}: {said}".encode()


def shell_output_in_our_words(data: bytes, image: str) -> bytes:
    """A shell's first output with tini's line about a command it could not start
    (``[FATAL tini (6)] exec bash failed: No such file or directory``) replaced by
    ours, as a job's stderr has it: ``gpumesh: bash: not found in image IMG (exit
    127)``. A terminal's ``\\r\\n`` is kept."""
    if not data.startswith(b"[FATAL tini"):
        return data
    line, newline, rest = data.partition(b"\n")
    match = _TINI_EXEC.fullmatch(line + newline)
    if match is None:
        return data
    return _in_our_words(match, image) + (b"\r\n" if line.endswith(b"\r") else b"\n") + rest


class _EntryReader:
    """Turns Docker log frames of one stream into LogLines after a cursor."""

    def __init__(self, stream: Stream, after: tuple[str, int] | None, skip: int) -> None:
        self._stream = stream
        self._after = after
        self._skip = skip
        self._key: tuple[str, int] | None = None
        self._count = 0
        self._in_piece_series = False
        self.reached = after is None or skip == 0
        """Whether the entry at the cursor went by (nothing to pass without one)."""

    def entry(self, frame: bytes) -> LogLine | None:
        stamp, sep, data = frame.partition(b" ")
        timestamp = stamp.decode("ascii", "replace")
        key = _timestamp_key(timestamp)
        if not sep or key is None:
            raise AgentError(
                "Docker sent a log entry without a timestamp: check the engine's log driver"
            )
        same = key == self._key
        self._count = self._count + 1 if same else 1
        self._key = key
        ends_line = data.endswith(b"\n")
        if (
            same
            and self._in_piece_series
            and not ends_line
            and len(data) < _LOG_PIECE
            and data  # keep empty entries empty
        ):
            # The last piece of a long line, whose newline the "local" driver
            # dropped. (A program that ends with over 16 KiB unterminated
            # output looks the same, and gains a newline.)
            data += b"\n"
        self._in_piece_series = len(data) == _LOG_PIECE and not ends_line
        if self._after is not None and (
            key < self._after or (key == self._after and self._count <= self._skip)
        ):
            if key == self._after and self._count == self._skip:
                self.reached = True
            return None
        return LogLine(self._stream, data, LogCursor(timestamp, self._count))


class _AttachedTerminal:
    """A :class:`~gpumesh.runtime.base.Terminal` over the engine's hijacked attach socket.

    With a TTY the socket carries the terminal's bytes as they are; without
    one, the engine multiplexes stdout and stderr into frames (``u8 stream,
    3 zero bytes, u32 length``), which are unwrapped here and merged.
    """

    def __init__(self, stream: Any, tty: bool) -> None:
        # The SDK hands back a SocketIO over the real socket; the socket itself
        # is needed for sendall and half-close.
        self._stream = stream
        self._sock: socket.socket = getattr(stream, "_sock", stream)
        self._tty = tty
        self._header = bytearray()
        self._left = 0
        self._closed = False

    def read(self) -> bytes:
        while True:
            try:
                data = self._sock.recv(_ATTACH_READ)
            except OSError as exc:
                if not self._closed:
                    logger.debug("attach socket read failed: %s", exc)
                return b""
            if not data or self._tty:
                return data
            payload = self._unframe(data)
            if payload:
                return payload

    def _unframe(self, data: bytes) -> bytes:
        out = bytearray()
        view = memoryview(data)
        while view:
            if self._left == 0:
                need = 8 - len(self._header)
                self._header += view[:need]
                view = view[need:]
                if len(self._header) == 8:
                    self._left = int.from_bytes(self._header[4:8], "big")
                    self._header.clear()
                continue
            piece = view[: self._left]
            out += piece
            self._left -= len(piece)
            view = view[len(piece) :]
        return bytes(out)

    def write(self, data: bytes) -> None:
        try:
            self._sock.sendall(data)
        except OSError as exc:
            raise AgentError(f"the container's stdin is closed: {exc.strerror or exc}") from exc

    def close_input(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._closed = True
        # shutdown wakes a recv blocked in another thread; close alone may not.
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._stream.close()
        with contextlib.suppress(OSError):
            self._sock.close()


# --- helpers ------------------------------------------------------------------------------


def _check_spec(spec: ContainerSpec, *, interactive: bool) -> None:
    if spec.network not in ("bridge", "none") and not is_job_network(spec.network):
        raise ConfigError(
            f"network {spec.network!r} is not allowed: use bridge, none or a job network"
        )
    if spec.dns and not is_job_network(spec.network):
        raise ConfigError("name servers are given only to containers on a job network")
    if spec.memory <= 0:
        raise ConfigError(f"memory limit must be a positive number of bytes, not {spec.memory}")
    for what, size in (("/tmp", spec.tmp_size), ("/dev/shm", spec.shm_size)):
        if size <= 0:
            raise ConfigError(f"{what} size must be a positive number of bytes, not {size}")
    if spec.storage_size < 0:
        raise ConfigError(f"storage size must be 0 (none) or more, not {spec.storage_size}")
    if spec.user is not None and _USER_IDS.fullmatch(spec.user) is None:
        raise ConfigError(f"container user {spec.user!r} is not UID:GID (two numbers)")
    home = spec.home
    if (
        not home.startswith("/")
        or posixpath.normpath(home) != home
        or home in ("/", "/tmp", "/dev/shm", WORKDIR_MOUNT)
        or home.startswith(tuple(f"{path}/" for path in SYSTEM_PATHS))
        or ":" in home
        or "," in home
    ):
        raise ConfigError(
            f"container home {home!r} must be a plain absolute path of its own "
            "(not /, /tmp, /dev/shm, /workspace or under /proc, /sys, /dev)"
        )
    if spec.pids_limit < 0:
        raise ConfigError(f"process limit must be 0 (default) or more, not {spec.pids_limit}")
    if spec.cpus < 0:
        raise ConfigError(f"CPU limit must be 0 (none) or more, not {spec.cpus:g}")
    required = _INTERACTIVE_LABELS if interactive else _REQUIRED_LABELS
    missing = [label for label in required if label not in spec.labels]
    if missing:
        raise ConfigError(f"container {spec.name!r} lacks the labels {', '.join(missing)}")
    for key in spec.env:
        if not key or "=" in key or "\0" in key:
            raise ConfigError(f"environment variable name {key!r} is not valid")
    if interactive and (spec.workdir is not None or spec.mounts):
        raise ConfigError("an interactive container gets no host folder")
    if spec.workdir is not None:
        workdir = spec.workdir
        if not os.path.isabs(workdir) or not os.path.isdir(workdir):
            raise ConfigError(
                f"job workdir {workdir!r} is not an existing absolute directory on this machine"
            )
        if ":" in workdir or "," in workdir:
            # Docker's bind syntax splits on these.
            raise ConfigError(f"job workdir {workdir!r} must not contain ':' or ','")
    if interactive and spec.mounts:
        raise ConfigError("an interactive container gets no host folder")
    if len(spec.mounts) > MAX_MOUNTS:
        raise ConfigError(f"a job may mount at most {MAX_MOUNTS} folders")
    targets: list[str] = []
    for mount in spec.mounts:
        if not os.path.isabs(mount.source) or not os.path.isdir(mount.source):
            raise ConfigError(f"mount {mount.source!r} is not an existing absolute directory")
        problem = mount_target_problem(mount.target, targets)
        if problem is not None:
            raise ConfigError(f"mount target {mount.target!r} {problem}")
        targets.append(mount.target)


def _container_env(spec: ContainerSpec, image_env: list[str] | None) -> dict[str, str]:
    """The variables to set: the spec's, HOME, and over the image's ``NVIDIA_*``."""
    env = dict(spec.env)
    env.setdefault("HOME", spec.home)
    for entry in image_env or []:
        key = entry.partition("=")[0]
        # e.g. NVIDIA_DRIVER_CAPABILITIES=all (graphics, video, display) in an
        # image; empty is as if the image never set it.
        if key.startswith("NVIDIA_") and key not in env:
            env[key] = ""
    # Set last so neither the job's env nor the image's ENV can widen GPU
    # access: "void" hides every GPU from the NVIDIA runtime.
    env["NVIDIA_VISIBLE_DEVICES"] = ",".join(spec.gpu_ids) if spec.gpu_ids else "void"
    env["NVIDIA_DRIVER_CAPABILITIES"] = _DRIVER_CAPABILITIES if spec.gpu_ids else ""
    return env


def _container_labels(spec: ContainerSpec, image_labels: dict[str, str] | None) -> dict[str, str]:
    """The spec's labels, and an empty value over each other label of the image
    (which readers treat as absent: see :func:`_state`)."""
    labels = {key: "" for key in image_labels or {}}
    labels.update(spec.labels)
    return labels


def _tmpfs_mounts(spec: ContainerSpec, volumes: dict[str, Any] | None) -> dict[str, str]:
    """Docker's ``Tmpfs``: /tmp, the home, and each VOLUME path of the image.

    A tmpfs at a VOLUME path stops Docker from making an anonymous volume
    there (on the host's disk, outside every limit); what the image has under
    that path is hidden, as with ``--tmpfs``.

    Docker gives a tmpfs the mode of the image's own directory under it, not
    ours: on an image whose ``/tmp`` is ``0755 root`` (one made with ``docker
    import``) the job's user could not write its ``/tmp``. So when the job's
    uid is known, /tmp and the VOLUME paths belong to it too."""
    options = f"{_TMPFS_OPTIONS},size={spec.tmp_size}"
    match = _USER_IDS.fullmatch(spec.user or "")
    if match is not None:
        uid, gid = match.groups()
        shared = f"{options},uid={uid},gid={gid},mode=1777"
        tmpfs = {"/tmp": shared, spec.home: f"{options},uid={uid},gid={gid},mode=0700"}
    else:
        shared = f"{options},mode=1777"  # the image's user: its uid is not known here
        tmpfs = {"/tmp": shared, spec.home: shared}
    taken = {"/", "/dev/shm", *tmpfs}
    if spec.workdir is not None:
        taken.add(WORKDIR_MOUNT)  # the bind mount already stands there
    mounted = tuple(m.target for m in spec.mounts)
    for volume in volumes or {}:
        # Docker compares the cleaned path with the Tmpfs keys.
        path = posixpath.normpath("/" + volume.lstrip("/"))
        if path not in taken and not any(path == m or path.startswith(m + "/") for m in mounted):
            tmpfs[path] = shared
    return tmpfs


def _engine_isolation(info: dict[str, Any]) -> EngineIsolation:
    """What ``docker info`` says about users; ``storage_size`` is probed apart."""
    options = [str(option) for option in info.get("SecurityOptions") or []]
    userns = any("name=userns" in option for option in options)
    remapped_root = None
    if userns:
        match = _REMAPPED_ROOT_DIR.search(str(info.get("DockerRootDir") or ""))
        if match is not None:
            remapped_root = (int(match.group(1)), int(match.group(2)))
    return EngineIsolation(
        userns_remap=userns,
        rootless=any("name=rootless" in option for option in options),
        remapped_root=remapped_root,
        storage_size=False,
    )


def _state(attrs: dict[str, Any]) -> ContainerState:
    state = attrs.get("State") or {}
    status = str(state.get("Status") or "")
    error = str(state.get("Error") or "")
    exit_code = int(state.get("ExitCode", 0)) if status in ("exited", "dead") else None
    if status == "created" and error:
        # A start that failed for a missing or non-executable command leaves
        # the container "created"; present it the way `docker run` would.
        # Docker sets ExitCode 127/126 for those (128 for any other start
        # failure); an engine that sets none is judged by the message.
        docker_code = int(state.get("ExitCode") or 0)
        if docker_code:
            code = docker_code if docker_code in _START_FAILURES else None
        else:
            code = _start_failure_code(error)
        if code is not None:
            status, exit_code = "exited", code
    config = attrs.get("Config") or {}
    labels = config.get("Labels") or {}
    return ContainerState(
        container_id=str(attrs.get("Id", "")),
        # An empty value is an image's label we overrode: as good as absent.
        labels={str(key): str(value) for key, value in labels.items() if value},
        status=status,
        exit_code=exit_code,
        oom_killed=bool(state.get("OOMKilled")),
        error=error,
        # The name the job gave (the engine only knows the id it was created from).
        image=str(labels.get(LABEL_IMAGE) or config.get("Image") or ""),
    )


def _start_failure_code(message: str) -> int | None:
    """The exit code `docker run` reports for an OCI start error, if it is one."""
    lowered = message.lower()
    # Same order as the daemon: "permission denied" wins over "not found".
    if "permission denied" in lowered:
        return ExitCode.NOT_EXECUTABLE
    if "executable file not found" in lowered or "no such file or directory" in lowered:
        return ExitCode.NOT_FOUND
    return None


def _timestamp_key(timestamp: str) -> tuple[str, int] | None:
    """A sortable key for a Docker log timestamp; None if it is not one."""
    match = _TIMESTAMP.fullmatch(timestamp)
    if match is None:
        return None
    return match.group(1), int((match.group(2) or "").ljust(9, "0"))


def _since(key: tuple[str, int]) -> float | None:
    """Docker's ``since`` (entries at or after it) for a cursor, never past it."""
    seconds = calendar.timegm(time.strptime(key[0], "%Y-%m-%dT%H:%M:%S"))
    # Floor to whole milliseconds: such a float prints back as exactly those
    # three decimals, so rounding can never move the bound past the cursor.
    millis = seconds * 1000 + key[1] // 1_000_000
    return millis / 1000 if millis > 0 else None


def _log_response(
    api: Any, container_id: str, streams: list[Stream], follow: bool, since: float | None
) -> Any:
    """The engine's answer to one read of a job's log, not yet read: what the
    SDK's ``logs(..., stream=True)`` gets, without the inspect it makes first to
    learn whether the container has a TTY (a job container never has one; its
    log is read several times for every job, the last reads after it exited, on
    the way to reporting its end) and with the stream of each frame kept."""
    params: dict[str, Any] = {
        "stdout": int("stdout" in streams),
        "stderr": int("stderr" in streams),
        "timestamps": 1,
        "follow": int(follow),
        "tail": "all",
    }
    if since is not None:
        params["since"] = since
    response = api._get(api._url("/containers/{0}/logs", container_id), params=params, stream=True)
    try:
        # Raises the engine's answer (no such container, ...) now, as logs() does.
        api._raise_for_status(response)
    except BaseException:
        response.close()
        raise
    if follow:
        # A job may stay quiet for days: no read timeout while following.
        with contextlib.suppress(AttributeError, OSError):
            api._disable_socket_timeout(api._get_raw_response_socket(response))
    return response


def _frames_in_blocks(response: Any) -> Iterator[tuple[int, bytes]]:
    """The frames of a multiplexed log response (``u8 stream, 3 zero bytes, u32
    length``, then the entry) as (stream, entry), read in large blocks: the SDK
    reads each frame's header and body apart, some tens of microseconds a frame."""
    buffer = b""
    while block := response.raw.read(_LOG_BLOCK):
        buffer = buffer + block if buffer else block
        offset, size = 0, len(buffer)
        while size - offset >= 8:
            end = offset + 8 + int.from_bytes(buffer[offset + 4 : offset + 8], "big")
            if end > size:
                break
            if end > offset + 8:
                yield buffer[offset], buffer[offset + 8 : end]
            offset = end
        buffer = buffer[offset:]


def _followed_frames(response: Any) -> Iterator[tuple[int, bytes]]:
    """The frames of a followed log response, each as soon as the engine sent it."""
    while len(header := response.raw.read(8)) == 8:
        length = int.from_bytes(header[4:8], "big")
        if not length:
            continue
        data = response.raw.read(length)
        if len(data) < length:
            return  # the connection ended mid-frame
        yield header[0], data


def _close_response(response: Any) -> None:
    # A response left before its end (its reader stopped): the socket closes only
    # once the response lets go of it.
    with contextlib.suppress(AttributeError, OSError, requests.exceptions.RequestException):
        response.close()


def _explanation(exc: docker.errors.APIError) -> str:
    return _one_line(str(exc.explanation or exc))


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _not_here(image: str) -> str:
    return (
        f"image {image!r} is not on this machine; on the provider run "
        f"`docker pull {image}` or `docker load -i FILE`"
    )


def pull_failure(detail: str) -> str:
    """What a peer may hear of a failed pull: its kind, never the engine's words
    (which name resolvers, proxies and addresses of the provider's network)."""
    text = detail.lower()
    if any(word in text for word in ("not found", "manifest unknown", "does not exist")):
        return "the registry has no such image or tag"
    if any(word in text for word in ("unauthorized", "denied", "authentication required")):
        return "the registry refused it: a private image, or it needs a login on the provider"
    if "toomanyrequests" in text or "rate limit" in text:
        return "the registry's pull rate limit was reached; try again later"
    if "invalid reference" in text or "invalid reference format" in text:
        return "that is not a valid image name"
    if any(word in text for word in ("no space left", "disk quota")):
        return "the provider's disk is full"
    network = (
        "lookup",
        "dial tcp",
        "no such host",
        "timeout",
        "connection refused",
        "tls",
        "i/o timeout",
        "network",
        "proxy",
        "eof",
        "certificate",
    )
    if any(word in text for word in network):
        return "the provider cannot reach the registry"
    return "the pull failed"


def _missing_image(image: str, reason: str) -> str:
    return (
        f"image {image!r} is not on this machine and cannot be pulled ({reason}); "
        f"on the provider run `docker pull {image}` or `docker load -i FILE`"
    )


def _endpoint(api: Any) -> str:
    adapter = getattr(api, "_custom_adapter", None)
    socket_path = getattr(adapter, "socket_path", None)
    if isinstance(socket_path, str):
        return f"unix://{socket_path}"
    return str(getattr(api, "base_url", "") or "the Docker socket")


def _root_reason(exc: BaseException) -> str:
    """The innermost OS error's text (e.g. "Connection refused"), else the message."""
    pending: list[BaseException] = [exc]
    seen: set[int] = set()
    while pending:
        current = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.strerror:
            return current.strerror
        pending.extend(arg for arg in current.args if isinstance(arg, BaseException))
        pending.extend(e for e in (current.__cause__, current.__context__) if e is not None)
    return _one_line(str(exc), 200)


def _connection_error(exc: BaseException, where: str) -> RuntimeUnavailableError:
    if isinstance(exc, requests.exceptions.Timeout):
        return RuntimeUnavailableError(
            f"Docker did not answer in time ({where}): check it with `docker info`, "
            "restart it with `sudo systemctl restart docker`"
        )
    reason = _root_reason(exc)
    if "permission denied" in reason.lower():
        return RuntimeUnavailableError(
            f"Docker is running but this user may not use it ({where}: permission denied): "
            "add the user to the docker group (`sudo usermod -aG docker $USER`) and log in again"
        )
    return RuntimeUnavailableError(
        f"Docker is not reachable on this machine ({where}: {reason}): {_START_HINT}"
    )
