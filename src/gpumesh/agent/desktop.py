"""The provider's desktop share: ``DesktopOpen`` reaches the one port the owner shared.

Owns desktop sessions. A request is served only for a peer on the desktop
allowlist (its own, empty until the owner adds someone; a denied peer is off it
too), only while the owner shares the desktop, and only ever to 127.0.0.1 on
the port the owner shared: the consumer names no address. Each request carries
one TCP connection (:func:`gpumesh.transport.tcpstream.pump`); RDP clients open
several. When the consumer asks for it (a direct path) and this node opens data
channels, the connection's bytes go over a data channel of its own instead
(TLS on TCP as ``cp``'s: a one-shot listener for the request's address, a
fresh ticket, this node's key; :func:`gpumesh.transport.tcpstream.splice`), and
the request's stream stays open beside it for refusals; a consumer that cannot
reach the channel declines it and DATA frames carry the connection after all.

:meth:`DesktopService.revoke` cuts at once every session whose peer left the
desktop allowlist or whose share ended; the agent calls it whenever the home
says its state changed (``desktop deny``, ``gpumesh deny``, ``desktop share stop``).
This is the one service that reaches the host rather than a container, which is
why it never forwards anywhere else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import msgspec

from gpumesh.agent.deps import Handlers, Provider, RequestContext
from gpumesh.blocking import closing_in_thread
from gpumesh.errors import (
    AccessDeniedError,
    AgentError,
    GPUMeshError,
    NotFoundError,
    ProtocolError,
    UnreachableError,
)
from gpumesh.protocol.desktop import DesktopKind
from gpumesh.protocol.handshake import BINDING_SIZE
from gpumesh.protocol.messages import ChannelDeclined, DesktopOpen, DesktopOpened
from gpumesh.transport.sealing import FRAMING_VERSION
from gpumesh.transport.sockowner import listening_on_loopback
from gpumesh.transport.tcpstream import READ_LIMIT, pump, splice

if TYPE_CHECKING:
    from gpumesh.store.peers import Peer
    from gpumesh.store.shares import DesktopShare
    from gpumesh.transport.channel import Listener, MemoryChannel
    from gpumesh.transport.stream import Stream

__all__ = ["DesktopService", "DesktopSession", "DesktopStore"]

logger = logging.getLogger(__name__)

SERVER_HOST = "127.0.0.1"
"""Where the shared desktop server is reached: this host's loopback, nowhere else."""
_CONNECT_TIMEOUT = 10.0


class ChannelSource(Protocol):
    """Whether and where this node opens data channels (the file service's channels)."""

    def enabled(self) -> bool: ...

    def listen(self, peer: str) -> Listener: ...


class DesktopStore(Protocol):
    """What the service reads of the store: the share and who may use it."""

    def desktop_share(self) -> DesktopShare | None: ...

    def desktop_allowed_ids(self) -> set[str]: ...


@dataclass
class DesktopSession:
    """One open TCP connection of a peer to the shared desktop."""

    peer: Peer
    kind: DesktopKind
    port: int
    since: float
    stream: Stream
    task: asyncio.Task[None] | None = None
    cut: GPUMeshError | None = None
    """Why the owner's side ended it (revoked, share stopped), once it did."""
    id: str = ""
    """How the owner names it (``status``, the owner's view) to end it."""
    path: str = "quic"
    """What carries its bytes: ``channel`` (a data channel; offered, while it opens)
    or ``quic`` (the stream)."""
    framing: int = 0
    """On a data channel: the sealed-frame version agreed (0: TLS records)."""


