"""What every container the provider runs for a peer gets, jobs and shells alike.

Owns the connection to the container engine (one per agent, made on first
use: an agent without Docker still serves pings), the images peers may use
(``allowed_images``, ``image_disk``), the user containers run as (``job_user``,
``job_root``), their limits (``job_*``) and the network they join
(``job_network``, whose rules :mod:`gpumesh.runtime.jobnet` owns: they are in
place before the first container of a filtered mode is made). The job and exec
services build their containers from these; neither reaches into the other for
them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, cast

from gpumesh.agent.deps import Provider, Sandboxes, Settings
from gpumesh.agent.images import ImageKeeper, check_allowed
from gpumesh.blocking import in_thread
from gpumesh.errors import ConfigError, GPUMeshError
from gpumesh.protocol.messages import PULL_PROGRESS_EVERY, ImagePull
from gpumesh.runtime.base import JobRuntime
from gpumesh.runtime.docker import DockerRuntime
from gpumesh.runtime.jobnet import NETWORK_PREFIX, JobNetwork, Mode
from gpumesh.runtime.pull import PullProgress
from gpumesh.runtime.users import job_identity
from gpumesh.settings import ENV_TEST_JOB_NETWORK, env
from gpumesh.store.db import Store
from gpumesh.store.limits import ShareLimits
from gpumesh.units import parse_size

if TYPE_CHECKING:
    from gpumesh.transport.stream import Stream

__all__ = ["ContainerLimits", "Containers", "JobUser", "PullReporter"]

logger = logging.getLogger(__name__)


class PullReporter:
    """Relays a pull's progress from the engine's thread to the request's stream, at
    most every ``PULL_PROGRESS_EVERY`` seconds; :meth:`finish` sends what is left.

    Called from the pulling thread; everything else happens on the event loop, so
    the stream is only touched there. A stream that is gone (its requester left)
    silently stops the reports: the pull itself goes on for the job."""

    def __init__(self, stream: Stream) -> None:
        self._stream = stream
        self._loop = asyncio.get_running_loop()
        self._sent_at = -math.inf
        self._pending: PullProgress | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._finished = False

    def __call__(self, progress: PullProgress) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed under a stopping agent
            self._loop.call_soon_threadsafe(self._take, progress)

    def _take(self, progress: PullProgress) -> None:
        if self._finished:
            return
        self._pending = progress
        due = self._sent_at + PULL_PROGRESS_EVERY
        if progress.done or self._loop.time() >= due:
            self._flush()
        elif self._timer is None:
            self._timer = self._loop.call_at(due, self._flush)

    def _flush(self) -> None:
        self._timer = None
        progress, self._pending = self._pending, None
        if progress is None:
            return
        self._sent_at = self._loop.time()
        with contextlib.suppress(GPUMeshError, ValueError):  # the stream was reset
            self._stream.send_message(ImagePull(**asdict(progress)))

    def finish(self) -> None:
        """The pull is over: send the last figures now, and nothing after."""
        if self._timer is not None:
            self._timer.cancel()
        self._flush()
        self._finished = True


@dataclass(frozen=True)
class ContainerLimits:
    """What every container run for a peer (job or shell) may use on this provider."""

    memory: int
    pids_limit: int
    cpus: float
    network: str
    """The container's network: ``bridge``, ``none`` or our job network."""
    dns: tuple[str, ...]
    """Its name servers (on our job network: the ones whose port 53 is open)."""
    tmp_size: int
    """/tmp and HOME, each (tmpfs: counted in ``memory``)."""
    shm_size: int


@dataclass(frozen=True)
class JobUser:
    """Who a peer's containers run as, and what of their file system they may write."""

    user: str
    """``UID:GID`` inside the container."""
    owner: tuple[int, int]
    """The host uid:gid that must own what the container may write (its workdir)."""
    writable_root: bool
    storage_size: int
    """Bytes of the writable root filesystem, where the engine can bound it; 0: unbounded."""


