"""A job from submission to its end as one async iterator: ``async for event in
watch_run(node, spec)``.

:func:`gpumesh.client.jobs.run_job` reports the steps before a job runs (where
``--group`` placed it, the provider's image pull, its acceptance, the workdir
upload) through :class:`JobCallbacks`. This yields them as events, then the job's
own events (:data:`gpumesh.client.jobs.JobEvent`) from :func:`logs`, which are
paced by the reader (credit), so a slow reader holds up nothing but itself.
The steps before are coalesced where they are progress (a pull's figures, bytes
uploaded): a slow reader sees the newest, never a backlog.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpumesh.client._events import EventQueue, Watch, stop
from gpumesh.client.jobs import JobCallbacks, JobEvent, JobResult, logs, run_job

if TYPE_CHECKING:
    from gpumesh.client.jobspec import JobSpec
    from gpumesh.client.node import Node
    from gpumesh.client.placement import Placement
    from gpumesh.protocol.messages import ImagePull, JobAccepted

__all__ = [
    "Accepted",
    "Placed",
    "Pulling",
    "Queued",
    "RunEvent",
    "RunWatch",
    "Uploading",
    "watch_run",
]


@dataclass(frozen=True)
class Placed:
    """Where ``run --group`` put the job, and why not elsewhere."""

    placement: Placement


@dataclass(frozen=True)
class Pulling:
    """How the provider's pull of the job's image goes."""

    pull: ImagePull


@dataclass(frozen=True)
class Accepted:
    """The provider took the job (its id, GPUs and mounts)."""

    accepted: JobAccepted


@dataclass(frozen=True)
class Uploading:
    sent: int
    total: int


@dataclass(frozen=True)
class Queued:
    """No provider can take the job now: it waits in the node process's queue."""

    job_id: str
    message: str


RunEvent = Placed | Pulling | Accepted | Uploading | Queued | JobEvent


class RunWatch(Watch[RunEvent]):
    """One job, submitted when iterated (once); ``result`` is where it stands, final
    once iteration ended (a failure to submit is raised from the loop). Leaving early
    cancels a submission under way; a job already accepted keeps running (cancel it by id)."""

    def __init__(
        self, node: Node, spec: JobSpec, follow: bool, wait: float = 0.0, sandbox_dir: str = ""
    ) -> None:
        self.result: JobResult | None = None
        self.seq = 0
        """The sequence number of the job's last event read (resume after it)."""
        self._events = self._run(node, spec, follow, wait, sandbox_dir)

    async def _run(
        self, node: Node, spec: JobSpec, follow: bool, wait: float, sandbox_dir: str
    ) -> AsyncGenerator[RunEvent, None]:
        queue: EventQueue[RunEvent] = EventQueue((Pulling, Uploading))
        callbacks = JobCallbacks(
            placed=lambda placement: queue.push(Placed(placement)),
            pull=lambda pull: queue.push(Pulling(pull)),
            accepted=lambda accepted: queue.push(Accepted(accepted)),
            upload=lambda sent, total: queue.push(Uploading(sent, total)),
        )
        task = asyncio.ensure_future(
            run_job(
                node, spec, detach=True, callbacks=callbacks, wait=wait, sandbox_dir=sandbox_dir
            )
        )
        try:
            while (event := await queue.next(task)) is not None:
                yield event
            self.result = task.result()
        finally:
            await stop(task)
        if self.result.waiting:
            yield Queued(self.result.job_id, self.result.message)
        if not follow:
            return
        events = logs(node, self.result.job_id, follow=True)
        try:
            async for event in events:
                self.result = events.result
                self.seq = events.seq
                yield event
            self.result = events.result
        finally:
            await events.aclose()


def watch_run(
    node: Node, spec: JobSpec, *, follow: bool = True, wait: float = 0.0, sandbox_dir: str = ""
) -> RunWatch:
    """:func:`run_job` as events: the steps until the provider holds the job, then
    (with ``follow``) the job's own events until it ends. ``wait``: seconds a group
    placement may wait for a member to free up; ``sandbox_dir``: run in that folder
    of the peer's sandbox (``app run``)."""
    return RunWatch(node, spec, follow, wait, sandbox_dir)
