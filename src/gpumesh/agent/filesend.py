"""Downloads from a peer's sandbox: ``FileGet``, ``ChannelGet`` and ``DirGet``.

A file is read through a descriptor opened in the sandbox (never through a
link), from the offset the consumer already has, and its whole hash, the
kept part included, follows the bytes in ``FileDone``; over a data channel
the same, with the bytes on the channel. A folder goes as one tar, packed
as it is sent (files opened again through the folder's descriptor), over a
data channel when the request asks for one and one opens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
from typing import TYPE_CHECKING

from gpumesh.agent.datachannel import FINISH_WAIT, channel_of, no_progress
from gpumesh.agent.deps import RequestContext
from gpumesh.agent.joboutputs import OUTPUTS_FOLDER
from gpumesh.agent.sandboxfs import refusing
from gpumesh.blocking import in_thread
from gpumesh.errors import (
    AgentError,
    ConfigError,
    ConnectionLostError,
    GPUMeshError,
    NotFoundError,
    ProtocolError,
)
from gpumesh.files.hashing import choose, new_hasher
from gpumesh.files.pack import scan_tree, tar_size
from gpumesh.files.sandbox import Tree
from gpumesh.files.transfer import file_chunks, hash_file, swallow, tar_chunks, worker
from gpumesh.platform import at_idle_priority
from gpumesh.protocol.messages import ChannelGet, ChannelOffer, DirGet, FileDone, FileGet, FileInfo
from gpumesh.transport.channel import send_file

if TYPE_CHECKING:
    from gpumesh.agent.files import FileService
    from gpumesh.files.pack import PackPlan
    from gpumesh.store.peers import Peer
    from gpumesh.transport.stream import Stream

__all__ = ["FileSender"]

logger = logging.getLogger(__name__)


class FileSender:
    """The file service's downloads."""

    def __init__(self, files: FileService) -> None:
        self.files = files

    @refusing
    async def handle_get(self, ctx: RequestContext, message: FileGet) -> None:
        where = self.files.where(message.path)
        fd = await in_thread(self.files.open_regular, ctx.peer, message.path)
        async with worker(cleanup=lambda: os.close(fd)) as runner:
            st = os.fstat(fd)
            stream = ctx.stream
            hash_name = choose(message.hashes)
            _announce_file(stream, message.path, message.offset, st, where, hash_name)
            hasher = new_hasher(hash_name)
            # The whole file's hash goes in FileDone: the part the peer already
            # has is hashed first, on the worker, ahead of the reads.
            runner.submit(hash_file, fd, message.offset, hasher).add_done_callback(swallow)
            chunks = file_chunks(runner, fd, message.offset, st.st_size, hasher)
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    await stream.send_data(chunk)
            stream.end_data()
            stream.send_message(FileDone(size=st.st_size, digest=hasher.digest()), end=True)
        await _until_finished(stream)
        logger.info("[%s] sent %s (%d bytes)", ctx.peer.name, where, st.st_size - message.offset)

    @refusing
    async def handle_channel_get(self, ctx: RequestContext, message: ChannelGet) -> None:
        """``FileGet`` with the bytes over a data channel."""

        where = self.files.where(message.path)
        listener = self.files.channels.listen(ctx.link.remote_address()[0])
        try:
            fd = await in_thread(self.files.open_regular, ctx.peer, message.path)
        except BaseException:
            listener.stop()
            listener.close()
            raise
        try:
            st = os.fstat(fd)
            stream = ctx.stream
            hash_name = choose(message.hashes)
            _announce_file(stream, message.path, message.offset, st, where, hash_name)
            stream.send_message(
                ChannelOffer(port=listener.port, ticket=listener.ticket, offset=message.offset)
            )
            # The consumer ends its side only after FileDone: an earlier end is a give-up.
            answered = asyncio.Event()
            ended = asyncio.ensure_future(_consumer_end(stream, answered))
            hasher = new_hasher(hash_name)
            try:
                async with channel_of(listener, ended) as channel:
                    # A job's outputs go home while it runs: the job comes first.
                    send = at_idle_priority(send_file) if _is_outputs(message.path) else send_file
                    await in_thread(
                        send, channel, fd, message.offset, st.st_size, hasher, no_progress
                    )
                    answered.set()
                    stream.send_message(FileDone(size=st.st_size, digest=hasher.digest()), end=True)
                    with contextlib.suppress(GPUMeshError, TimeoutError):
                        await asyncio.wait_for(asyncio.shield(ended), FINISH_WAIT)
            finally:
                if not ended.done():
                    ended.cancel()
                ended.add_done_callback(swallow)
        finally:
            listener.close()
            os.close(fd)
        logger.info(
            "[%s] sent %s over a data channel (%d bytes)",
            ctx.peer.name,
            where,
            st.st_size - message.offset,
        )

    @refusing
    async def handle_dir_get(self, ctx: RequestContext, message: DirGet) -> None:
        where = self.files.where(message.path)
        folder, plan = await in_thread(self._plan_folder, ctx.peer, message.path)
        via = ""
        try:
            size = tar_size(plan)
            st = await in_thread(os.fstat, folder.fd)
            stream = ctx.stream
            hash_name = choose(message.hashes)
            info = FileInfo(
                path=message.path,
                exists=True,
                kind="dir",
                size=size,
                mode=stat.S_IMODE(st.st_mode),
                mtime=st.st_mtime,
                hash=hash_name,
            )
            channels = self.files.channels
            offer = channels.offer(ctx, message.channel, info)
            hasher = new_hasher(hash_name)
            if offer is not None and await channels.send_tar(ctx, offer, plan, size, hasher):
                via = " over a data channel"
            else:
                sent = 0
                # Files are opened again through the folder's descriptor as they are packed.
                async with contextlib.aclosing(tar_chunks(plan, hasher)) as chunks:
                    async for chunk in chunks:
                        sent += len(chunk)
                        await stream.send_data(chunk)
                if sent != size:
                    raise AgentError(f"{where} changed while it was packed; copy it again")
                stream.end_data()
                stream.send_message(FileDone(size=size, digest=hasher.digest()), end=True)
                await _until_finished(stream)
        finally:
            folder.close()
        logger.info("[%s] sent folder %s%s (%d bytes of tar)", ctx.peer.name, where, via, size)

    def _plan_folder(self, peer: Peer, remote: str) -> tuple[Tree, PackPlan]:
        """The folder at ``remote``, opened, and what of it to send (blocking)."""

        files = self.files
        parts = files.parts(remote)
        with files.tree(peer) as tree:
            st = files.lstat(tree, parts, remote)
            if st is None:
                raise NotFoundError(f"{files.where(remote)} does not exist")
            if not stat.S_ISDIR(st.st_mode):
                raise ConfigError(f"{files.where(remote)} is not a folder")
            folder = files.subtree(tree, parts, remote)
        try:
            return folder, scan_tree(folder)
        except BaseException:
            folder.close()
            raise


