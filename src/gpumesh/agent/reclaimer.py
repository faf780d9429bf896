"""The owner comes first: the provider's watch over who else uses its GPUs.

While sharing, about once a second, it asks the GPU inventory which processes
use each GPU, tells GPUMesh's own (a process in a container this node made, a
CUDA session's worker) from the owner's, and feeds what is left, less
``reclaim_ignore``, to a :class:`~gpumesh.agent.reclaim.ReclaimTracker`. A GPU
the owner took back is withheld by the allocator and the unfinished guest jobs
on it are preempted (SIGTERM, then stopped after ``reclaim_grace``); one offered
again goes back to the allocator. Each says one line in the share's output.

The settings are read at every look, so ``config set`` while sharing counts
from the next one. It never stops a job itself: the job runner does, with the
reason; it never decides what is the owner's: :mod:`gpumesh.agent.reclaim` does.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from gpumesh.agent.deps import Provider, Settings
from gpumesh.agent.gpus import GpuAllocator
from gpumesh.agent.reclaim import (
    ReclaimChanges,
    ReclaimTracker,
    container_ids,
    ignored_names,
    owner_processes,
)
from gpumesh.blocking import in_thread
from gpumesh.runtime.base import JobRuntime
from gpumesh.store.jobs import JobRecord
from gpumesh.units import format_duration, parse_duration

__all__ = ["POLL_INTERVAL", "Engine", "GpuReclaimer", "Guests", "read_cgroup"]

logger = logging.getLogger(__name__)

POLL_INTERVAL = 1.0
"""Seconds between looks at who uses the GPUs."""


def read_cgroup(pid: int) -> str:
    """The text of ``/proc/PID/cgroup``; empty when the process is gone."""
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8", errors="replace") as cgroup:
            return cgroup.read()
    except OSError:
        return ""


class Engine(Protocol):
    """Where this node's containers run (the agent's :class:`Containers`)."""

    @property
    def runtime(self) -> JobRuntime: ...


class Guests(Protocol):
    """The hosted jobs' runner, as far as a reclaim uses it."""

    report: Callable[[str], None]
    """Says a line in the share's output."""

    async def preempt(self, job_id: str, reason: str, grace: float) -> JobRecord: ...


class GpuReclaimer:
    """Reclaims the GPUs the owner uses, and offers them again, while sharing."""

    def __init__(
        self,
        provider: Provider,
        settings: Settings,
        gpus: GpuAllocator,
        containers: Engine,
        guests: Guests,
        *,
        workers: Callable[[], Iterable[int]],
        jobs: Callable[[], list[JobRecord]],
        clock: Callable[[], float] = time.monotonic,
        cgroup: Callable[[int], str] = read_cgroup,
        interval: float = POLL_INTERVAL,
    ) -> None:
        self.provider = provider
        self.settings = settings
        self.gpus = gpus
        self._containers = containers
        self._guests = guests
        self._workers = workers
        """The process ids of the CUDA sessions' workers now."""
        self._jobs = jobs
        """The unfinished hosted jobs."""
        self._clock = clock
        self._cgroup = cgroup
        self.interval = interval
        self.tracker = ReclaimTracker(0.0)
        self.looks = 0
        """Looks taken so far (tests wait on it instead of on time)."""
        self._ours: set[str] = set()
        """Ids of the containers this node made, as last listed."""
        self._theirs: set[str] = set()
        """Ids of containers seen on a GPU that this node did not make."""
        self._stopping: dict[str, asyncio.Task[JobRecord]] = {}
        """Job id -> its preemption under way."""
        self._failure = ""

    def enabled(self) -> bool:
        return bool(self.settings.get("reclaim_on_gpu_use"))

    def grace(self) -> float:
        return parse_duration(str(self.settings.get("reclaim_grace")))

    async def run(self) -> None:
        """Look every :attr:`interval` seconds until cancelled."""
        while True:
            try:
                await self.look()
                self._failure = ""
            except Exception as exc:  # NVML, Docker or /proc: try again at the next look
                if str(exc) != self._failure:
                    logger.warning("cannot tell who uses the GPUs: %s", exc)
                    self._failure = str(exc)
            await asyncio.sleep(self.interval)

    async def look(self) -> ReclaimChanges:
        """One look at the GPUs, acted on."""
        if not self.enabled():
            for gpu in self.tracker.release_all():
                self._offer(gpu, "reclaim_on_gpu_use is off")
            self.looks += 1
            return ReclaimChanges()
        grace = self.grace()
        self.tracker.grace = grace
        ignore = ignored_names(str(self.settings.get("reclaim_ignore")))
        owners = await in_thread(self.owners, ignore)
        changes = self.tracker.observe(self._clock(), owners)
        for gpu, names in changes.reclaimed.items():
            line = f"GPU {gpu} is in use by its owner ({', '.join(names)}): reclaimed"
            logger.info("%s", line)
            self._guests.report(line)
        for gpu, names in self.tracker.held.items():
            self.gpus.withhold(str(gpu), ", ".join(names))  # the names as they are now
            self._stop_guests(gpu, names, grace)
        for gpu in changes.offered:
            self._offer(gpu, f"no process of its owner's used it for {format_duration(grace)}")
        self.looks += 1
        return changes

    def _offer(self, gpu: int, why: str) -> None:
        self.gpus.offer(str(gpu))
        line = f"GPU {gpu} offered again: {why}"
        logger.info("%s", line)
        self._guests.report(line)

    def _stop_guests(self, gpu: int, names: list[str], grace: float) -> None:
        """Preempt every unfinished job on ``gpu`` not already being stopped (one that
        landed there as it was reclaimed, or recovered after a restart, too)."""
        reason = f"{self.provider.name}'s owner is using GPU {gpu} ({', '.join(names)})"
        for job in self._jobs():
            if str(gpu) not in job.gpus or job.job_id in self._stopping:
                continue
            logger.info("[job %s] %s: preempting it", job.job_id, reason)
            task = asyncio.ensure_future(self._guests.preempt(job.job_id, reason, grace))
            self._stopping[job.job_id] = task
            task.add_done_callback(functools.partial(self._ended, job.job_id))

    def _ended(self, job_id: str, _done: object) -> None:
        task = self._stopping.pop(job_id, None)
        if task is not None and not task.cancelled() and task.exception() is not None:
            logger.warning("[job %s] preempting it failed: %s", job_id, task.exception())

    def stop(self) -> None:
        for task in list(self._stopping.values()):
            task.cancel()

    # --- blocking -----------------------------------------------------------------------------

    def owners(self, ignore: frozenset[str]) -> dict[int, list[str]]:
        """GPU index -> the owner's process names on it now (blocking: the inventory,
        ``/proc``, and Docker when a container not seen before uses a GPU)."""
        processes = self.gpus.inventory.processes()
        ours = {os.getpid(), *self._workers()}
        for process in processes:
            if process.pid in ours or process.name in ignore:
                continue
            ids = container_ids(self._cgroup(process.pid))
            if ids - self._ours - self._theirs:
                self._list_containers(ids)
            if ids & self._ours:
                ours.add(process.pid)
        return owner_processes(processes, ours, ignore)

    def _list_containers(self, seen: set[str]) -> None:
        """Learn which containers this node made; the rest of ``seen`` is not."""
        listed = self._containers.runtime.list_jobs(self.provider.node_id)
        self._ours = {state.container_id for state in listed}
        self._theirs |= seen - self._ours
