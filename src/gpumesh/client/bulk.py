"""How the consumer's bulk bytes travel: over the data channel when they can, else QUIC.

Owns the consumer's side of the data channel (see :mod:`gpumesh.transport.channel`)
that every bulk transfer shares: whether to ask a peer for one at all; dialling
an offered one, and remembering per peer, in the store, that one did not open
(a firewall that drops the channel's TCP port costs one connect timeout, and
for :data:`BLOCKED_FOR` after it copies, folders, workdirs and app syncs go
straight to QUIC); and a tar (a folder, a job's workdir, an app's files) sent
or received over an offered channel: the exact bytes on the channel, then the
size and hash of the tar on the QUIC request. When the offered channel cannot
be opened, the consumer answers ``ChannelDeclined`` and the caller moves the
tar as DATA on the same request, as without a channel.

Nothing here prints.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import shutil
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from gpumesh.blocking import closing_in_thread, in_thread
from gpumesh.errors import (
    ConnectionLostError,
    ProtocolError,
    TransportError,
    UnreachableError,
)
from gpumesh.files.hashing import label, new_hasher
from gpumesh.files.pack import write_tar
from gpumesh.files.transfer import unpack_pieces
from gpumesh.protocol.messages import (
    ChannelDeclined,
    ChannelOffer,
    FileDone,
    ImagePull,
    Message,
)
from gpumesh.transport.channel import dial, receive_stream, send_stream

if TYPE_CHECKING:
    from gpumesh.client.node import Node
    from gpumesh.files.pack import PackPlan
    from gpumesh.store.peers import Peer
    from gpumesh.transport.channel import Channel
    from gpumesh.transport.session import Session
    from gpumesh.transport.stream import Stream

__all__ = [
    "BLOCKED_FOR",
    "NoChannel",
    "Unpacked",
    "answer_after_offer",
    "open_channel",
    "receive_tar",
    "send_tar",
    "threadsafe",
    "why_no_channel",
]

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
T = TypeVar("T")

BLOCKED_FOR = 600.0
"""Seconds a peer's data channel is not tried again after one failed to open."""
_REFUSAL_WAIT = 5.0
"""How long a broken channel waits for the provider's reason on QUIC."""
_ANSWER_WAIT = 300.0
"""How long to wait for an answer on QUIC (the provider may be checking a hash)."""


class NoChannel(enum.StrEnum):
    """Why bulk bytes went over QUIC rather than a data channel."""

    OFF = "off"
    """The consumer asked for QUIC (``--no-fast-path``) or set ``data_channel off``."""
    RELAYED = "relayed"
    """The session goes through a relay: there is no direct TCP path."""
    BLOCKED = "blocked"
    """A data channel to this peer failed to open recently: not tried."""
    FAILED = "failed"
    """The offered channel could not be opened now (it is remembered)."""
    NOT_OFFERED = "not offered"
    """The provider opens none (an older one, or its ``data_channel off``)."""
    SMALL = "small"
    """Too few bytes to be worth a channel's TCP connect and TLS handshake (app syncs)."""


def why_no_channel(
    node: Node, peer: Peer, session: Session, *, now: float | None = None
) -> NoChannel | None:
    """Why this transfer should not ask for a data channel; None: it should."""
    if str(node.home.config.get("data_channel")) != "on":
        return NoChannel.OFF
    # A session set up through the relay has no direct TCP path to the peer,
    # even once hole punching moved its UDP packets onto a direct one.
    if session.through_relay:
        return NoChannel.RELAYED
    if peer.channel_blocked_until > (time.time() if now is None else now):
        return NoChannel.BLOCKED
    return None


async def open_channel(
    node: Node, session: Session, peer: Peer, offer: ChannelOffer, stall_timeout: float
) -> Channel | None:
    """Dial an offered channel; None when it cannot be opened (the transfer goes on
    over QUIC), remembered for :data:`BLOCKED_FOR` when nothing answered."""

    try:
        return await closing_in_thread(
            dial, session.address[0], offer.port, peer.public_key, offer.ticket, stall_timeout
        )
    except UnreachableError as exc:
        node.home.store.block_channel(str(peer.node_id), time.time() + BLOCKED_FOR)
        logger.info(
            "no data channel to %s (%s); QUIC only for %.0f minutes",
            peer.name,
            exc,
            BLOCKED_FOR / 60,
        )
        return None
    except TransportError as exc:
        logger.debug("data channel to %s failed: %s", peer.name, exc)
        return None


async def answer_after_offer(
    stream: Stream,
    kind: type[M],
    wait: float | None = _ANSWER_WAIT,
    on_pull: Callable[[ImagePull], None] | None = None,
) -> tuple[ChannelOffer | None, M]:
    """The answer to a tar request that asked for a channel: a ChannelOffer, when the
    provider makes one, then the request's usual first answer ``kind`` (within
    ``wait`` seconds; None: however long it takes). With ``on_pull`` (the request
    set ``pull_progress``) the provider's ImagePull reports may come first."""
    async with _answer_within(wait):
        message = await stream.read_message()
        while on_pull is not None and isinstance(message, ImagePull):
            on_pull(message)
            message = await stream.read_message()
        offer = None
        if isinstance(message, ChannelOffer):
            offer = message
            message = await stream.read_message()
    if not isinstance(message, kind):
        raise ProtocolError(
            f"peer sent {type(message).__name__} where {kind.__name__} was expected"
        )
    if offer is not None and offer.offset != 0:
        raise ProtocolError("peer offered a tar from the middle")
    return offer, message


