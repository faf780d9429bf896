"""The data channels the provider opens: one per request, for its file or tar bytes.

Owns whether a channel is opened (``data_channel`` on, and for a tar, room in
the link's ``link_buffer`` for the pump's buffers), the one-shot TLS listener
that admits only the requesting address with a fresh ticket (see
:mod:`gpumesh.transport.channel`), the tie between a channel and its QUIC
request (the request ending early stops its channel), and a request's tar
over a channel both ways: :meth:`DataChannels.offer`,
:meth:`~DataChannels.receive_tar` and :meth:`~DataChannels.send_tar` serve
the file service's ``DirPut`` and ``DirGet``, a job's workdir and an app's
files alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpumesh.agent.deps import Provider, RequestContext, Settings
from gpumesh.blocking import closing_in_thread, in_thread
from gpumesh.errors import ConnectionLostError, GPUMeshError, ProtocolError, UnreachableError
from gpumesh.files.pack import write_tar
from gpumesh.files.transfer import Hasher, swallow, unpack_pieces
from gpumesh.protocol.messages import ChannelDeclined, ChannelOffer, FileDone, Message
from gpumesh.transport.channel import HELD, Listener, receive_stream, send_stream, server_context

if TYPE_CHECKING:
    import ssl

    from gpumesh.files.pack import PackPlan
    from gpumesh.identity.keys import Identity
    from gpumesh.transport.channel import Channel, Listener
    from gpumesh.transport.quic import QuicLink
    from gpumesh.transport.stream import Stream

__all__ = ["FINISH_WAIT", "DataChannels", "TarOffer", "channel_of", "no_progress"]

logger = logging.getLogger(__name__)

FINISH_WAIT = 30.0
"""How long a finished transfer waits for the consumer to end its side."""
_CHANNEL_STALL = 20.0
"""Seconds without progress on a data channel after which it counts as dropped."""


@dataclass
class TarOffer:
    """A data channel offered for one request's tar. The pump's buffers count in the
    request's link (as unread bytes, against its ``link_buffer``) until it is closed."""

    listener: Listener
    link: QuicLink
    held: int

    def __post_init__(self) -> None:
        self.link.note_unread(self.held)

    def close(self) -> None:
        """Stop listening and give back what was counted (once; from the event loop)."""
        self.listener.stop()
        self.listener.close()
        if self.held:
            self.link.note_unread(-self.held)
            self.held = 0


