"""What an ended job's last attempt left, kept for its submitter's ``gpumesh debug``.

Owns the keeping and the sweep: when a hosted job ends, its uploaded workdir,
its outputs folder and, where its root file system was writable
(``job_root = on``), its stopped container stay until ``debug_ttl`` after the
end (the job's ``kept_until`` in the store; 0: nothing kept). The workdir and
the outputs lie where they always did, so they count in the peer's file_quota
until they go. At ``kept_until`` the sweep removes them: the workdir the job
uploaded (never a folder of the peer's sandbox it ran in: that is the peer's),
the outputs folder once its submitter released it (else the release removes
it, as before), the stopped container. The store knows each job's
``kept_until``, so a restarted agent sweeps what came due while it was down.

Never touches a job that has not ended, nor anything of a job it does not keep.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from gpumesh.agent.containers import Containers
from gpumesh.agent.deps import Settings
from gpumesh.agent.joboutputs import JobOutputs
from gpumesh.blocking import in_thread
from gpumesh.errors import GPUMeshError
from gpumesh.protocol.states import JobRole
from gpumesh.store.db import Store
from gpumesh.store.jobs import JobRecord
from gpumesh.units import parse_duration

__all__ = ["DEBUG_TTL", "Leftovers"]

logger = logging.getLogger(__name__)

DEBUG_TTL = "debug_ttl"
"""The config key: how long after a job ends what its last attempt left is kept."""
_MOST_SLEEP = 60.0
"""The longest the sweep sleeps between looks (a clock that jumped is caught)."""


class Leftovers:
    """The ended jobs' leftovers of one agent, and their sweep."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        containers: Containers,
        outputs: JobOutputs,
        jobs_dir: Path,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.store = store
        self.containers = containers
        self.outputs = outputs
        self.jobs_dir = jobs_dir
        self.clock = clock
        self._poked = asyncio.Event()

    def ttl(self) -> float:
        """Seconds what an ended job left is kept (``debug_ttl``; 0: nothing)."""
        try:
            return parse_duration(str(self.settings.get(DEBUG_TTL)))
        except GPUMeshError:
            return 0.0  # config checks it when set: a value edited by hand keeps nothing

    def kept_until(self, ended: float) -> float:
        """Until when a job that ended at ``ended`` keeps its leftovers (0: not at all)."""
        ttl = self.ttl()
        return ended + ttl if ttl > 0 else 0.0

    def keeps_container(self, writable_root: bool) -> bool:
        """Whether a final attempt's stopped container stays: only a writable root
        holds anything of the attempt that its folders do not."""
        return writable_root and self.ttl() > 0

    def poke(self) -> None:
        """A job ended (or a debug_ttl came due): look again."""
        self._poked.set()

    def released(self, job: JobRecord) -> bool:
        """The submitter has the job's outputs: True when the folder may go now,
        False when it stays with the rest until ``kept_until``."""
        if job.kept_until > self.clock():
            self.store.update_job(JobRole.HOSTED, job.job_id, outputs_released=1)
            return False
        return True

    async def sweep(self) -> None:
        """Remove what came due, until cancelled (a task of the agent)."""
        while True:
            self._poked.clear()
            try:
                wait = await self.sweep_once()
            except GPUMeshError as exc:
                logger.warning("could not remove what ended jobs left: %s", exc)
                wait = _MOST_SLEEP
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poked.wait(), wait)

    async def sweep_once(self) -> float:
        """Remove the leftovers due now; the seconds until the next are due."""
        now = self.clock()
        wait = _MOST_SLEEP
        for job in self.store.kept_hosted_jobs():
            if job.kept_until > now:
                wait = min(wait, job.kept_until - now)
                break
            await self.drop(job)
        return max(0.01, wait)

    async def drop(self, job: JobRecord) -> None:
        """Remove everything ``job`` keeps (its debug_ttl passed)."""
        if job.container_id:
            with contextlib.suppress(GPUMeshError):
                await in_thread(self.containers.runtime.remove, job.container_id)
        uploaded = self.jobs_dir / job.job_id
        if job.workdir.startswith(str(uploaded) + os.sep):
            await in_thread(shutil.rmtree, uploaded, True)
        if job.outputs and job.outputs_released:
            try:
                peer = self.store.peer_by_id(job.peer_id)
            except GPUMeshError:
                peer = None  # unpaired since: its sandbox went with it
            if peer is not None:
                await in_thread(self.outputs.remove, peer, job.job_id)
        self.store.update_job(
            JobRole.HOSTED, job.job_id, kept_until=0.0, container_id="", outputs_released=0
        )
        logger.info("[job %s] its debug_ttl passed: what it left is removed", job.job_id)
