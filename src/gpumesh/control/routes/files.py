"""Routes of files: copies, app syncs, runs and pulls (local paths: never a
browser session's)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from gpumesh.client import apprun
from gpumesh.client.apprun import watch_app_run
from gpumesh.client.apps import app_job, job_folder, pull_folder, pull_job, sync_app
from gpumesh.client.bodies import AppPullBody, AppRunBody, CopyBody, SyncBody
from gpumesh.client.files import RETRIES, CopyCallbacks, copy, parse_location
from gpumesh.client.jobspec import build_spec
from gpumesh.client.views.apps import AppPullView, AppRunView, SyncView
from gpumesh.client.views.files import (
    CopyProgressView,
    CopyRetryingView,
    CopyStartedView,
    CopyView,
)
from gpumesh.control.call import Call
from gpumesh.control.routes.jobs import run_event
from gpumesh.control.streams import EventStream, Feed, feed_events, paced_events, sse
from gpumesh.errors import BadRequestError, GPUMeshError

__all__ = ["post_app_pull", "post_app_run", "post_app_sync", "post_copy"]


async def post_copy(call: Call) -> object:
    """A copy; with ``stream``, its progress as Server-Sent Events (``copystarted``,
    ``copyprogress``, ``copyretrying``), then ``end`` (the copy's view) or ``error``.
    Leaving the stream stops the copy where it is (the next one resumes there)."""

    body: CopyBody = call.body
    if body.retries is not None and not 0 <= body.retries <= 20:
        raise BadRequestError("retries must be 0 to 20")
    source, destination, shown = _local_side(body)

    async def work(feed: Feed) -> object:
        def started(label: str, total: int) -> None:
            feed.put("copystarted", CopyStartedView(shown(label), total))

        def progress(done: int, total: int) -> None:
            feed.put("copyprogress", CopyProgressView(done, total), latest=True)

        def retrying(error: GPUMeshError, attempt: int) -> None:
            feed.put("copyretrying", CopyRetryingView(str(error), attempt))

        result = await copy(
            call.node,
            source,
            destination,
            retries=RETRIES if body.retries is None else body.retries,
            callbacks=CopyCallbacks(started=started, progress=progress, retrying=retrying),
            fast_path=body.fast_path,
        )
        view = CopyView.of(result)
        view.local = shown(view.local)
        return view

    if call.flag("stream"):
        return EventStream(feed_events(work))
    return await work(Feed())


def _local_side(body: CopyBody) -> tuple[str, str, Callable[[str], str]]:
    """``body``'s source and destination with a relative local path made absolute
    from ``cwd``, and a function that shows that absolute path as the caller wrote it."""

    source, destination = body.source, body.destination
    if body.cwd is None:
        return source, destination, lambda text: text
    if not os.path.isabs(body.cwd):
        raise BadRequestError(f"cwd {body.cwd!r} is not an absolute path")
    local = destination if parse_location(source).peer is not None else source
    if os.path.isabs(local) or parse_location(local).peer is not None:
        return source, destination, lambda text: text
    absolute = os.path.join(body.cwd, local)
    written = str(Path(local))
    norm = str(Path(absolute))
    if local == source:
        source = absolute
    else:
        destination = absolute

    def shown(text: str) -> str:
        parts = text.split(" -> ")
        for i, part in enumerate(parts):
            if part == norm:
                parts[i] = written
            elif part.startswith(norm.rstrip(os.sep) + os.sep):
                parts[i] = os.path.join(written, part[len(norm.rstrip(os.sep)) + 1 :])
        return " -> ".join(parts)

    return source, destination, shown


async def post_app_sync(call: Call) -> object:
    body: SyncBody = call.body
    result = await sync_app(
        call.node, body.peer, Path(body.dir), name=body.name, dry_run=body.dry_run
    )
    return SyncView.of(result)


def _absolute(what: str, path: str) -> Path:
    """A local path of a request: absolute, since the caller's folder is not ours."""
    if not Path(path).is_absolute():
        raise BadRequestError(f"{what} {path!r} is not an absolute path")
    return Path(path)


async def post_app_run(call: Call) -> object:
    """Sync a local folder, run a job in it, pull a folder back: Server-Sent Events
    ``syncview``, the job's steps and events as the jobs route streams them
    (numbered: resume a dropped stream with the job's events route, ``after`` the
    last number read), then ``end`` (the app run's view) or ``error``. The job's
    output is paced by the reader (nothing piles up here). Leaving the stream
    stops following (the job keeps running)."""

    body: AppRunBody = call.body
    folder = _absolute("dir", body.dir)
    out = None if body.out is None else _absolute("out", body.out)
    spec = build_spec(
        None,
        image=body.image,
        command=body.command or None,
        env_items=[f"{k}={v}" for k, v in body.env.items()],
        gpu_memory=body.gpu_memory,
        retries=body.retries,
        timeout=body.timeout,
        peer=body.peer,
        mounts=body.mounts,
    )
    return EventStream(_app_run_events(watch_app_run(call.node, body.peer, folder, spec, out=out)))


def _app_run_events(run: Any) -> AsyncIterator[bytes]:
    """An app run (:class:`gpumesh.client.apprun.AppRunWatch`) as Server-Sent Events,
    with a keep-alive comment while it is silent (a long sync or a quiet job)."""

    def event(item: Any) -> bytes:
        if isinstance(item, apprun.Synced):
            return sse("syncview", SyncView.of(item.sync))
        return run_event(item, run.seq)

    return paced_events(run, event, lambda: sse("end", AppRunView.of(run.result)))


async def post_app_pull(call: Call) -> object:
    body: AppPullBody = call.body
    dest = _absolute("dir", body.dir)
    peer, job = app_job(call.node, body.job, body.peer)
    if not body.folder:
        remote, size = await pull_job(call.node, peer.node_id, job, dest)
        return AppPullView(remote, size, peer.name, job)
    if body.folder in (".", "..") or "/" in body.folder or "\\" in body.folder:
        raise BadRequestError(f"folder {body.folder!r} is not a folder name")
    remote = f"{await job_folder(call.node, peer.node_id, job)}/{body.folder}"
    size = await pull_folder(call.node, peer.node_id, remote, dest)
    return AppPullView(remote, size, peer.name, job)
