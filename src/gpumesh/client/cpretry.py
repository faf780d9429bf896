"""One copy run to its end: attempts, retries after a dropped link, and what they share.

Owns the retry loop (a dropped link or a provider that stops answering is
retried a few times, after a pause, each attempt resuming where the last one
stopped), the timeouts that tell a dead link from a slow one, progress, and
the choice an attempt makes between a data channel (TLS on TCP, opened and
authorised by the QUIC request, see :mod:`gpumesh.transport.channel`) and
QUIC: a channel is tried when a direct path exists and neither side turned it
off, and once one cannot be opened the copy goes on over QUIC at once,
silently. The uploads (:mod:`gpumesh.client.cpupload`) and the downloads
(:mod:`gpumesh.client.cpdownload`) are :class:`Copier` subclasses.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from gpumesh.blocking import in_thread
from gpumesh.client.bulk import NoChannel, open_channel, why_no_channel
from gpumesh.errors import (
    ConfigError,
    ConnectionLostError,
    GPUMeshError,
    LimitError,
    ProtocolError,
    UnreachableError,
)
from gpumesh.protocol.messages import ChannelOffer, FileInfo, FileStat

if TYPE_CHECKING:
    from gpumesh.client.files import CopyCallbacks, CopyResult
    from gpumesh.client.node import Node
    from gpumesh.store.peers import Peer
    from gpumesh.transport.channel import Channel
    from gpumesh.transport.session import Session
    from gpumesh.transport.stream import Stream

__all__ = ["RESPONSE_TIMEOUT", "Copier", "local_error", "run_pump", "shown"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

RESPONSE_TIMEOUT = 300.0
"""Seconds to wait for an answer that may first need the provider to re-hash a
partial file (resuming a large upload)."""
_BACKOFF = (1.0, 2.0, 4.0, 8.0)
"""Seconds before each retry: long enough for a restarted agent to come back."""


class Copier:
    """One copy, attempted up to 1 + retries times; it fills in ``result``."""

    def __init__(
        self,
        node: Node,
        peer: Peer,
        local: Path,
        remote: str,
        callbacks: CopyCallbacks,
        stall_timeout: float,
        result: CopyResult,
    ) -> None:
        self.node = node
        self.peer = peer
        self.local = local
        self.remote = remote
        self.callbacks = callbacks
        self.stall_timeout = stall_timeout
        self.result = result
        self.done = 0
        """Bytes in place at the far end (or here) so far."""
        self.fast = False
        """Try the data channel (cleared for good once one could not be opened)."""
        self.background = False
        """Background work (a job's outputs): its channel's bytes move at the lowest CPU
        priority (:func:`gpumesh.platform.at_idle_priority`)."""

    def allow_channel(self, fast_path: bool) -> None:
        """Whether the data channel may be tried at all (the user's and the config's word)."""

        self.fast = fast_path and str(self.node.home.config.get("data_channel")) == "on"
        if not self.fast:
            self.result.no_channel = NoChannel.OFF

    async def prepare(self) -> None:
        """Local work done once, before any attempt."""

    async def attempt(self, session: Session) -> None:
        raise NotImplementedError

    async def run(self, retries: int, started: float) -> CopyResult:
        await self.prepare()
        attempt = 1
        while True:
            try:
                async with self.node.live_session(self.peer.node_id) as session:
                    await self.attempt(session)
                break
            except (ConnectionLostError, UnreachableError) as exc:
                error: GPUMeshError = exc
            except OSError as exc:
                logger.debug("copy failed here", exc_info=True)
                raise local_error(exc) from None
            if attempt > retries:
                raise self.gave_up(error) from None
            attempt += 1
            logger.info("copy: %s; attempt %d", error, attempt)
            self.callbacks.retrying(error, attempt)
            await asyncio.sleep(_BACKOFF[min(attempt - 2, len(_BACKOFF) - 1)])
        self.result.seconds = time.perf_counter() - started
        return self.result

    def gave_up(self, exc: GPUMeshError) -> GPUMeshError:
        return type(exc)(exc.message)

    # --- shared steps ---------------------------------------------------------------------

    async def stat_remote(self, session: Session, path: str) -> FileInfo:
        stream = session.open_stream()
        try:
            stream.send_message(FileStat(path=path), end=True)
            return await self.within(RESPONSE_TIMEOUT, stream.expect(FileInfo))
        finally:
            session.link.forget_stream(stream.stream_id)

    async def within(self, seconds: float, step: Awaitable[T]) -> T:
        """``step``, or ConnectionLostError when the peer shows no sign of life for ``seconds``."""
        try:
            async with asyncio.timeout(seconds):
                return await step
        except TimeoutError:
            raise ConnectionLostError(
                f"{self.peer.name} stopped answering (nothing for {seconds:.0f}s)"
            ) from None

    def begin(self, offset: int, total: int) -> None:
        """An attempt starts with ``offset`` bytes of ``total`` already in place."""
        self.result.offsets.append(offset)
        self.done = offset
        self.callbacks.progress(offset, total)

    def advance(self, count: int, total: int) -> None:
        self.done += count
        self.result.transferred += count
        self.callbacks.progress(self.done, total)

    def remote_label(self, path: str) -> str:
        return f"{self.peer.name}:{shown(path)}"

    def use_channel(self, session: Session) -> bool:
        """Whether to ask for a data channel now (if not, ``result.no_channel`` says why)."""

        if not self.fast:
            return False
        why = why_no_channel(self.node, self.peer, session)
        if why is not None:
            self.result.no_channel = why
            return False
        return True

    def no_channel(
        self, stream: Stream, session: Session, why: GPUMeshError, failed: bool = False
    ) -> None:
        """The data channel could not be opened (``failed``) or was not offered: this
        copy goes on over QUIC."""

        logger.debug("copy: no data channel to %s (%s); using QUIC", self.peer.name, why)
        self.fast = False
        self.result.no_channel = NoChannel.FAILED if failed else NoChannel.NOT_OFFERED
        with contextlib.suppress(GPUMeshError):
            stream.abort()
        session.link.forget_stream(stream.stream_id)

    async def offer(self, stream: Stream) -> ChannelOffer | None:
        """The provider's ChannelOffer; None when it opens no channel (then: QUIC)."""
        try:
            return await self.within(RESPONSE_TIMEOUT, stream.expect(ChannelOffer))
        except (ProtocolError, UnreachableError):
            # An older provider (it does not know the request), one with
            # data_channel off, or one that could not listen.
            return None

    async def open_channel(self, session: Session, offer: ChannelOffer) -> Channel | None:
        channel = await open_channel(self.node, session, self.peer, offer, self.stall_timeout)
        if channel is not None:
            self.result.congestion = channel.congestion
        return channel


def shown(remote: str) -> str:
    """``remote`` from the sandbox root, as results and messages name it."""
    return "/" + "/".join(part for part in remote.split("/") if part not in ("", "."))


async def run_pump(channel: Channel, fd: int, pump: Callable[..., None], *args: Any) -> None:
    """Run a channel pump on its own thread, which closes ``fd`` when it ends.

    Leaving early (cancelled, stopped) aborts the channel, so the thread ends
    too (closing the channel then waits for the thread to let go of it).
    """

    def run() -> None:
        try:
            pump(channel, fd, *args)
        finally:
            os.close(fd)

    running = in_thread(run)
    try:
        await asyncio.shield(running)
    except BaseException:
        channel.abort()
        raise


def local_error(exc: OSError) -> GPUMeshError:
    """An OS error met on this machine, as one line that says what to do."""
    where = f" ({exc.filename})" if exc.filename else ""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return LimitError(f"this machine's disk is full{where}; free some space and copy again")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return ConfigError(f"permission denied{where}")
    return ConfigError(f"{exc.strerror or exc}{where}")
