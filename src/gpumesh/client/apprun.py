"""``app run`` as one async iterator: ``async for event in watch_app_run(...)``.

The node process streams an app run with this (``POST /api/v1/apps/run``).
It yields the sync (:class:`Synced`), then what :func:`~gpumesh.client.runs.watch_run`
yields for a job run in the app's folder: the provider's image pull, its
acceptance, then the job's own events, each numbered (``seq``) as the job's
events route numbers them, so a reader that lost the stream resumes with that
route after the last number it read. Those events are paced by the reader (the
job's output is credited): nothing here holds more than the credit window, the
provider keeps what was not read yet up to its ``job_log_limit``, and a reader
that fell further behind is told how much it lost (``OutputDropped``). With
``out``, the app's folder named like ``out`` is pulled back once the job ended;
``result`` is then the :class:`~gpumesh.client.apps.AppRun`.

:func:`~gpumesh.client.apps.run_app` is the same with callbacks, on one session
and with the job attached to its submission (the in-process CLI's way).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gpumesh.client._events import Watch
from gpumesh.client.apps import AppRun, SyncResult, pull_out, sync_app
from gpumesh.client.runs import RunEvent, watch_run

if TYPE_CHECKING:
    from gpumesh.client.jobspec import JobSpec
    from gpumesh.client.node import Node

__all__ = ["AppRunEvent", "AppRunWatch", "Synced", "watch_app_run"]


@dataclass(frozen=True)
class Synced:
    """The app's folder is on the peer, as the sync left it."""

    sync: SyncResult


AppRunEvent = Synced | RunEvent


class AppRunWatch(Watch[AppRunEvent]):
    """One app run, started when iterated (once). ``seq``: the number of the job's
    last event read (resume the job's events after it); ``result``: the app run,
    once iteration ended. Leaving early cancels a submission under way; a job already
    accepted keeps running (cancel it by id)."""

    def __init__(
        self, node: Node, peer_query: str, folder: Path, spec: JobSpec, out: Path | None
    ) -> None:
        self.result: AppRun | None = None
        self.seq = 0
        self._events = self._run(node, peer_query, folder, spec, out)

    async def _run(
        self, node: Node, peer_query: str, folder: Path, spec: JobSpec, out: Path | None
    ) -> AsyncGenerator[AppRunEvent, None]:
        peer = node.peer(peer_query)
        sync = await sync_app(node, peer.node_id, folder)
        yield Synced(sync)
        run = watch_run(node, spec, sandbox_dir=sync.remote)
        try:
            async for event in run:
                self.seq = run.seq
                yield event
        finally:
            await run.aclose()
        assert run.result is not None  # iteration ended: the follow reached the end
        done = AppRun(sync, run.result)
        if out is not None:
            await pull_out(node, peer.node_id, done, out)
        self.result = done


def watch_app_run(
    node: Node, peer_query: str, folder: Path, spec: JobSpec, *, out: Path | None = None
) -> AppRunWatch:
    """Sync ``folder`` to the peer, run ``spec`` in it and follow it to its end, then
    (with ``out``) pull the app's folder named like ``out`` into ``out``: as events."""
    return AppRunWatch(node, peer_query, folder, spec, out)
