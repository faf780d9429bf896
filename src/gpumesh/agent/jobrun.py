"""The supervision of hosted jobs: attempts, retries, timeouts, cancels and ends.

Owns each accepted job's :class:`Run` once the job service hands it over: its
attempts' containers (made, started, followed until they exit, removed), the
retries with their backoff and the final state (decided by
:class:`~gpumesh.agent.jobstate.JobMachine`), timeouts, cancels, the sampling
of a GPU job's memory, the stop of a job whose peer stores more than its
file_quota, and the job's end: its state stored and logged, its GPU memory
released, the owner told. Output and state changes go to the job's event log
(:class:`~gpumesh.agent.joblogs.JobLog`).

Containers outlive the agent; on start, :meth:`JobRunner.recover` re-attaches
to running containers by label and resumes their logs from the stored cursor,
so a restart loses no line and never runs a second copy of a job.

Blocking engine calls run in daemon threads (a long ``wait`` must never keep
the process alive after ``share stop``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict

from gpumesh.agent.containers import Containers, JobUser
from gpumesh.agent.deps import Provider, Sandboxes
from gpumesh.agent.gpus import GpuAllocator, Holder, HolderKind
from gpumesh.agent.joblogs import JobLog
from gpumesh.agent.joboutputs import OUTPUTS_ENV, JobOutputs
from gpumesh.agent.jobstate import Decision, JobMachine
from gpumesh.blocking import abandon, in_thread
from gpumesh.errors import AgentError, ExitCode, GPUMeshError, RuntimeUnavailableError
from gpumesh.protocol.states import FINAL_STATES, JobRole, JobState
from gpumesh.runtime.base import (
    LABEL_ATTEMPT,
    LABEL_JOB,
    LABEL_NODE,
    LABEL_PEER,
    NO_GPU_RUNTIME_NOTE,
    ContainerSpec,
    ContainerState,
    JobRuntime,
    Mount,
)
from gpumesh.store.db import Store
from gpumesh.store.jobs import JobRecord
from gpumesh.units import format_size

__all__ = [
    "ATTEMPT_ENV",
    "CANCEL_GRACE",
    "GPU_SAMPLE_INTERVAL",
    "QUOTA_INTERVAL",
    "RESUMED_ENV",
    "TIMEOUT_EXIT",
    "JobRunner",
    "Run",
    "attempt_env",
    "gpu_holder",
]

logger = logging.getLogger(__name__)

TIMEOUT_EXIT = ExitCode.JOB_TIMED_OUT
"""Exit code of an attempt stopped by its timeout (as coreutils `timeout` reports)."""
_REMOVAL_DELAY = 0.05
"""Seconds between telling a job's end and removing its container: the removal's
thread would otherwise take turns with the event loop (the interpreter's lock)
while the end is stored and sent to the consumer."""
GPU_SAMPLE_INTERVAL = 2.0
"""Seconds between samples of a running GPU job's memory use."""
QUOTA_INTERVAL = 5.0
"""Seconds between checks of what a running job's peer stores against its file_quota."""
CANCEL_GRACE = 5.0
"""Seconds a cancelled job's container has between SIGTERM and SIGKILL."""
_END_WAIT = 20.0
"""Seconds a cancel or a preemption waits, past the grace, for the job to be told ended."""
ATTEMPT_ENV = "GPUMESH_ATTEMPT"
"""The variable that says which start of the job an attempt is (:func:`attempt_env`)."""
RESUMED_ENV = "GPUMESH_RESUMED"
"""The variable that says ``1`` when the job started before (:func:`attempt_env`)."""


def attempt_env(attempts_before: int, attempt: int) -> dict[str, str]:
    """What the provider tells an attempt of a job (over what the job's env says):
    which start of the job it is, counting every start on every provider it ran
    on, retries and moves together, from 1 (:data:`ATTEMPT_ENV`), and whether an
    earlier start may have left work to resume from (:data:`RESUMED_ENV`): a
    checkpoint in its outputs folder, restored there after a move."""
    start = attempts_before + attempt
    return {ATTEMPT_ENV: str(start), RESUMED_ENV: "1" if start > 1 else "0"}


def gpu_holder(job_id: str) -> Holder:
    """Who a job's GPU memory is promised to."""
    return Holder(HolderKind.JOB, job_id)


class Run:
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
        self.grace = CANCEL_GRACE
        """Seconds its container has between SIGTERM and SIGKILL when it is stopped."""
        self.over_quota = ""
        """Why the job was stopped for what its peer stores (empty: it was not)."""
        self.outputs: asyncio.Task[None] | None = None
        """The watch of the attempt's outputs folder (``run --outputs``), if any."""


class JobRunner:
    """The runs of one agent's hosted jobs, from the first attempt to the end."""

    def __init__(
        self,
        provider: Provider,
        store: Store,
        *,
        containers: Containers,
        gpus: GpuAllocator,
        sandboxes: Sandboxes,
        log: JobLog,
    ) -> None:
        self.provider = provider
        self.store = store
        self.containers = containers
        self.gpus = gpus
        self.sandboxes = sandboxes
        self.log = log
        self.outputs = JobOutputs(store, sandboxes)
        """The jobs' outputs folders (``run --outputs``): watched while they run."""
        self.runs: dict[str, Run] = {}
        """The jobs taken in or recovered since this agent started, by id (ended ones
        stay)."""
        self._recovering = False
        self._recovered = asyncio.Event()
        """Set once :meth:`recover` attached the unfinished jobs (or could not)."""
        self.no_gpu_runtime = False
        """This machine has GPUs its Docker cannot give to containers: found at the
        share's start, or when Docker refused a container its GPUs."""
        self.report: Callable[[str], None] = lambda line: None
        """Where the owner is told, a line each, how each job ended (and when Docker
        turned out unable to give GPUs to containers)."""

    @property
    def runtime(self) -> JobRuntime:
        """The engine (made on first use)."""
        return self.containers.runtime

    def record(self, job_id: str) -> JobRecord:
        """The stored record of a hosted job that exists."""
        job = self.store.job(JobRole.HOSTED, job_id)
        assert job is not None
        return job

    def add(self, record: JobRecord) -> Run:
        """Take in a job just accepted; :meth:`start` runs it."""
        run = Run(record)
        self.runs[record.job_id] = run
        return run

    def start(self, run: Run, record: JobRecord) -> None:
        """Supervise ``run`` from its first attempt until it ends (a task)."""
        run.task = asyncio.create_task(self._supervise(run, record))

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
            run = Run(job)
            self.runs[job.job_id] = run
            container: ContainerState | None = by_job.get(job.job_id)
            if container is not None and container.labels.get(LABEL_ATTEMPT) != str(job.attempt):
                container = None
            logger.info("[job %s] recovering (%s, attempt %d)", job.job_id, job.state, job.attempt)
            run.task = asyncio.create_task(self._recover_one(run, job, container))

    async def _recover_one(
        self, run: Run, job: JobRecord, container: ContainerState | None
    ) -> None:
        state = run.machine.state
        if state is JobState.UPLOADING:
            await self.finish(
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

    async def recovered(self) -> None:
        """Return once a restarted agent attached its unfinished jobs (at once when it
        is not recovering)."""
        if self._recovering:
            await self._recovered.wait()

    def stop(self) -> None:
        """Stop supervising; containers keep running and are re-attached on next start."""
        for run in self.runs.values():
            if run.task is not None:
                run.task.cancel()

    async def cancel(self, job_id: str, reason: str = "cancelled") -> JobRecord:
        """Stop a hosted job for good (never retried), saying why; its record after."""
        job = self.record(job_id)
        if job.state not in FINAL_STATES and job_id not in self.runs and self._recovering:
            # A restarted agent attaches its unfinished jobs in the background: a cancel
            # that comes first waits for that (it found nothing to stop, and the job
            # went on after its backoff).
            await self._recovered.wait()
            job = self.record(job_id)
        run = self.runs.get(job_id)
        if job.state not in FINAL_STATES and run is not None:
            decision = run.machine.cancel(reason)
            self.store.update_job(
                JobRole.HOSTED, job_id, cancel_requested=1, message=run.machine.cancel_reason
            )
            run.wake.set()
            await self._end(run, decision, reason)
        return self.record(job_id)

    async def preempt(self, job_id: str, reason: str, grace: float) -> JobRecord:
        """End a hosted job ``preempted``, saying why: the provider's owner takes the
        machine back. A running container gets SIGTERM and ``grace`` seconds to exit
        (checkpoint, write its outputs) before it is killed; a job waiting to start or
        to retry ends now. Returns its record once it ended (a cancel asked before
        wins)."""
        if job_id not in self.runs:
            await self.recovered()
        run = self.runs.get(job_id)
        if run is None or self.record(job_id).state in FINAL_STATES:
            return self.record(job_id)
        if not run.machine.stopping:
            run.grace = grace
        decision = run.machine.preempt(reason)
        run.wake.set()
        await self._end(run, decision, reason)
        return self.record(job_id)

    async def _end(self, run: Run, decision: Decision | None, reason: str) -> None:
        """Carry out a cancel or a preemption: the job ends now when ``decision`` says
        so (nothing was running), else its running container is stopped (SIGTERM, then
        SIGKILL after its grace); then wait for the end to be recorded."""
        if decision is not None:
            if run.task is not None:
                run.task.cancel()
            await self.finish(run, decision)
        elif run.container_id:
            logger.info("[job %s] %s: stopping its container", run.job_id, reason)
            await in_thread(self.runtime.stop, run.container_id, run.grace)
        if run.task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(run.task), run.grace + _END_WAIT)

    # --- attempts --------------------------------------------------------------------------

    async def _supervise(
        self, run: Run, job: JobRecord, resume: ContainerState | None = None
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
                    if run.machine.stopping:
                        await self.finish(run, run.machine.infra_failed("cancelled"))
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("[job %s] supervisor failed", run.job_id)
            decision = run.machine.infra_failed("the provider hit an internal error")
            await self.finish(run, decision, no_retry=True)

    async def _start_attempt(self, run: Run, job: JobRecord) -> Decision | None:
        if run.machine.attempt == 0 and job.outputs and job.attempts_before:
            await self.outputs.baseline(job)  # before anything of this copy can write
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
        await self.log.state(
            run.job_id, attempt, JobState.STARTING, None, f"attempt {attempt} starting"
        )
        job = self.record(run.job_id)
        knew = self.no_gpu_runtime
        if job.outputs:  # watched before the job can write there
            run.outputs = await self.outputs.started(job)
        try:
            spec = await in_thread(self._create_and_start, run, job, attempt)
            if self.no_gpu_runtime and not knew:  # this attempt found out: the owner hears
                self.report(NO_GPU_RUNTIME_NOTE)
            self.store.update_job(JobRole.HOSTED, run.job_id, container_id=run.container_id)
            if job.gpus and not spec.gpu_ids:  # it runs without them (no GPU runtime)
                self.gpus.hold(gpu_holder(run.job_id), [], 0)
                self.store.update_job(JobRole.HOSTED, run.job_id, gpus=[])
        except GPUMeshError as exc:
            if run.outputs is not None:
                run.outputs.cancel()
            await self._remove_container(run)
            return run.machine.infra_failed(self.containers.in_our_name(exc).message)
        # Just started: no need to ask the engine (an inspect here would only wait
        # for a short job to exit). A command that could not start leaves it
        # exited with 126/127, which the wait in _follow reports.
        state = ContainerState(
            run.container_id, dict(spec.labels), "running", None, image=job.image
        )
        return await self._follow(run, job, state)

    def _create_and_start(self, run: Run, job: JobRecord, attempt: int) -> ContainerSpec:
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
        root = str(self.sandboxes.sandbox(peer)) + os.sep
        remotes = [str(m["remote"]) for m in job.mounts]
        if job.workdir.startswith(root):  # else an uploaded workdir, handed over once
            remotes.insert(0, "/" + job.workdir[len(root) :])
        for remote in remotes:
            try:
                self.sandboxes.resolve_sandbox_dir(peer, remote)
            except GPUMeshError as exc:
                raise AgentError(
                    f"its folder {remote} cannot be used any more: {exc.message}"
                ) from None

    def container_spec(self, job: JobRecord, attempt: int, who: JobUser) -> ContainerSpec:
        """The locked-down container for one attempt of ``job``."""
        return ContainerSpec(
            image=job.image,
            command=list(job.command),
            env=dict(job.env)
            | ({OUTPUTS_ENV: job.outputs} if job.outputs else {})
            | attempt_env(job.attempts_before, attempt),
            labels={
                LABEL_JOB: job.job_id,
                LABEL_PEER: job.peer_id,
                LABEL_NODE: self.provider.node_id,
                LABEL_ATTEMPT: str(attempt),
            },
            # Named by the job's start (every provider it moved between counted), so
            # two hops never clash where one Docker engine serves both.
            name=f"gpumesh-{job.job_id}-{job.attempts_before + attempt}",
            **asdict(self.containers.limits()),
            user=who.user,
            writable_root=who.writable_root,
            storage_size=who.storage_size,
            workdir=job.workdir or None,
            mounts=[
                Mount(
                    source=str(m["source"]),
                    target=str(m["target"]),
                    rw=bool(m["rw"]),
                    below_workdir=bool(m.get("outputs")),
                )
                for m in job.mounts
            ],
            # Without the NVIDIA container runtime no container may have a GPU: a job
            # that asked for no GPU memory then runs without one.
            gpu_ids=[] if self.no_gpu_runtime and not job.gpu_memory else list(job.gpus),
        )

    async def _follow(self, run: Run, job: JobRecord, container: ContainerState) -> Decision:
        """Stream a started container's logs into the event log until it exits."""
        if run.machine.state is JobState.STARTING:
            if container.status == "created":
                await in_thread(self.runtime.start, container.container_id)
            run.machine.running()
            fields: dict[str, object] = {"state": JobState.RUNNING}
            if job.started_at is None:
                fields["started_at"] = time.time()
            self.store.update_job(JobRole.HOSTED, run.job_id, **fields)
            attempt = run.machine.attempt
            await self.log.state(
                run.job_id, attempt, JobState.RUNNING, None, f"attempt {attempt} running"
            )
        pump = self.log.pump(
            self.runtime, run.job_id, run.machine.attempt, container.container_id, run.cursor
        )
        sampler = (
            asyncio.create_task(self.sample_gpu_memory(run, container.container_id))
            if job.gpus
            else None
        )
        watcher = (
            asyncio.create_task(self._watch_quota(run, job, container.container_id))
            if job.workdir or any(m["rw"] for m in job.mounts)
            else None
        )
        if job.outputs and run.outputs is None:  # a restarted agent follows it again
            run.outputs = asyncio.create_task(self.outputs.watch(job))
        outputs, run.outputs = run.outputs, None
        waiter = in_thread(self.runtime.wait, container.container_id)
        try:
            if run.machine.stopping:  # cancelled while the container was being made
                await in_thread(self.runtime.stop, container.container_id, run.grace)
            if job.timeout:
                # Per attempt, from when we (re)attached: a restart gives it the full time again.
                done, _ = await asyncio.wait({waiter}, timeout=job.timeout)
                if not done:
                    run.timed_out = True
                    await in_thread(self.runtime.stop, container.container_id, 5.0)
            final = await waiter
            await pump.finish()
        except GPUMeshError as exc:
            await self._remove_container(run)
            return run.machine.infra_failed(exc.message)
        finally:
            pump.stop()  # stopping the agent cancels us: the pump stops with us
            for task in (sampler, watcher, outputs):
                if task is not None:
                    task.cancel()
            abandon(waiter)  # a failure (or a cancel) before the wait was awaited
        if job.outputs:  # what the attempt left, whether or not the watch saw it
            await self.outputs.scan(job)
        # Exited and its output stored: removed once its end is told (see _supervise).
        if run.over_quota and not run.machine.stopping:
            await self.log.diagnostic(run.job_id, run.machine.attempt, run.over_quota)
            return Decision(JobState.FAILED, 0.0, run.over_quota)
        if run.timed_out and not run.machine.stopping:
            self.store.update_job(JobRole.HOSTED, run.job_id, exit_code=TIMEOUT_EXIT)
            return run.machine.infra_failed(f"timed out after {job.timeout:.0f}s")
        if final.error and final.exit_code in (ExitCode.NOT_EXECUTABLE, ExitCode.NOT_FOUND):
            await self.log.diagnostic(run.job_id, run.machine.attempt, final.error)
        exit_code = final.exit_code if final.exit_code is not None else ExitCode.JOB_NOT_RUN
        decision = run.machine.exited(exit_code)
        if final.oom_killed and decision.state is not JobState.CANCELLED:
            decision = Decision(
                decision.state, decision.delay, decision.message + " (out of memory)"
            )
        self.store.update_job(JobRole.HOSTED, run.job_id, exit_code=exit_code)
        return decision

    async def sample_gpu_memory(self, run: Run, container_id: str) -> None:
        """Record the job's peak GPU memory (sum over its processes) while it runs."""
        peak = self.record(run.job_id).peak_gpu_memory
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

    async def _watch_quota(self, run: Run, job: JobRecord, container_id: str) -> None:
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
                usage = await self.sandboxes.usage(peer)
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

    async def _remove_container(self, run: Run) -> None:
        """Remove the attempt's container."""
        if run.container_id:
            with contextlib.suppress(GPUMeshError):
                await in_thread(self.runtime.remove, run.container_id)
            run.container_id = ""
            self.store.update_job(JobRole.HOSTED, run.job_id, container_id="")

    # --- outcomes --------------------------------------------------------------------------

    async def _after_attempt(self, run: Run, job: JobRecord, decision: Decision) -> None:
        if decision.state is JobState.RETRYING:
            self.store.update_job(
                JobRole.HOSTED, run.job_id, state=JobState.RETRYING, message=decision.message
            )
            await self.log.state(
                run.job_id,
                run.machine.attempt,
                JobState.RETRYING,
                None,
                decision.message,
                exited=decision.exited,
            )
            logger.info("[job %s] %s", run.job_id, decision.message)
            return
        await self.finish(run, decision)

    async def finish(self, run: Run, decision: Decision, *, no_retry: bool = False) -> None:
        """End the job as ``decision`` says (``no_retry``: failed, where it says retry):
        stored, logged, its GPU memory released, the owner told; nothing if it ended."""
        if no_retry and decision.state is JobState.RETRYING:
            decision = Decision(JobState.FAILED, 0.0, decision.message, decision.exited)
            run.machine.state = JobState.FAILED
        # Whatever happens below, the job holds no GPU memory once it ends.
        self.gpus.release(gpu_holder(run.job_id))
        job = self.record(run.job_id)
        exit_code = job.exit_code
        if decision.state is JobState.CANCELLED:
            exit_code = exit_code if exit_code is not None else ExitCode.INTERRUPTED
        elif decision.state is JobState.PREEMPTED:
            exit_code = exit_code if exit_code is not None else ExitCode.PREEMPTED
        elif decision.state is JobState.FAILED and exit_code in (None, 0):
            # Never ran to completion: like docker run's own failures.
            exit_code = ExitCode.JOB_NOT_RUN
        if job.state in FINAL_STATES:
            return
        if job.outputs:  # the last scan, before the job is final: then outputs are too
            await self.outputs.scan(job)
        self.store.update_job(
            JobRole.HOSTED,
            run.job_id,
            state=decision.state,
            exit_code=exit_code,
            message=decision.message,
            finished_at=time.time(),
        )
        self.outputs.tell(run.job_id)
        await self.log.state(
            run.job_id,
            run.machine.attempt,
            decision.state,
            exit_code,
            decision.message,
            exited=decision.exited,
        )
        logger.info("[job %s] %s: %s", run.job_id, decision.state, decision.message)
        self.report(
            f"job {run.job_id[:8]} of {job.peer_name} {decision.state} ({decision.message})"
        )


def _retrieved(future: asyncio.Future[None]) -> None:
    """Take a removal's failure (a container already gone is fine; any other stays
    for the orphan clean-up of the next start), so nothing logs it as unseen."""
    if not future.cancelled():
        future.exception()
