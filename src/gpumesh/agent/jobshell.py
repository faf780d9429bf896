"""Shells of a job: ``gpumesh debug`` (a twin of an ended job's last attempt) and
``gpumesh exec --job`` (a program in a running job's own container).

Owns the checks of such a request (the job is the asking peer's; ended and
within its ``debug_ttl`` for a twin, running for an exec) and the container a
twin gets: the job's own container spec (the image the attempt ran, by id;
its workdir, mounts, outputs folder and environment; its user and limits), as
a shell's (labelled ``kind=exec``, no GPU unless the shell holds one), from the
attempt's stopped container committed to a throwaway image where its root was
writable (``job_root = on``), so what it changed there comes too. The exec
service runs both as any shell: admitted as one, ended by a deny or the owner,
removed when the session ends (the throwaway image with it).

Never gives a twin more than the job had: the same folders (rechecked as
before each attempt), user, limits and network.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from gpumesh.agent.containers import Containers
from gpumesh.agent.deps import OwnedJobs, Provider
from gpumesh.agent.jobrun import JobRunner
from gpumesh.blocking import in_thread
from gpumesh.errors import ConfigError, GPUMeshError, NotFoundError
from gpumesh.protocol.messages import ExecStart, ExecStarted
from gpumesh.protocol.states import FINAL_STATES, JobState
from gpumesh.runtime.base import KIND_EXEC, LABEL_KIND, LABEL_NODE, LABEL_PEER, ContainerSpec
from gpumesh.store.jobs import JobRecord
from gpumesh.store.peers import Peer
from gpumesh.units import format_duration

__all__ = ["JobShells", "Twin"]


@dataclass(frozen=True)
class Twin:
    """A twin's container, ready to be made, and what its consumer is told."""

    spec: ContainerSpec
    started: ExecStarted
    throwaway_image: str = ""
    """The image committed from the attempt's kept container: removed with the twin."""


class JobShells:
    """The twins and execs of one agent's hosted jobs."""

    def __init__(
        self,
        provider: Provider,
        jobs: OwnedJobs,
        runner: JobRunner,
        containers: Containers,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.provider = provider
        self.jobs = jobs
        self.runner = runner
        self.containers = containers
        self.clock = clock

    def _owned(self, peer: Peer, job_id: str) -> JobRecord:
        try:
            return self.jobs.owned(peer, job_id)
        except NotFoundError:
            raise NotFoundError(
                f"{self.provider.name} has no job {job_id}: it was pruned there, or ran "
                "elsewhere; see `gpumesh jobs`"
            ) from None

    def running(self, peer: Peer, job_id: str) -> JobRecord:
        """The job, refused unless it is ``peer``'s and its container runs now."""
        job = self._owned(peer, job_id)
        if job.state in FINAL_STATES:
            raise ConfigError(
                f"job {job_id} on {self.provider.name} has ended ({job.state}): "
                f"look into what it left with `gpumesh debug {job_id[:12]}`"
            )
        if job.state is not JobState.RUNNING or not job.container_id:
            raise ConfigError(
                f"job {job_id} on {self.provider.name} is {job.state}, not running: "
                "try again once it runs (`gpumesh jobs` shows it)"
            )
        return job

    async def twin(self, peer: Peer, message: ExecStart, gpus: list[str]) -> Twin:
        """The twin of the job's last attempt, refused unless the job is ``peer``'s,
        ended, and within its debug_ttl."""
        job = self._owned(peer, message.job)
        short = job.job_id[:12]
        if job.state not in FINAL_STATES:
            raise ConfigError(
                f"job {job.job_id} on {self.provider.name} is still {job.state}: "
                f"enter it with `gpumesh exec --job {short}`, or debug it once it ended"
            )
        if job.kept_until <= self.clock():
            ttl = format_duration(self.runner.leftovers.ttl())
            raise NotFoundError(
                f"job {job.job_id} on {self.provider.name} ended too long ago: what it "
                f"left is kept for debug_ttl ({ttl}) after it ends and is gone; run it "
                "again and debug it sooner"
            )
        if job.attempt == 0:
            raise NotFoundError(
                f"job {job.job_id} on {self.provider.name} never started: nothing to debug"
            )
        who = await self.containers.who_runs(job.image)
        await in_thread(self.runner.recheck_folders, job)
        throwaway = ""
        image = job.image_id or job.image
        if job.container_id:  # its root was writable: start from what it left there
            throwaway = await in_thread(self.runner.runtime.commit, job.container_id)
            image = throwaway
        base = self.runner.container_spec(job, job.attempt, who)
        spec = replace(
            base,
            image=image,
            command=list(message.command),
            env=base.env | dict(message.env),
            labels={
                LABEL_PEER: peer.node_id,
                LABEL_NODE: self.provider.node_id,
                LABEL_KIND: KIND_EXEC,
            },
            name=f"gpumesh-debug-{short}-{secrets.token_hex(4)}",
            gpu_ids=list(gpus),
        )
        started = ExecStarted(
            provider=self.provider.name,
            gpus=list(gpus),
            job=job.job_id,
            attempt=job.attempts_before + job.attempt,
            exit_code=job.exit_code,
            ended_at=job.finished_at or 0.0,
            kept_until=job.kept_until,
        )
        return Twin(spec, started, throwaway)

    async def discard(self, twin: Twin) -> None:
        """Remove the twin's throwaway image (its container is gone)."""
        if twin.throwaway_image:
            try:
                await in_thread(self.runner.runtime.remove_image, twin.throwaway_image)
            except GPUMeshError:
                return  # the next twin of the job, or docker image prune, takes it
