"""``gpumesh.Mesh`` through the home's node process: the control API over
``control.sock``, with the same methods and the same view structs as in-process.

:class:`Mesh` is the public one: it picks its backend (:class:`ThroughNode`, as
the CLI; :class:`~gpumesh.client.mesh.InProcess` with ``in_process=True``). It
lives on this floor because it talks to the node process; everything else is
:class:`gpumesh.client.mesh.Mesh`'s.

:class:`ThroughNode` sends each call as one request of the standard-library
client (:mod:`gpumesh.daemon.client`, in a worker thread so the caller's loop
never blocks), starting the node process when none runs. Answers are
converted to the view structs; an error answer's ``{code, message}`` is raised
as the error tree's class. A job's events come from the API's event stream
and are turned back into the client layer's events; a node process that dies
under a follow is replaced and the follow resumes after the last numbered
event, so no line is lost or repeated. Local paths (a workdir, a copy's local
side) are made absolute here: the node process has another working folder.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import quote

from gpumesh.client import mesh as base
from gpumesh.client.bodies import (
    AppRunBody,
    CancelBody,
    CopyBody,
    PairBody,
    job_body,
    job_options,
)
from gpumesh.client.views.jobs import (
    Dropped,
    JobResultView,
    Moved,
    Output,
    Reconnecting,
    Status,
)
from gpumesh.daemon.client import LOG_NAME, job_events
from gpumesh.errors import AgentError, NotInitializedError, error_from_code

if TYPE_CHECKING:
    from gpumesh.client.jobs import JobEvent
    from gpumesh.client.jobspec import JobSpec
    from gpumesh.client.views.apps import AppRunView
    from gpumesh.client.views.files import CopyView
    from gpumesh.client.views.groups import GroupListEntry, MemberStatusEntry
    from gpumesh.client.views.joblist import JobListEntry
    from gpumesh.client.views.node import StatusView
    from gpumesh.client.views.peers import PairView, PeerView
    from gpumesh.daemon.client import NodeClient

__all__ = ["Mesh", "ThroughNode"]

T = TypeVar("T")


class Mesh(base.Mesh):
    """One home's node, its peers, jobs, copies, apps and groups.

    ``home``: the home folder (default ``$GPUMESH_HOME``, else ``~/.gpumesh``).
    ``in_process``: not true (the default) talks to the home's node process over
    its ``control.sock``, starting it in the background when none runs, as the
    CLI does; True runs the client layer in this process instead (the same one
    implementation the node process runs).

    Close it when done (``with Mesh() as mesh:``, or ``async with`` in async code).
    """

    @staticmethod
    def _backend_for(home: str | Path | None, in_process: bool | None) -> base.MeshBackend:
        return base.InProcess(home) if in_process else ThroughNode(home)


class ThroughNode:
    """The client layer in the home's node process, over its control API."""

    def __init__(self, home: str | Path | None) -> None:
        from gpumesh.settings import home_dir

        self.home = home_dir(home)
        self._client: NodeClient | None = None

    def close(self) -> None:
        pass

    # --- requests ---------------------------------------------------------------------

    def _connect(self) -> NodeClient:
        from gpumesh.daemon.client import connect

        if not (self.home / "identity.key").exists():
            raise NotInitializedError(
                f"no GPUMesh node in {self.home}: run `gpumesh init --name NAME` first "
                "(or set GPUMESH_HOME to your node's folder)"
            )
        self._client = connect(self.home)
        return self._client

    def _call_sync(self, kind: type[T], method: str, path: str, body: object) -> T:
        from gpumesh.daemon.client import NodeUnavailableError

        if method != "GET":
            # A change is sent once: to a node process just seen answering (one that
            # went idle or died since the last call is replaced first).
            return self._connect().call(method, path, kind, body)
        client = self._client or self._connect()
        try:
            return client.call(method, path, kind, body)
        except NodeUnavailableError:
            # It died or went idle since: the next one is started, once.
            return self._connect().call(method, path, kind, body)

    async def _get(self, kind: type[T], method: str, path: str, body: object = None) -> T:
        return await asyncio.to_thread(self._call_sync, kind, method, path, body)

    # --- the backend --------------------------------------------------------------------

    async def status(self, *, refresh: bool) -> StatusView:
        from gpumesh.client.views.node import StatusView

        return await self._get(StatusView, "GET", f"/api/v1/status?{_offline(refresh)}")

    async def peers(self) -> list[PeerView]:
        from gpumesh.client.views.peers import PeerView

        return await self._get(list[PeerView], "GET", "/api/v1/peers")

    async def pair(self, code: str, *, rekey: bool, check: bool) -> PairView:
        from gpumesh.client.views.peers import PairView

        body = PairBody(code=code, rekey=rekey, offline=not check)
        return await self._get(PairView, "POST", "/api/v1/peers/pair", body)

    async def run(self, spec: JobSpec, *, detach: bool, wait: float = 0) -> JobResultView:
        body = job_body(spec, wait=wait)
        accepted = await self._get(JobResultView, "POST", "/api/v1/jobs", body)
        if detach:
            return accepted
        follow = self.events(accepted.job_id, follow=True)
        async with contextlib.aclosing(follow):
            async for _ in follow:
                pass
        return follow.view()

    def events(self, job_id: str, *, follow: bool) -> NodeFollow:
        return NodeFollow(self, job_id, follow)

    async def cancel(self, job_id: str) -> JobResultView:
        path = f"/api/v1/jobs/{_q(job_id)}/cancel"
        return await self._get(JobResultView, "POST", path, CancelBody())

    async def jobs(self, *, limit: int, refresh: bool) -> list[JobListEntry]:
        from gpumesh.client.views.joblist import JobListEntry

        path = f"/api/v1/jobs?limit={limit}&{_offline(refresh)}"
        return await self._get(list[JobListEntry], "GET", path)

    async def job(self, job_id: str) -> JobResultView:
        from gpumesh.client.views.joblist import JobListEntry
        from gpumesh.protocol.states import FINAL_STATES, JobRole, JobState

        entry = await self._get(JobListEntry, "GET", f"/api/v1/jobs/{_q(job_id)}")
        state = JobState(entry.state)
        return JobResultView(
            job_id=entry.job_id,
            peer=entry.peer,
            role=JobRole(entry.role),
            state=state,
            final=state in FINAL_STATES,
            exit_code=entry.exit_code,
            attempt=entry.attempt,
            message=entry.message,
            gpus=list(entry.gpus),
            output_dropped=entry.output_dropped,
        )

    async def cp(self, source: str, destination: str, *, retries: int) -> CopyView:
        from gpumesh.client.views.files import CopyView

        body = CopyBody(
            source=_absolute(source), destination=_absolute(destination), retries=retries
        )
        return await self._get(CopyView, "POST", "/api/v1/copies", body)

    async def app_run(
        self, peer: str, folder: Path, spec: JobSpec, *, out: Path | None
    ) -> AppRunView:
        from gpumesh.daemon.apprun import NodeAppRun

        body = AppRunBody(
            peer=peer,
            dir=_local(folder),
            out=None if out is None else _local(out),
            command=spec.command,
            **job_options(spec),
        )
        run = NodeAppRun(self._connect, body)

        def whole() -> AppRunView:
            for _ in run.events():
                pass
            assert run.view is not None  # the events ran out: the view is there
            return run.view

        return await asyncio.to_thread(whole)

    async def groups(self) -> list[GroupListEntry]:
        from gpumesh.client.views.groups import GroupListEntry

        return await self._get(list[GroupListEntry], "GET", "/api/v1/groups")

    async def group_status(self, name: str, *, live: bool) -> list[MemberStatusEntry]:
        from gpumesh.client.views.groups import MemberStatusEntry

        path = f"/api/v1/groups/{_q(name)}/members?{_offline(live)}"
        return await self._get(list[MemberStatusEntry], "GET", path)


