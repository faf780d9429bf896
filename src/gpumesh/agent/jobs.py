"""The provider's job service: accept, run, supervise, recover and stream jobs.

Owns the hosted jobs of this node: their records and event logs in the store,
their containers (through :class:`~gpumesh.runtime.base.JobRuntime`, as
:class:`~gpumesh.agent.containers.Containers` sets them up), their GPU memory
(reserved with :class:`~gpumesh.agent.gpus.GpuAllocator` from acceptance until
the job ends), and the requests ``JobSubmit``, ``JobLogs``, ``JobQuery`` and ``JobCancel``.

Durability: output read from the engine is appended to the job's event log
together with the engine-log cursor, in one transaction. Containers outlive
the agent; on start, :meth:`JobService.recover` re-attaches to running
containers by label and resumes their logs from the stored cursor, so a
restart loses no line and never runs a second copy of a job.

Output never waits for consumers: the engine's log is read into the store as
fast as the store takes it, the oldest output dropped beyond ``job_log_limit``,
and each consumer is streamed from the store at its own pace (within its
credit: :mod:`gpumesh.protocol.joboutput`).

Blocking engine calls run in daemon threads (a long ``wait`` must never keep
the process alive after ``share stop``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shlex
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from gpumesh.agent.containers import Containers, JobUser
from gpumesh.agent.deps import (
    Handlers,
    Provider,
    RequestContext,
    SandboxFiles,
    Settings,
)
from gpumesh.agent.gpus import GpuAllocator, Holder, HolderKind
from gpumesh.agent.jobstate import REVOKED, Decision, JobMachine
from gpumesh.agent.limits import Admission, Claim, Kind
from gpumesh.agent.sandboxfs import shown
from gpumesh.blocking import abandon, in_thread
from gpumesh.errors import (
    AccessDeniedError,
    AgentError,
    ConfigError,
    ExitCode,
    GPUMeshError,
    LimitError,
    NotFoundError,
    ProtocolError,
    RuntimeUnavailableError,
)
from gpumesh.files.hashing import choose, label, new_hasher
from gpumesh.protocol.joboutput import UNKNOWN, OutputPosition, encode_events
from gpumesh.protocol.messages import (
    MAX_OUTPUT_CHUNK,
    JobAccepted,
    JobCancel,
    JobLogs,
    JobMount,
    JobOutput,
    JobQuery,
    JobStatus,
    JobSubmit,
)
from gpumesh.protocol.states import FINAL_STATES, OWNER_CANCELLED, JobRole, JobState
from gpumesh.runtime.base import (
    LABEL_ATTEMPT,
    LABEL_JOB,
    LABEL_NODE,
    LABEL_PEER,
    NO_GPU_RUNTIME_NOTE,
    ContainerSpec,
    ContainerState,
    JobRuntime,
    LogCursor,
    LogLine,
    Mount,
    mount_target_problem,
)
from gpumesh.runtime.base import Stream as LogStream
from gpumesh.store.db import JobRecord, Store
from gpumesh.store.followers import FollowerWakeups
from gpumesh.store.limits import ShareLimits
from gpumesh.units import format_size, parse_size

if TYPE_CHECKING:
    from gpumesh.agent.files import TarOffer
    from gpumesh.store.db import Peer
    from gpumesh.transport.stream import Stream

__all__ = ["JobService", "uploaded_workdirs"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
TIMEOUT_EXIT = ExitCode.JOB_TIMED_OUT
"""Exit code of an attempt stopped by its timeout (as coreutils `timeout` reports)."""
_LOG_STREAMS: tuple[LogStream, ...] = ("stdout", "stderr")
_LOG_DRAIN_TIMEOUT = 15.0
_REMOVAL_DELAY = 0.05
"""Seconds between telling a job's end and removing its container: the removal's
thread would otherwise take turns with the event loop (the interpreter's lock)
while the end is stored and sent to the consumer."""
"""After a container exits, how long its log readers may go without progress."""
_PIPE_BYTES = 4 * 1024 * 1024
"""Most engine-log bytes read but not yet stored. Beyond it the readers wait: only
our reading of the engine's log waits, never the container, whose output the
engine keeps meanwhile."""
_LINE_OVERHEAD = 100
"""What a line held in memory costs beside its bytes, roughly (an empty one too)."""
_BATCH_BYTES = 256 * 1024
"""Most output stored in one transaction."""
_EVENTS_PER_SEND = 128
"""Most events read from the store at once for one consumer (each at most 32 KiB)."""
_ENGINE_LOST = (
    b"gpumesh: output may be missing here: the job printed faster than the provider "
    b"could read it, and Docker had already dropped the oldest of its log\n"
)
"""Where output is stored after entries the engine rotated out of its log unread."""
GPU_SAMPLE_INTERVAL = 2.0
"""Seconds between samples of a running GPU job's memory use."""
QUOTA_INTERVAL = 5.0
"""Seconds between checks of what a running job's peer stores against its file_quota."""


def uploaded_workdirs(store: Store, jobs_dir: Path, peer_id: str) -> list[Path]:
    """The uploaded workdirs of a peer's jobs still on disk (not its sandbox folders):
    what its jobs write there counts in its file_quota."""
    root = str(jobs_dir) + os.sep
    return [Path(w) for w in store.hosted_workdirs(peer_id) if w.startswith(root)]


def _hand_over(job_dir: Path) -> None:
    """Keep the job's folder (``jobs/<id>``) private to the agent, so no one else on
    the host reaches the workdir inside it; the job's user owns every file and
    folder of the workdir already (the unpacker made them so)."""
    job_dir.chmod(0o700)


def _state_data(
    state: str, exit_code: int | None, message: str, peak: int, *, exited: bool
) -> bytes:
    info = {
        "state": state,
        "exit_code": exit_code,
        "message": message,
        "peak_gpu_memory": peak,
        "exited": exited,
    }
    return json.dumps(info).encode()


class _Run:
    """In-memory side of one supervised job."""

    def __init__(self, record: JobRecord) -> None:
        self.job_id = record.job_id
        self.machine = JobMachine(
            record.retries,
            state=JobState(record.state),
            attempt=record.attempt,
            cancel_requested=record.cancel_requested,
            # A cancel's reason is kept in the message until the job ends.
            cancel_reason=record.message if record.cancel_requested else "",
        )
        self.container_id = record.container_id
        self.cursor: dict[str, list[object]] = dict(record.log_cursor)
        self.task: asyncio.Task[None] | None = None
        self.wake = asyncio.Event()
        """Set to cut a retry backoff short (cancel)."""
        self.timed_out = False
        self.over_quota = ""
        """Why the job was stopped for what its peer stores (empty: it was not)."""


class JobService:
    """Hosted jobs of one agent."""

    def __init__(
        self,
        provider: Provider,
        settings: Settings,
        store: Store,
        *,
        containers: Containers,
        gpus: GpuAllocator,
        files: SandboxFiles,
        share_limits: Callable[[], ShareLimits],
        jobs_dir: Path,
        followers: FollowerWakeups,
    ) -> None:
        self.provider = provider
        self.settings = settings
        self.store = store
        self.containers = containers
        self.gpus = gpus
        """Where each job's GPU memory is promised, from acceptance until it ends."""
        self.files = files
        self.jobs_dir = jobs_dir
        self._runs: dict[str, _Run] = {}
        self._recovering = False
        self._recovered = asyncio.Event()
        """Set once :meth:`recover` attached the unfinished jobs (or could not)."""
        self._changed = asyncio.Condition()
        self._followers = followers
        """``gpumesh logs -f`` of hosted jobs in other processes, woken on new events."""
        self.admission = Admission(share_limits, self._claims, provider.name)
        """Admits jobs and shells (max_jobs_per_peer, max_shells_per_peer, share_memory)."""
        self.no_gpu_runtime = False
        """This machine has GPUs its Docker cannot give to containers: found at the
        share's start, or when Docker refused a container its GPUs."""
        self.report: Callable[[str], None] = lambda line: None
        """Where the owner is told, a line each, who runs which job here and how it
        ended (a share's output sets it)."""
        # What unfinished jobs were promised holds again from the start, before any
        # request is served: they will run (again).
        for job in store.unfinished_hosted_jobs():
            gpus.hold(_holder(job.job_id), job.gpus, job.gpu_memory)

    def register(self, handlers: Handlers) -> None:
        handlers.add(JobSubmit, self.handle_submit)
        handlers.add(JobLogs, self.handle_logs)
        handlers.add(JobCancel, self.handle_cancel)
        handlers.add(JobQuery, self.handle_query)

    @property
    def runtime(self) -> JobRuntime:
        """The engine (made on first use: an agent without Docker still serves pings)."""
        return self.containers.runtime

    # --- lifecycle ------------------------------------------------------------------------

    async def recover(self) -> None:
        """Re-attach to this node's job containers after a (re)start; clean orphans."""
        self._recovering = True
        try:
            await self._recover()
        finally:
            self._recovered.set()

    async def _recover(self) -> None:
        unfinished = self.store.unfinished_hosted_jobs()
        try:
            containers = await in_thread(self.runtime.list_jobs, self.provider.node_id)
        except GPUMeshError as exc:
            if unfinished:
                logger.warning("cannot recover %d job(s) yet: %s", len(unfinished), exc)
            return
        with contextlib.suppress(GPUMeshError):
            await in_thread(self.runtime.sweep_holders, self.provider.node_id)
        by_job = {c.labels.get(LABEL_JOB, ""): c for c in containers}
        known = {job.job_id for job in unfinished}
        for orphan in containers:
            if orphan.labels.get(LABEL_JOB, "") not in known:
                logger.info("removing orphaned container %s", orphan.container_id[:12])
                await in_thread(self.runtime.remove, orphan.container_id)
        for job in unfinished:
            run = _Run(job)
            self._runs[job.job_id] = run
            container: ContainerState | None = by_job.get(job.job_id)
            if container is not None and container.labels.get(LABEL_ATTEMPT) != str(job.attempt):
                container = None
            logger.info("[job %s] recovering (%s, attempt %d)", job.job_id, job.state, job.attempt)
            run.task = asyncio.create_task(self._recover_one(run, job, container))

    async def _recover_one(
        self, run: _Run, job: JobRecord, container: ContainerState | None
    ) -> None:
        state = run.machine.state
        if state is JobState.UPLOADING:
            await self._finish(
                run,
                run.machine.infra_failed("the provider restarted during the upload"),
                no_retry=True,
            )
            return
        if state in (JobState.STARTING, JobState.RUNNING):
            if container is None:
                decision = run.machine.infra_failed(
                    "its container disappeared while the provider was down"
                )
                await self._after_attempt(run, job, decision)
                return
            run.container_id = container.container_id
            await self._supervise(run, job, resume=container)
            return
        # queued or retrying: nothing ran yet for the next attempt.
        await self._supervise(run, job)

    def stop(self) -> None:
        """Stop supervising; containers keep running and are re-attached on next start."""
        for run in self._runs.values():
            if run.task is not None:
                run.task.cancel()
        self._followers.close()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()
        self._followers.wake()

    async def wait_changed(self, timeout: float) -> None:
        """Return when a hosted job gets events (or after ``timeout`` seconds): what an
        in-process follower waits on (:func:`gpumesh.client.jobs.follow_hosted`)."""
        async with self._changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout)

    # --- requests ----------------------------------------------------------------------------

    async def handle_submit(self, ctx: RequestContext, message: JobSubmit) -> None:
        peer = ctx.peer
        existing = self.store.job(JobRole.HOSTED, message.job_id)
        if existing is not None:
            if existing.peer_id != peer.node_id:
                raise AccessDeniedError(f"job id {message.job_id} is taken; submit again")
            if existing.state != JobState.UPLOADING:
                # A resubmission after a dropped link: never a second copy.
                ctx.stream.send_message(
                    JobAccepted(
                        job_id=existing.job_id,
                        gpus=existing.gpus,
                        provider=self.provider.name,
                        mounts=[m["target"] for m in existing.mounts],
                    )
                )
                if message.attach:
                    await self._follow_events(
                        ctx.stream, existing.job_id, 0, credited=message.credited
                    )
                else:
                    ctx.stream.finish()
                return
            await self._discard(existing.job_id)
        self._check_env(message)
        self.admission.admit_job(peer.node_id)  # before any image is pulled for it
        limit = parse_size(str(self.settings.get("upload_limit")))
        if message.workdir_bytes > limit:
            raise LimitError(
                f"the workdir is {format_size(message.workdir_bytes)}; {self.provider.name} "
                f"accepts at most {format_size(limit)} (its upload_limit): trim it with "
                ".gpumeshignore"
            )
        workdir = ""
        if message.sandbox_dir:
            if message.workdir_bytes:
                raise ProtocolError("a job has an uploaded workdir or a sandbox_dir, not both")
            parts = await in_thread(self.files.resolve_sandbox_dir, peer, message.sandbox_dir)
            workdir = str(self.files.sandbox(peer).joinpath(*parts))
            self._check_nesting(peer.node_id, workdir, message.sandbox_dir)
        mounts = await self._resolve_mounts(peer, message.mounts, workdir)
        holder = _holder(message.job_id)
        gpus = await self.gpus.reserve(holder, message.gpu_memory, message.gpu)
        try:
            await self.containers.prepare(
                message.image, ctx.stream if message.pull_progress else None
            )
            record = JobRecord(
                role=JobRole.HOSTED,
                job_id=message.job_id,
                peer_id=peer.node_id,
                peer_name=peer.name,
                image=message.image,
                command=list(message.command),
                env=dict(message.env),
                gpu_memory=message.gpu_memory,
                gpus=gpus,
                retries=message.retries,
                timeout=message.timeout,
                workdir=workdir,
                created_at=time.time(),
                mounts=mounts,
            )
            # Again, with nothing awaited before the record claims it: a submit that
            # raced this one through the checks above may have taken the last place.
            self.admission.admit_job(peer.node_id)
            self.store.add_job(record)
        except BaseException:
            self.gpus.release(holder)
            raise
        run = _Run(record)
        self._runs[record.job_id] = run
        logger.info("[job %s] accepted from %s: %s", record.job_id, peer.name, record.image)
        self.report(
            f"job {record.job_id[:8]} from {peer.name}: {_shown(record.command)} ({record.image})"
        )
        # The workdir may take a data channel: offered before the acceptance.
        accepted = JobAccepted(
            job_id=record.job_id,
            gpus=gpus,
            provider=self.provider.name,
            mounts=[m["target"] for m in mounts],
        )
        wanted = message.channel and message.workdir_bytes > 0
        # The tar's hash over a channel: named in the offer when the consumer listed
        # any (a consumer from before the list checks SHA-256, and looks for no name).
        hash_name = choose(message.hashes)
        named = hash_name if message.hashes else ""
        offer = self.files.offer_channel(ctx, wanted, accepted, named)
        if message.workdir_bytes:
            try:
                await self._receive_workdir(
                    ctx, run, message.workdir_bytes, limit, offer, hash_name
                )
            except BaseException as exc:
                await self._upload_failed(run, exc)
                raise
            record = self._record(record.job_id)
        run.task = asyncio.create_task(self._supervise(run, record))
        if message.attach:
            await self._follow_events(ctx.stream, record.job_id, 0, credited=message.credited)
        else:
            ctx.stream.finish()

    async def handle_logs(self, ctx: RequestContext, message: JobLogs) -> None:
        job = self.owned(ctx.peer, message.job_id)
        await self._follow_events(
            ctx.stream, job.job_id, message.after_seq, message.follow, credited=message.credited
        )

    async def handle_cancel(self, ctx: RequestContext, message: JobCancel) -> None:
        job = await self.cancel(self.owned(ctx.peer, message.job_id).job_id)
        ctx.stream.send_message(
            JobStatus(
                job_id=job.job_id,
                seq=job.last_seq,
                state=job.state,
                attempt=job.attempt,
                exit_code=job.exit_code,
                message=job.message,
            ),
            end=True,
        )

    async def handle_query(self, ctx: RequestContext, message: JobQuery) -> None:
        job = self.owned(ctx.peer, message.job_id)
        entered = job.finished_at or job.started_at or job.created_at
        ctx.stream.send_message(
            JobStatus(
                job_id=job.job_id,
                seq=job.last_seq,
                state=job.state,
                attempt=job.attempt,
                exit_code=job.exit_code,
                message=job.message,
                time=entered,
                peak_gpu_memory=job.peak_gpu_memory,
                started=job.started_at or 0.0,
            ),
            end=True,
        )

    async def cancel(self, job_id: str, reason: str = "cancelled") -> JobRecord:
        """Stop a hosted job for good (never retried), saying why; its record after."""
        job = self._record(job_id)
        if job.state not in FINAL_STATES and job_id not in self._runs and self._recovering:
            # A restarted agent attaches its unfinished jobs in the background: a cancel
            # that comes first waits for that (it found nothing to stop, and the job
            # went on after its backoff).
            await self._recovered.wait()
            job = self._record(job_id)
        run = self._runs.get(job_id)
        if job.state not in FINAL_STATES and run is not None:
            decision = run.machine.cancel(reason)
            self.store.update_job(
                JobRole.HOSTED, job_id, cancel_requested=1, message=run.machine.cancel_reason
            )
            run.wake.set()
            if decision is not None:  # nothing running: ends now
                if run.task is not None:
                    run.task.cancel()
                await self._finish(run, decision)
            elif run.container_id:
                logger.info("[job %s] %s: stopping its container", job_id, reason)
                await in_thread(self.runtime.stop, run.container_id, 5.0)
            if run.task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await asyncio.wait_for(asyncio.shield(run.task), 20)
        return self._record(job_id)

    async def revoke(self, allowed: Callable[[str], bool]) -> None:
        """Cancel the unfinished jobs of every peer that may no longer use this node."""
        revoked = [
            job.job_id
            for job in self.store.unfinished_hosted_jobs()
            if job.job_id in self._runs and not allowed(job.peer_id)
        ]
        await asyncio.gather(*(self.cancel(job_id, REVOKED) for job_id in revoked))

    async def owner_cancels(self) -> None:
        """Carry out cancels this node's owner recorded (``gpumesh cancel`` of a hosted job)."""
        asked = [
            job
            for job in self.store.unfinished_hosted_jobs()
            if job.cancel_requested
            and job.job_id in self._runs
            and not self._runs[job.job_id].machine.cancel_requested
        ]
        await asyncio.gather(
            *(self.cancel(job.job_id, job.message or OWNER_CANCELLED) for job in asked)
        )

    # --- checks -----------------------------------------------------------------------------

    def owned(self, peer: Peer, job_id: str) -> JobRecord:
        """The hosted job ``job_id`` when ``peer`` submitted it; refused otherwise."""
        job = self.store.job(JobRole.HOSTED, job_id)
        if job is None:
            raise NotFoundError(f"{self.provider.name} has no job {job_id}")
        if job.peer_id != peer.node_id:
            raise AccessDeniedError(
                f"job {job_id} on {self.provider.name} was submitted by another peer"
            )
        return job

    def _record(self, job_id: str) -> JobRecord:
        job = self.store.job(JobRole.HOSTED, job_id)
        assert job is not None
        return job

    async def _resolve_mounts(
        self, peer: Peer, wanted: list[JobMount], workdir: str
    ) -> list[dict[str, Any]]:
        """The sandbox folders a submitted job mounts, each checked as a ``sandbox_dir``
        is (inside the sandbox, a folder, no link on the way, not nested with a
        folder of the peer's unfinished jobs nor of this job), handed to the job's
        user; as :attr:`JobRecord.mounts` stores them."""
        mounts: list[dict[str, Any]] = []
        own = [workdir] if workdir else []
        for mount in wanted:
            target = mount.target
            problem = mount_target_problem(mount.target, [m["target"] for m in mounts])
            if problem is not None:
                raise ConfigError(
                    f"{self.provider.name} refused --mount {shown(mount.source)}:"
                    f"{target if target.isprintable() else repr(target)}: "
                    f"the container path {problem}"
                )
            parts = await in_thread(
                self.files.resolve_sandbox_dir,
                peer,
                mount.source,
                "copy it there first with `gpumesh cp`",
            )
            source = str(self.files.sandbox(peer).joinpath(*parts))
            remote = "/" + "/".join(parts)
            self._check_nesting(peer.node_id, source, remote)
            for folder in own:
                if _nested(folder, source):
                    raise LimitError(
                        f"{self.provider.name} refused --mount {remote}: it lies above or below "
                        "another folder of the same job; mount one of them, or folders side by side"
                    )
            own.append(source)
            mounts.append(
                {"remote": remote, "source": source, "target": mount.target, "rw": mount.rw}
            )
        return mounts

    def _check_nesting(self, peer_id: str, workdir: str, remote: str) -> None:
        """Refuse a sandbox folder above or below one an unfinished job of the peer uses.

        Docker mounts a job's folder by its path when each attempt's container
        starts. A job that has a folder mounted can rename anything below it
        and put a symlink to a host path there; were another job to mount a
        folder below it, Docker would follow that link. Folders of running,
        queued and retrying jobs are therefore never nested (the same folder
        twice is fine: no job can rename the folder it is given).
        """
        for job in self.store.unfinished_hosted_jobs():
            if job.peer_id != peer_id:
                continue
            if any(_nested(folder, workdir) for folder in _folders(job)):
                raise LimitError(
                    f"{self.provider.name} refused {remote}: your job {job.job_id} ({job.state}) "
                    "works in a folder above or below it, and jobs may not share nested "
                    "folders; wait for it to end, or use a folder beside it"
                )

    def _create_and_start(self, run: _Run, job: JobRecord, attempt: int) -> ContainerSpec:
        """An attempt's container, made and started, in one trip to a thread (a
        thread and a wake-up of the event loop for each step would add up to
        milliseconds on a busy machine): who runs it, its folders checked again,
        created (``run.container_id`` set at once, for a cancel and for removal
        should the start fail), started. Blocking."""
        who = self.containers.checked_job_user(job.image)
        self._recheck_folder(job)
        spec = self.container_spec(job, attempt, who)
        run.container_id = self.runtime.create(spec)
        try:
            self.runtime.start(run.container_id)
        except RuntimeUnavailableError:
            if not spec.gpu_ids or job.gpu_memory:
                raise  # a job that asked for GPU memory needs the GPU: said in one line
            # This machine has GPUs but its Docker cannot give them to containers (no
            # NVIDIA container toolkit): a job that asked for no GPU memory runs
            # without them, as it would on a machine without GPUs.
            logger.warning(
                "[job %s] Docker cannot give GPUs to containers here: it runs without "
                "them (install nvidia-container-toolkit for GPU jobs)",
                job.job_id,
            )
            self.no_gpu_runtime = True
            self.runtime.remove(run.container_id)
            spec = self.container_spec(job, attempt, who)
            run.container_id = self.runtime.create(spec)
            self.runtime.start(run.container_id)
        return spec

    def _recheck_folder(self, job: JobRecord) -> None:
        """Before each attempt: the job's sandbox folders (the one it runs in,
        those it mounts) are still folders there, with no link on the way, and
        its user owns what is in them (blocking)."""
        try:
            peer = self.store.peer_by_id(job.peer_id)
        except GPUMeshError:
            return
        root = str(self.files.sandbox(peer)) + os.sep
        remotes = [str(m["remote"]) for m in job.mounts]
        if job.workdir.startswith(root):  # else an uploaded workdir, handed over once
            remotes.insert(0, "/" + job.workdir[len(root) :])
        for remote in remotes:
            try:
                self.files.resolve_sandbox_dir(peer, remote)
            except GPUMeshError as exc:
                raise AgentError(
                    f"its folder {remote} cannot be used any more: {exc.message}"
                ) from None

    @staticmethod
    def _check_env(message: JobSubmit) -> None:
        for key in message.env:
            if key.upper().startswith("NVIDIA_"):
                raise LimitError(f"{key} may not be set by a job: the provider decides GPU access")

    # --- upload -------------------------------------------------------------------------------

    async def _receive_workdir(
        self,
        ctx: RequestContext,
        run: _Run,
        size: int,
        limit: int,
        offer: TarOffer | None,
        hash_name: str,
    ) -> None:
        """Receive and unpack the job's workdir, as it arrives, straight to the job's
        user: over the data channel when one was offered (checked against its
        ``hash_name`` hash before it becomes the job's), else as DATA on the
        request's stream (checked by its size; QUIC protects the bytes)."""
        from gpumesh.files.transfer import NoHash, unpack_from

        try:
            run.machine.uploading()
            self.store.update_job(JobRole.HOSTED, run.job_id, state=JobState.UPLOADING)
            job_dir = self.jobs_dir / run.job_id
            job_dir.mkdir(parents=True, exist_ok=True)
        except BaseException:
            if offer is not None:
                offer.close()
            raise
        work = job_dir / "work"
        # Everything is unpacked as the job's user: no second walk to chown it.
        owner = self.files.owner
        if offer is not None:
            incoming = job_dir / "incoming"
            hasher = new_hasher(hash_name)
            if await self.files.receive_tar(ctx, offer, size, incoming, limit, hasher, owner):
                await in_thread(incoming.rename, work)
                await in_thread(_hand_over, job_dir)
                self.store.update_job(JobRole.HOSTED, run.job_id, workdir=str(work))
                logger.info(
                    "[job %s] workdir received over a data channel (%d bytes of tar, %s)",
                    run.job_id,
                    size,
                    label(hash_name),
                )
                return
        stream = ctx.stream
        received = 0
        async with unpack_from(work, limit, NoHash(), owner) as feed:
            while chunk := await stream.read_data():
                received += len(chunk)
                if received > size:
                    raise ProtocolError("the workdir upload is larger than announced")
                await feed(chunk)
            if received != size:
                raise ProtocolError(f"the workdir upload ended after {received} of {size} bytes")
            await feed(None)
        await in_thread(_hand_over, job_dir)
        self.store.update_job(JobRole.HOSTED, run.job_id, workdir=str(work))
        logger.info("[job %s] workdir received (%d bytes of tar)", run.job_id, size)

    async def _upload_failed(self, run: _Run, exc: BaseException) -> None:
        """End a job whose workdir never fully arrived (the link dropped, the agent is
        stopping, the upload was malformed): failed, never retried. Left "uploading",
        it would hold one of its peer's places (max_jobs_per_peer) until a restart."""
        reason = exc.message if isinstance(exc, GPUMeshError) else type(exc).__name__
        decision = Decision(JobState.FAILED, 0.0, f"the workdir upload did not complete: {reason}")
        run.machine.state = JobState.FAILED
        with contextlib.suppress(Exception):
            await asyncio.shield(self._finish(run, decision))

    async def _discard(self, job_id: str) -> None:
        self._runs.pop(job_id, None)
        self.gpus.release(_holder(job_id))
        shutil.rmtree(self.jobs_dir / job_id, ignore_errors=True)
        self.store.delete_job(JobRole.HOSTED, job_id)

    # --- supervision ---------------------------------------------------------------------------

    async def _supervise(
        self, run: _Run, job: JobRecord, resume: ContainerState | None = None
    ) -> None:
        try:
            while not run.machine.final:
                if resume is None:
                    decision = await self._start_attempt(run, job)
                else:
                    decision = await self._follow(run, job, resume)
                    resume = None
                if decision is None:
                    continue
                if decision.state is JobState.RETRYING:
                    await self._remove_container(run)  # before the next attempt is recorded
                await self._after_attempt(run, job, decision)
                # A final attempt's container is removed once its end is recorded and
                # told (just after: the followers send it first): the consumer need not
                # wait for the engine. Should the agent stop before it is done, its next
                # start removes the container of a finished job as an orphan (see
                # recover).
                if run.container_id and decision.state is not JobState.RETRYING:
                    try:
                        await asyncio.sleep(_REMOVAL_DELAY)
                    except asyncio.CancelledError:
                        # The agent is stopping: removed all the same, in a thread.
                        removal = in_thread(self.runtime.remove, run.container_id)
                        removal.add_done_callback(_retrieved)
                        raise
                await self._remove_container(run)
                if run.machine.state is JobState.RETRYING:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(run.wake.wait(), decision.delay)
                    if run.machine.cancel_requested:
                        await self._finish(run, run.machine.infra_failed("cancelled"))
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("[job %s] supervisor failed", run.job_id)
            decision = run.machine.infra_failed("the provider hit an internal error")
            await self._finish(run, decision, no_retry=True)

    async def _start_attempt(self, run: _Run, job: JobRecord) -> Decision | None:
        attempt = run.machine.start_attempt()
        run.cursor = {}
        run.timed_out = False
        self.store.update_job(
            JobRole.HOSTED,
            run.job_id,
            state=JobState.STARTING,
            attempt=attempt,
            log_cursor={},
            exit_code=None,  # each attempt reports its own
        )
        await self._event(run, JobState.STARTING, None, f"attempt {attempt} starting")
        job = self._record(run.job_id)
        knew = self.no_gpu_runtime
        try:
            spec = await in_thread(self._create_and_start, run, job, attempt)
            if self.no_gpu_runtime and not knew:  # this attempt found out: the owner hears
                self.report(NO_GPU_RUNTIME_NOTE)
            self.store.update_job(JobRole.HOSTED, run.job_id, container_id=run.container_id)
            if job.gpus and not spec.gpu_ids:  # it runs without them (no GPU runtime)
                self.gpus.hold(_holder(run.job_id), [], 0)
                self.store.update_job(JobRole.HOSTED, run.job_id, gpus=[])
        except GPUMeshError as exc:
            await self._remove_container(run)
            return run.machine.infra_failed(self.containers.in_our_name(exc).message)
        # Just started: no need to ask the engine (an inspect here would only wait
        # for a short job to exit). A command that could not start leaves it
        # exited with 126/127, which the wait in _follow reports.
        state = ContainerState(
            run.container_id, dict(spec.labels), "running", None, image=job.image
        )
        return await self._follow(run, job, state)

    async def _follow(self, run: _Run, job: JobRecord, container: ContainerState) -> Decision:
        """Stream a started container's logs into the event log until it exits."""
        if run.machine.state is JobState.STARTING:
            if container.status == "created":
                await in_thread(self.runtime.start, container.container_id)
            run.machine.running()
            fields: dict[str, object] = {"state": JobState.RUNNING}
            if job.started_at is None:
                fields["started_at"] = time.time()
            self.store.update_job(JobRole.HOSTED, run.job_id, **fields)
            await self._event(run, JobState.RUNNING, None, f"attempt {run.machine.attempt} running")
        pipe = _LogPipe(asyncio.get_running_loop(), readers=1)
        readers = [in_thread(self._read_logs, pipe, container.container_id, run.cursor)]
        writer = asyncio.create_task(self._write_logs(run, pipe))
        sampler = (
            asyncio.create_task(self._sample_gpu_memory(run, container.container_id))
            if job.gpus
            else None
        )
        watcher = (
            asyncio.create_task(self._watch_quota(run, job, container.container_id))
            if job.workdir or any(m["rw"] for m in job.mounts)
            else None
        )
        waiter = in_thread(self.runtime.wait, container.container_id)
        try:
            if run.machine.cancel_requested:  # cancelled while the container was being made
                await in_thread(self.runtime.stop, container.container_id, 5.0)
            if job.timeout:
                # Per attempt, from when we (re)attached: a restart gives it the full time again.
                done, _ = await asyncio.wait({waiter}, timeout=job.timeout)
                if not done:
                    run.timed_out = True
                    await in_thread(self.runtime.stop, container.container_id, 5.0)
            final = await waiter
            await _drain(readers, pipe)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(writer), _LOG_DRAIN_TIMEOUT)
        except GPUMeshError as exc:
            await self._remove_container(run)
            return run.machine.infra_failed(exc.message)
        finally:
            # Stopping the agent cancels us: the writer must stop too, or it would
            # keep writing beside the next agent's (the cursor in the store is the truth).
            writer.cancel()
            pipe.close()
            for task in (sampler, watcher):
                if task is not None:
                    task.cancel()
            abandon(waiter)  # a failure (or a cancel) before the wait was awaited
        # Exited and its output stored: removed once its end is told (see _supervise).
        if run.over_quota and not run.machine.cancel_requested:
            await self._event(run, None, None, run.over_quota, kind_state=False)
            return Decision(JobState.FAILED, 0.0, run.over_quota)
        if run.timed_out and not run.machine.cancel_requested:
            self.store.update_job(JobRole.HOSTED, run.job_id, exit_code=TIMEOUT_EXIT)
            return run.machine.infra_failed(f"timed out after {job.timeout:.0f}s")
        if final.error and final.exit_code in (ExitCode.NOT_EXECUTABLE, ExitCode.NOT_FOUND):
            await self._event(run, None, final.exit_code, final.error, kind_state=False)
        exit_code = final.exit_code if final.exit_code is not None else ExitCode.JOB_NOT_RUN
        decision = run.machine.exited(exit_code)
        if final.oom_killed and decision.state is not JobState.CANCELLED:
            decision = Decision(
                decision.state, decision.delay, decision.message + " (out of memory)"
            )
        self.store.update_job(JobRole.HOSTED, run.job_id, exit_code=exit_code)
        return decision

    async def _sample_gpu_memory(self, run: _Run, container_id: str) -> None:
        """Record the job's peak GPU memory (sum over its processes) while it runs."""
        peak = self._record(run.job_id).peak_gpu_memory
        while True:
            try:
                pids = await in_thread(self.runtime.pids, container_id)
                usage = await in_thread(self.gpus.inventory.process_memory)
            except GPUMeshError:
                pids, usage = [], {}
            used = sum(usage.get(pid, 0) for pid in pids)
            if used > peak:
                peak = used
                self.store.update_job(JobRole.HOSTED, run.job_id, peak_gpu_memory=peak)
            await asyncio.sleep(GPU_SAMPLE_INTERVAL)

    async def _watch_quota(self, run: _Run, job: JobRecord, container_id: str) -> None:
        """Stop the job when what its peer stores here goes over the peer's file_quota.

        Its workdir (an upload, or a folder of the sandbox) is written by the job
        itself; everything the peer keeps counts, so a job cannot fill the
        provider's disk past the quota the owner set.
        """
        try:
            peer = self.store.peer_by_id(job.peer_id)
        except GPUMeshError:
            return  # unpaired since: nothing of theirs to count
        while True:
            await asyncio.sleep(QUOTA_INTERVAL)
            try:
                usage = await self.files.usage(peer)
            except GPUMeshError as exc:
                reason = f"stopped: its files could not be counted ({exc.message})"
            else:
                if usage.used <= usage.quota:
                    continue
                reason = (
                    f"stopped: your files on {self.provider.name} grew to "
                    f"{format_size(usage.used)}, over its file_quota of "
                    f"{format_size(usage.quota)}; free space there or ask its owner for more"
                )
            run.over_quota = reason
            logger.info("[job %s] %s", run.job_id, reason)
            await in_thread(self.runtime.stop, container_id, 5.0)
            return

    def _read_logs(
        self, pipe: _LogPipe, container_id: str, cursors: dict[str, list[object]]
    ) -> None:
        """Read the engine's log (both streams, in one request a read) from the
        cursors into ``pipe`` (a thread)."""
        try:
            start: dict[LogStream, LogCursor] = {}
            for stream in _LOG_STREAMS:
                saved = cursors.get(stream) or ["", 0]
                start[stream] = LogCursor(str(saved[0]), int(str(saved[1])))
            for line in self.runtime.job_logs(container_id, start, True):
                if not pipe.put(line):
                    return  # the writer stopped: the cursor in the store is the truth
        finally:
            pipe.end()

    async def _write_logs(self, run: _Run, pipe: _LogPipe) -> None:
        """Store what the readers read: a batch of lines per transaction, the cursor
        with it, consecutive lines of a stream joined into pieces of up to 32 KiB."""
        while (lines := await pipe.take()) is not None:
            limit = self._log_limit()
            start = 0
            while start < len(lines):
                end, size = start, 0
                while end < len(lines) and size < _BATCH_BYTES:
                    size += len(lines[end].data)
                    end += 1
                batch = lines[start:end]
                start = end
                for line in batch:
                    run.cursor[line.stream] = [line.cursor.timestamp, line.cursor.count]
                self.store.append_job_events(
                    run.job_id,
                    run.machine.attempt,
                    _pieces(batch),
                    log_cursor=dict(run.cursor),
                    log_limit=limit,
                )
                await self._notify()

    def _log_limit(self) -> int:
        """Most bytes of a job's output this provider keeps (config job_log_limit)."""
        return parse_size(str(self.settings.get("job_log_limit")))

    async def _remove_container(self, run: _Run) -> None:
        """Remove the attempt's container."""
        if run.container_id:
            with contextlib.suppress(GPUMeshError):
                await in_thread(self.runtime.remove, run.container_id)
            run.container_id = ""
            self.store.update_job(JobRole.HOSTED, run.job_id, container_id="")

    async def _after_attempt(self, run: _Run, job: JobRecord, decision: Decision) -> None:
        if decision.state is JobState.RETRYING:
            self.store.update_job(
                JobRole.HOSTED, run.job_id, state=JobState.RETRYING, message=decision.message
            )
            await self._event(
                run, JobState.RETRYING, None, decision.message, exited=decision.exited
            )
            logger.info("[job %s] %s", run.job_id, decision.message)
            return
        await self._finish(run, decision)

    async def _finish(self, run: _Run, decision: Decision, *, no_retry: bool = False) -> None:
        if no_retry and decision.state is JobState.RETRYING:
            decision = Decision(JobState.FAILED, 0.0, decision.message, decision.exited)
            run.machine.state = JobState.FAILED
        # Whatever happens below, the job holds no GPU memory once it ends.
        self.gpus.release(_holder(run.job_id))
        job = self._record(run.job_id)
        exit_code = job.exit_code
        if decision.state is JobState.CANCELLED:
            exit_code = exit_code if exit_code is not None else ExitCode.INTERRUPTED
        elif decision.state is JobState.FAILED and exit_code in (None, 0):
            # Never ran to completion: like docker run's own failures.
            exit_code = ExitCode.JOB_NOT_RUN
        if job.state in FINAL_STATES:
            return
        self.store.update_job(
            JobRole.HOSTED,
            run.job_id,
            state=decision.state,
            exit_code=exit_code,
            message=decision.message,
            finished_at=time.time(),
        )
        await self._event(run, decision.state, exit_code, decision.message, exited=decision.exited)
        logger.info("[job %s] %s: %s", run.job_id, decision.state, decision.message)
        self.report(
            f"job {run.job_id[:8]} of {job.peer_name} {decision.state} ({decision.message})"
        )

    async def _event(
        self,
        run: _Run,
        state: str | None,
        exit_code: int | None,
        message: str,
        *,
        kind_state: bool = True,
        exited: bool = False,
    ) -> None:
        if kind_state:
            peak = self._record(run.job_id).peak_gpu_memory
            data = _state_data(str(state), exit_code, message, peak, exited=exited)
            self.store.append_job_event(run.job_id, run.machine.attempt, "state", data)
        else:  # a diagnostic for the user, on the job's stderr
            text = f"gpumesh: {message.strip()}\n".encode()
            self.store.append_job_event(
                run.job_id, run.machine.attempt, "stderr", text, log_limit=self._log_limit()
            )
        await self._notify()

    def _claims(self, limits: ShareLimits) -> list[Claim]:
        """Memory promised to jobs: every unfinished one will run (again)."""
        return [
            Claim(job.peer_id, Kind.JOB, limits.job_memory)
            for job in self.store.unfinished_hosted_jobs()
        ]

    def container_spec(self, job: JobRecord, attempt: int, who: JobUser) -> ContainerSpec:
        """The locked-down container for one attempt of ``job``."""
        return ContainerSpec(
            image=job.image,
            command=list(job.command),
            env=dict(job.env),
            labels={
                LABEL_JOB: job.job_id,
                LABEL_PEER: job.peer_id,
                LABEL_NODE: self.provider.node_id,
                LABEL_ATTEMPT: str(attempt),
            },
            name=f"gpumesh-{job.job_id}-{attempt}",
            **asdict(self.containers.limits()),
            user=who.user,
            writable_root=who.writable_root,
            storage_size=who.storage_size,
            workdir=job.workdir or None,
            mounts=[
                Mount(source=str(m["source"]), target=str(m["target"]), rw=bool(m["rw"]))
                for m in job.mounts
            ],
            # Without the NVIDIA container runtime no container may have a GPU: a job
            # that asked for no GPU memory then runs without one.
            gpu_ids=[] if self.no_gpu_runtime and not job.gpu_memory else list(job.gpus),
        )

    # --- streaming to consumers ------------------------------------------------------------------

    async def _follow_events(
        self, stream: Stream, job_id: str, after: int, follow: bool = True, *, credited: bool
    ) -> None:
        """:meth:`_stream_events` until the stream fails (reset or stopped by the consumer,
        its link closed, over its limits): a follow waiting for output would otherwise
        hold the stream, and the link under it, until the job ends."""
        events = asyncio.ensure_future(
            self._stream_events(stream, job_id, after, follow, credited=credited)
        )
        failed = asyncio.ensure_future(stream.wait_failed())
        try:
            await asyncio.wait({events, failed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not failed.done():
                failed.cancel()
            if not events.done():
                events.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await events
        if events.cancelled():
            raise failed.result()
        events.result()

    async def _stream_events(
        self, stream: Stream, job_id: str, after: int, follow: bool, *, credited: bool
    ) -> None:
        """Send a job's events after seq ``after`` from the store, and with ``follow``
        new ones until it ends; ``credited``: inside one DATA section, at the pace of
        the consumer's credit (an older consumer gets plain messages)."""
        # What an older consumer was not sent is told in a line on its stderr; a
        # credited consumer tells that itself, from the offsets.
        position = OutputPosition(0 if after == 0 else UNKNOWN)
        while True:
            events = self.store.job_events(job_id, after, _EVENTS_PER_SEND)
            if events:
                after = events[-1].seq
                messages = [event.to_message() for event in events]
                if credited:
                    await stream.send_data(encode_events(messages))
                    continue
                for message in messages:
                    if isinstance(message, JobOutput):
                        dropped = position.on_output(message.offset, len(message.data))
                        if dropped:
                            stream.send_message(_dropped_line(message, dropped))
                    stream.send_message(message)
                await stream.drain()
                continue
            job = self._record(job_id)
            if not follow or (job.state in FINAL_STATES and after >= job.last_seq):
                break
            async with self._changed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), 1.0)
        if credited:
            stream.end_data()
        stream.finish()