def _is_outputs(path: str) -> bool:
    """Whether a sandbox path lies in a job's outputs folder (``/gpumesh-outputs/...``)."""
    return path.lstrip("/").startswith(OUTPUTS_FOLDER + "/")


def _announce_file(
    stream: Stream, path: str, offset: int, st: os.stat_result, where: str, hash_name: str
) -> None:
    """Answer a download with the file's FileInfo (naming the hash of its FileDone),
    after checking the resume offset."""
    if offset > st.st_size:
        raise ProtocolError(
            f"asked for {where} from byte {offset}, past its end ({st.st_size} bytes)"
        )
    stream.send_message(
        FileInfo(
            path=path,
            exists=True,
            kind="file",
            size=st.st_size,
            mode=stat.S_IMODE(st.st_mode),
            mtime=st.st_mtime,
            hash=hash_name,
        )
    )


async def _until_finished(stream: Stream) -> None:
    """Keep a download's stream until the consumer ends it.

    The consumer returns credit while it reads the last chunks; were the
    stream forgotten before that credit arrives, it would open a new request.
    """
    with contextlib.suppress(GPUMeshError, TimeoutError):
        async with asyncio.timeout(FINISH_WAIT):
            while await stream.read_frame() is not None:
                pass


async def _consumer_end(stream: Stream, answered: asyncio.Event) -> None:
    """Wait for the consumer to end its side; raise when it did before ``answered``."""
    while await stream.read_frame() is not None:
        pass
    if not answered.is_set():
        raise ConnectionLostError("the consumer ended the request before the file was sent")
