"""A peer's desktop from the consumer's side: ``gpumesh desktop connect``.

Owns the local end of a desktop tunnel: it asks the provider once whether its
desktop may be used (``DesktopOpen`` with ``probe``: the allowlist, the share,
its server answering; a refusal is raised as one error), then listens on a
loopback port (15900 for VNC, 13389 for RDP) and carries each TCP connection
a local client opens on its own stream of one session
(:func:`gpumesh.transport.tcpstream.pump`). RDP clients open several. On a
direct path each connection asks for a data channel of its own (TLS on TCP
with the provider's key pinned, as ``cp``'s: :mod:`gpumesh.client.bulk`
decides when) and its bytes go there, the stream staying open for refusals;
a channel that does not open is declined, remembered for the peer as ``cp``
remembers it, and DATA frames on the stream carry the connection.

Only loopback addresses are ever bound. On Linux a connection is taken only
from a process of this user (the kernel's socket table says whose it is), so
another account on a shared machine cannot ride the tunnel; elsewhere
:attr:`TunnelReady.owner_checked` is False and the caller says so.

The tunnel ends with the session: a revoked access, a stopped share or a lost
link is raised as its error; cancelling the call closes it. Nothing here prints.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import os
import socket
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpumesh.blocking import closing_in_thread
from gpumesh.client.bulk import BLOCKED_FOR, why_no_channel
from gpumesh.errors import (
    AccessDeniedError,
    BadRequestError,
    GPUMeshError,
    InUseError,
    NotFoundError,
    ProtocolError,
    TransportError,
    UnreachableError,
)
from gpumesh.protocol.desktop import DesktopKind, client_commands, kind_for_port
from gpumesh.protocol.handshake import BINDING_SIZE
from gpumesh.protocol.messages import ChannelDeclined, DesktopOpen, DesktopOpened
from gpumesh.transport.channel import dial_memory
from gpumesh.transport.sealing import FRAMING_VERSION
from gpumesh.transport.sockowner import (
    listening_beyond_loopback,
    listening_on_loopback,
    owner_check_available,
    socket_owner,
)
from gpumesh.transport.tcpstream import READ_LIMIT, pump, splice

if TYPE_CHECKING:
    from gpumesh.client.node import Node
    from gpumesh.store.peers import Peer
    from gpumesh.store.shares import DesktopShare
    from gpumesh.transport.channel import MemoryChannel
    from gpumesh.transport.session import Session

__all__ = [
    "INSTALL_HINTS",
    "DesktopOffer",
    "DesktopReport",
    "LocalServer",
    "TunnelReady",
    "allow_desktop",
    "check_desktop",
    "deny_desktop",
    "desktop_tunnel",
    "parse_bind",
    "probe_desktop",
    "share_desktop",
    "stop_desktop_share",
]

logger = logging.getLogger(__name__)

FRAMING = FRAMING_VERSION
"""The sealed-frame version a connection offers for its data channel (0: TLS
records only, as a consumer before sealed frames)."""

OwnerLookup = Callable[[tuple[str, int], tuple[str, int]], "int | None"]


@dataclass(frozen=True)
class DesktopOffer:
    """What a provider shares, as it answered the probe."""

    provider: str
    kind: DesktopKind
    port: int
    """The port on the provider's loopback (for messages; the consumer never picks it)."""


@dataclass(frozen=True)
class TunnelReady:
    """The tunnel listens: what to tell the user."""

    offer: DesktopOffer
    host: str
    port: int
    owner_checked: bool
    """True: connections from other users' processes are refused (Linux)."""

    @property
    def commands(self) -> list[str]:
        """What to run to use it (vncviewer, xfreerdp, mstsc)."""
        return client_commands(self.offer.kind, self.host, self.port)


def parse_bind(text: str) -> tuple[str, int | None]:
    """``[HOST:]PORT`` or ``HOST`` for the listener; HOST must be a loopback address."""
    host, port_text = "127.0.0.1", ""
    text = text.strip()
    if text.startswith("["):  # [::1]:PORT
        host, _, rest = text[1:].partition("]")
        port_text = rest.removeprefix(":")
    elif text.count(":") == 1:
        host, port_text = text.split(":")
        host = host or "127.0.0.1"
    elif text.isdigit():
        port_text = text
    else:
        host = text
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise BadRequestError(
            f"--bind {text}: the desktop tunnel listens on a loopback address only "
            "(127.0.0.1 or ::1), so other machines cannot reach it"
        )
    if not port_text:
        return host, None
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise BadRequestError(f"--bind {text}: {port_text!r} is not a port (0-65535)")
    return host, int(port_text)