async def send_tar(
    node: Node,
    session: Session,
    peer: Peer,
    stream: Stream,
    offer: ChannelOffer,
    plan: PackPlan,
    size: int,
    hash_name: str,
    progress: Callable[[int], None],
    stall_timeout: float,
) -> bytes | None:
    """Send ``plan`` as its tar of exactly ``size`` bytes over the offered channel,
    then FileDone (size, ``hash_name`` digest) on ``stream``; returns that digest.

    None: the channel did not open, ChannelDeclined is sent, and the caller
    sends the tar as DATA. ``progress`` gets the bytes of each piece sent.
    A provider that refused mid-way (it closes the channel) is raised as its
    refusal, not as the broken channel.
    """

    channel = await open_channel(node, session, peer, offer, stall_timeout)
    if channel is None:
        stream.send_message(ChannelDeclined(reason="the data channel did not open"))
        return None
    hasher = new_hasher(hash_name)

    def produce(out: Any) -> None:
        write_tar(plan, out)

    try:
        await _on_thread(channel, send_stream, size, produce, hasher, threadsafe(progress))
    except ConnectionLostError:
        await _refusal(stream)
        raise
    digest = hasher.digest()
    stream.send_message(FileDone(size=size, digest=digest))
    return digest


class Unpacked(NamedTuple):
    """A folder received whole."""

    digest: bytes
    """Its tar's hash, as both ends agreed."""
    content: int
    """Bytes of file contents unpacked (without the tar's headers)."""


async def receive_tar(
    node: Node,
    session: Session,
    peer: Peer,
    stream: Stream,
    offer: ChannelOffer,
    size: int,
    hash_name: str,
    dest: Path,
    progress: Callable[[int], None],
    stall_timeout: float,
) -> Unpacked | None:
    """Unpack the tar of exactly ``size`` bytes arriving over the offered channel into
    ``dest`` (all or nothing, at most ``size`` bytes of content), and check it
    against the FileDone that follows on ``stream``; returns its hash and the bytes
    of content unpacked. On any failure nothing is left at ``dest``.

    None: the channel did not open, ChannelDeclined is sent, and the provider
    sends the tar as DATA on ``stream``.
    """

    channel = await open_channel(node, session, peer, offer, stall_timeout)
    if channel is None:
        stream.send_message(ChannelDeclined(reason="the data channel did not open"))
        return None
    hasher = new_hasher(hash_name)
    consume = functools.partial(unpack_pieces, dest=dest, limit=size)
    try:
        try:
            content = await _on_thread(
                channel, receive_stream, size, consume, hasher, threadsafe(progress)
            )
        except ConnectionLostError:
            await _refusal(stream)
            raise
        async with _answer_within(_ANSWER_WAIT):
            done = await stream.expect(FileDone)
        if done.size != size or done.digest != hasher.digest():
            raise ProtocolError(
                f"the folder from {peer.name} did not match its {label(hash_name)} hash "
                "and was removed; copy it again"
            )
    except BaseException:
        await in_thread(shutil.rmtree, dest, True)
        raise
    return Unpacked(done.digest, content)


async def _on_thread(channel: Channel, pump: Callable[..., T], *args: Any) -> T:
    """Run a pump on its own thread; what it returns. Leaving early (cancelled,
    stopped) aborts the channel so the thread ends too; the channel is closed once
    it let go."""
    running = in_thread(pump, channel, *args)
    try:
        return await asyncio.shield(running)
    except BaseException:
        channel.abort()
        running.add_done_callback(_retrieved)
        raise
    finally:
        channel.close()


def threadsafe(progress: Callable[[int], None]) -> Callable[[int], None]:
    """``progress`` for a pump's thread to call: it runs on this event loop."""
    loop = asyncio.get_running_loop()

    def report(count: int) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody listens
            loop.call_soon_threadsafe(progress, count)

    return report


async def _refusal(stream: Stream) -> None:
    """Raise the provider's refusal when one comes on QUIC soon after the channel broke
    (a refusal closes the channel first); return when none does."""
    with contextlib.suppress(TimeoutError, ConnectionLostError):
        async with asyncio.timeout(_REFUSAL_WAIT):
            await stream.read_message()


@contextlib.asynccontextmanager
async def _answer_within(seconds: float | None) -> AsyncIterator[None]:
    if seconds is None:
        yield
        return
    try:
        async with asyncio.timeout(seconds):
            yield
    except TimeoutError:
        raise ConnectionLostError(
            f"the peer stopped answering (nothing for {seconds:.0f}s)"
        ) from None


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