class _LogPipe:
    """Engine-log lines from the reader threads to the writer task, bounded in bytes.

    The writer takes everything queued at once, so a busy loop is woken once
    for many lines, not once per line.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, readers: int) -> None:
        self._loop = loop
        self._cond = threading.Condition()
        self._lines: deque[LogLine] = deque()
        self._bytes = 0
        self._open = readers
        self._closed = False
        self._woken = False
        self._ready = asyncio.Event()
        self.received = 0
        """Lines put so far: how the drain tells progress from a stuck reader."""

    def put(self, line: LogLine) -> bool:
        """Queue a line (a reader thread), waiting while the pipe is full; False once
        the writer stopped."""
        with self._cond:
            while self._bytes >= _PIPE_BYTES and not self._closed:
                self._cond.wait()
            if self._closed:
                return False
            self._lines.append(line)
            self._bytes += len(line.data) + _LINE_OVERHEAD
            self.received += 1
            self._wake()
        return True

    def end(self) -> None:
        """A reader is done (a reader thread)."""
        with self._cond:
            self._open -= 1
            self._wake()

    def _wake(self) -> None:
        if not self._woken:
            self._woken = True
            with contextlib.suppress(RuntimeError):  # the loop is gone: the agent stopped
                self._loop.call_soon_threadsafe(self._ready.set)

    async def take(self) -> list[LogLine] | None:
        """Every line queued so far, once there is one; None when all readers ended."""
        while True:
            with self._cond:
                if self._lines:
                    lines = list(self._lines)
                    self._lines.clear()
                    self._bytes = 0
                    self._cond.notify_all()
                    return lines
                if self._open <= 0:
                    return None
                self._woken = False
                self._ready.clear()
            await self._ready.wait()

    def close(self) -> None:
        """The writer stopped: readers waiting on a full pipe give up."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