class DesktopService:
    """Desktop connections of one agent."""

    def __init__(
        self,
        provider: Provider,
        store: DesktopStore,
        *,
        clock: Callable[[], float] = time.time,
        channels: ChannelSource | None = None,
    ) -> None:
        self.provider = provider
        self.channels = channels
        """Where data channels come from; None: connections go over QUIC only."""
        self.store = store
        self.clock = clock
        self._sessions: dict[str, DesktopSession] = {}
        self.framing = FRAMING_VERSION
        """The sealed-frame version it agrees to on a data channel when the consumer
        offers it (0: TLS records only, as a provider before sealed frames). Version
        1 is never agreed: its keys were bound to ``tls-unique``."""

    def register(self, handlers: Handlers) -> None:
        handlers.add(DesktopOpen, self.handle_open)

    def sessions(self) -> list[DesktopSession]:
        """Open connections, oldest first."""
        return sorted(self._sessions.values(), key=lambda s: s.since)

    # --- the request ----------------------------------------------------------------------

    def check(self, peer: Peer) -> DesktopShare:
        """The share ``peer`` may use now; raises the refusal it gets otherwise."""
        name = self.provider.name
        if peer.node_id not in self.store.desktop_allowed_ids():
            raise AccessDeniedError(
                f"{name} has not allowed you to use its desktop; ask its owner to run "
                "`gpumesh desktop allow YOUR-NODE` (jobs and files have their own allowlist)"
            )
        share = self.store.desktop_share()
        if share is None:
            raise NotFoundError(
                f"{name} does not share its desktop; ask its owner to run "
                "`gpumesh desktop share --vnc` (or --rdp)"
            )
        return share

    async def handle_open(self, ctx: RequestContext, message: DesktopOpen) -> None:
        share = self.check(ctx.peer)
        reply = DesktopOpened(provider=self.provider.name, kind=str(share.kind), port=share.port)
        if message.probe and listening_on_loopback(share.port) is not None:
            # Checked in the kernel's table, not by connecting: a VNC server started
            # for one client (x11vnc without -forever) would exit after the probe.
            if not listening_on_loopback(share.port):
                raise self._no_server(share)
            ctx.stream.send_message(reply, end=True)
            return
        try:
            server = await _connect(share.port)
        except (OSError, TimeoutError):
            raise self._no_server(share) from None
        if message.probe:
            server.close()
            ctx.stream.send_message(reply, end=True)
            return
        listener = self._listener(ctx) if message.channel else None
        framing = 0
        if listener is not None and len(ctx.link.binding) == BINDING_SIZE:
            # Only the field of version 2 on: a consumer that offers only version 1
            # (``framing``) keeps TLS records.
            framing = self.framing if self.framing and message.sealing >= self.framing else 0
        if listener is not None:
            reply = msgspec.structs.replace(
                reply, channel_port=listener.port, channel_ticket=listener.ticket, sealing=framing
            )
        try:
            ctx.stream.send_message(reply)
        except BaseException:
            server.close()
            if listener is not None:
                listener.close()
            raise
        session = DesktopSession(ctx.peer, share.kind, share.port, self.clock(), ctx.stream)
        key = f"desktop-{secrets.token_hex(6)}"
        session.id = key
        session.path = "quic" if listener is None else "channel"
        session.framing = framing
        self._sessions[key] = session
        try:
            channel = await self._channel(ctx, listener) if listener is not None else None
        except BaseException:
            self._sessions.pop(key, None)
            server.close()
            raise
        if _is_cut(session):  # denied while the channel opened
            self._sessions.pop(key, None)
            server.close()
            if channel is not None:
                channel.close()
            return
        session.path = "quic" if channel is None else "channel"
        session.framing = 0 if channel is None else framing
        logger.info(
            "[%s] opened a desktop connection (%s, over %s)",
            ctx.peer.name,
            share.kind,
            "a data channel" if channel is not None else "QUIC",
        )
        session.task = asyncio.create_task(
            _over_quic(ctx.stream, server)
            if channel is None
            else splice(
                ctx.stream, server, channel, sealed_to=ctx.link.binding if framing else None
            )
        )
        try:
            await session.task
        except asyncio.CancelledError:
            if session.cut is None:
                raise  # the agent is stopping: not ours to swallow
        except GPUMeshError as exc:
            logger.info("[%s] desktop connection ended: %s", ctx.peer.name, exc)
        finally:
            session.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, GPUMeshError):
                await session.task
            self._sessions.pop(key, None)
        if session.cut is not None:
            logger.info("[%s] desktop connection cut: %s", ctx.peer.name, session.cut)

    def _listener(self, ctx: RequestContext) -> Listener | None:
        """A one-shot data channel listener for this request; None: QUIC carries it."""

        channels = self.channels
        if channels is None or not channels.enabled():
            return None
        try:
            return channels.listen(ctx.link.remote_address()[0])
        except UnreachableError as exc:
            logger.debug("[%s] no data channel for the desktop: %s", ctx.peer.name, exc)
            return None

    async def _channel(self, ctx: RequestContext, listener: Listener) -> MemoryChannel | None:
        """The consumer's data channel, or None when it declined it (QUIC carries the
        connection). A channel neither opened nor declined ends the request."""
        accepting = asyncio.ensure_future(closing_in_thread(listener.accept_memory))
        declining = asyncio.ensure_future(ctx.stream.read_message())
        taken = False
        try:
            done, _ = await asyncio.wait(
                {accepting, declining}, return_when=asyncio.FIRST_COMPLETED
            )
            if accepting in done and accepting.exception() is None:
                taken = True
                return accepting.result()
            # The channel did not open: the consumer says so on the stream (or it
            # saw a channel we did not: nothing would carry the connection).
            async with asyncio.timeout(_CONNECT_TIMEOUT):
                message = await declining
            if not isinstance(message, ChannelDeclined):
                raise ProtocolError(
                    f"peer sent {type(message).__name__} where a desktop connection's "
                    "data channel or ChannelDeclined was expected"
                )
            logger.info("[%s] desktop data channel declined: %s", ctx.peer.name, message.reason)
            return None
        except TimeoutError:
            raise ProtocolError(
                "the desktop connection's data channel neither opened nor was declined"
            ) from None
        finally:
            listener.stop()  # accept() returns within a fraction of a second
            declining.cancel()
            if not accepting.done():
                accepting.cancel()  # a channel it still returns is closed, unclaimed
            elif not taken and not accepting.cancelled() and accepting.exception() is None:
                accepting.result().close()  # opened, yet the consumer declined it
            with contextlib.suppress(asyncio.CancelledError, GPUMeshError):
                await declining

    def _no_server(self, share: DesktopShare) -> AgentError:
        return AgentError(
            f"{self.provider.name} shares its desktop ({share.kind}) on port {share.port}, "
            "but no server answers there now; ask its owner to start it "
            "(`gpumesh desktop doctor` says how)"
        )

    # --- the owner's side -------------------------------------------------------------------

    def revoke(self) -> None:
        """Cut every connection whose peer may no longer use the desktop, or whose
        share ended or changed."""
        if not self._sessions:
            return
        allowed = self.store.desktop_allowed_ids()
        share = self.store.desktop_share()
        name = self.provider.name
        for session in list(self._sessions.values()):
            if session.cut is not None:
                continue
            if session.peer.node_id not in allowed:
                self._cut(
                    session, AccessDeniedError(f"{name} has revoked your access to its desktop")
                )
            elif share is None or share.port != session.port:
                self._cut(session, NotFoundError(f"{name} stopped sharing its desktop"))

    def end(self, session_id: str) -> bool:
        """End one connection because the owner asked; False when it is not open."""
        session = self._sessions.get(session_id)
        if session is None or session.cut is not None:
            return False
        name = self.provider.name
        self._cut(session, AccessDeniedError(f"{name}'s owner ended your desktop connection"))
        return True

    def _cut(self, session: DesktopSession, error: GPUMeshError) -> None:
        session.cut = error
        # The refusal ends our side (FIN), so the consumer reads it after what it was
        # sent; no reset or STOP_SENDING may follow, or QUIC could drop it unread.
        with contextlib.suppress(GPUMeshError):
            session.stream.refuse(error)
        if session.task is not None:
            session.task.cancel()  # closes the socket to the desktop server now

    def stop(self) -> None:
        for session in list(self._sessions.values()):
            if session.task is not None:
                session.task.cancel()


def _is_cut(session: DesktopSession) -> bool:
    return session.cut is not None


async def _connect(port: int) -> socket.socket:
    """A plain socket connected to the shared server on this host's loopback."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        async with asyncio.timeout(_CONNECT_TIMEOUT):
            await asyncio.get_running_loop().sock_connect(sock, (SERVER_HOST, port))
    except BaseException:
        sock.close()
        raise
    return sock


async def _over_quic(stream: Stream, server: socket.socket) -> None:
    """The connection's bytes as DATA frames on its stream (no data channel)."""
    try:
        reader, writer = await asyncio.open_connection(sock=server, limit=READ_LIMIT)
    except BaseException:
        server.close()
        raise
    await pump(stream, reader, writer)
