"""Outputs coming home: the submitter's side of ``run --outputs``.

A job submitted with outputs has a receiver in the submitter's node process
(:class:`OutputsReceivers`; one task a job, resumed when the process starts
again) that asks the provider which files the job finished
(``OutputsQuery``, a long poll) and fetches them one at a time, in order,
with the downloads of ``cp`` (:class:`~gpumesh.client.cpdownload.Download`: a
part file, the hash checked, renamed into place), so the job keeps most of its
provider's disk and network to itself. What it records in the job's record
(the last entry dealt with, files, bytes, a note) lets a restarted node
process go on where it stopped; what arrived stays whatever becomes of the
provider.

Every entry is hostile: its path must be relative, with no empty, ``.`` or
``..`` component and no name ``cp`` would not take, and nothing on its way
here may be a link; on the provider it is read as ``cp`` reads it (a link, or
a file swapped for one, is refused with ``cp``'s words, recorded as the note,
and the stream goes on). An entry whose file changed since it was recorded is
skipped: a newer entry comes when the job closes it again. Past
``outputs_limit`` the stream stops, saying how to fetch the rest. An
unreachable provider is asked again later (backoff), never given up on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpumesh.blocking import in_thread
from gpumesh.client.cpdownload import PART_SUFFIX, Download
from gpumesh.client.cpupload import FolderUpload
from gpumesh.client.files import RETRIES, STALL_TIMEOUT, CopyCallbacks, CopyResult
from gpumesh.errors import (
    ConfigError,
    ConnectionLostError,
    GPUMeshError,
    NotFoundError,
    NotPairedError,
    ProtocolError,
    UnreachableError,
)
from gpumesh.files.outputs import usable_name
from gpumesh.protocol.messages import (
    OUTPUTS_FOLDER,
    FileInfo,
    OutputFile,
    OutputsQuery,
    OutputsReady,
)
from gpumesh.protocol.states import JobRole
from gpumesh.store.jobs import JobRecord
from gpumesh.units import format_size, parse_size

if TYPE_CHECKING:
    from gpumesh.client.node import Node
    from gpumesh.store.peers import Peer

__all__ = [
    "COMPLETE",
    "RECEIVING",
    "STOPPED",
    "OutputsReceivers",
    "entry_problem",
    "receive_outputs",
    "restore_outputs",
]

logger = logging.getLogger(__name__)

RECEIVING = "receiving"
COMPLETE = "complete"
STOPPED = "stopped"
_WAIT = 30.0
"""Seconds one query waits on the provider for a file to be finished."""
_PACE = 7.0
"""While the job runs, each fetch is followed by a pause this many times as long:
the stream takes at most an eighth of the time (its bytes moving at the lowest CPU
priority on both ends), and the job keeps the rest of its provider's disk, network
and processors (and this machine's). Once the job ended, what is left comes at full
speed (bench/outputs.py measures what the stream costs a job)."""
_ASK_AGAIN = 2.0
"""Seconds of paced fetches after which the provider is asked again (cheap: the rest
of the list comes back at once), so that a job's end lifts the pacing soon."""
_BACKOFF = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
"""Seconds before asking an unreachable provider again (the last one repeats)."""


def entry_problem(path: str) -> str | None:
    """Why an entry's path may not be placed under the destination (None: it may)."""
    parts = path.split("/")
    if path.startswith("/") or any(not usable_name(part) for part in parts):
        return "is not a plain relative path"
    if parts[-1].endswith(PART_SUFFIX):
        return f"ends in {PART_SUFFIX}, which downloads keep for themselves"
    return None


def _prepare_local(root: Path, path: str) -> tuple[Path, bool]:
    """Where ``path`` goes under ``root``: its folders made, none of them a link or
    anything but a folder, nor the file's place a folder; and whether nothing is
    there yet (blocking)."""
    root.mkdir(mode=0o755, parents=True, exist_ok=True)
    parts = path.split("/")
    current = root
    for part in parts[:-1]:
        current = current / part
        if current.is_symlink():
            raise ConfigError(f"{current} is a link here: outputs never go through one")
        if not current.is_dir():
            if current.exists():
                raise ConfigError(f"{current} is a file here, where the outputs need a folder")
            current.mkdir(mode=0o755)
    target = current / parts[-1]
    if target.is_dir() and not target.is_symlink():
        raise ConfigError(f"{target} is a folder here")
    return target, not os.path.lexists(target)


class _Changed(Exception):
    """The file is not (or no longer) what the entry said: a newer entry will come."""


class _OutputDownload(Download):
    """One output file: ``cp``'s download, taking only the regular file the entry
    names, unchanged since the provider recorded it."""

    def __init__(self, entry: OutputFile, *args: Any) -> None:
        super().__init__(*args)
        self.entry = entry
        self.background = True  # the job on the provider, and this machine's own work, first

    def destination(self, info: FileInfo, where: str) -> Path:
        if not info.exists:
            raise _Changed
        if info.kind != "file":
            raise ConfigError(f"{where} is not a regular file")
        if info.size != self.entry.size or info.mtime != self.entry.mtime:
            raise _Changed
        return self.local


async def receive_outputs(node: Node, job_id: str) -> None:
    """Bring a submitted job's outputs home until they are complete or stopped;
    an unreachable provider is asked again later, without end."""
    store = node.home.store
    failures = 0
    while True:
        job = store.job(JobRole.SUBMITTED, job_id)
        if job is None or job.outputs_state != RECEIVING or not job.peer_id:
            return  # done, or moving (the next hop's receiver takes over)
        try:
            peer = node.peer(job.peer_id)
            if await _receive(node, peer, job_id):
                return
            failures = 0
        except (ConnectionLostError, UnreachableError) as exc:
            logger.info("[job %s] outputs: %s; asking again later", job_id, exc)
        except (NotFoundError, NotPairedError) as exc:
            _stop(node, job_id, f"outputs stopped: {exc.message}")
            return
        except GPUMeshError as exc:
            logger.warning("[job %s] outputs: %s; asking again later", job_id, exc)
        await asyncio.sleep(_BACKOFF[min(failures, len(_BACKOFF) - 1)])
        failures += 1


def _stop(node: Node, job_id: str, note: str) -> None:
    logger.info("[job %s] %s", job_id, note)
    node.home.store.update_job(JobRole.SUBMITTED, job_id, outputs_state=STOPPED, outputs_note=note)


async def _receive(node: Node, peer: Peer, job_id: str) -> bool:
    """One session's worth: True once the outputs are complete or stopped."""
    store = node.home.store
    async with node.live_session(peer.node_id) as session:
        while True:
            job = store.job(JobRole.SUBMITTED, job_id)
            if job is None or job.outputs_state != RECEIVING or job.peer_id != peer.node_id:
                return True  # done, or the job moved (its next hop gets a receiver)
            query = OutputsQuery(job_id=job_id, after=job.outputs_seq, wait=_WAIT)
            ready = await session.request(query, timeout=_WAIT + 30)
            if not isinstance(ready, OutputsReady):
                raise ProtocolError(f"{peer.name} answered an outputs query with {ready}")
            if ready.epoch and ready.epoch != job.epoch:
                raise ProtocolError(
                    f"{peer.name} listed outputs of epoch {ready.epoch} for job {job_id}, "
                    f"whose newest hop is epoch {job.epoch}: refused"
                )
            if ready.final and node.keeper is not None:
                node.keeper.poke(job_id)  # it ended there: preempted, maybe, and to move
            answered = time.monotonic()
            for entry in ready.files:
                if entry.seq <= job.outputs_seq:
                    continue
                began = time.monotonic()
                if not await _take(node, peer, job, ready.folder, entry):
                    return True
                job = store.job(JobRole.SUBMITTED, job_id) or job
                if not ready.final:
                    await asyncio.sleep((time.monotonic() - began) * _PACE)
                    if time.monotonic() - answered > _ASK_AGAIN:
                        break  # the job may have ended since: ask, and go on at its pace
            if ready.final and not ready.more:
                await session.request(OutputsQuery(job_id=job_id, release=True), timeout=60)
                store.update_job(JobRole.SUBMITTED, job_id, outputs_state=COMPLETE)
                logger.info("[job %s] outputs complete in %s", job_id, job.outputs_to)
                return True


async def _take(node: Node, peer: Peer, job: JobRecord, folder: str, entry: OutputFile) -> bool:
    """Fetch one entry, or skip it with a note; False when the stream stopped."""
    store = node.home.store
    fields: dict[str, object] = {"outputs_seq": entry.seq}
    problem = entry_problem(entry.path)
    remote = f"{folder}/{entry.path}"
    limit_text = str(node.home.config.get("outputs_limit"))
    if problem is not None:
        fields["outputs_note"] = f"skipped {entry.path!r}: it {problem}"
    elif job.outputs_bytes + entry.size > parse_size(limit_text):
        _stop(
            node,
            job.job_id,
            f"outputs stopped at {entry.path}: over outputs_limit {limit_text} "
            f"({format_size(job.outputs_bytes)} came); raise it with `gpumesh config set "
            f"outputs_limit 50GB` and fetch the rest with `gpumesh cp -r "
            f"{peer.name}:{folder} {job.outputs_to}.rest`",
        )
        return False
    else:
        try:
            placed, new = await _fetch(node, peer, job, remote, entry)
        except _Changed:
            pass  # written again since: its newer entry comes
        except (ConnectionLostError, UnreachableError):
            raise  # asked again later, from this entry
        except GPUMeshError as exc:
            fields["outputs_note"] = exc.message
            logger.info("[job %s] outputs: %s", job.job_id, exc.message)
        except OSError as exc:
            fields["outputs_note"] = f"{entry.path}: {exc.strerror or exc} here"
        else:
            fields["outputs_bytes"] = job.outputs_bytes + placed
            fields["outputs_files"] = job.outputs_files + new
    store.update_job(JobRole.SUBMITTED, job.job_id, **fields)
    return True


async def _fetch(
    node: Node, peer: Peer, job: JobRecord, remote: str, entry: OutputFile
) -> tuple[int, int]:
    """The entry's file, placed; its bytes, and 1 when it is new here (else 0)."""
    target, new = await in_thread(_prepare_local, Path(job.outputs_to), entry.path)
    result = CopyResult("download", "file", peer.name, target, remote, 0, "", 0.0)
    copier = _OutputDownload(
        entry, node, peer, target, remote, CopyCallbacks(), STALL_TIMEOUT, result
    )
    copier.allow_channel(True)
    await copier.run(RETRIES, time.perf_counter())
    return result.size, int(new)


async def restore_outputs(node: Node, peer: Peer, job_id: str, local: Path) -> None:
    """Put the outputs a moved job already brought home into its outputs folder on
    ``peer`` (``/gpumesh-outputs/JOB_ID`` of this node's sandbox there), before the
    job is submitted there: its next copy resumes from them. Nothing home: nothing sent."""
    if not await in_thread(_has_files, local):
        return
    remote = f"/{OUTPUTS_FOLDER}/{job_id}"
    result = CopyResult("upload", "dir", peer.name, local, remote, 0, "", 0.0)
    copier = FolderUpload(node, peer, local, remote, CopyCallbacks(), STALL_TIMEOUT, result)
    copier.target = remote  # exactly there, not into it
    copier.allow_channel(True)
    await copier.run(RETRIES, time.perf_counter())
    logger.info(
        "[job %s] %s of outputs restored on %s", job_id, format_size(result.size), peer.name
    )


def _has_files(folder: Path) -> bool:
    """Whether ``folder`` holds a file, at any depth (blocking)."""
    return folder.is_dir() and any(path.is_file() for path in folder.rglob("*"))


class OutputsReceivers:
    """The receivers of one node process, one task a submitted job."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def start(self, job_id: str) -> None:
        """Receive the job's outputs (a task, unless one runs already)."""
        task = self._tasks.get(job_id)
        if task is not None and not task.done():
            return
        task = asyncio.create_task(self._run(job_id))
        self._tasks[job_id] = task

    async def _run(self, job_id: str) -> None:
        try:
            await receive_outputs(self.node, job_id)
        except Exception:
            logger.exception("[job %s] the outputs receiver failed", job_id)

    def resume(self) -> None:
        """Start the receivers of every job whose outputs are still coming."""
        for job in self.node.home.store.receiving_outputs():
            self.start(job.job_id)

    async def halt(self, job_id: str) -> None:
        """Stop the job's receiver (its job moves: the next hop gets a new one)."""
        task = self._tasks.pop(job_id, None)
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def running(self, job_id: str) -> bool:
        task = self._tasks.get(job_id)
        return task is not None and not task.done()

    @property
    def busy(self) -> bool:
        """Whether a receiver still has work (the node process then stays)."""
        return any(not task.done() for task in self._tasks.values())

    async def settled(self, job_id: str, timeout: float) -> JobRecord | None:
        """The job's record once its receiver ended (or after ``timeout`` seconds)."""
        task = self._tasks.get(job_id)
        if task is not None and not task.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), timeout)
        return self.node.home.store.job(JobRole.SUBMITTED, job_id)

    async def stop(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        for task in self._tasks.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task
