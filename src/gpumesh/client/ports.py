"""A job's ports on this machine's loopback: ``run --port`` and ``gpumesh port``.

Owns the consumer's end of a job's forwarded ports. For each ``LOCAL:CONTAINER`` it
listens on 127.0.0.1:LOCAL (only this user's programs are taken, as the desktop
tunnel takes them) and carries each connection to CONTAINER in the job's container
(``PortOpen``), as :mod:`gpumesh.client.localport` carries one. Beside them, one
``watch`` stream per port asks the provider whether the port listens; its first
answer is the refusal, if any (not this node's job, ended, an agent that cannot
enter containers), its next says the port answers now, and its refusal later
ends every forward with the job (a cancel, a deny, its end).

Only the node that submitted a job may forward its ports: the provider checks
that the request comes from the job's submitter. Nothing here prints.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpumesh.client.jobs import SUBMITTED, find_job
from gpumesh.client.localport import (
    OwnerLookup,
    Way,
    accept_loop,
    carry_connection,
    owner_lookup,
    same_user,
)
from gpumesh.errors import (
    AccessDeniedError,
    GPUMeshError,
    InUseError,
    NotFoundError,
    TransportError,
)
from gpumesh.protocol.messages import PortOpen, PortOpened
from gpumesh.protocol.ports import PortSpec
from gpumesh.protocol.states import FINAL_STATES
from gpumesh.transport.sealing import FRAMING_VERSION

if TYPE_CHECKING:
    from gpumesh.client.node import Node
    from gpumesh.transport.stream import Stream

__all__ = ["ForwardReady", "Forwards", "forward_ports", "local_ports_free"]

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"


@dataclass(frozen=True)
class ForwardReady:
    """The forwards listen: what to tell the user."""

    job_id: str
    provider: str
    ports: list[PortSpec]
    listening: list[int]
    """The container ports that listen already (the others: once they do)."""
    owner_checked: bool
    """True: connections from other users' processes are refused (Linux)."""


@dataclass
class Forwards:
    """The forwards this node process holds now, by job (the dashboard links them)."""

    jobs: dict[str, list[PortSpec]] = field(default_factory=dict)

    def add(self, job_id: str, specs: list[PortSpec]) -> None:
        self.jobs.setdefault(job_id, []).extend(specs)

    def remove(self, job_id: str, specs: list[PortSpec]) -> None:
        held = [spec for spec in self.jobs.get(job_id, []) if spec not in specs]
        if held:
            self.jobs[job_id] = held
        else:
            self.jobs.pop(job_id, None)


FORWARDS = Forwards()
"""This process's forwards (one node process serves one home)."""


def local_ports_free(specs: list[PortSpec]) -> None:
    """Raise, naming it, when a local port of ``specs`` is taken here (``run`` asks
    before it submits; the forward itself binds it later)."""
    for spec in specs:
        _bind(spec).close()


def _bind(spec: PortSpec) -> socket.socket:
    try:
        listener = socket.create_server((HOST, spec.local))
    except OSError as exc:
        raise InUseError(
            f"cannot listen on {HOST}:{spec.local}: {exc.strerror or exc}; pick another "
            f"local port: --port OTHER:{spec.container}"
        ) from None
    listener.setblocking(False)
    return listener


async def forward_ports(
    node: Node,
    job_id: str,
    specs: list[PortSpec],
    *,
    ready: Callable[[ForwardReady], None] = lambda _ready: None,
    answers: Callable[[PortSpec], None] = lambda _spec: None,
    refused_local: Callable[[int | None], None] = lambda _uid: None,
    connection_refused: Callable[[GPUMeshError], None] = lambda _error: None,
    carried: Callable[[str], None] = lambda _path: None,
    owner: OwnerLookup | None = None,
) -> None:
    """Forward ``specs`` of job ``job_id`` (an id or a unique prefix) to this machine's
    loopback until cancelled or the job ends (raised: why it ended).

    ``ready`` hears where it listens; ``answers`` of each container port once it first
    listens; ``refused_local`` of each local connection refused because another user's
    process made it; ``connection_refused`` of each one the provider refused (nothing
    listens there yet); ``carried`` of what carries each connection."""
    job = find_job(node, job_id)
    if job.role != SUBMITTED:
        raise AccessDeniedError(
            f"job {job.job_id} was not submitted from this node: only its submitter may "
            "forward its ports"
        )
    if job.state in FINAL_STATES:
        raise NotFoundError(f"job {job.job_id} has ended ({job.state})")
    if not job.peer_id:
        raise NotFoundError(f"job {job.job_id} waits in the queue: no provider runs it yet")
    lookup = owner_lookup(owner)
    target = node.peer(job.peer_id)
    listeners: list[socket.socket] = []
    try:
        for spec in specs:
            listeners.append(_bind(spec))
        async with node.session(target.node_id) as session:
            way = Way(node, target, session, carried)
            watches = [await _watch(session.open_stream(), job.job_id, spec) for spec in specs]
            await _serve(
                way,
                job.job_id,
                list(zip(specs, listeners, watches, strict=True)),
                ready=ready,
                answers=answers,
                refused_local=refused_local,
                connection_refused=connection_refused,
                lookup=lookup,
            )
    finally:
        for listener in listeners:
            listener.close()


