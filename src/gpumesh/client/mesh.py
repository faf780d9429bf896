"""``gpumesh.Mesh``: the Python API as one object, with sync methods and async twins.

A :class:`Mesh` stands for one home (``$GPUMESH_HOME``, else ``~/.gpumesh``):
its node's status, its peers, the jobs it submits and hosts, copies, apps and
groups. It owns no product logic: every method calls the client layer (the
functions the CLI calls) through a backend and returns the view structs of
:mod:`gpumesh.client.views` (what ``--json`` prints and the control API
returns), so a script sees the same shapes whichever way it reaches the home.

Backends: :class:`InProcess` runs the client layer in this process, with a
:class:`~gpumesh.client.node.Node` of the home. The one that talks to the
home's node process through its control API sits a floor higher, with the
public ``gpumesh.Mesh`` that chooses between the two
(:mod:`gpumesh.daemon.mesh`); both implement :class:`MeshBackend`, and nothing
above that line changes. This floor's :class:`Mesh` alone runs in-process.

Every method has an async twin whose name starts with ``a`` (``run``/``arun``).
The sync ones are for plain scripts: they run their twin on an event loop
this Mesh owns (one loop for its whole life, so a job's log iterator and the
sessions it holds stay on one loop from call to call). Called inside a running
event loop they refuse with a :class:`~gpumesh.errors.ConfigError` that names
the twin, rather than block that loop. Failures are the project's error tree
(:mod:`gpumesh.errors`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import weakref
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Generator,
    Iterator,
    Mapping,
    Sequence,
)
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from gpumesh.client.views.jobs import JobResultView
from gpumesh.errors import ConfigError

if TYPE_CHECKING:
    from gpumesh.client.jobs import JobEvent
    from gpumesh.client.jobspec import JobSpec
    from gpumesh.client.node import Node
    from gpumesh.client.views.apps import AppRunView
    from gpumesh.client.views.files import CopyView
    from gpumesh.client.views.groups import GroupListEntry, MemberStatusEntry
    from gpumesh.client.views.joblist import JobListEntry
    from gpumesh.client.views.node import StatusView
    from gpumesh.client.views.peers import PairView, PeerView

__all__ = ["Follow", "InProcess", "Job", "Mesh", "MeshBackend"]

T = TypeVar("T")


class Follow(Protocol):
    """A job's events, read once with ``async for``; :meth:`view`: where the job stood
    once they ran out."""

    def __aiter__(self) -> AsyncIterator[JobEvent]: ...

    async def aclose(self) -> None: ...

    def view(self) -> JobResultView: ...


class MeshBackend(Protocol):
    """Where a :class:`Mesh` sends its calls: the client layer in this process, or
    (later) the home's node process. Each returns the client layer's view structs."""

    async def status(self, *, refresh: bool) -> StatusView: ...

    async def peers(self) -> list[PeerView]: ...

    async def pair(self, code: str, *, rekey: bool, check: bool) -> PairView: ...

    async def run(self, spec: JobSpec, *, detach: bool, wait: float = 0) -> JobResultView: ...

    def events(self, job_id: str, *, follow: bool) -> Follow:
        """A job's events from its start (``follow``: until it ends)."""
        ...

    async def cancel(self, job_id: str) -> JobResultView: ...

    async def jobs(self, *, limit: int, refresh: bool) -> list[JobListEntry]: ...

    async def job(self, job_id: str) -> JobResultView:
        """Where a job (an id or a unique prefix) stands as last recorded."""
        ...

    async def cp(self, source: str, destination: str, *, retries: int) -> CopyView: ...

    async def app_run(
        self, peer: str, folder: Path, spec: JobSpec, *, out: Path | None
    ) -> AppRunView: ...

    async def groups(self) -> list[GroupListEntry]: ...

    async def group_status(self, name: str, *, live: bool) -> list[MemberStatusEntry]: ...

    def close(self) -> None: ...


