"""A job's forwarded ports, the provider's side: ``PortOpen`` reaches one port of the
container of a job its submitter runs here, and nothing else.

Only the peer that submitted the job may ask, only while the job is not over, and
only ever 127.0.0.1 inside the job's own network namespace: the socket is made in
that namespace (``setns`` in a thread of its own, which ends after) and connected
there, so the provider's host, its other containers and the job network are out of
reach whatever the job listens on, and a job on ``job_network none`` is reached
too. Entering a namespace takes root: an agent that is not refuses, saying why.

A ``watch`` request connects nothing: it is answered at once (whether the port
listens, read from the namespace's socket table), again once the port listens, and
refused when the job ends, so the consumer's forward ends with the job; a deny
closes the peer's link and every forward with it. Each connection is carried as
:mod:`gpumesh.agent.tcpserve` carries one.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import msgspec

from gpumesh.agent.tcpserve import ChannelSource, carry, channel_listener, sealing_for, take_channel
from gpumesh.blocking import closing_in_thread, in_thread
from gpumesh.errors import AgentError, GPUMeshError, NotFoundError
from gpumesh.protocol.messages import PortOpen, PortOpened
from gpumesh.protocol.states import FINAL_STATES, JobState
from gpumesh.transport.sealing import FRAMING_VERSION
from gpumesh.transport.sockowner import parse_listeners

if TYPE_CHECKING:
    from gpumesh.agent.deps import Handlers, Provider, RequestContext
    from gpumesh.store.jobs import JobRecord
    from gpumesh.store.peers import Peer

__all__ = ["PortJobs", "PortService", "can_enter_namespaces", "in_container"]

logger = logging.getLogger(__name__)

_CLONE_NEWNET = 0x40000000
_CONNECT_TIMEOUT = 10.0
WATCH_EVERY = 0.5
"""Seconds between looks at a watched job (its state, whether its port listens)."""
_REACHES_LOOPBACK = {"127.0.0.1", "0.0.0.0", "::", "::1"}


class PortJobs(Protocol):
    """What the service asks of the job service."""

    def owned(self, peer: Peer, job_id: str) -> JobRecord: ...

    async def wait_changed(self, timeout: float) -> None: ...


def can_enter_namespaces() -> bool:
    """Whether this process may enter a container's network namespace (root, Linux)."""
    return hasattr(os, "geteuid") and os.geteuid() == 0 and Path("/proc/self/ns/net").exists()


