"""Jobs that move: the submitter's node process keeps its group jobs where they can run.

A job run with ``--group`` is watched by a task of the submitter's node process
(:class:`JobKeeper`): it asks the job's provider where the job stands
(``JobQuery``, every few seconds, and at once when a follower saw news). The
job leaves its provider (a *hop* ends) when the provider preempts it (its owner
paused, or took a GPU back), denies this node, no longer knows the job, or has
not answered for ``job_lease``. It is then placed again on another member of
the group, never on one it left, with a raised fencing epoch; the outputs
already home are restored into its outputs folder there first, so the job
resumes from its last checkpoint (``GPUMESH_RESUMED``, ``GPUMESH_ATTEMPT``).
At most ``max_moves`` moves; then the job ends, saying why each hop ended.

A job that finds no provider waits in the queue (state ``queued``, no peer)
for ``queue_wait`` seconds, the first placement (``run --wait``) and every move
alike; the queue is the store, so it outlives the process.

Only the newest hop delivers: a status or an outputs list is applied only when
it comes from the job's current provider and carries its epoch
(:func:`status_problem`). The provider a job left is told, until it hears it,
that the job moved (``JobCancel.moved``): it stops its copy and drops that
copy's outputs. A provider cannot tell a cut link from a sleeping submitter,
so a copy cut off from this node runs until its provider hears of the move.

Every decision here reads the store first, so a restarted process goes on
where the last one stopped: a job still on a silent provider gets a whole
``job_lease`` again before it moves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpumesh.client.hops import NextHop
from gpumesh.client.jobs import cancel_job, record_status, run_job
from gpumesh.client.jobspec import JobSpec, MountSpec
from gpumesh.errors import (
    AccessDeniedError,
    GPUMeshError,
    LimitError,
    NotFoundError,
    UnreachableError,
)
from gpumesh.protocol.messages import JobCancel, JobQuery, JobStatus
from gpumesh.protocol.states import FINAL_STATES, JobRole, JobState
from gpumesh.units import parse_duration

if TYPE_CHECKING:
    from gpumesh.client.node import Node
    from gpumesh.store.jobs import JobRecord
    from gpumesh.transport.session import Session

__all__ = ["JobKeeper", "job_lease", "spec_of"]

logger = logging.getLogger(__name__)

SUBMITTED = JobRole.SUBMITTED
_PLACE_EVERY = 2.0
"""Seconds between placement tries while a job waits in the queue."""
_SETTLE = 60.0
"""Seconds a preempted copy's last outputs may take to come home before the job moves."""
_STOP_BACKOFF = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
"""Seconds between tries to tell a provider the job it runs moved (the last repeats)."""


def job_lease(node: Node) -> float:
    """Seconds a provider may stay silent before its job moves (``job_lease``)."""
    return parse_duration(str(node.home.config.get("job_lease")))


def spec_of(job: JobRecord) -> JobSpec:
    """The job as it was submitted, to submit again on another provider."""

    return JobSpec(
        image=job.image,
        command=list(job.command),
        env=dict(job.env),
        workdir=Path(job.workdir) if job.workdir else None,
        gpu_memory=job.gpu_memory,
        retries=job.retries,
        timeout=job.timeout,
        peer=None if job.job_group else job.peer_name or None,
        group=job.job_group or None,
        mounts=[MountSpec(**m) for m in job.mounts],
        outputs=job.outputs,
        outputs_to=Path(job.outputs_to) if job.outputs_to else None,
        max_moves=job.max_moves,
    )


@dataclass(frozen=True)
class _Left:
    """Why a job's hop ended although the job did not."""

    ended: str
    """``preempted``, ``denied``, ``forgot`` or ``unreachable``."""
    reason: str