class NodeFollow:
    """A job's events through the node process's event stream
    (:func:`~gpumesh.daemon.client.job_events`), as the client layer's events;
    ``view()`` is where the job stood at the stream's end."""

    def __init__(self, backend: ThroughNode, job_id: str, follow: bool) -> None:
        self._backend = backend
        self._job_id = job_id
        self._reconnect = False
        log = str(backend.home / "logs" / LOG_NAME)
        self._stream = job_events(self._connect, job_id, log, live=follow)
        self._end: JobResultView | None = None

    def __aiter__(self) -> AsyncIterator[JobEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[JobEvent]:
        while (event := await asyncio.to_thread(self._next)) is not None:
            yield event

    def _connect(self) -> NodeClient:
        # The first stream asks the node process just seen answering; one after a
        # failure, the next one started.
        client = None if self._reconnect else self._backend._client
        self._reconnect = True
        return client or self._backend._connect()

    def _next(self) -> JobEvent | None:
        """The next event (None: the stream ended)."""
        while True:
            try:
                item = next(self._stream)
            except StopIteration as end:
                self._end = end.value
                return None
            converted = _event(self._job_id, item.view)
            if converted is not None:
                return converted

    async def aclose(self) -> None:
        with contextlib.suppress(ValueError):  # a step still under way in its thread
            self._stream.close()

    def view(self) -> JobResultView:
        if self._end is None:
            raise AgentError(f"the follow of job {self._job_id} did not reach its end")
        return self._end


def _event(job_id: str, view: object) -> JobEvent | None:
    """An event stream's event as the client layer's (None: one of no kind known)."""
    from gpumesh.client import jobs
    from gpumesh.protocol.messages import JobStatus

    if isinstance(view, Output):
        return jobs.Output(view.stream, base64.b64decode(view.data))
    if isinstance(view, Status):
        status = JobStatus(
            job_id=job_id,
            seq=view.seq,
            state=str(view.state),
            attempt=view.attempt,
            exit_code=view.exit_code,
            message=view.message,
            exited=view.exited,
        )
        return jobs.StatusChanged(status, view.exited)
    if isinstance(view, Dropped):
        return jobs.OutputDropped(view.count)
    if isinstance(view, Reconnecting):
        return jobs.Reconnecting(error_from_code(view.code, view.message))
    if isinstance(view, Moved):
        return jobs.Moved(view.left, view.to, view.attempt, view.reason, view.unread)
    return None


def _q(text: str) -> str:
    return quote(text, safe="")


def _offline(live: bool) -> str:
    return f"offline={'false' if live else 'true'}"


def _absolute(location: str) -> str:
    """A copy's side with a local path made absolute (``PEER:PATH`` as it is)."""
    from gpumesh.client.files import parse_location

    return location if parse_location(location).peer is not None else _local(location)


def _local(path: str | Path) -> str:
    return str(Path(path).expanduser().absolute())