class InProcess:
    """The client layer in this process, for one home."""

    def __init__(self, home: str | Path | None) -> None:
        from gpumesh.client.node import Node

        self.node: Node = Node(home)

    def close(self) -> None:
        self.node.close()

    async def status(self, *, refresh: bool) -> StatusView:
        from gpumesh.client.views.node import StatusView

        node = self.node
        unknown = 0
        if refresh and node.home.store.unconfirmed_submitted_jobs():
            from gpumesh.client.jobrefresh import refresh_jobs

            unconfirmed: set[str] = set()
            for answer in await refresh_jobs(node):
                unconfirmed |= answer.job_ids
            unknown = len(unconfirmed)
        return StatusView.of(node.status(), submitted_unknown=unknown)

    async def peers(self) -> list[PeerView]:
        from gpumesh.client.views.peers import PeerView

        return [PeerView.of(peer) for peer in self.node.peers()]

    async def pair(self, code: str, *, rekey: bool, check: bool) -> PairView:
        from gpumesh.client.views.peers import PairView

        peer = self.node.pair(code, rekey=rekey)
        checked = await self.node.check_paired_back(peer.name) if check else None
        return PairView.of(peer, checked)

    async def run(self, spec: JobSpec, *, detach: bool, wait: float = 0) -> JobResultView:
        from gpumesh.client.jobs import run_job

        # In this process no keeper runs: a job no provider takes now is refused.
        return JobResultView.of(await run_job(self.node, spec, detach=detach, wait=wait))

    def events(self, job_id: str, *, follow: bool) -> Follow:
        from gpumesh.client.jobs import logs

        return logs(self.node, job_id, follow=follow)

    async def cancel(self, job_id: str) -> JobResultView:
        from gpumesh.client.jobs import cancel

        return JobResultView.of(await cancel(self.node, job_id))

    async def jobs(self, *, limit: int, refresh: bool) -> list[JobListEntry]:
        from gpumesh.client.views.joblist import JobListEntry

        store = self.node.home.store
        unconfirmed: dict[str, str] = {}
        if refresh and store.unconfirmed_submitted_jobs(limit):
            from gpumesh.client.jobrefresh import refresh_jobs

            for answer in await refresh_jobs(self.node, limit=limit):
                unconfirmed.update(dict.fromkeys(answer.job_ids, answer.reason))
        return [JobListEntry.of(job, unconfirmed) for job in store.jobs(limit=limit)]

    async def job(self, job_id: str) -> JobResultView:
        from gpumesh.client.jobs import JobResult, find_job

        return JobResultView.of(JobResult.of_record(find_job(self.node, job_id)))

    async def cp(self, source: str, destination: str, *, retries: int) -> CopyView:
        from gpumesh.client.files import copy
        from gpumesh.client.views.files import CopyView

        return CopyView.of(await copy(self.node, source, destination, retries=retries))

    async def app_run(
        self, peer: str, folder: Path, spec: JobSpec, *, out: Path | None
    ) -> AppRunView:
        from gpumesh.client.apps import run_app
        from gpumesh.client.views.apps import AppRunView

        return AppRunView.of(await run_app(self.node, peer, folder, spec, out=out))

    async def groups(self) -> list[GroupListEntry]:
        from gpumesh.client.groups import summaries
        from gpumesh.client.views.groups import GroupListEntry

        return [GroupListEntry.of_summary(s) for s in summaries(self.node)]

    async def group_status(self, name: str, *, live: bool) -> list[MemberStatusEntry]:
        from gpumesh.client.groups import group_status
        from gpumesh.client.views.groups import MemberStatusEntry

        statuses = await group_status(self.node, name, live=live)
        return [MemberStatusEntry.of_status(s) for s in statuses]


