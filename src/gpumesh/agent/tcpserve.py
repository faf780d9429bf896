"""One TCP connection a peer asked for, carried from this node's side: what the desktop
share and a job's forwarded ports have in common.

The service connects the socket (the desktop server on this host's loopback, or a
port inside a job's container) and answers the request; then the connection's bytes
go as DATA frames on the request's stream (:func:`gpumesh.transport.tcpstream.pump`),
or, when the consumer asked for it and this node opens data channels, over a data
channel of its own (TLS on TCP as ``cp``'s: a one-shot listener for the request's
address, a fresh ticket, this node's key; :func:`gpumesh.transport.tcpstream.splice`),
the stream staying open beside it for refusals. A consumer that cannot reach the
channel declines it and DATA frames carry the connection after all. Nothing here
decides what may be reached.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import TYPE_CHECKING, Protocol

from gpumesh.blocking import closing_in_thread
from gpumesh.errors import GPUMeshError, ProtocolError, UnreachableError
from gpumesh.protocol.handshake import BINDING_SIZE
from gpumesh.protocol.messages import ChannelDeclined
from gpumesh.transport.tcpstream import READ_LIMIT, pump, splice

if TYPE_CHECKING:
    from gpumesh.agent.deps import RequestContext
    from gpumesh.transport.channel import Listener, MemoryChannel
    from gpumesh.transport.stream import Stream

__all__ = ["ChannelSource", "carry", "channel_listener", "sealing_for", "take_channel"]

logger = logging.getLogger(__name__)

DECLINE_TIMEOUT = 10.0
"""Seconds a consumer has to say it declined a channel that did not open."""


class ChannelSource(Protocol):
    """Whether and where this node opens data channels (the file service's channels)."""

    def enabled(self) -> bool: ...

    def listen(self, peer: str) -> Listener: ...


def channel_listener(channels: ChannelSource | None, ctx: RequestContext) -> Listener | None:
    """A one-shot data channel listener for this request; None: QUIC carries it."""
    if channels is None or not channels.enabled():
        return None
    try:
        return channels.listen(ctx.link.remote_address()[0])
    except UnreachableError as exc:
        logger.debug("[%s] no data channel for a TCP connection: %s", ctx.peer.name, exc)
        return None


def sealing_for(listener: Listener | None, ctx: RequestContext, ours: int, offered: int) -> int:
    """The sealed-frame version agreed on the channel (0: TLS records): ours when the
    consumer offers at least it on a session whose binding can key it."""
    if listener is None or len(ctx.link.binding) != BINDING_SIZE:
        return 0
    return ours if ours and offered >= ours else 0


async def take_channel(ctx: RequestContext, listener: Listener, what: str) -> MemoryChannel | None:
    """The consumer's data channel, or None when it declined it (QUIC carries the
    connection). A channel neither opened nor declined ends the request."""
    accepting = asyncio.ensure_future(closing_in_thread(listener.accept_memory))
    declining = asyncio.ensure_future(ctx.stream.read_message())
    taken = False
    try:
        done, _ = await asyncio.wait({accepting, declining}, return_when=asyncio.FIRST_COMPLETED)
        if accepting in done and accepting.exception() is None:
            taken = True
            return accepting.result()
        # The channel did not open: the consumer says so on the stream (or it
        # saw a channel we did not: nothing would carry the connection).
        async with asyncio.timeout(DECLINE_TIMEOUT):
            message = await declining
        if not isinstance(message, ChannelDeclined):
            raise ProtocolError(
                f"peer sent {type(message).__name__} where a {what}'s "
                "data channel or ChannelDeclined was expected"
            )
        logger.info("[%s] %s data channel declined: %s", ctx.peer.name, what, message.reason)
        return None
    except TimeoutError:
        raise ProtocolError(f"the {what}'s data channel neither opened nor was declined") from None
    finally:
        listener.stop()  # accept() returns within a fraction of a second
        declining.cancel()
        if not accepting.done():
            accepting.cancel()  # a channel it still returns is closed, unclaimed
        elif not taken and not accepting.cancelled() and accepting.exception() is None:
            accepting.result().close()  # opened, yet the consumer declined it
        with contextlib.suppress(asyncio.CancelledError, GPUMeshError):
            await declining


async def carry(
    stream: Stream,
    server: socket.socket,
    channel: MemoryChannel | None,
    sealed_to: bytes | None,
) -> None:
    """The connection's bytes until both sides ended: over ``channel`` when there is
    one (sealed frames keyed to ``sealed_to``, else TLS records), else as DATA frames."""
    if channel is not None:
        await splice(stream, server, channel, sealed_to=sealed_to)
        return
    try:
        reader, writer = await asyncio.open_connection(sock=server, limit=READ_LIMIT)
    except BaseException:
        server.close()
        raise
    await pump(stream, reader, writer)
