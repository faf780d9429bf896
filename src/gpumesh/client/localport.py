"""A loopback listener whose connections a peer carries: what the desktop tunnel and a
job's forwarded ports have in common.

Each connection a local program opens is taken only from a process of this user
(:func:`same_user`: the kernel's socket table says whose it is, failing closed), then
carried on its own stream of one session (:func:`carry_connection`). On a direct path
it asks for a data channel of its own (TLS on TCP with the provider's key pinned, as
``cp``'s: :mod:`gpumesh.client.bulk` decides when) and its bytes go there, the stream
staying open for refusals; a channel that does not open is declined, remembered for
the peer as ``cp`` remembers it, and DATA frames on the stream carry the connection.
Nothing here prints; what may be reached is the provider's to decide.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from gpumesh.blocking import closing_in_thread
from gpumesh.client.bulk import BLOCKED_FOR, why_no_channel
from gpumesh.errors import GPUMeshError, ProtocolError, TransportError, UnreachableError
from gpumesh.protocol.handshake import BINDING_SIZE
from gpumesh.protocol.messages import ChannelDeclined, DesktopOpened, Message, PortOpened
from gpumesh.transport.channel import dial_memory
from gpumesh.transport.sockowner import owner_check_available, socket_owner
from gpumesh.transport.tcpstream import READ_LIMIT, pump, splice

if TYPE_CHECKING:
    from gpumesh.client.node import Node
    from gpumesh.store.peers import Peer
    from gpumesh.transport.channel import MemoryChannel
    from gpumesh.transport.session import Session

__all__ = [
    "OwnerLookup",
    "Way",
    "accept_loop",
    "carry_connection",
    "family_of",
    "owner_lookup",
    "same_user",
]

logger = logging.getLogger(__name__)

OwnerLookup = Callable[[tuple[str, int], tuple[str, int]], "int | None"]
"""Who owns the socket bound to the first endpoint and connected to the second."""

Opened = TypeVar("Opened", DesktopOpened, PortOpened)


def owner_lookup(owner: OwnerLookup | None) -> OwnerLookup | None:
    """``owner``, else the kernel's table where there is one (None: no check here)."""
    if owner is not None:
        return owner
    return socket_owner if owner_check_available() else None


def family_of(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def same_user(
    conn: socket.socket, lookup: OwnerLookup, refused: Callable[[int | None], None]
) -> bool:
    """Whether the connecting socket is this user's (its row in the kernel's table);
    a socket no row proves an owner of (gone, orphaned) is refused."""
    try:
        theirs, ours = conn.getpeername(), conn.getsockname()
    except OSError:
        return False  # already gone
    uid = lookup((str(theirs[0]), int(theirs[1])), (str(ours[0]), int(ours[1])))
    if uid == os.getuid():
        return True
    logger.warning("refused a local connection from uid %s (not this user)", uid)
    refused(uid)
    return False


async def accept_loop(
    listener: socket.socket,
    serve: Callable[[socket.socket], Coroutine[Any, Any, None]],
    connections: set[asyncio.Task[None]],
    what: str,
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
                f"the {what}'s listener failed: {exc.strerror or exc}; start it again"
            ) from None
        conn.setblocking(False)
        task = asyncio.create_task(serve(conn))
        connections.add(task)  # before it first runs: a close now cancels it too


@dataclass(frozen=True)
class Way:
    """What each connection of one listener needs to pick its path."""

    node: Node
    peer: Peer
    session: Session
    carried: Callable[[str], None]
    """Told what carries each connection once it is open: ``channel`` or ``quic``."""


async def _open_channel(way: Way, port: int, ticket: bytes) -> MemoryChannel | None:
    """Dial the offered data channel; None when it does not open (remembered for the
    peer, as ``cp`` remembers it: later connections go over QUIC without trying)."""
    try:
        return await closing_in_thread(
            dial_memory, way.session.address[0], port, way.peer.public_key, ticket
        )
    except GPUMeshError as exc:
        if isinstance(exc, UnreachableError):
            way.node.home.store.block_channel(str(way.peer.node_id), time.time() + BLOCKED_FOR)
        logger.info("no data channel to %s (%s); QUIC instead", way.peer.name, exc)
        return None


async def carry_connection(
    way: Way,
    conn: socket.socket,
    ask: Callable[[bool, int], Message],
    answer: type[Opened],
    framing: int,
) -> None:
    """One local connection over its own stream (or a data channel beside it) until
    both sides ended. ``ask(channel, sealing)`` is the request (a data channel wanted,
    the sealed-frame version offered, from ``framing``), ``answer`` its reply's type.
    Raises the provider's refusal; ``conn`` is closed whatever happens."""
    session = way.session
    stream = session.open_stream()
    try:
        wanted = why_no_channel(way.node, way.node.peer(way.peer.name), session) is None
        binding = session.link.binding
        offer = framing if wanted and len(binding) == BINDING_SIZE else 0
        # Offered in ``sealing`` only: a provider of version 1 reads ``framing`` and,
        # finding 0 there, keeps TLS records rather than bind keys to ``tls-unique``.
        stream.send_message(ask(wanted, offer))
        opened = await stream.expect(answer)
        old = opened.framing if isinstance(opened, DesktopOpened) else 0
        if old or opened.sealing not in (0, offer):
            raise ProtocolError(
                f"{way.peer.name} answered with sealed frames of version "
                f"{opened.sealing or old}, which were not offered"
            )
        channel = None
        if opened.channel_port:
            channel = await _open_channel(way, opened.channel_port, opened.channel_ticket)
            if channel is None:
                stream.send_message(ChannelDeclined(reason="the data channel did not open"))
        way.carried("quic" if channel is None else "channel")
        if channel is None:
            reader, writer = await asyncio.open_connection(sock=conn, limit=READ_LIMIT)
            await pump(stream, reader, writer)
        else:
            sealed_to = binding if opened.sealing else None
            await splice(stream, conn, channel, sealed_to=sealed_to, dialler=True)
    except BaseException:
        conn.close()
        raise
    finally:
        session.link.forget_stream(stream.stream_id)