async def probe_desktop(session: Session) -> DesktopOffer:
    """Ask the provider whether its desktop is ours to use now; raises its refusal."""
    reply = await session.request(DesktopOpen(probe=True))
    if not isinstance(reply, DesktopOpened):
        raise ProtocolError(
            f"{session.peer_name} answered a desktop request with {type(reply).__name__}"
        )
    return DesktopOffer(reply.provider, DesktopKind.parse(reply.kind), reply.port)


async def desktop_tunnel(
    node: Node,
    peer: str,
    *,
    bind: tuple[str, int | None] = ("127.0.0.1", None),
    ready: Callable[[TunnelReady], None] = lambda _ready: None,
    refused_local: Callable[[int | None], None] = lambda _uid: None,
    connection_refused: Callable[[GPUMeshError], None] = lambda _error: None,
    owner: OwnerLookup | None = None,
    carried: Callable[[str], None] = lambda _path: None,
) -> None:
    """Tunnel ``peer``'s shared desktop to a loopback port until cancelled.

    ``bind``: where to listen (port None: 15900 for VNC, 13389 for RDP; 0: any).
    ``ready`` hears where it listens; ``refused_local`` hears of each connection
    refused because another user's process made it (its uid, None if unknown);
    ``connection_refused`` of each one the provider refused while the tunnel goes
    on (e.g. past its max_requests_per_link); ``carried`` of what carries each
    connection once it is open (``channel``: a data channel; ``quic``: the stream).
    Raises the provider's refusal (not on its desktop allowlist, not shared, its
    server not running), and later why the tunnel ended (access revoked, share
    stopped, link lost).
    """
    host, port = bind
    lookup = owner if owner is not None else (socket_owner if owner_check_available() else None)
    target = node.peer(peer)
    async with node.session(target.node_id) as session:
        offer = await probe_desktop(session)
        way = _Way(node, target, session, carried)
        ended: asyncio.Future[GPUMeshError] = asyncio.get_running_loop().create_future()
        connections: set[asyncio.Task[None]] = set()

        async def serve(conn: socket.socket) -> None:
            task = asyncio.current_task()
            assert task is not None
            connections.add(task)
            try:
                if lookup is not None and not _same_user(conn, lookup, refused_local):
                    conn.close()
                    return
                await _carry(way, conn, ended, connection_refused)
            finally:
                connections.discard(task)

        listen_port = port if port is not None else offer.kind.local_port
        try:
            listener = socket.create_server((host, listen_port), family=_family(host))
        except OSError as exc:
            raise InUseError(
                f"cannot listen on {host}:{listen_port}: {exc.strerror or exc}; is another "
                "tunnel running? pick another port with --bind 127.0.0.1:PORT"
            ) from None
        listener.setblocking(False)
        accepting = asyncio.create_task(_accept(listener, serve, connections))
        closed = asyncio.ensure_future(session.link.wait_closed())
        try:
            bound = listener.getsockname()
            ready(TunnelReady(offer, host, int(bound[1]), lookup is not None))
            waits: set[asyncio.Future[Any]] = {closed, ended, accepting}
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if accepting in done:
                accepting.result()  # the listener failed
            raise (ended.result() if ended in done else closed.result())
        finally:
            closed.cancel()
            accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await accepting
            listener.close()
            for task in list(connections):
                task.cancel()
            for task in list(connections):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