class Mesh:
    """One home's node, its peers, jobs, copies, apps and groups, in this process.

    The public ``gpumesh.Mesh`` (:mod:`gpumesh.daemon.mesh`) is this with the
    choice of the home's node process; see there for ``in_process``.
    ``home``: the home folder (default ``$GPUMESH_HOME``, else ``~/.gpumesh``).

    Close it when done (``with Mesh() as mesh:``, or ``async with`` in async code).
    """

    def __init__(self, home: str | Path | None = None, *, in_process: bool | None = None) -> None:
        self._backend: MeshBackend = self._backend_for(home, in_process)
        self._runner: asyncio.Runner | None = None
        self._closer: weakref.finalize[[asyncio.Runner], Mesh] | None = None

    @staticmethod
    def _backend_for(home: str | Path | None, in_process: bool | None) -> MeshBackend:
        if in_process is False:
            raise ConfigError(
                "this Mesh runs in this process only: use gpumesh.Mesh for the node process"
            )
        return InProcess(home)

    # --- the sync face ------------------------------------------------------------------

    def _sync(self, name: str, twin: str, call: Awaitable[T]) -> T:
        """Run one async twin's coroutine on this Mesh's own loop."""
        _refuse_in_loop(name, twin, call)
        if self._runner is None:
            self._runner = asyncio.Runner()
            # A script that never calls close() leaves no unclosed loop behind.
            self._closer = weakref.finalize(self, _close_runner, self._runner)
        return self._runner.run(_awaited(call))

    def _iterate(self, name: str, twin: str, items: AsyncIterator[T]) -> Iterator[T]:
        """A sync iterator over an async one, each step on this Mesh's own loop."""
        _refuse_in_loop(name, twin)  # at the call, not at the first step
        return self._steps(name, twin, items)

    def _steps(self, name: str, twin: str, items: AsyncIterator[T]) -> Iterator[T]:
        try:
            while True:
                try:
                    item = self._sync(name, twin, anext(items))
                except StopAsyncIteration:
                    return
                yield item
        finally:
            # Left early (a break) or done: the follow's session closes on this loop.
            closing = getattr(items, "aclose", None)
            if closing is not None and self._runner is not None:
                self._runner.run(_awaited(closing()))

    def close(self) -> None:
        """Close the home's database and this Mesh's event loop."""
        if self._closer is not None:
            self._closer()
            self._runner = self._closer = None
        self._backend.close()

    def __enter__(self) -> Mesh:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()

    async def __aenter__(self) -> Mesh:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()

    # --- this node and its peers --------------------------------------------------------

    async def astatus(self, *, refresh: bool = True) -> StatusView:
        """This node: identity, sharing, GPUs, job counts, peers (``gpumesh status --json``).
        ``refresh``: first ask providers where unfinished submitted jobs stand."""
        return await self._backend.status(refresh=refresh)

    def status(self, *, refresh: bool = True) -> StatusView:
        return self._sync("status", "astatus", self.astatus(refresh=refresh))

    async def apeers(self) -> list[PeerView]:
        """The paired peers (``gpumesh peers --json``)."""
        return await self._backend.peers()

    def peers(self) -> list[PeerView]:
        return self._sync("peers", "apeers", self.apeers())

    async def apair(self, code: str, *, rekey: bool = False, check: bool = True) -> PairView:
        """Pair with a peer from its code (``gpumesh pair``); ``check``: dial it once to
        see whether it paired this node too (``paired_back``)."""
        return await self._backend.pair(code, rekey=rekey, check=check)

    def pair(self, code: str, *, rekey: bool = False, check: bool = True) -> PairView:
        return self._sync("pair", "apair", self.apair(code, rekey=rekey, check=check))

    # --- jobs ---------------------------------------------------------------------------

    async def arun(
        self,
        peer: str | None,
        command: Sequence[str] | str,
        *,
        image: str | None = None,
        workdir: str | Path | None = None,
        gpu_memory: str | int | None = None,
        env: Mapping[str, str] | None = None,
        mounts: Sequence[str] | None = None,
        group: str | None = None,
        retries: int = 0,
        timeout: str | float | None = None,
        detach: bool = True,
        outputs: str = "",
        outputs_to: str | Path | None = None,
        wait: str | float = 0,
        max_moves: int | None = None,
    ) -> Job:
        """Run ``command`` on ``peer`` (or, with ``peer=None`` and ``group``, on the best
        member of a group), as ``gpumesh run`` does, and return its :class:`Job`.

        ``command``: a list, or a string split as a shell would split it (no shell
        runs it). ``gpu_memory``: ``"8GB"`` or bytes. ``mounts``: ``"NAME:/target"``
        or ``"NAME:/target:rw"``, as ``--mount``. ``timeout``: seconds or ``"30m"``.
        ``detach`` (the default): return once the provider accepted the job;
        otherwise once it ended. ``outputs``: a container path whose finished files
        come home (``--outputs``), into ``outputs_to`` (default
        ``./gpumesh-outputs/JOB_ID``). ``wait``: seconds or ``"30m"`` the job may wait
        in the node process's queue when no provider can take it now (``--wait``).
        ``max_moves``: with ``group``, moves allowed (``--max-moves``, default 3).
        """
        from gpumesh.client.jobspec import build_spec, queue_wait

        spec = build_spec(
            None,
            image=image,
            command=shlex.split(command) if isinstance(command, str) else list(command),
            env_items=[f"{key}={value}" for key, value in (env or {}).items()],
            workdir=workdir,
            gpu_memory=gpu_memory,
            retries=retries,
            timeout=timeout,
            peer=peer,
            group=group,
            mounts=mounts,
            **_outputs_here(outputs, outputs_to),
            max_moves=max_moves,
        )
        return Job(self, await self._backend.run(spec, detach=detach, wait=queue_wait(wait)))

    def run(
        self,
        peer: str | None,
        command: Sequence[str] | str,
        *,
        image: str | None = None,
        workdir: str | Path | None = None,
        gpu_memory: str | int | None = None,
        env: Mapping[str, str] | None = None,
        mounts: Sequence[str] | None = None,
        group: str | None = None,
        retries: int = 0,
        timeout: str | float | None = None,
        detach: bool = True,
        outputs: str = "",
        outputs_to: str | Path | None = None,
        wait: str | float = 0,
        max_moves: int | None = None,
    ) -> Job:
        call = self.arun(
            peer,
            command,
            image=image,
            workdir=workdir,
            gpu_memory=gpu_memory,
            env=env,
            mounts=mounts,
            group=group,
            retries=retries,
            timeout=timeout,
            detach=detach,
            outputs=outputs,
            outputs_to=outputs_to,
            wait=wait,
            max_moves=max_moves,
        )
        return self._sync("run", "arun", call)

    async def ajobs(self, *, limit: int = 20, refresh: bool = True) -> list[JobListEntry]:
        """Jobs this node submitted and hosted, newest first (``gpumesh jobs --json``).
        ``refresh``: first ask providers where unfinished submitted jobs stand."""
        return await self._backend.jobs(limit=limit, refresh=refresh)

    def jobs(self, *, limit: int = 20, refresh: bool = True) -> list[JobListEntry]:
        return self._sync("jobs", "ajobs", self.ajobs(limit=limit, refresh=refresh))

    async def ajob(self, job_id: str) -> Job:
        """A job this node submitted or hosts, by its id or a unique prefix."""
        return Job(self, await self._backend.job(job_id))

    def job(self, job_id: str) -> Job:
        return self._sync("job", "ajob", self.ajob(job_id))

    # --- files, apps, groups ------------------------------------------------------------

    async def acp(self, source: str, destination: str, *, retries: int = 3) -> CopyView:
        """Copy a file or folder between here and a peer's sandbox; one side is
        ``PEER:PATH`` (``gpumesh cp``)."""
        return await self._backend.cp(source, destination, retries=retries)

    def cp(self, source: str, destination: str, *, retries: int = 3) -> CopyView:
        return self._sync("cp", "acp", self.acp(source, destination, retries=retries))

    async def aapp_run(
        self,
        peer: str,
        folder: str | Path,
        command: Sequence[str] | str,
        *,
        image: str | None = None,
        gpu_memory: str | int | None = None,
        env: Mapping[str, str] | None = None,
        retries: int = 0,
        timeout: str | float | None = None,
        out: str | Path | None = None,
        mounts: Sequence[str] | None = None,
    ) -> AppRunView:
        """Sync ``folder`` to ``peer``, run ``command`` in it to the end and, with
        ``out``, pull the app's folder named like ``out`` back into it
        (``gpumesh app run``). ``mounts``: folders of this node's sandbox on the
        peer, as in :meth:`run` (``--mount``). The job's output:
        ``mesh.job(view.job.job_id).logs()``."""
        from gpumesh.client.jobspec import build_spec

        spec = build_spec(
            None,
            image=image,
            command=shlex.split(command) if isinstance(command, str) else list(command),
            env_items=[f"{key}={value}" for key, value in (env or {}).items()],
            gpu_memory=gpu_memory,
            retries=retries,
            timeout=timeout,
            peer=peer,
            mounts=mounts,
        )
        where = None if out is None else Path(out)
        return await self._backend.app_run(peer, Path(folder), spec, out=where)

    def app_run(
        self,
        peer: str,
        folder: str | Path,
        command: Sequence[str] | str,
        *,
        image: str | None = None,
        gpu_memory: str | int | None = None,
        env: Mapping[str, str] | None = None,
        retries: int = 0,
        timeout: str | float | None = None,
        out: str | Path | None = None,
        mounts: Sequence[str] | None = None,
    ) -> AppRunView:
        call = self.aapp_run(
            peer,
            folder,
            command,
            image=image,
            gpu_memory=gpu_memory,
            env=env,
            retries=retries,
            timeout=timeout,
            out=out,
            mounts=mounts,
        )
        return self._sync("app_run", "aapp_run", call)

    async def agroups(self) -> list[GroupListEntry]:
        """The groups this node is in (``gpumesh group list --json``)."""
        return await self._backend.groups()

    def groups(self) -> list[GroupListEntry]:
        return self._sync("groups", "agroups", self.agroups())

    async def agroup_status(self, name: str, *, live: bool = True) -> list[MemberStatusEntry]:
        """Every member of a group and, with ``live``, where each usable one stands now
        (``gpumesh group status --json``)."""
        return await self._backend.group_status(name, live=live)

    def group_status(self, name: str, *, live: bool = True) -> list[MemberStatusEntry]:
        return self._sync("group_status", "agroup_status", self.agroup_status(name, live=live))


