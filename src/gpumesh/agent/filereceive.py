"""Uploads into a peer's sandbox: ``FilePut``, ``ChannelPut`` and ``DirPut``.

Every upload is checked against the peer's ``file_quota`` and its target
(a file must not replace a folder, nor a folder a file) before a byte is
written. A file lands in a partial upload outside the sandbox
(:mod:`gpumesh.agent.partials`), resumed after the bytes already there,
hashed while it arrives (the kept part re-hashed from disk), and is
renamed into place, through the sandbox's descriptors, only when its hash
matches the consumer's; over a data channel the same, with the bytes on the
channel and the hash at the end. A folder comes as one tar, unpacked all or
nothing into a staging folder of the agent's own, then moved in.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from gpumesh.agent.datachannel import FINISH_WAIT, channel_of, no_progress
from gpumesh.agent.deps import RequestContext
from gpumesh.agent.partials import (
    discard,
    kept_offset,
    partial_key,
    start_partial,
    truncate_and_hash,
)
from gpumesh.agent.sandboxfs import os_refusal, refusing
from gpumesh.blocking import in_thread
from gpumesh.errors import (
    AccessDeniedError,
    ConfigError,
    ConnectionLostError,
    ProtocolError,
    UnreachableError,
)
from gpumesh.files.hashing import SHA256, choose, label, new_hasher
from gpumesh.files.sandbox import Tree
from gpumesh.files.transfer import FileSink, Worker, swallow, truncate_at, unpack_from, worker
from gpumesh.protocol.messages import (
    ChannelOffer,
    ChannelPut,
    DirPut,
    FileDone,
    FilePut,
    FileResume,
)
from gpumesh.transport.channel import receive_file

if TYPE_CHECKING:
    from gpumesh.agent.files import FileService
    from gpumesh.store.peers import Peer

__all__ = ["FileReceiver"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class FileReceiver:
    """The file service's uploads."""

    def __init__(self, files: FileService) -> None:
        self.files = files

    @refusing
    async def handle_put(self, ctx: RequestContext, message: FilePut) -> None:
        files = self.files
        peer, name = ctx.peer, files.provider.name
        where = files.where(message.path)
        parts, relative = self._file_target(message.path)
        if message.digest is not None:  # an older consumer: its SHA-256 up front
            key, expected = partial_key(relative, message.size, sha256=message.digest)
        elif message.source:
            key, expected = partial_key(relative, message.size, source=message.source)
        else:
            raise ProtocolError(f"the upload to {where} names neither its hash nor its source")
        # Made only when a byte is kept: a refused request leaves nothing behind.
        partials = files.partials(peer, create=False)
        part, meta = partials / f"{key}.part", partials / f"{key}.json"
        async with files.in_flight.claim(peer, key, message.size, ctx.stream):
            replaced = await in_thread(self._replaced_size, peer, parts, message.path)
            offset = await in_thread(kept_offset, part, meta, expected)
            usage = await files.usage(peer, exclude=key)
            usage.check(name, message.size - replaced)
            if offset == 0:
                await in_thread(_guarded, start_partial, part, meta, expected)
            fd = await in_thread(_guarded, os.open, part, os.O_RDWR)
            async with worker(cleanup=lambda: os.close(fd)) as runner:
                digest = await self._receive_file(ctx, runner, fd, offset, message, (part, meta))
        ctx.stream.send_message(FileDone(size=message.size, digest=digest), end=True)
        logger.info(
            "[%s] received %s (%d bytes, from byte %d)", peer.name, where, message.size, offset
        )

    async def _receive_file(
        self,
        ctx: RequestContext,
        runner: Worker,
        fd: int,
        offset: int,
        message: FilePut,
        partial: tuple[Path, Path],
    ) -> bytes:
        """Take the bytes after ``offset`` and check the whole file; its digest."""
        stream = ctx.stream
        part, meta = partial
        where = self.files.where(message.path)
        # An older consumer's FilePut carries its SHA-256; a newer one's hash follows the bytes.
        hash_name = SHA256 if message.digest is not None else choose(message.hashes)
        hasher = new_hasher(hash_name)
        # Drop whatever lies past the offset (a write cut short by a crash),
        # then hash the kept part, all before a new byte is appended.
        await runner.call(truncate_and_hash, fd, offset, hasher)
        stream.send_message(FileResume(offset=offset, hash=hash_name))
        sink = FileSink(runner, fd, hasher)
        received = offset
        try:
            while chunk := await stream.read_data():
                received += len(chunk)
                if received > message.size:
                    raise ProtocolError(f"the upload to {where} is larger than announced")
                await sink.write(chunk)
            await sink.finish()
            expected = message.digest
            if expected is None and received == message.size:
                done = await stream.expect(FileDone)
                if done.size != message.size:
                    raise ProtocolError(f"the upload to {where} ended with another size")
                expected = done.digest
        except ProtocolError:
            await in_thread(discard, part, meta)
            raise
        except BaseException:
            # The link dropped (or the agent stops): keep what arrived for a resume.
            with contextlib.suppress(BaseException):
                await asyncio.shield(sink.finish())
            raise
        if received != message.size:
            await in_thread(discard, part, meta)
            raise ProtocolError(
                f"the upload to {where} ended after {received} of {message.size} bytes"
            )
        digest = hasher.digest()
        if digest != expected:
            await in_thread(discard, part, meta)
            raise ProtocolError(
                f"the upload to {where} does not match its {label(hash_name)} hash and was "
                "discarded; copy it again"
            )
        await runner.call(self._place_file, ctx.peer, fd, message.mode, partial, message.path)
        return digest

    @refusing
    async def handle_channel_put(self, ctx: RequestContext, message: ChannelPut) -> None:
        """``FilePut`` with the bytes over a data channel and the hash at the end."""

        files = self.files
        peer, name, stream = ctx.peer, files.provider.name, ctx.stream
        where = files.where(message.path)
        if not files.channels.enabled():
            raise UnreachableError(f"{name} opens no data channels (data_channel off)")
        parts, relative = self._file_target(message.path)
        key, expected = partial_key(relative, message.size, source=message.source)
        # Made only when a byte is kept: a refused request leaves nothing behind.
        partials = files.partials(peer, create=False)
        part, meta = partials / f"{key}.part", partials / f"{key}.json"
        async with files.in_flight.claim(peer, key, message.size, stream):
            replaced = await in_thread(self._replaced_size, peer, parts, message.path)
            offset = await in_thread(kept_offset, part, meta, expected)
            usage = await files.usage(peer, exclude=key)
            usage.check(name, message.size - replaced)
            if offset == 0:
                await in_thread(_guarded, start_partial, part, meta, expected)
            hash_name = choose(message.hashes)
            hasher = new_hasher(hash_name)
            fd = await in_thread(_guarded, os.open, part, os.O_RDWR)
            try:
                # Drop what lies past the offset before a byte is added; the kept
                # part is hashed while the first new bytes arrive.
                await in_thread(truncate_at, fd, offset)
                listener = files.channels.listen(ctx.link.remote_address()[0])
                stream.send_message(
                    ChannelOffer(
                        port=listener.port, ticket=listener.ticket, offset=offset, hash=hash_name
                    )
                )
                final = asyncio.ensure_future(stream.expect(FileDone))
                try:
                    async with channel_of(listener, final) as channel:
                        remaining = message.size - offset
                        await in_thread(
                            receive_file, channel, fd, remaining, hasher, no_progress, offset
                        )
                        done = await asyncio.wait_for(asyncio.shield(final), FINISH_WAIT)
                finally:
                    final.cancel()  # nothing, once it is done
                    final.add_done_callback(swallow)
                digest = hasher.digest()
                if done.size != message.size or done.digest != digest:
                    await in_thread(discard, part, meta)
                    raise ProtocolError(
                        f"the upload to {where} does not match its {label(hash_name)} hash and "
                        "was discarded; copy it again"
                    )
                await in_thread(
                    self._place_file, peer, fd, message.mode, (part, meta), message.path
                )
            except ProtocolError:
                await in_thread(discard, part, meta)
                raise
            except TimeoutError:
                raise ConnectionLostError("the consumer did not finish the upload") from None
            finally:
                os.close(fd)
        stream.send_message(FileDone(size=message.size, digest=digest), end=True)
        logger.info(
            "[%s] received %s over a data channel (%d bytes, from byte %d)",
            peer.name,
            where,
            message.size,
            offset,
        )

    @refusing
    async def handle_dir_put(self, ctx: RequestContext, message: DirPut) -> None:
        files = self.files
        peer, name = ctx.peer, files.provider.name
        parts = files.parts(message.path)
        where = files.where(message.path)
        await in_thread(self._check_folder_target, peer, parts, message.path)
        temp_name = f"dir-{secrets.token_hex(8)}"
        temp = files.partials(peer) / temp_name
        stream = ctx.stream
        async with files.in_flight.claim(peer, temp_name, message.size, None):
            usage = await files.usage(peer, exclude=temp_name)
            usage.check(name, message.size)
            hash_name = choose(message.hashes)
            hasher = new_hasher(hash_name)
            received = 0
            limit = max(0, usage.quota - usage.used)
            via = ""
            channels = files.channels
            offer = channels.offer(ctx, message.channel, FileResume(offset=0, hash=hash_name))
            try:
                # Unpacked straight to the jobs' owner: no second walk to chown it.
                if offer is not None and await channels.receive_tar(
                    ctx, offer, message.size, temp, limit, hasher, files.owner
                ):
                    received, via = message.size, " over a data channel"
                else:
                    async with unpack_from(temp, limit, hasher, files.owner) as feed:
                        while chunk := await stream.read_data():
                            received += len(chunk)
                            if received > message.size:
                                raise ProtocolError(
                                    f"the folder sent to {where} is larger than announced"
                                )
                            await feed(chunk)
                        if received != message.size:
                            raise ProtocolError(
                                f"the folder sent to {where} ended after {received} of "
                                f"{message.size} bytes"
                            )
                        await feed(None)
                await in_thread(self._place_folder, peer, temp, message.path)
            finally:
                await in_thread(shutil.rmtree, temp, True)
        stream.send_message(FileDone(size=received, digest=hasher.digest()), end=True)
        logger.info("[%s] received folder %s%s (%d bytes of tar)", peer.name, where, via, received)

    # --- blocking steps: the target checked, the upload placed ------------------------------

    def _file_target(self, remote: str) -> tuple[tuple[str, ...], str]:
        """An upload's parts in the sandbox and its path from the sandbox root."""
        parts = self.files.parts(remote)
        if not parts:
            raise ConfigError(
                f"{self.files.where(remote)} is your folder itself: name a file to copy to"
            )
        return parts, "/".join(parts)

    def _replaced_size(self, peer: Peer, parts: tuple[str, ...], remote: str) -> int:
        """Bytes of the file an upload will replace (0: none); a folder cannot be replaced."""
        where = self.files.where(remote)
        with self.files.tree(peer) as tree:
            st = self.files.lstat(tree, parts, remote)
            if st is None:
                self._check_parents(tree, parts, remote)
                return 0
        if stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"{where} is a folder: copy into it as {where.rstrip('/')}/NAME")
        if not stat.S_ISREG(st.st_mode):
            raise AccessDeniedError(f"{where} is not a regular file (a device, pipe or socket)")
        return st.st_size

    def _check_parents(self, tree: Tree, parts: tuple[str, ...], remote: str) -> None:
        """Refuse now, not after the transfer, when a file sits where a folder must go."""
        for end in range(len(parts) - 1, 0, -1):
            st = self.files.lstat(tree, parts[:end], remote)
            if st is None:
                continue
            if not stat.S_ISDIR(st.st_mode):
                raise ConfigError(
                    f"cannot create {self.files.where(remote)}: {parts[end - 1]!r} there is a file"
                )
            return

    def _check_folder_target(self, peer: Peer, parts: tuple[str, ...], remote: str) -> None:
        with self.files.tree(peer) as tree:
            st = self.files.lstat(tree, parts, remote)
            if st is None:
                self._check_parents(tree, parts, remote)
            elif not stat.S_ISDIR(st.st_mode):
                raise ConfigError(
                    f"{self.files.where(remote)} is a file, not a folder: pick another name"
                )

    def _place_file(
        self, peer: Peer, fd: int, mode: int, partial: tuple[Path, Path], remote: str
    ) -> None:
        """Rename a finished upload into place, through the sandbox's descriptors."""
        part, meta = partial
        os.fchmod(fd, mode & 0o777)  # set-id and sticky bits never travel
        if self.files.owner is not None:
            os.fchown(fd, *self.files.owner)
        refusal = f"{self.files.where(remote)} became a folder during the upload"
        self._move_in(peer, part, remote, Tree.place, (IsADirectoryError, refusal))
        meta.unlink(missing_ok=True)

    def _place_folder(self, peer: Peer, temp: Path, remote: str) -> None:
        """Move an unpacked folder (unpacked for the sandbox's owner already) into place:
        renamed when new, merged into an existing one."""
        refusal = f"{self.files.where(remote)} is not a folder: pick another name"
        self._move_in(peer, temp, remote, Tree.place_tree, (NotADirectoryError, refusal))

    def _move_in(
        self,
        peer: Peer,
        staged: Path,
        remote: str,
        move: Callable[[Tree, int, str, tuple[str, ...]], None],
        in_the_way: tuple[type[OSError], str],
    ) -> None:
        """Move ``staged`` (in the agent's own staging folder) to ``remote`` in the
        sandbox with ``move``; ``in_the_way``: what is there that cannot be
        replaced, and the refusal that says so."""
        source = os.open(staged.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            with self.files.tree(peer) as tree:
                move(tree, source, staged.name, self.files.parts(remote))
        except in_the_way[0]:
            raise ConfigError(in_the_way[1]) from None
        except OSError as exc:
            raise self.files.refusal(exc, remote) from None
        finally:
            os.close(source)


def _guarded(function: Callable[..., T], *args: Any) -> T:
    """Turn the OS errors a request can meet into refusals that say what happened."""
    try:
        return function(*args)
    except OSError as exc:
        raise os_refusal(exc) from None