async def _accept(
    listener: socket.socket,
    serve: Callable[[socket.socket], Coroutine[Any, Any, None]],
    connections: set[asyncio.Task[None]],
) -> None:
    """Take each connection to ``listener`` as a plain socket (a data channel moves
    its bytes on a thread of its own; QUIC wraps it in asyncio streams)."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            conn, _address = await loop.sock_accept(listener)
        except (ConnectionAbortedError, InterruptedError):
            continue  # gone while it was queued
        except OSError as exc:  # e.g. out of file descriptors
            raise TransportError(
                f"the tunnel's listener failed: {exc.strerror or exc}; "
                "start `desktop connect` again"
            ) from None
        conn.setblocking(False)
        task = asyncio.create_task(serve(conn))
        connections.add(task)  # before it first runs: a close now cancels it too


def _same_user(
    conn: socket.socket, lookup: OwnerLookup, refused: Callable[[int | None], None]
) -> bool:
    """Whether the connecting socket is this user's (its row in the kernel's table)."""
    try:
        theirs, ours = conn.getpeername(), conn.getsockname()
    except OSError:
        return False  # already gone
    uid = lookup((str(theirs[0]), int(theirs[1])), (str(ours[0]), int(ours[1])))
    if uid == os.getuid():
        return True
    logger.warning("refused a desktop connection from uid %s (not this user)", uid)
    refused(uid)
    return False


@dataclass(frozen=True)
class _Way:
    """What each connection of one tunnel needs to pick its path."""

    node: Node
    peer: Peer
    session: Session
    carried: Callable[[str], None]


async def _open_channel(way: _Way, opened: DesktopOpened) -> MemoryChannel | None:
    """Dial the offered data channel; None when it does not open (remembered for the
    peer, as ``cp`` remembers it: later connections go over QUIC without trying)."""

    try:
        return await closing_in_thread(
            dial_memory,
            way.session.address[0],
            opened.channel_port,
            way.peer.public_key,
            opened.channel_ticket,
        )
    except GPUMeshError as exc:
        if isinstance(exc, UnreachableError):
            way.node.home.store.block_channel(str(way.peer.node_id), time.time() + BLOCKED_FOR)
        logger.info("no desktop data channel to %s (%s); QUIC instead", way.peer.name, exc)
        return None


async def _carry(
    way: _Way,
    conn: socket.socket,
    ended: asyncio.Future[GPUMeshError],
    refused: Callable[[GPUMeshError], None],
) -> None:
    """One local connection over its own stream (or a data channel beside it); a
    refusal that ends the whole tunnel (access revoked, share stopped) settles
    ``ended``."""

    session = way.session
    stream = session.open_stream()
    try:
        wanted = why_no_channel(way.node, way.node.peer(way.peer.name), session) is None
        binding = session.link.binding
        offer = FRAMING if wanted and len(binding) == BINDING_SIZE else 0
        # Offered in ``sealing`` only: a provider of version 1 reads ``framing`` and,
        # finding 0 there, keeps TLS records rather than bind keys to ``tls-unique``.
        stream.send_message(DesktopOpen(channel=wanted, sealing=offer))
        opened = await stream.expect(DesktopOpened)
        if opened.framing or (opened.sealing not in (0, offer)):
            raise ProtocolError(
                f"{way.peer.name} answered with sealed frames of version "
                f"{opened.sealing or opened.framing}, which were not offered"
            )
        channel = None
        if opened.channel_port:
            channel = await _open_channel(way, opened)
            if channel is None:
                stream.send_message(ChannelDeclined(reason="the data channel did not open"))
        way.carried("quic" if channel is None else "channel")
        if channel is None:
            reader, writer = await asyncio.open_connection(sock=conn, limit=READ_LIMIT)
            await pump(stream, reader, writer)
        else:
            sealed_to = binding if opened.sealing else None
            await splice(stream, conn, channel, sealed_to=sealed_to, dialler=True)
    except GPUMeshError as exc:
        conn.close()
        if isinstance(exc, AccessDeniedError | NotFoundError) and not ended.done():
            ended.set_result(exc)
        else:
            logger.info("a desktop connection ended: %s", exc)
            if not isinstance(exc, TransportError):  # a reset or a lost link is no refusal
                refused(exc)
    except BaseException:
        conn.close()
        raise
    finally:
        session.link.forget_stream(stream.stream_id)


# --- the owner's side: the share and its allowlist ------------------------------------


def exposure(port: int) -> list[str]:
    """The addresses beyond loopback a server on ``port`` listens on (empty: loopback
    only, or nothing there, or no socket table to tell)."""
    return listening_beyond_loopback(port) or []


def exposure_warning(kind: str, port: int, exposed: Sequence[str]) -> str:
    """The one line ``desktop share`` and ``desktop doctor`` warn with."""
    where = ", ".join("every address" if a in ("0.0.0.0", "::") else a for a in exposed)
    return (
        f"the {kind} server on port {port} also listens on {where}: jobs in containers, "
        "the LAN and anyone who reaches this machine can connect to it without GPUMesh; "
        "make it listen on 127.0.0.1 only (x11vnc -localhost, xrdp's address=127.0.0.1)"
    )


def share_desktop(node: Node, kind: DesktopKind, port: int) -> DesktopShare:
    """Offer this machine's desktop server on 127.0.0.1:``port`` to the peers on the
    desktop allowlist whenever this node shares (remembered; the agent sees it at the
    next request). A change of port cuts the connections to the old one."""
    share = node.home.store.set_desktop_share(kind, port)
    node.home.agent_changed()
    return share


def stop_desktop_share(node: Node) -> bool:
    """Stop offering the desktop and cut its open connections; False if not shared."""
    stopped = node.home.store.clear_desktop_share()
    node.home.agent_changed()
    return stopped


def allow_desktop(node: Node, peer: str) -> Peer:
    """Put a paired peer on the desktop allowlist (jobs keep their own)."""
    record = node.peer(peer)
    node.home.store.set_desktop_allowed(record.node_id, True)
    return record


def deny_desktop(node: Node, peer: str) -> Peer:
    """Take a peer off the desktop allowlist; a running agent cuts its open desktop
    connections at once (its jobs and files are untouched)."""
    record = node.peer(peer)
    node.home.store.set_desktop_allowed(record.node_id, False)
    node.home.agent_changed()
    return record


# --- doctor: what serves a desktop here -----------------------------------------------

_CANDIDATE_PORTS = (*range(5900, 5910), 3389)


@dataclass(frozen=True)
class LocalServer:
    """A desktop server found listening on this machine's loopback."""

    kind: DesktopKind
    port: int
    greeting: str
    """What it said first (a VNC server's ``RFB 003.008``) where servers are found by
    connecting; empty for RDP (the client speaks first) and on Linux (not connected)."""
    exposed: tuple[str, ...] = ()
    """The addresses beyond loopback it also listens on (``0.0.0.0``: all of them),
    where jobs in containers, the LAN or anyone reach it without this node."""