class PortService:
    """Connections to the ports of the jobs this agent runs."""

    def __init__(
        self,
        provider: Provider,
        jobs: PortJobs,
        pids: Callable[[str], list[int]],
        *,
        channels: ChannelSource | None = None,
        enter: Callable[[], bool] = can_enter_namespaces,
    ) -> None:
        self.provider = provider
        self.jobs = jobs
        self.pids = pids
        """The host pids of a container's processes (blocking: the engine is asked)."""
        self.channels = channels
        self.enter = enter
        self.framing = FRAMING_VERSION
        self._pids: dict[str, int] = {}
        """A process of each container seen (its network namespace is the job's)."""

    def register(self, handlers: Handlers) -> None:
        handlers.add(PortOpen, self.handle_open)

    # --- checks ---------------------------------------------------------------------------

    def _running(self, peer: Peer, job_id: str) -> JobRecord:
        job = self.jobs.owned(peer, job_id)
        if job.state in FINAL_STATES:
            raise NotFoundError(f"job {job_id} on {self.provider.name} has ended ({job.state})")
        return job

    async def _pid(self, job: JobRecord, port: int) -> int:
        """A process of the job's container now; refused while it has none."""
        container = job.container_id
        pid = self._pids.get(container) if container else None
        if pid is not None and in_container(pid, container):
            return pid
        pids = await in_thread(self.pids, container) if container else []
        if job.state is not JobState.RUNNING or not pids:
            raise AgentError(f"nothing listens on {port} in job {job.job_id} yet (not running)")
        self._pids = {c: p for c, p in self._pids.items() if in_container(p, c)}
        self._pids[container] = pids[0]
        return pids[0]

    def _listening(self, pid: int, container: str, port: int) -> bool:
        if not in_container(pid, container):
            return False
        found: set[tuple[str, int]] = set()
        for table in ("tcp", "tcp6"):
            with contextlib.suppress(OSError):
                found |= parse_listeners(Path(f"/proc/{pid}/net/{table}").read_text())
        return any(p == port and host in _REACHES_LOOPBACK for host, p in found)

    # --- the request ----------------------------------------------------------------------

    async def handle_open(self, ctx: RequestContext, message: PortOpen) -> None:
        job = self._running(ctx.peer, message.job_id)
        if not self.enter():
            raise AgentError(
                f"{self.provider.name} cannot reach ports inside its containers: its agent "
                "does not run as root; run the job without --port"
            )
        if message.watch:
            await self._watch(ctx, message)
            return
        pid = await self._pid(job, message.port)
        server = await self._connect(pid, job, message.port)
        listener = channel_listener(self.channels, ctx) if message.channel else None
        framing = sealing_for(listener, ctx, self.framing, message.sealing)
        reply = PortOpened(provider=self.provider.name)
        if listener is not None:
            reply = msgspec.structs.replace(
                reply, channel_port=listener.port, channel_ticket=listener.ticket, sealing=framing
            )
        try:
            ctx.stream.send_message(reply)
            channel = (
                await take_channel(ctx, listener, "forwarded port")
                if listener is not None
                else None
            )
        except BaseException:
            server.close()
            if listener is not None:
                listener.close()
            raise
        logger.info(
            "[%s] [job %s] opened port %d (over %s)",
            ctx.peer.name,
            job.job_id,
            message.port,
            "a data channel" if channel is not None else "QUIC",
        )
        sealed_to = ctx.link.binding if channel is not None and framing else None
        try:
            await carry(ctx.stream, server, channel, sealed_to)
        except GPUMeshError as exc:
            logger.info("[%s] [job %s] port connection ended: %s", ctx.peer.name, job.job_id, exc)

    async def _connect(self, pid: int, job: JobRecord, port: int) -> socket.socket:
        job_id = job.job_id
        try:
            sock = await closing_in_thread(_socket_in, pid, job.container_id)
        except OSError as exc:
            raise AgentError(
                f"{self.provider.name} could not enter job {job_id}'s network: "
                f"{exc.strerror or exc}"
            ) from None
        sock.setblocking(False)
        try:
            async with asyncio.timeout(_CONNECT_TIMEOUT):
                await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        except (OSError, TimeoutError):
            sock.close()
            raise AgentError(f"nothing listens on {port} in job {job_id} yet") from None
        except BaseException:
            sock.close()
            raise
        return sock

    async def _watch(self, ctx: RequestContext, message: PortOpen) -> None:
        """Say whether the port listens, again once it does; refuse once the job ends
        (or return when the consumer leaves)."""
        told: bool | None = None
        leaving = asyncio.ensure_future(ctx.stream.read_message())
        try:
            while True:
                job = self._running(ctx.peer, message.job_id)
                listening = False
                with contextlib.suppress(AgentError):
                    pid = await self._pid(job, message.port)
                    listening = self._listening(pid, job.container_id, message.port)
                if listening != told and (told is None or listening):
                    ctx.stream.send_message(
                        PortOpened(provider=self.provider.name, listening=listening)
                    )
                    told = listening
                changed = asyncio.ensure_future(self.jobs.wait_changed(WATCH_EVERY))
                done, _ = await asyncio.wait(
                    {changed, leaving}, return_when=asyncio.FIRST_COMPLETED
                )
                changed.cancel()
                if leaving in done:
                    return  # the consumer closed its forward (or its stream failed)
        finally:
            leaving.cancel()
            with contextlib.suppress(asyncio.CancelledError, GPUMeshError):
                await leaving


def in_container(pid: int, container: str) -> bool:
    """Whether process ``pid`` is one of ``container``'s (its cgroup names the
    container) and not in this process's own network namespace: a pid the container
    left and the host reused is never taken for the job's."""
    try:
        cgroups = Path(f"/proc/{pid}/cgroup").read_text()
        theirs = os.stat(f"/proc/{pid}/ns/net").st_ino
        ours = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return False
    return bool(container) and container in cgroups and theirs != ours


def _socket_in(pid: int, container: str) -> socket.socket:
    """A TCP socket made in the network namespace of process ``pid`` of ``container``
    (it stays in that namespace wherever it is used). Runs in a thread of its own
    that ends after: should the way back fail, no other work runs in that thread."""
    libc = ctypes.CDLL(None, use_errno=True)
    target = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        # Checked once the namespace is held open: the process is the container's.
        if not in_container(pid, container):
            raise OSError(errno.ESRCH, "the job's process is gone")
        if libc.setns(target, _CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise OSError(error, os.strerror(error))
        try:
            return socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        finally:
            if libc.setns(own, _CLONE_NEWNET) != 0:
                logger.warning("a thread could not leave a job's network namespace; it ends")
    finally:
        os.close(target)
        os.close(own)