class Containers:
    """The engine, the image policy, the user and the limits of peers' containers."""

    def __init__(
        self,
        provider: Provider,
        settings: Settings,
        store: Store,
        share_limits: Callable[[], ShareLimits],
        sandboxes: Sandboxes,
        *,
        runtime: JobRuntime | None = None,
    ) -> None:
        self._provider = provider
        self._settings = settings
        self._share_limits = share_limits
        self._sandboxes = sandboxes
        self._runtime = runtime
        self._owns_runtime = runtime is None
        self._network: JobNetwork | None = None
        self._network_lock = threading.Lock()
        self.images = ImageKeeper(store, lambda: self.runtime, provider=provider.name)

    @property
    def runtime(self) -> JobRuntime:
        """The engine (connected on first use)."""
        if self._runtime is None:
            pull_timeout = float(self._settings.get("pull_timeout"))
            self._runtime = DockerRuntime(pull_timeout=pull_timeout)
        return self._runtime

    def close(self) -> None:
        """Close the engine's connection when this agent made it."""
        if self._owns_runtime and self._runtime is not None:
            self._runtime.close()

    def limits(self) -> ContainerLimits:
        """This provider's limits for every container it runs for a peer (config job_*)."""
        settings = self._settings
        network = self.network()
        shared = self._share_limits()
        return ContainerLimits(
            memory=shared.job_memory,
            pids_limit=int(settings.get("job_pids_limit")),
            cpus=shared.job_cpus,
            network=network.docker_network,
            dns=network.dns,
            tmp_size=parse_size(str(settings.get("job_tmp"))),
            shm_size=parse_size(str(settings.get("job_shm"))),
        )

    def network(self) -> JobNetwork:
        """The job network of config ``job_network`` (a new one when it changed)."""
        mode = cast(Mode, str(self._settings.get("job_network")))
        with self._network_lock:
            if self._network is None or self._network.mode != mode:
                prefix = env(ENV_TEST_JOB_NETWORK) or NETWORK_PREFIX
                self._network = JobNetwork(mode, prefix=prefix)
            return self._network

    def start_network(self) -> None:
        """At share start (blocking): refuse, in one line, a ``job_network`` this
        machine cannot filter; make the network and its rules now when the engine
        answers, else before the first container."""
        network = self.network()
        try:
            rootless = self.runtime.is_rootless()
        except GPUMeshError as exc:
            rootless = False
            unreachable: str | None = exc.message
        else:
            unreachable = None
        problem = network.problem(rootless=rootless)
        if problem is not None:
            raise ConfigError(problem)
        if unreachable is not None:
            logger.warning("job network not made yet (%s): made before the first job", unreachable)
            return
        network.ensure(self.runtime)
        if network.docker_network != "none":  # the first job starts as fast as the next
            self.runtime.prepare(network.docker_network, network.dns, self._provider.node_id)

    def job_user(self, image: str) -> JobUser:
        """Who containers run as, from job_user / job_root and what the engine does
        with users (blocking: asks the engine once). Also tells the sandboxes
        whom to give what peers store, so their jobs can write it."""
        settings = self._settings
        isolation = self.runtime.isolation(image)
        as_root = str(settings.get("job_root")) == "on"
        user, owner = job_identity(
            str(settings.get("job_user")), as_root, isolation, os.geteuid(), os.getegid()
        )
        self._sandboxes.owner = owner
        # The root filesystem stays read-only unless the engine can bound it, or
        # the owner explicitly allowed root jobs (which doctor and share flag).
        sized = isolation.storage_size
        return JobUser(
            user=user,
            owner=owner,
            writable_root=as_root or sized,
            storage_size=parse_size(str(settings.get("job_tmp"))) if sized else 0,
        )

    async def who_runs(self, image: str) -> JobUser:
        """:meth:`job_user`, its refusals in this provider's name."""
        return await in_thread(self.checked_job_user, image)

    def checked_job_user(self, image: str) -> JobUser:
        """:meth:`job_user`, its refusals in this provider's name (blocking). Every
        container is made after this, so the job network and its rules are made
        sure of here too (a filtered mode whose rules cannot be installed is
        refused)."""
        try:
            self.network().ensure(self.runtime)
            return self.job_user(image)
        except ConfigError as exc:
            raise ConfigError(
                f"{self._provider.name} cannot run jobs as configured: {exc.message}"
            ) from None

    def in_our_name(self, exc: GPUMeshError) -> GPUMeshError:
        """The runtime's error for the consumer: the runtime speaks of "this machine",
        the consumer needs to know which one."""
        name = self._provider.name
        message = exc.message.replace("this machine", name)
        return type(exc)(message if name in message else f"{name}: {message}")

    async def prepare(self, image: str, report_to: Stream | None = None) -> JobUser:
        """Refuse, naming this provider, an image its owner does not allow, or that is
        neither here nor pullable; keep the pulled images within image_disk; then
        :meth:`who_runs`. All in one trip to a thread (each trip costs a thread
        and a wake-up of the event loop, milliseconds on a busy machine).

        ``report_to``: the request's stream, which hears a pull's progress as
        ``ImagePull`` messages (its requester asked for them)."""
        settings = self._settings
        check_allowed(image, str(settings.get("allowed_images")), self._provider.name)
        reporter = PullReporter(report_to) if report_to is not None else None
        budget = parse_size(str(settings.get("image_disk")))
        try:
            return await in_thread(self._prepare, image, reporter, budget)
        finally:
            if reporter is not None:
                reporter.finish()

    def _prepare(self, image: str, reporter: PullReporter | None, budget: int) -> JobUser:
        """:meth:`prepare`'s blocking part."""
        try:
            pulled = self.runtime.ensure_image(image, reporter)
        except GPUMeshError as exc:
            raise self.in_our_name(exc) from None
        self.images.used(image, pulled, budget)
        return self.checked_job_user(image)
