"""The Docker implementation of :class:`~gpumesh.runtime.base.JobRuntime`.

With its sibling modules, owns everything GPUMesh says to a Docker engine: the
locked-down shape of a job container (and of an interactive one for ``gpumesh
exec``, attached through a raw socket), image checks and pulls, start-failure
exit codes, log reading with resumable cursors, and the translation of every
Docker, requests and socket failure into a :mod:`gpumesh.errors` exception with
a one-line message that says what to do. :class:`DockerRuntime` holds the
client and is what the rest of GPUMesh calls; beside it lie the container's
shape (:mod:`~gpumesh.runtime.shape`), pulls (:mod:`~gpumesh.runtime.images`),
log reading (:mod:`~gpumesh.runtime.logs`), states and start failures
(:mod:`~gpumesh.runtime.states`), the attached terminal
(:mod:`~gpumesh.runtime.attach`) and the engine's failures in our words
(:mod:`~gpumesh.runtime.failures`).

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

import contextlib
import dataclasses
import logging
import math
import os
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import docker
import docker.errors
import docker.types

from gpumesh.errors import (
    AgentError,
    GPUMeshError,
    ImageMissingError,
    NotFoundError,
    RuntimeUnavailableError,
)
from gpumesh.runtime.attach import AttachedTerminal
from gpumesh.runtime.base import (
    LABEL_IMAGE,
    LABEL_JOB,
    LABEL_KIND,
    LABEL_NODE,
    NO_GPU_RUNTIME,
    WORKDIR_MOUNT,
    ContainerSpec,
    ContainerState,
    EngineIsolation,
    LogCursor,
    LogLine,
    Stream,
)
from gpumesh.runtime.failures import CONNECTION_ERRORS, connection_error, endpoint, explanation
from gpumesh.runtime.holders import Holders, Placement
from gpumesh.runtime.images import missing_image, not_here, pull_image
from gpumesh.runtime.jobnet import is_job_network
from gpumesh.runtime.logs import LogReader, check_cursors
from gpumesh.runtime.pull import PullProgress
from gpumesh.runtime.shape import (
    LOG_CONFIG,
    check_spec,
    container_env,
    container_labels,
    tmpfs_mounts,
)
from gpumesh.runtime.states import ALIVE, container_state, tini_in_our_words

__all__ = ["DockerRuntime"]

logger = logging.getLogger(__name__)

_DEFAULT_ENDPOINT = "unix:///var/run/docker.sock"

# Every job holds up to three long requests at once (wait plus two followed
# log streams); a bigger pool keeps those connections reusable instead of
# being opened and discarded beyond the SDK's default of 10.
_MAX_POOL_SIZE = 64
# How long ensure_image's inspection of an image stands in for the one before
# creating a container from it (a job's check and its container come within
# milliseconds; a later attempt inspects again).
_INSPECTION_REUSE = 2.0
_NVIDIA_HOOK = "nvidia-container-runtime-hook"
"""NVIDIA's OCI hook, which Docker runs for a container given GPUs."""
_PROBE_SIZE = "1G"
_IPV6_SYSCTLS = "/proc/sys/net/ipv6"
"""Missing where the kernel has no IPv6 (then there is none to switch off)."""
# Under userns-remap Docker keeps its data in <data root>/<uid>.<gid>.
_REMAPPED_ROOT_DIR = re.compile(r"/(\d+)\.(\d+)/*$")


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
        begins): a log reader pausing between reads (see
        :meth:`~gpumesh.runtime.logs.LogReader.lines`) goes on at once, and takes
        it as stopped without asking. Guarded by ``_lock``."""
        self._isolation: EngineIsolation | None = None
        self._storage_size: bool | None = None
        self._holders = Holders(self._engine, self._arch)
        """Spare network namespaces for the next container on a network (see
        :mod:`gpumesh.runtime.holders`)."""
        self._logs = LogReader(self._engine, self.inspect, self._stop_event)

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
                logger.info("Docker cannot limit container filesystems: %s", explanation(exc))
                return False
            # v=True: also the anonymous volumes of the image's VOLUME lines.
            api.remove_container(created["Id"], force=True, v=True)
        return True

    def is_rootless(self) -> bool:
        return self.isolation().rootless

    def ensure_network(self, name: str, bridge: str) -> None:
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
        return self.image_size(image) is not None

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
                raise ImageMissingError(missing_image(image, explanation(exc))) from exc
            else:
                with self._lock:
                    self._inspected[image] = (time.monotonic(), attrs)
                return False
        pull_image(self._api(), image, progress, self._pull_timeout)
        with self._engine(f"look up image {image!r}") as api:
            try:
                api.inspect_image(image)
            except docker.errors.APIError as exc:
                reason = "the pull finished but the image is still not there"
                raise ImageMissingError(missing_image(image, reason)) from exc
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
                logger.info("keeping image %s: %s", image, explanation(exc))
                return False
        return True

    # --- containers ---------------------------------------------------------------------

    def create(self, spec: ContainerSpec) -> str:
        check_spec(spec, interactive=False)
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
        env = container_env(spec, image_config.get("Env"))
        labels = container_labels(spec, image_config.get("Labels"))
        labels[LABEL_IMAGE] = spec.image
        tmpfs = tmpfs_mounts(spec, image_config.get("Volumes"))
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
            log_config = docker.types.LogConfig(type="local", config=dict(LOG_CONFIG))
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
                raise ImageMissingError(not_here(spec.image)) from exc
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
                raise ImageMissingError(not_here(name)) from exc

    def start(self, container_id: str) -> None:
        with self._engine("start container", container_id) as api:
            try:
                api.start(container_id)
            except docker.errors.NotFound:
                raise
            except docker.errors.APIError as exc:
                message = explanation(exc)
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
        return container_state(attrs)

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
                if exc.status_code == 409 and "already in progress" in explanation(exc):
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
                states.append(container_state(attrs))
                network_mode = (attrs.get("HostConfig") or {}).get("NetworkMode") or ""
                self._holders.adopt(container_id, str(network_mode))
        return states

    def sweep_holders(self, node_id: str) -> None:
        self._holders.sweep(node_id)

    def prepare(self, network: str, dns: tuple[str, ...], node_id: str, *, wait: float = 0) -> bool:
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
        check_spec(spec, interactive=True)
        return self._create(spec, interactive=True, tty=tty)

    def attach(self, container_id: str, tty: bool) -> AttachedTerminal:
        params = {"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}
        with self._engine("attach to container", container_id) as api:
            sock = api.attach_socket(container_id, params=params)
        return AttachedTerminal(sock, tty)

    def resize(self, container_id: str, rows: int, cols: int) -> None:
        with self._engine("resize the terminal of container", container_id) as api:
            api.resize(container_id, height=rows, width=cols)

    # --- logs ---------------------------------------------------------------------------

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
        check_cursors(cursors)
        if state is None:
            # Fail now (unknown container, engine down), not at the first next().
            state = self.inspect(container_id)
        lines = self._logs.lines(container_id, dict(cursors), follow, state.status in ALIVE)
        # tini's own line is tini's, not the job's: only a container it started has one.
        if self._init and "stderr" in cursors:
            return tini_in_our_words(lines, state.image)
        return lines

    # --- plumbing -----------------------------------------------------------------------

    def _api(self) -> Any:
        """The low-level client of the engine (connected on first use)."""
        with self._lock:
            if self._client is None:
                try:
                    self._client = docker.from_env(max_pool_size=_MAX_POOL_SIZE)
                except CONNECTION_ERRORS as exc:
                    where = os.environ.get("DOCKER_HOST") or _DEFAULT_ENDPOINT
                    raise connection_error(exc, where) from exc
            return self._client.api

    @contextlib.contextmanager
    def _engine(self, action: str, container_id: str = "") -> Iterator[Any]:
        """Yield the low-level API client; turn what goes wrong into GPUMesh errors."""
        api = self._api()
        try:
            yield api
        except GPUMeshError:
            raise
        except docker.errors.APIError as exc:
            if container_id and isinstance(exc, docker.errors.NotFound):
                raise NotFoundError(
                    f"no container {container_id[:12]} on this machine's Docker: "
                    "it was removed, or never created here"
                ) from exc
            raise AgentError(f"Docker could not {action}: {explanation(exc)}") from exc
        except CONNECTION_ERRORS as exc:
            raise connection_error(exc, endpoint(api)) from exc


def _placement(network: str, dns: tuple[str, ...], node_id: str) -> Placement:
    # The job network's rules are IPv4 rules: a container there gets no IPv6 at
    # all (not even a link-local address to reach this machine by).
    ipv6_off = is_job_network(network) and os.path.isdir(_IPV6_SYSCTLS)
    return Placement(network, dns, ipv6_off, node_id)


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