class Job:
    """A job this node submitted or hosts: read its output, wait for it, cancel it.

    ``result`` is where it stood when last seen (updated by ``logs``, ``wait``
    and ``cancel``). A job's output stays with its provider, so ``logs`` reads
    it from the start however late it is called.
    """

    def __init__(self, mesh: Mesh, result: JobResultView) -> None:
        self._mesh = mesh
        self.result = result

    def __repr__(self) -> str:
        return f"Job({self.id!r}, peer={self.peer!r}, state={self.result.state.value!r})"

    @property
    def id(self) -> str:
        return self.result.job_id

    @property
    def peer(self) -> str:
        """The provider (a submitted job) or the submitter (a hosted one)."""
        return self.result.peer

    async def aevents(self, *, follow: bool = True) -> AsyncGenerator[JobEvent, None]:
        """The job's events from its start: output, state changes, output the provider
        dropped, reconnects (:data:`gpumesh.client.jobs.JobEvent`). ``follow``: until
        the job ends, else what there is now."""
        events = self._mesh._backend.events(self.id, follow=follow)
        async with contextlib.aclosing(events):
            async for event in events:
                yield event
        self.result = events.view()

    def events(self, *, follow: bool = True) -> Iterator[JobEvent]:
        return self._mesh._iterate("events", "aevents", self.aevents(follow=follow))

    async def alogs(self, *, follow: bool = True, stderr: bool = True) -> AsyncGenerator[str, None]:
        """The job's output as lines of text (no line ends), from its start, stdout
        and stderr as they came (``stderr=False``: stdout only). ``follow``: until
        the job ends, else what there is now."""
        from gpumesh.client.jobs import Output

        lines = _Lines()
        async with contextlib.aclosing(self.aevents(follow=follow)) as events:
            async for event in events:
                if isinstance(event, Output) and (stderr or event.stream == "stdout"):
                    for line in lines.add(event.stream, event.data):
                        yield line
        for line in lines.rest():
            yield line

    def logs(self, *, follow: bool = True, stderr: bool = True) -> Iterator[str]:
        return self._mesh._iterate("logs", "alogs", self.alogs(follow=follow, stderr=stderr))

    async def await_(self) -> JobResultView:
        """Wait for the job to end (the async twin of :meth:`wait`; ``await job`` too):
        where it ended, with ``state`` and ``exit_code``."""
        if not self.result.final:
            async with contextlib.aclosing(self.aevents(follow=True)) as events:
                async for _ in events:
                    pass
        return self.result

    def __await__(self) -> Generator[Any, None, JobResultView]:
        return self.await_().__await__()

    def wait(self) -> JobResultView:
        return self._mesh._sync("wait", "await_", self.await_())

    async def acancel(self) -> JobResultView:
        """Cancel the job (its provider stops it; a hosted one: this home's agent)."""
        self.result = await self._mesh._backend.cancel(self.id)
        return self.result

    def cancel(self) -> JobResultView:
        return self._mesh._sync("cancel", "acancel", self.acancel())


