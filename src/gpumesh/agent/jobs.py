"""The provider's job service: the job requests, and the intake of new jobs.

Owns the requests ``JobSubmit``, ``JobLogs``, ``JobQuery`` and ``JobCancel`` of
this node's hosted jobs, and what a job goes through before it runs: the
checks of a submission (its image, environment, workdir size, sandbox folders
and mounts), the admission of the peer's job (:class:`~gpumesh.agent.limits.Admission`),
its GPU memory (reserved with :class:`~gpumesh.agent.gpus.GpuAllocator` from
acceptance until the job ends), its record in the store and its uploaded
workdir. Each accepted job is then run by the supervision
(:class:`~gpumesh.agent.jobrun.JobRunner`: attempts, retries, timeouts, cancels,
recovery after a restart), and its output and states are kept in its event
log and streamed to consumers (:class:`~gpumesh.agent.joblogs.JobLog`).

Jobs that move: a job id is held here under one fencing epoch for good (the
``JobSubmit.epoch`` of the copy accepted); a submit under another is refused
(:func:`fenced`), and a cancel that says the job ``moved`` stops this copy and
deletes its outputs, so only the submitter's newest copy is ever served.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import shlex
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpumesh.agent.containers import Containers
from gpumesh.agent.deps import (
    Handlers,
    Provider,
    RequestContext,
    SandboxFiles,
    Settings,
)
from gpumesh.agent.gpus import GpuAllocator
from gpumesh.agent.joblogs import JobLog, told
from gpumesh.agent.joboutputs import outputs_remote
from gpumesh.agent.jobrun import JobRunner, Run, gpu_holder
from gpumesh.agent.jobstate import MOVED, REVOKED, Decision
from gpumesh.agent.limits import Admission, Claim, Kind
from gpumesh.agent.sandboxfs import os_refusal, shown
from gpumesh.blocking import in_thread
from gpumesh.errors import (
    AccessDeniedError,
    ConfigError,
    GPUMeshError,
    InUseError,
    LimitError,
    NotFoundError,
    ProtocolError,
)
from gpumesh.files.hashing import choose, label, new_hasher
from gpumesh.files.transfer import NoHash, unpack_from
from gpumesh.protocol.messages import (
    JobAccepted,
    JobCancel,
    JobLogs,
    JobMount,
    JobQuery,
    JobStatus,
    JobSubmit,
)
from gpumesh.protocol.states import OWNER_CANCELLED, JobRole, JobState
from gpumesh.runtime.base import mount_target_problem
from gpumesh.store.db import Store
from gpumesh.store.jobs import JobRecord
from gpumesh.store.limits import ShareLimits
from gpumesh.units import format_size, parse_size

if TYPE_CHECKING:
    from gpumesh.agent.datachannel import TarOffer
    from gpumesh.store.peers import Peer

__all__ = ["JobService", "fenced", "uploaded_workdirs"]

logger = logging.getLogger(__name__)


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


class JobService:
    """Hosted jobs of one agent: their requests, and the intake of new ones."""

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
    ) -> None:
        self.provider = provider
        self.settings = settings
        self.store = store
        self.containers = containers
        self.gpus = gpus
        """Where each job's GPU memory is promised, from acceptance until it ends."""
        self.files = files
        self.jobs_dir = jobs_dir
        self.log = JobLog(settings, store)
        """The jobs' event logs: output and states stored, followers woken, consumers fed."""
        self.runner = JobRunner(
            provider, store, containers=containers, gpus=gpus, sandboxes=files, log=self.log
        )
        """The jobs' supervision, from an accepted job's first attempt to its end."""
        self.admission = Admission(
            share_limits, self._claims, provider.name, lambda: store.paused() is not None
        )
        """Admits jobs and shells (max_jobs_per_peer, max_shells_per_peer, share_memory)."""
        # What unfinished jobs were promised holds again from the start, before any
        # request is served: they will run (again).
        for job in store.unfinished_hosted_jobs():
            gpus.hold(gpu_holder(job.job_id), job.gpus, job.gpu_memory)

    def register(self, handlers: Handlers) -> None:
        handlers.add(JobSubmit, self.handle_submit)
        handlers.add(JobLogs, self.handle_logs)
        handlers.add(JobCancel, self.handle_cancel)
        handlers.add(JobQuery, self.handle_query)

    @property
    def no_gpu_runtime(self) -> bool:
        """This machine has GPUs its Docker cannot give to containers: found at the
        share's start, or when Docker refused a container its GPUs."""
        return self.runner.no_gpu_runtime

    @no_gpu_runtime.setter
    def no_gpu_runtime(self, lacking: bool) -> None:
        self.runner.no_gpu_runtime = lacking

    @property
    def report(self) -> Callable[[str], None]:
        """Where the owner is told, a line each, who runs which job here and how it
        ended (a share's output sets it)."""
        return self.runner.report

    @report.setter
    def report(self, report: Callable[[str], None]) -> None:
        self.runner.report = report

    # --- lifecycle ------------------------------------------------------------------------

    async def wait_changed(self, timeout: float) -> None:
        """Return when a hosted job gets events (or after ``timeout`` seconds): what an
        in-process follower waits on (:func:`gpumesh.client.jobs.logs`)."""
        await self.log.wait_changed(timeout)

    # --- requests ----------------------------------------------------------------------------

    async def handle_submit(self, ctx: RequestContext, message: JobSubmit) -> None:
        peer = ctx.peer
        existing = self.store.job(JobRole.HOSTED, message.job_id)
        if existing is not None:
            if existing.peer_id != peer.node_id:
                raise AccessDeniedError(f"job id {message.job_id} is taken; submit again")
            if existing.epoch != message.epoch:
                refusal = fenced(existing, message.epoch)
                logger.info("[job %s] refused from %s: %s", existing.job_id, peer.name, refusal)
                raise refusal
            if existing.state != JobState.UPLOADING:
                # A resubmission after a dropped link: never a second copy.
                ctx.stream.send_message(
                    JobAccepted(
                        job_id=existing.job_id,
                        gpus=existing.gpus,
                        provider=self.provider.name,
                        mounts=[m["target"] for m in existing.mounts if not m.get("outputs")],
                        outputs=existing.outputs,
                    )
                )
                if message.attach:
                    await self.log.follow(
                        ctx.stream,
                        existing.job_id,
                        0,
                        credited=message.credited,
                        knows_preempted=message.knows_preempted,
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
        asked = [m["target"] for m in mounts]
        if message.outputs:
            mounts.append(await self._outputs_folder(peer, message, mounts, workdir))
        holder = gpu_holder(message.job_id)
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
                outputs=message.outputs,
                epoch=message.epoch,
                attempts_before=message.attempts_before,
            )
            # Again, with nothing awaited before the record claims it: a submit that
            # raced this one through the checks above may have taken the last place.
            self.admission.admit_job(peer.node_id)
            self.store.add_job(record)
        except BaseException:
            self.gpus.release(holder)
            raise
        run = self.runner.add(record)
        logger.info("[job %s] accepted from %s: %s", record.job_id, peer.name, record.image)
        self.report(
            f"job {record.job_id[:8]} from {peer.name}: {_shown(record.command)} ({record.image})"
        )
        # The workdir may take a data channel: offered before the acceptance.
        accepted = JobAccepted(
            job_id=record.job_id,
            gpus=gpus,
            provider=self.provider.name,
            mounts=asked,
            outputs=message.outputs,
        )
        wanted = message.channel and message.workdir_bytes > 0
        # The tar's hash over a channel: named in the offer when the consumer listed
        # any (a consumer from before the list checks SHA-256, and looks for no name).
        hash_name = choose(message.hashes)
        named = hash_name if message.hashes else ""
        offer = self.files.channels.offer(ctx, wanted, accepted, named)
        if message.workdir_bytes:
            try:
                await self._receive_workdir(
                    ctx, run, message.workdir_bytes, limit, offer, hash_name
                )
            except BaseException as exc:
                await self._upload_failed(run, exc)
                raise
            record = self.runner.record(record.job_id)
        self.runner.start(run, record)
        if message.attach:
            await self.log.follow(
                ctx.stream,
                record.job_id,
                0,
                credited=message.credited,
                knows_preempted=message.knows_preempted,
            )
        else:
            ctx.stream.finish()

    async def handle_logs(self, ctx: RequestContext, message: JobLogs) -> None:
        job = self.owned(ctx.peer, message.job_id)
        await self.log.follow(
            ctx.stream,
            job.job_id,
            message.after_seq,
            message.follow,
            credited=message.credited,
            knows_preempted=message.knows_preempted,
        )

    async def handle_cancel(self, ctx: RequestContext, message: JobCancel) -> None:
        job_id = self.owned(ctx.peer, message.job_id).job_id
        if message.moved:
            job = await self._moved(ctx.peer, job_id)
        else:
            job = await self.runner.cancel(job_id)
        ctx.stream.send_message(_status_of(job, message.knows_preempted), end=True)

    async def _moved(self, peer: Peer, job_id: str) -> JobRecord:
        """Its submitter moved the job elsewhere: this copy is stopped as a cancel
        stops it (an ended one keeps its state), then its outputs folder and entries
        go, so nothing of it is served or counts in the peer's quota any more: the
        newest copy is the one whose outputs come home. Its record after."""
        job = await self.runner.cancel(job_id, MOVED)
        if job.outputs:
            await in_thread(self.runner.outputs.remove, peer, job_id)
        logger.info("[job %s] moved by %s: this copy stopped (%s)", job_id, peer.name, job.state)
        return job

    async def handle_query(self, ctx: RequestContext, message: JobQuery) -> None:
        job = self.owned(ctx.peer, message.job_id)
        ctx.stream.send_message(_status_of(job, message.knows_preempted), end=True)

    async def revoke(self, allowed: Callable[[str], bool]) -> None:
        """Cancel the unfinished jobs of every peer that may no longer use this node."""
        revoked = [
            job.job_id
            for job in self.store.unfinished_hosted_jobs()
            if job.job_id in self.runner.runs and not allowed(job.peer_id)
        ]
        await asyncio.gather(*(self.runner.cancel(job_id, REVOKED) for job_id in revoked))

    async def preempt(self, reason: str, grace: float, gpu: str | None = None) -> list[str]:
        """Preempt the unfinished hosted jobs (those on GPU ``gpu`` only, when given):
        SIGTERM, then SIGKILL after ``grace`` seconds; returns their ids once they ended."""
        await self.runner.recovered()
        chosen = [
            job.job_id
            for job in self.store.unfinished_hosted_jobs()
            if job.job_id in self.runner.runs and (gpu is None or gpu in job.gpus)
        ]
        await asyncio.gather(*(self.runner.preempt(job_id, reason, grace) for job_id in chosen))
        return chosen

    async def owner_cancels(self) -> None:
        """Carry out cancels this node's owner recorded (``gpumesh cancel`` of a hosted job)."""
        asked = [
            job
            for job in self.store.unfinished_hosted_jobs()
            if job.cancel_requested
            and job.job_id in self.runner.runs
            and not self.runner.runs[job.job_id].machine.cancel_requested
        ]
        await asyncio.gather(
            *(self.runner.cancel(job.job_id, job.message or OWNER_CANCELLED) for job in asked)
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

    async def _outputs_folder(
        self, peer: Peer, message: JobSubmit, mounts: list[dict[str, Any]], workdir: str
    ) -> dict[str, Any]:
        """The job's outputs folder (``/gpumesh-outputs/JOB_ID`` of the peer's sandbox,
        made here, handed to the job's user), as a read-write mount at
        ``message.outputs``; as :attr:`JobRecord.mounts` stores it, marked ``outputs``."""
        target = message.outputs
        problem = mount_target_problem(target, [m["target"] for m in mounts], below_workdir=True)
        if problem is not None:
            shown_target = target if target.isprintable() else repr(target)
            raise ConfigError(
                f"{self.provider.name} refused --outputs {shown_target}: the container path "
                f"{problem}"
            )
        remote = outputs_remote(message.job_id)
        parts = await in_thread(self._make_outputs_folder, peer, remote)
        source = str(self.files.sandbox(peer).joinpath(*parts))
        self._check_nesting(peer.node_id, source, remote)
        for folder in [workdir, *(str(m["source"]) for m in mounts)]:
            if folder and _nested(folder, source):
                raise LimitError(
                    f"{self.provider.name} refused --outputs: the job mounts a folder above "
                    f"{remote}, where its outputs go; mount a folder beside it"
                )
        return {"remote": remote, "source": source, "target": target, "rw": True, "outputs": True}

    def _make_outputs_folder(self, peer: Peer, remote: str) -> tuple[str, ...]:
        """Make the outputs folder in the peer's sandbox through descriptors (a link
        on the way is refused), then check and hand it over as a mounted folder is."""
        parts = self.files.parts(remote)
        with self.files.tree(peer) as tree:
            try:
                os.close(tree.open_dir(parts, create=True))
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise self.files.link_refused(remote) from None
                raise os_refusal(exc) from None
        return self.files.resolve_sandbox_dir(peer, remote)

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

    @staticmethod
    def _check_env(message: JobSubmit) -> None:
        for key in message.env:
            if key.upper().startswith("NVIDIA_"):
                raise LimitError(f"{key} may not be set by a job: the provider decides GPU access")

    # --- upload -------------------------------------------------------------------------------

    async def _receive_workdir(
        self,
        ctx: RequestContext,
        run: Run,
        size: int,
        limit: int,
        offer: TarOffer | None,
        hash_name: str,
    ) -> None:
        """Receive and unpack the job's workdir, as it arrives, straight to the job's
        user: over the data channel when one was offered (checked against its
        ``hash_name`` hash before it becomes the job's), else as DATA on the
        request's stream (checked by its size; QUIC protects the bytes)."""

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
        incoming = job_dir / "incoming"
        if offer is not None and await self.files.channels.receive_tar(
            ctx, offer, size, incoming, limit, new_hasher(hash_name), owner
        ):
            await in_thread(incoming.rename, work)
            how = f"over a data channel ({size} bytes of tar, {label(hash_name)})"
        else:
            received = 0
            async with unpack_from(work, limit, NoHash(), owner) as feed:
                while chunk := await ctx.stream.read_data():
                    received += len(chunk)
                    if received > size:
                        raise ProtocolError("the workdir upload is larger than announced")
                    await feed(chunk)
                if received != size:
                    raise ProtocolError(
                        f"the workdir upload ended after {received} of {size} bytes"
                    )
                await feed(None)
            how = f"({size} bytes of tar)"
        await in_thread(_hand_over, job_dir)
        self.store.update_job(JobRole.HOSTED, run.job_id, workdir=str(work))
        logger.info("[job %s] workdir received %s", run.job_id, how)

    async def _upload_failed(self, run: Run, exc: BaseException) -> None:
        """End a job whose workdir never fully arrived (the link dropped, the agent is
        stopping, the upload was malformed): failed, never retried. Left "uploading",
        it would hold one of its peer's places (max_jobs_per_peer) until a restart."""
        reason = exc.message if isinstance(exc, GPUMeshError) else type(exc).__name__
        decision = Decision(JobState.FAILED, 0.0, f"the workdir upload did not complete: {reason}")
        run.machine.state = JobState.FAILED
        with contextlib.suppress(Exception):
            await asyncio.shield(self.runner.finish(run, decision))

    async def _discard(self, job_id: str) -> None:
        self.runner.runs.pop(job_id, None)
        self.gpus.release(gpu_holder(job_id))
        shutil.rmtree(self.jobs_dir / job_id, ignore_errors=True)
        self.store.delete_job(JobRole.HOSTED, job_id)

    def _claims(self, limits: ShareLimits) -> list[Claim]:
        """Memory promised to jobs: every unfinished one will run (again)."""
        return [
            Claim(job.peer_id, Kind.JOB, limits.job_memory)
            for job in self.store.unfinished_hosted_jobs()
        ]


def fenced(existing: JobRecord, epoch: int) -> InUseError:
    """The refusal of a job id this provider holds under another fencing epoch: one
    copy of a job may ever run here, so a copy moved away never comes back, and a
    stale submit of an older copy never replaces a newer one."""
    job = existing.job_id
    if existing.epoch < epoch:
        return InUseError(
            f"job {job} ran here before as an older copy (epoch {existing.epoch}): "
            f"it cannot come back under epoch {epoch}; place it on another provider"
        )
    return InUseError(
        f"job {job} came here as a newer copy (epoch {existing.epoch}): an older one "
        f"(epoch {epoch}) cannot take its place"
    )


def _status_of(job: JobRecord, knows_preempted: bool) -> JobStatus:
    """Where a hosted job stands now (``seq``: its last event), as its submitter is
    told it (:func:`~gpumesh.agent.joblogs.told`)."""
    status = JobStatus(
        job_id=job.job_id,
        seq=job.last_seq,
        state=job.state,
        attempt=job.attempt,
        exit_code=job.exit_code,
        message=job.message,
        time=job.finished_at or job.started_at or job.created_at,
        peak_gpu_memory=job.peak_gpu_memory,
        started=job.started_at or 0.0,
    )
    return told(status, knows_preempted, job.epoch)


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