class DataChannels:
    """The data channels this provider opens for its peers' requests."""

    def __init__(self, provider: Provider, settings: Settings, identity: Identity) -> None:
        self.provider = provider
        self.settings = settings
        self.identity = identity
        """Whose certificate data channels present."""
        self._tls: ssl.SSLContext | None = None

    def enabled(self) -> bool:
        return str(self.settings.get("data_channel")) == "on"

    def listen(self, peer: str) -> Listener:
        """A one-shot TLS listener on the share address, with a fresh ticket, that admits
        only ``peer`` (the IP address the request came from)."""

        if not self.enabled():
            raise UnreachableError(
                f"{self.provider.name} opens no data channels (data_channel off)"
            )
        if self._tls is None:
            self._tls = server_context(self.identity)
        try:
            return Listener(self.provider.host, self._tls, secrets.token_bytes(32), peer=peer)
        except OSError as exc:
            raise UnreachableError(f"cannot open a data channel: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise UnreachableError(f"cannot open a data channel: {exc}") from None

    def offer(
        self, ctx: RequestContext, wanted: bool, answer: Message, hash_name: str = ""
    ) -> TarOffer | None:
        """Send ``answer``, the request's usual first answer, after a ChannelOffer when
        the consumer asked for a channel for its tar, this provider opens them, and
        the link has room for the pump's buffers (its ``link_buffer`` counts them
        while the offer lives); the offer, or None: the tar goes as DATA on QUIC.
        ``hash_name``: the tar's hash, named in the offer where the request carries
        no other answer that names it (a JobSubmit's workdir); empty: none named."""

        offer = None
        if wanted and self.enabled():
            limit = ctx.link.buffer_limit
            if limit and ctx.link.held() + HELD > limit:
                logger.info(
                    "[%s] no data channel for a tar: the connection holds too much "
                    "(link_buffer); QUIC instead",
                    ctx.peer.name,
                )
            else:
                try:
                    listener = self.listen(ctx.link.remote_address()[0])
                except UnreachableError as exc:
                    logger.debug("[%s] no data channel for a tar: %s", ctx.peer.name, exc)
                else:
                    offer = TarOffer(listener, ctx.link, HELD)
        try:
            if offer is not None:
                listener = offer.listener
                ctx.stream.send_message(
                    ChannelOffer(
                        port=listener.port, ticket=listener.ticket, offset=0, hash=hash_name
                    )
                )
            ctx.stream.send_message(answer)
        except BaseException:
            if offer is not None:
                offer.close()
            raise
        return offer

    async def receive_tar(
        self,
        ctx: RequestContext,
        offer: TarOffer,
        size: int,
        dest: Path,
        limit: int,
        hasher: Hasher,
        owner: tuple[int, int] | None = None,
    ) -> bool:
        """Unpack the request's tar from its data channel into ``dest`` (all or nothing,
        the same unpacker, ``limit`` and ``owner`` as over QUIC) and check it against
        the FileDone the consumer sends on QUIC after it; on any failure ``dest`` is
        removed. False: the consumer declined the channel, and the tar comes as
        DATA on the stream."""

        following = _next_message(ctx.stream, offer.listener)
        consume = functools.partial(unpack_pieces, dest=dest, limit=limit, owner=owner)
        try:
            try:
                async with channel_of(offer.listener, following) as channel:
                    await in_thread(receive_stream, channel, size, consume, hasher, no_progress)
                    done = await asyncio.wait_for(asyncio.shield(following), FINISH_WAIT)
            except ConnectionLostError:
                if _declined(following):
                    return False
                raise
            except TimeoutError:
                raise ConnectionLostError("the consumer did not finish the upload") from None
            matches = isinstance(done, FileDone) and (done.size, done.digest) == (
                size,
                hasher.digest(),
            )
            if not matches:
                raise ProtocolError(
                    "the tar sent over the data channel does not match its hash and was "
                    "discarded; send it again"
                )
        except BaseException:
            await in_thread(shutil.rmtree, dest, True)
            raise
        finally:
            _let_go(following)
            offer.close()
        return True

    async def send_tar(
        self, ctx: RequestContext, offer: TarOffer, plan: PackPlan, size: int, hasher: Hasher
    ) -> bool:
        """Send ``plan`` as a tar of exactly ``size`` bytes over the request's data
        channel, then FileDone on QUIC, and wait for the consumer to end its side.
        False: the consumer declined the channel; nothing was sent."""

        stream = ctx.stream
        following = _next_message(stream, offer.listener)
        produce = functools.partial(write_tar, plan)
        try:
            try:
                async with channel_of(offer.listener, following) as channel:
                    await in_thread(send_stream, channel, size, produce, hasher, no_progress)
                    stream.send_message(FileDone(size=size, digest=hasher.digest()), end=True)
                    # The consumer ends its side once it checked FileDone.
                    with contextlib.suppress(GPUMeshError, TimeoutError):
                        await asyncio.wait_for(asyncio.shield(following), FINISH_WAIT)
            except ConnectionLostError:
                if _declined(following):
                    return False
                raise
        finally:
            _let_go(following)
            offer.close()
        return True


@contextlib.asynccontextmanager
async def channel_of(listener: Listener, watch: asyncio.Future[Any]) -> AsyncIterator[Channel]:
    """The listener's one connection, torn down when the QUIC request ends early.

    ``watch`` is the request's next step on QUIC; its failing (the consumer
    gave up, a newer upload took over, the link dropped) stops the channel.
    """
    channel: Channel | None = None

    def stop(future: asyncio.Future[Any]) -> None:
        if future.cancelled() or future.exception() is not None:
            listener.stop()
            if channel is not None:
                channel.abort()

    watch.add_done_callback(stop)
    try:
        channel = await closing_in_thread(listener.accept, _CHANNEL_STALL)
        if watch.done():
            stop(watch)
        yield channel
    finally:
        watch.remove_done_callback(stop)
        listener.stop()
        listener.close()
        if channel is not None:
            channel.close()


def no_progress(_count: int) -> None:
    """A channel pump's progress, which the provider does not report."""
    return None


def _next_message(stream: Stream, listener: Listener) -> asyncio.Future[Message]:
    """The consumer's next message on a request whose tar was offered a channel: its
    FileDone, or ChannelDeclined, which stops the listener at once."""
    following = asyncio.ensure_future(stream.read_message())

    def declined(future: asyncio.Future[Message]) -> None:
        if _declined(future):
            listener.stop()

    following.add_done_callback(declined)
    return following


def _declined(future: asyncio.Future[Message]) -> bool:
    return (
        future.done()
        and not future.cancelled()
        and future.exception() is None
        and isinstance(future.result(), ChannelDeclined)
    )


def _let_go(future: asyncio.Future[Any]) -> None:
    future.cancel()  # nothing, once it is done
    future.add_done_callback(swallow)