class JobKeeper:
    """The jobs one node process keeps: one task a job that may move or waits in
    the queue, and one a provider to be told that its copy moved."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._stoppers: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._news: dict[str, asyncio.Event] = {}

    # --- the process's side ------------------------------------------------------------------

    def start(self, job_id: str) -> None:
        """Keep the job (a task, unless one runs already)."""
        task = self._tasks.get(job_id)
        if task is None or task.done():
            self._tasks[job_id] = asyncio.create_task(self._run(job_id))

    def resume(self) -> None:
        """Keep every job the store says is kept (the process just started)."""
        for job in self.node.home.store.kept_jobs():
            if job.state not in FINAL_STATES:
                self.start(job.job_id)
            self._stop_left(job)

    def poke(self, job_id: str) -> None:
        """News of the job (a follower saw its provider end it): look now."""
        event = self._news.get(job_id)
        if event is not None:
            event.set()

    async def stop(self) -> None:
        tasks = [*self._tasks.values(), *self._stoppers.values()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self, job_id: str) -> None:
        try:
            await self._keep(job_id)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("[job %s] keeping the job failed", job_id)

    # --- one job -----------------------------------------------------------------------------

    def _job(self, job_id: str) -> JobRecord | None:
        return self.node.home.store.job(SUBMITTED, job_id)

    async def _keep(self, job_id: str) -> None:
        while (job := self._job(job_id)) is not None and job.state not in FINAL_STATES:
            if job.cancel_requested:
                if job.peer_id:  # placed just as it was cancelled
                    with contextlib.suppress(GPUMeshError):
                        await cancel_job(self.node, job.peer_id, job.job_id)
                return  # a cancelled job never moves
            if not job.peer_id:
                await self._place(job)
                continue
            left = await self._watch(job)
            if left is None:
                return  # the job ended where it ran, or it may not move
            await self._leave(job, left)

    async def _watch(self, job: JobRecord) -> _Left | None:
        """Until the job's hop ends: None when the job itself ended (or it does not
        move: a ``--peer`` job's keeper only ever waited for it to be placed)."""
        lease = job_lease(self.node)
        every = min(5.0, max(0.5, lease / 6))
        heard = time.monotonic()
        """The provider's last answer (or the watch's start): the lease runs from it."""
        news = self._news.setdefault(job.job_id, asyncio.Event())
        while True:
            current = self._job(job.job_id)
            if current is None or current.state in FINAL_STATES:
                return None
            if current.peer_id != job.peer_id or current.cancel_requested:
                return None
            if not current.job_group:
                return None  # a --peer job stays where it was placed
            news.clear()
            left = lease - (time.monotonic() - heard)
            try:
                # An ask never outlasts the lease: a silent provider is left on time.
                status = await self._query(current, min(3.0, max(0.25, left)))
            except NotFoundError:
                return _Left("forgot", f"{job.peer_name} no longer knows the job")
            except AccessDeniedError as exc:
                return _Left("denied", f"{job.peer_name} denied you: {exc.message}")
            except (GPUMeshError, TimeoutError) as exc:
                if time.monotonic() - heard >= lease:
                    why = f"{job.peer_name} did not answer for {lease:g}s (job_lease)"
                    logger.info("[job %s] %s: %s", job.job_id, why, exc)
                    return _Left("unreachable", why)
            else:
                heard = time.monotonic()
                if status.state == JobState.PREEMPTED:
                    return _Left("preempted", status.message)
                if status.state in FINAL_STATES:
                    return None
            pause = min(every, max(0.0, heard + lease - time.monotonic()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(news.wait(), pause)

    async def _query(self, job: JobRecord, within: float) -> JobStatus:
        """Ask the job's provider where it stands; apply the answer (the newest hop's)."""

        async def ask(session: Session) -> JobStatus:
            reply = await session.request(
                JobQuery(job_id=job.job_id, knows_preempted=True), timeout=within
            )
            if not isinstance(reply, JobStatus) or reply.job_id != job.job_id:
                raise LimitError(f"{job.peer_name} answered a job query with something else")
            return reply

        async with asyncio.timeout(within):
            status = await self.node.on_session(job.peer_id, ask, timeout=within)
        record_status(self.node, job.job_id, job.peer_id, status, keeper=True)
        return status

    async def _leave(self, job: JobRecord, left: _Left) -> None:
        """The hop ended: record it, tell its provider (in the background), and queue
        the job for its next hop, or end it when it may not move again. A preempted
        copy's last outputs (its checkpoint at SIGTERM) come home first."""
        job = self._job(job.job_id) or job  # as its provider last told it
        hop = {
            "peer": job.peer_name,
            "peer_id": job.peer_id,
            "epoch": job.epoch,
            "attempt": job.attempt + job.attempts_before,
            "ended": left.ended,
            "reason": left.reason,
            "stopped": False,
        }
        hops = [*job.hops, hop]
        logger.info("[job %s] left %s (%s): %s", job.job_id, job.peer_name, left.ended, left.reason)
        if self.node.outputs is not None:
            if left.ended == "preempted":
                await self.node.outputs.settled(job.job_id, _SETTLE)
            await self.node.outputs.halt(job.job_id)
        fields: dict[str, Any] = {"hops": hops}
        if len(job.hops) >= job.max_moves:
            why = f"{_moves(len(job.hops))} (--max-moves {job.max_moves}); " + _reasons(hops)
            fields.update(state=_ended_as(hops), message=why, finished_at=time.time())
        else:
            fields.update(
                peer_id="",
                state=JobState.QUEUED,
                message=f"moving: {left.reason}",
                wait_until=time.time() + job.queue_wait,
                attempts_before=job.attempts_before + job.attempt,
                attempt=0,
                gpus=[],
            )
        self.node.home.store.update_job(SUBMITTED, job.job_id, **fields)
        self._stop_left(self._job(job.job_id) or job)

    def _end(self, job: JobRecord, state: JobState, message: str) -> None:
        self.node.home.store.update_job(
            SUBMITTED,
            job.job_id,
            state=state,
            message=message,
            wait_until=0.0,
            finished_at=time.time(),
        )

    async def _place(self, job: JobRecord) -> None:
        """One try to place a queued job (``run_job`` records its provider and starts
        its outputs receiver); on no room, wait and let the loop try again, or end the
        job once its wait is over."""
        hop = NextHop(
            epoch=job.epoch + 1,
            attempts_before=job.attempts_before,
            left=frozenset(h["peer_id"] for h in job.hops),
        )
        try:
            await run_job(self.node, spec_of(job), detach=True, job_id=job.job_id, hop=hop)
        except (LimitError, UnreachableError) as exc:
            if time.time() >= job.wait_until:
                waited = f"waited {job.queue_wait:g}s (--wait)" if job.queue_wait else "no --wait"
                why = f"no provider could take it ({waited}): {exc.message}"
                self._end(job, _ended_as(job.hops), why)
                return
            self.node.home.store.update_job(
                SUBMITTED, job.job_id, message=f"waiting for a provider: {exc.message}"
            )
            news = self._news.setdefault(job.job_id, asyncio.Event())
            news.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(news.wait(), _PLACE_EVERY)
        except GPUMeshError as exc:
            self._end(job, JobState.FAILED, f"could not start it again: {exc.message}")

    # --- telling providers the job moved ---------------------------------------------------

    def _stop_left(self, job: JobRecord) -> None:
        for hop in job.hops:
            key = (job.job_id, str(hop["peer_id"]))
            running = key in self._stoppers and not self._stoppers[key].done()
            if hop.get("stopped") or running:
                continue
            self._stoppers[key] = asyncio.create_task(self._tell_moved(job.job_id, hop))

    async def _tell_moved(self, job_id: str, hop: dict[str, Any]) -> None:
        """Tell the provider a job left that it moved, until it heard it (or cannot
        run it any more: it forgot the job, or unpaired this node)."""
        peer_id = str(hop["peer_id"])
        tries = 0

        async def tell(session: Session) -> object:
            return await session.request(
                JobCancel(job_id=job_id, knows_preempted=True, moved=True), timeout=30
            )

        while True:
            try:
                await self.node.on_session(peer_id, tell, timeout=10)
            except (NotFoundError, AccessDeniedError) as exc:
                logger.info("[job %s] %s: %s", job_id, hop["peer"], exc.message)
                break
            except GPUMeshError as exc:
                logger.debug("[job %s] telling %s it moved: %s", job_id, hop["peer"], exc)
                await asyncio.sleep(_STOP_BACKOFF[min(tries, len(_STOP_BACKOFF) - 1)])
                tries += 1
                continue
            except Exception:
                logger.exception("[job %s] telling %s it moved failed", job_id, hop["peer"])
                return
            logger.info("[job %s] %s stopped its copy", job_id, hop["peer"])
            break
        self._stopped(job_id, peer_id)

    def _stopped(self, job_id: str, peer_id: str) -> None:
        job = self._job(job_id)
        if job is None:
            return
        hops = [{**h, "stopped": True} if h["peer_id"] == peer_id else h for h in job.hops]
        self.node.home.store.update_job(SUBMITTED, job_id, hops=hops)


def _ended_as(hops: list[dict[str, Any]]) -> JobState:
    """How a job that cannot go on elsewhere ends (its moves used up, or no provider
    in time): as its last hop did when it was preempted there, else failed."""
    if hops and hops[-1]["ended"] == "preempted":
        return JobState.PREEMPTED
    return JobState.FAILED


def _moves(count: int) -> str:
    return f"moved {count} time{'s' if count != 1 else ''}"


def _reasons(hops: list[dict[str, Any]]) -> str:
    return "; ".join(f"{h['peer']}: {h['reason']}" for h in hops)
