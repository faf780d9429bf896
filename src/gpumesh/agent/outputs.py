"""The provider's outputs service: ``OutputsQuery`` from a job's submitter.

Owns the answer to "which files of my job's outputs are finished after N":
the entries the job's watch and scans recorded (:mod:`gpumesh.agent.joboutputs`),
a bounded list at a time, after a long poll of at most ``MAX_OUTPUTS_WAIT``
seconds when there is nothing new yet; and the release of a finished job's
outputs folder once its submitter has everything. The files themselves are
fetched with the sandbox's downloads (``FileStat``, ``FileGet``), which check
every path again through descriptors: nothing here reads them. Only the job's
own submitter is answered, and every answer names the epoch of the copy that
runs here. A copy its submitter moved away had its folder and entries deleted
(:meth:`~gpumesh.agent.jobs.JobService.handle_cancel`), so it is answered as a
released job is: final, with no files.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from gpumesh.agent.deps import Handlers, OwnedJobs, Provider, RequestContext
from gpumesh.agent.joboutputs import JobOutputs, outputs_remote
from gpumesh.blocking import in_thread
from gpumesh.errors import ConfigError, NotFoundError
from gpumesh.protocol.messages import (
    MAX_MESSAGE_FRAME,
    MAX_OUTPUT_FILES,
    OutputFile,
    OutputsQuery,
    OutputsReady,
)
from gpumesh.protocol.states import FINAL_STATES, JobRole
from gpumesh.store.db import Store

__all__ = ["OutputsService"]

_REPLY_BUDGET = MAX_MESSAGE_FRAME - 8 * 1024
"""Bytes of paths (and their fields) one reply carries at most, under the frame limit."""
_ENTRY_OVERHEAD = 48
"""Bytes an entry takes in a reply besides its path (a generous bound)."""


class OutputsService:
    """Answers the submitters of jobs with ``--outputs``."""

    def __init__(
        self, provider: Provider, store: Store, jobs: OwnedJobs, outputs: JobOutputs
    ) -> None:
        self.provider = provider
        self.store = store
        self.jobs = jobs
        self.outputs = outputs

    def register(self, handlers: Handlers) -> None:
        handlers.add(OutputsQuery, self.handle_query)

    async def handle_query(self, ctx: RequestContext, message: OutputsQuery) -> None:
        job = self.jobs.owned(ctx.peer, message.job_id)
        if not job.outputs:
            raise NotFoundError(f"job {job.job_id} on {self.provider.name} has no --outputs")
        folder = outputs_remote(job.job_id)
        if message.release:
            if job.state not in FINAL_STATES:
                raise ConfigError(
                    f"job {job.job_id} on {self.provider.name} still runs: its outputs "
                    "are released once it ended"
                )
            await in_thread(self.outputs.remove, ctx.peer, job.job_id)
            released = OutputsReady(files=[], final=True, folder=folder, epoch=job.epoch)
            ctx.stream.send_message(released, end=True)
            return
        deadline = time.monotonic() + message.wait
        while True:
            news = self.outputs.news(job.job_id)
            record = self.store.job(JobRole.HOSTED, job.job_id)
            final = record is None or record.state in FINAL_STATES
            entries = self.store.job_outputs(job.job_id, message.after, MAX_OUTPUT_FILES)
            left = deadline - time.monotonic()
            if entries or final or left <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(news.wait(), left)
        files: list[OutputFile] = []
        used = 0
        for entry in entries:
            used += len(entry.path.encode("utf-8")) + _ENTRY_OVERHEAD
            if used > _REPLY_BUDGET:
                break
            files.append(
                OutputFile(seq=entry.seq, path=entry.path, size=entry.size, mtime=entry.mtime)
            )
        more = len(files) < len(entries) or len(entries) == MAX_OUTPUT_FILES
        reply = OutputsReady(
            files=files, final=final and not more, folder=folder, more=more, epoch=job.epoch
        )
        ctx.stream.send_message(reply, end=True)