@dataclass(frozen=True)
class DesktopReport:
    """``desktop doctor``: servers found here, and this node's share and its allowlist."""

    servers: list[LocalServer]
    share: DesktopShare | None
    share_answers: bool
    """Whether something listens on the shared port now."""
    allowed: list[Peer]
    connected: list[dict[str, str]]
    """Open connections, as the running agent publishes them (none when not sharing)."""
    sharing: bool
    """Whether this node's agent runs (the desktop is offered only while it does)."""
    owner_checked: bool
    """Whether this system can refuse other users' connections to a tunnel's port."""


async def _probe_port(port: int, timeout: float = 1.0) -> LocalServer | None:
    listening = listening_on_loopback(port)
    if listening is not None:
        # Read from the kernel's table: connecting would end a VNC server started
        # for one client (x11vnc without -forever), as its one client leaving.
        if not listening:
            return None
        return LocalServer(kind_for_port(port), port, "", tuple(exposure(port)))
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except (OSError, TimeoutError):
        return None
    greeting = b""
    try:
        with contextlib.suppress(TimeoutError, OSError):
            async with asyncio.timeout(timeout):
                greeting = await reader.read(12)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    if greeting.startswith(b"RFB "):
        return LocalServer(DesktopKind.VNC, port, greeting.decode("ascii", "replace").strip())
    if port == 3389:
        return LocalServer(DesktopKind.RDP, port, "")
    return LocalServer(DesktopKind.TCP, port, greeting.decode("ascii", "replace").strip())


async def check_desktop(node: Node) -> DesktopReport:
    """What ``desktop doctor`` reports: servers on 127.0.0.1:5900-5909, 3389 and the
    shared port (from the kernel's socket table on Linux; elsewhere by connecting and
    reading a VNC server's greeting); nothing leaves this machine."""
    share = node.home.store.desktop_share()
    ports = list(dict.fromkeys([*_CANDIDATE_PORTS, *([share.port] if share else [])]))
    found = await asyncio.gather(*(_probe_port(port) for port in ports))
    servers = [
        dataclasses.replace(server, kind=share.kind)
        if share is not None and server.port == share.port and not server.greeting
        else server
        for server in found
        if server is not None
    ]
    allowed_ids = node.home.store.desktop_allowed_ids()
    agent = node.home.agent_info()
    return DesktopReport(
        servers=servers,
        share=share,
        share_answers=share is not None and any(s.port == share.port for s in servers),
        allowed=[peer for peer in node.peers() if peer.node_id in allowed_ids],
        connected=list(agent.desktop) if agent else [],
        sharing=agent is not None,
        owner_checked=owner_check_available(),
    )


INSTALL_HINTS = {
    DesktopKind.VNC: (
        "VNC on Linux: `sudo apt install x11vnc`, then `x11vnc -display :0 -localhost "
        "-usepw -forever` (or turn on your desktop's screen sharing: GNOME, KDE)"
    ),
    DesktopKind.RDP: (
        "RDP on Linux: `sudo apt install freerdp2-shadow-x11` (`freerdp-shadow-cli "
        "/bind-address:127.0.0.1`) or xrdp; on Windows, turn on Remote Desktop"
    ),
}
