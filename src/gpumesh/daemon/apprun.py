"""``app run`` by the home's node process, as ``gpumesh app run`` and
``gpumesh.Mesh.app_run`` read it: one stream that survives the node process.

``POST /api/v1/apps/run`` streams the sync (``syncview``), the job's steps and
its events (output and status numbered as the job's events route numbers
them), then ``end`` (the app run's view). When that stream breaks (the node
process died) after the provider accepted the job, the job's events route of
a new node process (started by :func:`~gpumesh.daemon.client.connect`) goes on
after the last numbered event read, so no line is lost or repeated, and the
folder ``out`` names is then pulled back with ``POST /api/v1/apps/pull``. A
stream that breaks before acceptance cannot tell whether a job started: that
is an error naming ``gpumesh jobs``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from gpumesh.client.bodies import AppPullBody
from gpumesh.client.views.apps import AppRunView, SyncView
from gpumesh.client.views.jobs import JobResultView
from gpumesh.client.views.runs import RUN_EVENTS, AcceptedView
from gpumesh.daemon.client import NoAnswer, NodeUnavailableError, job_events
from gpumesh.errors import AgentError, NotFoundError

if TYPE_CHECKING:
    from gpumesh.client.bodies import AppRunBody
    from gpumesh.daemon.client import NodeClient, SseEvent

__all__ = ["APP_RUN_EVENTS", "NodeAppRun"]

APP_RUN_EVENTS: dict[str, type] = {**RUN_EVENTS, "syncview": SyncView, "end": AppRunView}
"""``POST /api/v1/apps/run``'s events: the sync, then a run's, then the app run's view."""


class NodeAppRun:
    """One app run by the node process: :meth:`events` yields its events (not
    ``end``; an error is raised) and, once they ran out, :attr:`view` is the app
    run's view. ``connect`` reaches the home's node process, starting one when
    none runs; ``body`` is the route's."""

    def __init__(self, connect: Callable[[], NodeClient], body: AppRunBody) -> None:
        self._connect = connect
        self._body = body
        self.view: AppRunView | None = None
        self.job_id = ""
        """The job's id, once the provider accepted it."""
        self._sync: SyncView | None = None

    def events(self) -> Iterator[SseEvent]:
        after = 0  # the number of the job's last event read
        try:
            stream = self._connect().events("/api/v1/apps/run", APP_RUN_EVENTS, "POST", self._body)
            for event in stream:
                if isinstance(event.view, AppRunView):
                    self.view = event.view
                    return
                if isinstance(event.view, SyncView):
                    self._sync = event.view
                elif isinstance(event.view, AcceptedView):
                    self.job_id = event.view.job_id
                if event.id is not None:
                    after = event.id
                yield event
        except NodeUnavailableError:
            sync = self._sync
            if not self.job_id or sync is None:
                raise AgentError(
                    "the node process stopped before the provider accepted the app's job: "
                    "`gpumesh jobs` shows whether it started; run `gpumesh app run` again "
                    "(the sync sends only what changed)"
                ) from None
            # The stream broke after the acceptance: the job goes on where it is.
            log = "its log, logs/node.log in your GPUMesh home"
            job = yield from job_events(self._connect, self.job_id, log, after=after)
            self.view = self._finish(sync, job)

    def _finish(self, sync: SyncView, job: JobResultView) -> AppRunView:
        """The app run's view once its job ended: with ``out``, its folder pulled back."""
        view = AppRunView(sync=sync, job=job, out_remote="", pulled=False)
        out = self._body.out
        if out is None:
            return view
        name = os.path.basename(os.path.normpath(out))
        view.out_remote = f"{sync.remote}/{name}"
        pull = AppPullBody(peer=self._body.peer, job=self.job_id, dir=out, folder=name)
        for attempt in range(2):
            try:
                self._connect().call("POST", "/api/v1/apps/pull", NoAnswer, pull)
            except NotFoundError:
                return view
            except NodeUnavailableError:
                if attempt:
                    raise AgentError(
                        f"the node process stopped while it pulled {view.out_remote}: "
                        f"`gpumesh app pull --peer {self._body.peer} --job {self.job_id} "
                        f"--dir DIR` pulls the app's folder"
                    ) from None
            else:
                view.pulled = True
                return view
        return view
