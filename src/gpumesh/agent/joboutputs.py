"""The outputs folders of hosted jobs (``run --outputs``): made at submit, watched
while an attempt runs, scanned at its end, released once the submitter has them.

A job's outputs folder lies in its submitter's sandbox, at
``/gpumesh-outputs/JOB_ID`` (:func:`outputs_remote`): it counts in the peer's
file_quota, survives the job, and is read with the sandbox's own downloads
(``FileGet`` and their checks). It is mounted read-write into the job like a
``--mount :rw`` (the job service adds it to the job's mounts, so the nesting
check, the recheck before each attempt and the quota watch cover it).

Which files are finished is the watch's word (:mod:`gpumesh.files.outputs`:
closed after writing, or renamed into place) while an attempt runs, and a
scan's at each attempt's end (every regular file whose size or mtime changed);
each is recorded in ``job_outputs`` with a new sequence number
(:meth:`~gpumesh.store.jobs.JobTables.record_outputs`), which the outputs
service (:mod:`gpumesh.agent.outputs`) answers ``OutputsQuery`` from. A job
that moved here from other providers finds, in its folder, what came home from
them (its submitter restored it before the submit): recorded once, before its
first attempt, as home already (:meth:`JobOutputs.baseline`). Never reads a
file's bytes, and never follows a link.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable
from typing import TypeVar

from gpumesh.agent.deps import Sandboxes
from gpumesh.blocking import in_thread
from gpumesh.errors import GPUMeshError
from gpumesh.files.outputs import (
    Found,
    OutputsWatch,
    open_outputs_watch,
    scan_outputs,
    stat_outputs,
)
from gpumesh.files.sandbox import Tree
from gpumesh.protocol.messages import OUTPUTS_FOLDER
from gpumesh.store.db import Store
from gpumesh.store.jobs import JobRecord
from gpumesh.store.peers import Peer

__all__ = ["OUTPUTS_ENV", "OUTPUTS_FOLDER", "JobOutputs", "outputs_remote"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

OUTPUTS_ENV = "GPUMESH_OUTPUTS"
"""The variable that names the outputs folder inside the job."""
_BATCH = 0.05
"""Seconds a watch lets news gather before it reads them (a burst of closes is one
trip to a thread and one transaction; a new folder waits this long for its watch)."""
_SETTLE = 2.0
"""A scan while the job runs takes files unchanged for this many seconds only: one
changed more recently may be open still, and its close is told by the watch."""
_POLL = 5.0
"""Seconds between scans where the kernel cannot watch the folder (no inotify)."""


def outputs_remote(job_id: str) -> str:
    """A job's outputs folder as a path of its submitter's sandbox."""
    return f"/{OUTPUTS_FOLDER}/{job_id}"


async def _finished(call: Callable[..., T], *args: object) -> T:
    """A blocking call in a thread, seen through to its end even when the caller
    is cancelled meanwhile (the folder's descriptor must outlive it)."""
    future = in_thread(call, *args)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        with contextlib.suppress(BaseException):
            await future
        raise


class JobOutputs:
    """The outputs of this agent's hosted jobs: files found ready, waiters told."""

    def __init__(self, store: Store, sandboxes: Sandboxes) -> None:
        self.store = store
        self.sandboxes = sandboxes
        self._news: dict[str, asyncio.Event] = {}

    # --- waiting ----------------------------------------------------------------------------

    def news(self, job_id: str) -> asyncio.Event:
        """Set at the job's next news (files ready, the job's end); take it before
        reading the store, so nothing recorded meanwhile is missed."""
        return self._news.setdefault(job_id, asyncio.Event())

    def tell(self, job_id: str) -> None:
        """Wake whoever waits on the job's outputs."""
        event = self._news.pop(job_id, None)
        if event is not None:
            event.set()

    # --- the folder ---------------------------------------------------------------------------

    def _peer(self, job: JobRecord) -> Peer | None:
        try:
            return self.store.peer_by_id(job.peer_id)
        except GPUMeshError:
            return None  # unpaired since: nothing of theirs to look at

    def _open(self, peer: Peer, job_id: str) -> Tree | None:
        """The job's outputs folder, opened without following a link (blocking)."""
        with self.sandboxes.tree(peer) as sandbox:
            try:
                return sandbox.subtree((OUTPUTS_FOLDER, job_id))
            except OSError:
                return None

    def remove(self, peer: Peer, job_id: str) -> None:
        """Delete the job's outputs folder, never following a link (blocking)."""
        with self.sandboxes.tree(peer) as sandbox:
            try:
                fd = sandbox.open_dir((OUTPUTS_FOLDER,))
            except OSError:
                return
            try:
                with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                    shutil.rmtree(job_id, dir_fd=fd)  # fd-based, never follows links
            finally:
                os.close(fd)
        self.store.forget_outputs(job_id)

    # --- finding finished files -------------------------------------------------------------

    def _record(self, job_id: str, found: list[Found]) -> None:
        if self.store.record_outputs(job_id, found):
            self.tell(job_id)

    async def _found(self, job: JobRecord) -> list[Found]:
        """Every regular file in the job's outputs folder now (none when it is gone)."""
        peer = self._peer(job)
        if peer is None:
            return []
        tree = await in_thread(self._open, peer, job.job_id)
        if tree is None:
            return []
        with tree:
            return await _finished(scan_outputs, tree)

    async def scan(self, job: JobRecord, *, settled: bool = False) -> None:
        """Record every file whose size or mtime changed since it was last recorded
        (``settled``: only those unchanged for a while; the job may be writing)."""
        found = await self._found(job)
        if settled:
            recent = time.time() - _SETTLE
            found = [entry for entry in found if entry[3] < recent]
        self._record(job.job_id, found)

    async def baseline(self, job: JobRecord) -> None:
        """Before a moved job's first attempt here: take what its outputs folder holds
        as home already. Its submitter restored there, with ``cp``, what the
        providers before this one had sent home, which need not travel back.
        Recorded with seq 0, so only a file the job changes from now on is listed."""
        found = await self._found(job)
        self.store.record_outputs(job.job_id, found, baseline=True)
        logger.info(
            "[job %s] %d file(s) restored in its outputs folder: home already",
            job.job_id,
            len(found),
        )

    async def started(self, job: JobRecord) -> asyncio.Task[None]:
        """:meth:`watch` for an attempt about to start: returned once the folder is
        watched, so nothing the attempt finishes goes unseen."""
        ready = asyncio.Event()
        task = asyncio.create_task(self.watch(job, ready))
        waiter = asyncio.ensure_future(ready.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        return task

    async def watch(self, job: JobRecord, ready: asyncio.Event | None = None) -> None:
        """While an attempt runs (until cancelled): record each file as the job
        finishes it. ``ready`` (an attempt not started yet) is set once the folder
        is watched; without it (a restarted provider follows a running attempt),
        what the job finished meanwhile is scanned for first."""
        peer = self._peer(job)
        if peer is None:
            return
        tree = await in_thread(self._open, peer, job.job_id)
        if tree is None:
            logger.warning("[job %s] its outputs folder is gone: nothing is watched", job.job_id)
            return
        with tree:
            watch = await _finished(open_outputs_watch, tree)
            if ready is not None:
                ready.set()
            try:
                if ready is None:
                    await self.scan(job, settled=True)
                if watch is None:
                    while True:
                        await asyncio.sleep(_POLL)
                        await self.scan(job, settled=True)
                await self._follow(job, tree, watch)
            finally:
                if watch is not None:
                    watch.close()

    async def _follow(self, job: JobRecord, tree: Tree, watch: OutputsWatch) -> None:
        loop = asyncio.get_running_loop()
        readable = asyncio.Event()
        loop.add_reader(watch.fd, readable.set)
        try:
            while True:
                await readable.wait()
                await asyncio.sleep(_BATCH)
                readable.clear()
                paths, again = await _finished(watch.ready)
                found = await _finished(stat_outputs, tree, paths)
                self._record(job.job_id, found)
                if again:
                    await self.scan(job, settled=True)
        finally:
            loop.remove_reader(watch.fd)