async def _watch(stream: Stream, job_id: str, spec: PortSpec) -> tuple[Stream, bool]:
    """Ask the provider to watch ``spec``'s container port; raises its refusal."""
    stream.send_message(PortOpen(job_id=job_id, port=spec.container, watch=True))
    opened = await stream.expect(PortOpened)
    return stream, opened.listening


async def _serve(
    way: Way,
    job_id: str,
    forwards: list[tuple[PortSpec, socket.socket, tuple[Stream, bool]]],
    *,
    ready: Callable[[ForwardReady], None],
    answers: Callable[[PortSpec], None],
    refused_local: Callable[[int | None], None],
    connection_refused: Callable[[GPUMeshError], None],
    lookup: OwnerLookup | None,
) -> None:
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[GPUMeshError] = loop.create_future()
    connections: set[asyncio.Task[None]] = set()
    tasks: set[asyncio.Future[Any]] = set()

    def serve_to(spec: PortSpec) -> Callable[[socket.socket], Any]:
        async def serve(conn: socket.socket) -> None:
            task = asyncio.current_task()
            assert task is not None
            connections.add(task)
            try:
                if lookup is not None and not same_user(conn, lookup, refused_local):
                    conn.close()
                    return
                await carry_connection(
                    way,
                    conn,
                    lambda channel, sealing: PortOpen(
                        job_id=job_id, port=spec.container, channel=channel, sealing=sealing
                    ),
                    PortOpened,
                    FRAMING_VERSION,
                )
            except GPUMeshError as exc:
                if isinstance(exc, AccessDeniedError | NotFoundError) and not ended.done():
                    ended.set_result(exc)
                elif not isinstance(exc, TransportError):  # a reset is no refusal
                    logger.info("[job %s] a port connection was refused: %s", job_id, exc)
                    connection_refused(exc)
            finally:
                connections.discard(task)

        return serve

    async def follow(spec: PortSpec, stream: Stream, listening: bool) -> None:
        """The watch's later answers: the port listens now; the job's end."""
        try:
            while True:
                opened = await stream.expect(PortOpened)
                if opened.listening and not listening:
                    listening = True
                    answers(spec)
        except GPUMeshError as exc:
            if not ended.done():
                ended.set_result(exc)

    for spec, listener, _watched in forwards:
        tasks.add(asyncio.create_task(accept_loop(listener, serve_to(spec), connections, "port")))
    specs = [spec for spec, _listener, _watch in forwards]
    FORWARDS.add(job_id, specs)
    closed = asyncio.ensure_future(way.session.link.wait_closed())
    try:
        ready(
            ForwardReady(
                job_id,
                way.peer.name,
                specs,
                [spec.container for spec, _l, (_s, listening) in forwards if listening],
                lookup is not None,
            )
        )
        for spec, _listener, (stream, listening) in forwards:
            if listening:
                answers(spec)
            tasks.add(asyncio.create_task(follow(spec, stream, listening)))
        waits: set[asyncio.Future[Any]] = {closed, ended, *tasks}
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task not in (closed, ended):
                task.result()  # a listener failed
        raise (ended.result() if ended in done else closed.result())
    finally:
        FORWARDS.remove(job_id, specs)
        closed.cancel()
        for _spec, _listener, (stream, _l) in forwards:
            with contextlib.suppress(GPUMeshError):
                stream.finish()
            way.session.link.forget_stream(stream.stream_id)
        for pending in (*tasks, *connections):
            pending.cancel()
        for pending in (*tasks, *connections):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pending