class _Lines:
    """Output bytes into lines, per stream: a line split across two chunks is whole."""

    def __init__(self) -> None:
        self._partial: dict[str, bytes] = {}

    def add(self, stream: str, data: bytes) -> list[str]:
        *whole, rest = (self._partial.pop(stream, b"") + data).split(b"\n")
        if rest:
            self._partial[stream] = rest
        return [_text(line) for line in whole]

    def rest(self) -> list[str]:
        left = [_text(part) for part in self._partial.values()]
        self._partial.clear()
        return left


def _text(line: bytes) -> str:
    return line.removesuffix(b"\r").decode("utf-8", errors="replace")


def _refuse_in_loop(name: str, twin: str, call: Awaitable[Any] | None = None) -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    if asyncio.iscoroutine(call):
        call.close()  # never awaited: no "coroutine was never awaited" warning
    raise ConfigError(
        f"{name}() cannot block inside a running event loop: use `await ...{twin}(...)` "
        f"(or `async for ... in ...{twin}(...)`) in async code"
    )


async def _awaited(call: Awaitable[T]) -> T:
    return await call


def _close_runner(runner: asyncio.Runner) -> None:
    """Close a Mesh's own loop, also when the Mesh is collected while another loop runs
    in this thread (a Mesh dropped inside async code): that loop cannot run ours to
    shut it down, so ours is only closed."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        runner.close()
        return
    loop = runner.get_loop()
    if not loop.is_running() and not loop.is_closed():
        loop.close()


def _outputs_here(outputs: str, outputs_to: str | Path | None) -> dict[str, Any]:
    """``outputs`` with where they go, as absolute folders of this process (the node
    process works elsewhere): ``outputs_to``, else ``./gpumesh-outputs/JOB_ID``."""
    if not outputs:
        return {"outputs": ""}
    if outputs_to:
        return {"outputs": outputs, "outputs_to": os.path.abspath(outputs_to)}
    return {"outputs": outputs, "outputs_under": os.path.abspath("gpumesh-outputs")}