async def _drain(readers: list[asyncio.Future[None]], pipe: _LogPipe) -> None:
    """After the container exited: wait for the readers to reach the end of its log,
    however long that takes, as long as they make progress."""
    pending: set[asyncio.Future[None]] = set(readers)
    progress = -1
    while pending and pipe.received != progress:
        progress = pipe.received
        _done, pending = await asyncio.wait(pending, timeout=_LOG_DRAIN_TIMEOUT)
    for reader in readers:
        if not reader.done():
            reader.cancel()  # stuck: given up on (its thread ends with the engine's stream)
        elif not reader.cancelled() and reader.exception() is not None:
            logger.info("a log reader failed: %s", reader.exception())


def _pieces(lines: list[LogLine]) -> list[tuple[str, bytes]]:
    """Consecutive entries of a stream joined into pieces of at most MAX_OUTPUT_CHUNK.

    A piece holds whole entries (the engine splits longer lines into 16 KiB
    entries), so output dropped beyond job_log_limit goes a line at a time and
    what is kept starts at a line.
    """
    pieces: list[tuple[str, bytearray]] = []
    for line in lines:
        data = line.data
        if line.lost:
            pieces.append(("stderr", bytearray(_ENGINE_LOST)))
        if pieces and pieces[-1][0] == line.stream:
            piece = pieces[-1][1]
            if len(piece) + len(data) <= MAX_OUTPUT_CHUNK:
                piece += data
                continue
        for start in range(0, max(1, len(data)), MAX_OUTPUT_CHUNK):
            pieces.append((line.stream, bytearray(data[start : start + MAX_OUTPUT_CHUNK])))
    return [(stream, bytes(piece)) for stream, piece in pieces]


def _dropped_line(before: JobOutput, dropped: int) -> JobOutput:
    """The line that tells an older consumer that output was dropped before ``before``."""
    text = (
        f"gpumesh: {format_size(dropped)} of output dropped here (the provider keeps the "
        "newest job_log_limit of a job's output)\n"
    )
    return JobOutput(
        seq=before.seq - 1, attempt=before.attempt, stream="stderr", data=text.encode()
    )


def _shown(command: list[str], most: int = 60) -> str:
    """A job's command on one line of the owner's output, cut at ``most`` characters."""
    text = " ".join(shlex.quote(word) for word in command).replace("\n", " ")
    return text if len(text) <= most else text[: most - 1] + "…"


def _folders(job: JobRecord) -> list[str]:
    """The host folders a job has mounted: its workdir and its sandbox mounts."""
    folders = [job.workdir] if job.workdir else []
    return folders + [str(m["source"]) for m in job.mounts]


def _nested(a: str, b: str) -> bool:
    """Whether one of two folders lies inside the other (not the same one)."""
    return a != b and (
        a.startswith(b.rstrip(os.sep) + os.sep) or b.startswith(a.rstrip(os.sep) + os.sep)
    )


def _retrieved(future: asyncio.Future[None]) -> None:
    """Take a removal's failure (a container already gone is fine; any other stays
    for the orphan clean-up of the next start), so nothing logs it as unseen."""
    if not future.cancelled():
        future.exception()


def _holder(job_id: str) -> Holder:
    """Who a job's GPU memory is promised to."""
    return Holder(HolderKind.JOB, job_id)
