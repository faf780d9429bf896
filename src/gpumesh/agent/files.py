"""The provider's file service: one sandbox folder per peer, its quota, and `gpumesh cp`.

Owns ``$GPUMESH_HOME/files/<peer node id>/`` (each peer's sandbox: a peer
reaches its own folder only, never another peer's or anything else of the
provider's), the partial uploads kept for resuming in
``files/.partial/<peer node id>/``, and the requests ``FileStat``,
``FilePut``, ``FileGet``, ``DirPut`` and ``DirGet``, and their data-channel
variants ``ChannelPut`` and ``ChannelGet`` (file bytes over a one-shot TLS/TCP
channel, see :mod:`gpumesh.transport.channel`; same checks, same partials, same
hash verdict). A tar (``DirPut``/``DirGet`` here, a job's workdir, an app's
files) takes a channel when its request asks for one: :meth:`FileService.offer_channel`,
:meth:`~FileService.receive_tar` and :meth:`~FileService.send_tar` serve the
job and app services too.

Paths: a remote path names a place inside the sandbox; a leading ``/`` is the
sandbox root. :func:`~gpumesh.agent.sandboxfs.sandbox_parts` is the pure check every request goes
through (no ``..``, no NUL, control characters or backslashes, no component
over 255 bytes). The sandbox is then only ever reached through
:class:`gpumesh.files.sandbox.Tree`: relative to directory descriptors, one
component at a time, never following a symlink (a path with a link anywhere
on it is refused), so a peer's running job, which can change the folder at
any instant, cannot turn a check into a use somewhere else. Only regular
files and folders are served: devices, pipes, sockets and links are refused.

Uploads land in a partial file outside the sandbox, are hashed while they
arrive, and are renamed into place only when their hash matches the
consumer's (the algorithm picked per request: see
:mod:`gpumesh.files.hashing`). A partial upload is kept, keyed by (path,
size, source) with those written beside it, when the link drops or the agent
dies, and the next upload of the same file, over QUIC or a data channel,
resumes after the bytes already there (re-hashing them from disk first, so
the final check still covers the whole file). An older consumer's
``FilePut`` names its file by its SHA-256 instead, which is then the key.
Every upload is checked against the peer's ``file_quota`` before a byte is
written; so is everything else the peer keeps here, including what
its jobs wrote into the sandbox and into their uploaded workdirs.

This module also holds the blocking-I/O helpers both ends of a transfer use
(files read and written, tars packed and unpacked, on worker threads so the
event loop keeps moving packets); ``gpumesh.client.files`` imports them.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import hashlib
import json
import logging
import os
import secrets
import shutil
import stat
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from gpumesh.agent.deps import Handlers, Provider, RequestContext, Settings
from gpumesh.agent.sandboxfs import (
    Listing,
    Usage,
    os_refusal,
    refusing,
    sandbox_parts,
    sandbox_path,
    shown,
)
from gpumesh.blocking import closing_in_thread, in_thread
from gpumesh.errors import (
    AccessDeniedError,
    AgentError,
    ConfigError,
    ConnectionLostError,
    GPUMeshError,
    NotFoundError,
    ProtocolError,
    UnreachableError,
)
from gpumesh.files.hashing import SHA256, choose, label, new_hasher
from gpumesh.files.sandbox import Tree
from gpumesh.files.transfer import (
    FileSink,
    Hasher,
    Worker,
    file_chunks,
    hash_file,
    swallow,
    tar_chunks,
    truncate_at,
    unpack_from,
    worker,
)
from gpumesh.protocol.messages import (
    ChannelDeclined,
    ChannelGet,
    ChannelOffer,
    ChannelPut,
    DirGet,
    DirPut,
    FileDone,
    FileGet,
    FileInfo,
    FilePut,
    FileResume,
    FileStat,
    Message,
)
from gpumesh.units import parse_size

if TYPE_CHECKING:
    import ssl
    import threading

    from gpumesh.files.pack import PackPlan
    from gpumesh.identity.keys import Identity
    from gpumesh.store.db import Peer
    from gpumesh.transport.channel import Channel, Listener
    from gpumesh.transport.quic import QuicLink
    from gpumesh.transport.stream import Stream

__all__ = [
    "FileService",
    "TarOffer",
    "sandbox_parts",
    "sandbox_path",
    "shown",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

PARTIALS = ".partial"
"""Folder under ``files/`` holding partial uploads (node ids never start with a dot)."""
PARTIAL_TTL = 7 * 86400.0
"""Partial uploads untouched this long are removed (they count against the quota)."""
_FINISH_WAIT = 30.0
"""How long a finished download waits for the consumer to end its side."""
_TAKEOVER_WAIT = 30.0
"""How long a resumed upload waits for the dropped attempt it replaces to let go."""
_CHANNEL_STALL = 20.0
"""Seconds without progress on a data channel after which it counts as dropped."""


@dataclass
class _Active:
    """An upload in progress: what it holds of the quota, and how to stop it."""

    reserved: int
    stream: Stream | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)


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


class FileService:
    """Each allowed peer's sandbox on this provider."""

    def __init__(
        self,
        provider: Provider,
        settings: Settings,
        identity: Identity,
        *,
        root: Path,
        job_dirs: Callable[[str], list[Path]] | None = None,
    ) -> None:
        self.provider = provider
        self.settings = settings
        self.identity = identity
        """Whose certificate data channels present."""
        self.root = root
        """``files/`` of the home: the sandboxes, and the partial uploads in ``.partial``."""
        self.owner: tuple[int, int] | None = None
        """Who owns what a peer stores here: the host uid:gid its jobs run as, set
        by the job service once it asked the engine; None until then (what is
        placed meanwhile is handed over when a job gets its folder)."""
        self._job_dirs = job_dirs or (lambda _peer_id: [])
        """A peer's uploaded job workdirs (what its jobs write there counts too)."""
        self._active: dict[str, dict[str, _Active]] = {}
        """Peer id -> name in its partials folder -> the upload writing it."""
        self._tls: ssl.SSLContext | None = None

    def register(self, handlers: Handlers) -> None:
        handlers.add(FileStat, self.handle_stat)
        handlers.add(FilePut, self.handle_put)
        handlers.add(FileGet, self.handle_get)
        handlers.add(DirPut, self.handle_dir_put)
        handlers.add(DirGet, self.handle_dir_get)
        handlers.add(ChannelPut, self.handle_channel_put)
        handlers.add(ChannelGet, self.handle_channel_get)

    # --- places -------------------------------------------------------------------------

    def sandbox(self, peer: Peer) -> Path:
        """The peer's folder (made when missing); name it only to open a :meth:`tree`."""
        path = self.root / str(peer.node_id)
        if not path.is_dir():
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.root.chmod(0o700)
            path.mkdir(mode=0o700, exist_ok=True)
        return path

    def tree(self, peer: Peer) -> Tree:
        """The peer's sandbox, opened (blocking; close it)."""
        return Tree(self.sandbox(peer), owner=self.owner)

    def partials(self, peer: Peer, *, create: bool = True) -> Path:
        """The agent's own folder of the peer's partial uploads (no job reaches it)."""
        path = self.root / PARTIALS / str(peer.node_id)
        if create:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        return path

    def parts(self, remote: str) -> tuple[str, ...]:
        """The checked components of a peer's path, refused in this provider's name."""
        try:
            return sandbox_parts(remote)
        except GPUMeshError as exc:
            raise type(exc)(f"{self.provider.name} refused {exc.message}") from None

    def _where(self, remote: str) -> str:
        return f"{self.provider.name}:{shown(remote)}"

    def link_refused(self, remote: str) -> AccessDeniedError:
        return AccessDeniedError(
            f"{self.provider.name} refused {shown(remote)}: a symlink is on that path, and "
            "links in your folder are never followed"
        )

    def resolve_sandbox_dir(
        self, peer: Peer, remote: str, missing: str = "sync it first"
    ) -> tuple[str, ...]:
        """A job's ``sandbox_dir`` (or a folder it mounts): the parts of an existing
        folder inside the peer's sandbox, with no link on the way, handed to the
        job's user (blocking). ``missing``: what to do when there is none."""
        parts = self.parts(remote)
        if not parts:
            raise AccessDeniedError(
                f"{self.provider.name} refused {remote!r}: name a folder inside your "
                "sandbox, such as /datasets, not the sandbox itself"
            )
        with self.tree(peer) as tree:
            try:
                folder = tree.subtree(parts)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise self.link_refused(remote) from None
                raise ConfigError(
                    f"{remote} is not a folder on {self.provider.name}: {missing}"
                ) from None
        with folder:
            if self.owner is not None:
                folder.chown_all((), self.owner)
        return parts

    def quota(self) -> int:
        return parse_size(str(self.settings.get("file_quota")))

    # --- requests -----------------------------------------------------------------------

    @refusing
    async def handle_stat(self, ctx: RequestContext, message: FileStat) -> None:
        info = await in_thread(self._stat, ctx.peer, message.path)
        ctx.stream.send_message(info, end=True)

    def _stat(self, peer: Peer, remote: str) -> FileInfo:
        """What is at ``remote`` (blocking: a folder is scanned for its tar size)."""
        from gpumesh.files.pack import scan_tree, tar_size

        parts = self.parts(remote)
        with self.tree(peer) as tree:
            st = self._lstat(tree, parts, remote)
            if st is None:
                return FileInfo(path=remote, exists=False, kind="", size=0, mode=0, mtime=0.0)
            mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISDIR(st.st_mode):
                with self._subtree(tree, parts, remote) as folder:
                    size = tar_size(scan_tree(folder))
                kind = "dir"
            elif stat.S_ISREG(st.st_mode):
                size, kind = st.st_size, "file"
            else:
                size, kind = 0, ""
        return FileInfo(
            path=remote, exists=True, kind=kind, size=size, mode=mode, mtime=st.st_mtime
        )

    def _lstat(self, tree: Tree, parts: Sequence[str], remote: str) -> os.stat_result | None:
        """What is at ``parts``, None when nothing; a link on the way or there is refused."""
        try:
            st = tree.lstat(parts)
        except OSError as exc:
            raise self._refusal(exc, remote) from None
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise self.link_refused(remote)
        return st

    def _subtree(self, tree: Tree, parts: Sequence[str], remote: str) -> Tree:
        try:
            return tree.subtree(parts)
        except OSError as exc:
            raise self._refusal(exc, remote) from None

    def _refusal(self, exc: OSError, remote: str) -> GPUMeshError:
        """An OS error met on a peer's path, as the refusal it sends back."""
        where = self._where(remote)
        if exc.errno == errno.ELOOP:
            return self.link_refused(remote)
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return NotFoundError(f"{where} does not exist")
        if exc.errno == errno.EISDIR:
            return ConfigError(f"{where} is a folder")
        if exc.errno == errno.EPERM:
            return AccessDeniedError(f"{where} is not a regular file (a device, pipe or socket)")
        return os_refusal(exc)

    def open_regular(self, peer: Peer, remote: str) -> int:
        """A regular file of the peer's, opened for reading (blocking)."""
        parts = self.parts(remote)
        with self.tree(peer) as tree:
            try:
                return tree.open_file(parts)
            except OSError as exc:
                raise self._refusal(exc, remote) from None

    @refusing
    async def handle_get(self, ctx: RequestContext, message: FileGet) -> None:
        where = self._where(message.path)
        fd = await in_thread(self.open_regular, ctx.peer, message.path)
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
    async def handle_put(self, ctx: RequestContext, message: FilePut) -> None:
        peer, name = ctx.peer, self.provider.name
        where = self._where(message.path)
        parts, relative = self._file_target(message.path)
        if message.digest is not None:  # an older consumer: its SHA-256 up front
            key, expected = _partial_key(relative, message.size, sha256=message.digest)
        elif message.source:
            key, expected = _partial_key(relative, message.size, source=message.source)
        else:
            raise ProtocolError(f"the upload to {where} names neither its hash nor its source")
        # Made only when a byte is kept: a refused request leaves nothing behind.
        partials = self.partials(peer, create=False)
        part, meta = partials / f"{key}.part", partials / f"{key}.json"
        async with self._claim(peer, key, message.size, ctx.stream):
            replaced = await in_thread(self._replaced_size, peer, parts, message.path)
            offset = await in_thread(_kept_offset, part, meta, expected)
            usage = await self.usage(peer, exclude=key)
            usage.check(name, message.size - replaced)
            if offset == 0:
                await in_thread(_guarded, _start_partial, part, meta, expected)
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
        where = self._where(message.path)
        # An older consumer's FilePut carries its SHA-256; a newer one's hash follows the bytes.
        hash_name = SHA256 if message.digest is not None else choose(message.hashes)
        hasher = new_hasher(hash_name)
        # Drop whatever lies past the offset (a write cut short by a crash),
        # then hash the kept part, all before a new byte is appended.
        await runner.call(_truncate_and_hash, fd, offset, hasher)
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
            await in_thread(_discard, part, meta)
            raise
        except BaseException:
            # The link dropped (or the agent stops): keep what arrived for a resume.
            with contextlib.suppress(BaseException):
                await asyncio.shield(sink.finish())
            raise
        if received != message.size:
            await in_thread(_discard, part, meta)
            raise ProtocolError(
                f"the upload to {where} ended after {received} of {message.size} bytes"
            )
        digest = hasher.digest()
        if digest != expected:
            await in_thread(_discard, part, meta)
            raise ProtocolError(
                f"the upload to {where} does not match its {label(hash_name)} hash and was "
                "discarded; copy it again"
            )
        await runner.call(self._place_file, ctx.peer, fd, message.mode, partial, message.path)
        return digest

    @refusing
    async def handle_dir_get(self, ctx: RequestContext, message: DirGet) -> None:
        from gpumesh.files.pack import tar_size

        where = self._where(message.path)
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
            offer = self.offer_channel(ctx, message.channel, info)
            hasher = new_hasher(hash_name)
            if offer is not None and await self.send_tar(ctx, offer, plan, size, hasher):
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
        from gpumesh.files.pack import scan_tree

        parts = self.parts(remote)
        with self.tree(peer) as tree:
            st = self._lstat(tree, parts, remote)
            if st is None:
                raise NotFoundError(f"{self._where(remote)} does not exist")
            if not stat.S_ISDIR(st.st_mode):
                raise ConfigError(f"{self._where(remote)} is not a folder")
            folder = self._subtree(tree, parts, remote)
        try:
            return folder, scan_tree(folder)
        except BaseException:
            folder.close()
            raise

    @refusing
    async def handle_dir_put(self, ctx: RequestContext, message: DirPut) -> None:
        peer, name = ctx.peer, self.provider.name
        parts = self.parts(message.path)
        where = self._where(message.path)
        await in_thread(self._check_folder_target, peer, parts, message.path)
        temp_name = f"dir-{secrets.token_hex(8)}"
        temp = self.partials(peer) / temp_name
        stream = ctx.stream
        async with self._claim(peer, temp_name, message.size, None):
            usage = await self.usage(peer, exclude=temp_name)
            usage.check(name, message.size)
            hash_name = choose(message.hashes)
            hasher = new_hasher(hash_name)
            received = 0
            limit = max(0, usage.quota - usage.used)
            via = ""
            offer = self.offer_channel(ctx, message.channel, FileResume(offset=0, hash=hash_name))
            try:
                # Unpacked straight to the jobs' owner: no second walk to chown it.
                if offer is not None and await self.receive_tar(
                    ctx, offer, message.size, temp, limit, hasher, self.owner
                ):
                    received, via = message.size, " over a data channel"
                else:
                    async with unpack_from(temp, limit, hasher, self.owner) as feed:
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

    # --- the data channel ------------------------------------------------------------------

    def channel_enabled(self) -> bool:
        return str(self.settings.get("data_channel")) == "on"

    def _listener(self, peer: str) -> Listener:
        """A one-shot TLS listener on the share address, with a fresh ticket, that admits
        only ``peer`` (the IP address the request came from)."""
        from gpumesh.transport.channel import Listener, server_context

        if not self.channel_enabled():
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

    def offer_channel(
        self, ctx: RequestContext, wanted: bool, answer: Message, hash_name: str = ""
    ) -> TarOffer | None:
        """Send ``answer``, the request's usual first answer, after a ChannelOffer when
        the consumer asked for a channel for its tar, this provider opens them, and
        the link has room for the pump's buffers (its ``link_buffer`` counts them
        while the offer lives); the offer, or None: the tar goes as DATA on QUIC.
        ``hash_name``: the tar's hash, named in the offer where the request carries
        no other answer that names it (a JobSubmit's workdir); empty: none named."""
        from gpumesh.transport.channel import HELD

        offer = None
        if wanted and self.channel_enabled():
            limit = ctx.link.buffer_limit
            if limit and ctx.link.held() + HELD > limit:
                logger.info(
                    "[%s] no data channel for a tar: the connection holds too much "
                    "(link_buffer); QUIC instead",
                    ctx.peer.name,
                )
            else:
                try:
                    listener = self._listener(ctx.link.remote_address()[0])
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
        from gpumesh.files.transfer import unpack_pieces
        from gpumesh.transport.channel import receive_stream

        following = _next_message(ctx.stream, offer.listener)
        consume = functools.partial(unpack_pieces, dest=dest, limit=limit, owner=owner)
        try:
            try:
                async with _channel_of(offer.listener, following) as channel:
                    await in_thread(receive_stream, channel, size, consume, hasher, _ignore)
                    done = await asyncio.wait_for(asyncio.shield(following), _FINISH_WAIT)
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
        from gpumesh.files.pack import write_tar
        from gpumesh.transport.channel import send_stream

        stream = ctx.stream
        following = _next_message(stream, offer.listener)

        def produce(out: Any) -> None:
            write_tar(plan, out)

        try:
            try:
                async with _channel_of(offer.listener, following) as channel:
                    await in_thread(send_stream, channel, size, produce, hasher, _ignore)
                    stream.send_message(FileDone(size=size, digest=hasher.digest()), end=True)
                    # The consumer ends its side once it checked FileDone.
                    with contextlib.suppress(GPUMeshError, TimeoutError):
                        await asyncio.wait_for(asyncio.shield(following), _FINISH_WAIT)
            except ConnectionLostError:
                if _declined(following):
                    return False
                raise
        finally:
            _let_go(following)
            offer.close()
        return True

    @refusing
    async def handle_channel_put(self, ctx: RequestContext, message: ChannelPut) -> None:
        """``FilePut`` with the bytes over a data channel and the hash at the end."""
        from gpumesh.transport.channel import receive_file

        peer, name, stream = ctx.peer, self.provider.name, ctx.stream
        where = self._where(message.path)
        if not self.channel_enabled():
            raise UnreachableError(f"{name} opens no data channels (data_channel off)")
        parts, relative = self._file_target(message.path)
        key, expected = _partial_key(relative, message.size, source=message.source)
        # Made only when a byte is kept: a refused request leaves nothing behind.
        partials = self.partials(peer, create=False)
        part, meta = partials / f"{key}.part", partials / f"{key}.json"
        async with self._claim(peer, key, message.size, stream):
            replaced = await in_thread(self._replaced_size, peer, parts, message.path)
            offset = await in_thread(_kept_offset, part, meta, expected)
            usage = await self.usage(peer, exclude=key)
            usage.check(name, message.size - replaced)
            if offset == 0:
                await in_thread(_guarded, _start_partial, part, meta, expected)
            hash_name = choose(message.hashes)
            hasher = new_hasher(hash_name)
            fd = await in_thread(_guarded, os.open, part, os.O_RDWR)
            try:
                # Drop what lies past the offset before a byte is added; the kept
                # part is hashed while the first new bytes arrive.
                await in_thread(truncate_at, fd, offset)
                listener = self._listener(ctx.link.remote_address()[0])
                stream.send_message(
                    ChannelOffer(
                        port=listener.port, ticket=listener.ticket, offset=offset, hash=hash_name
                    )
                )
                final = asyncio.ensure_future(stream.expect(FileDone))
                try:
                    async with _channel_of(listener, final) as channel:
                        remaining = message.size - offset
                        await in_thread(
                            receive_file, channel, fd, remaining, hasher, _ignore, offset
                        )
                        done = await asyncio.wait_for(asyncio.shield(final), _FINISH_WAIT)
                finally:
                    if not final.done():
                        final.cancel()
                    final.add_done_callback(swallow)
                digest = hasher.digest()
                if done.size != message.size or done.digest != digest:
                    await in_thread(_discard, part, meta)
                    raise ProtocolError(
                        f"the upload to {where} does not match its {label(hash_name)} hash and "
                        "was discarded; copy it again"
                    )
                await in_thread(
                    self._place_file, peer, fd, message.mode, (part, meta), message.path
                )
            except ProtocolError:
                await in_thread(_discard, part, meta)
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
    async def handle_channel_get(self, ctx: RequestContext, message: ChannelGet) -> None:
        """``FileGet`` with the bytes over a data channel."""
        from gpumesh.transport.channel import send_file

        where = self._where(message.path)
        listener = self._listener(ctx.link.remote_address()[0])
        try:
            fd = await in_thread(self.open_regular, ctx.peer, message.path)
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
                async with _channel_of(listener, ended) as channel:
                    await in_thread(
                        send_file, channel, fd, message.offset, st.st_size, hasher, _ignore
                    )
                    answered.set()
                    stream.send_message(FileDone(size=st.st_size, digest=hasher.digest()), end=True)
                    with contextlib.suppress(GPUMeshError, TimeoutError):
                        await asyncio.wait_for(asyncio.shield(ended), _FINISH_WAIT)
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

    # --- quota and concurrent uploads ----------------------------------------------------

    @contextlib.asynccontextmanager
    async def _claim(
        self, peer: Peer, key: str, reserve: int, stream: Stream | None
    ) -> AsyncIterator[_Active]:
        """Hold ``key`` in the peer's partials; an older upload of the same file gives way.

        A consumer that lost its link and came back finds its previous attempt
        still reading a dead stream (the provider may not know yet): that one is
        stopped, keeps its bytes, and this one resumes after them.
        """
        active = self._active.setdefault(str(peer.node_id), {})
        while (previous := active.get(key)) is not None:
            if previous.stream is not None:
                previous.stream.fail(ConnectionLostError("a newer upload of this file took over"))
            try:
                await asyncio.wait_for(previous.done.wait(), _TAKEOVER_WAIT)
            except TimeoutError:
                raise AgentError(
                    f"{self.provider.name} is still finishing an earlier upload of this file; "
                    "try again in a minute"
                ) from None
        claim = _Active(reserve, stream)
        active[key] = claim
        try:
            yield claim
        finally:
            if active.get(key) is claim:
                del active[key]
            claim.done.set()

    async def usage(
        self,
        peer: Peer,
        exclude: str = "",
        listing: Listing | None = None,
        stop: threading.Event | None = None,
    ) -> Usage:
        """Bytes the peer holds here: its sandbox, its partial uploads, its jobs'
        uploaded workdirs, and uploads in flight (all but ``exclude``).

        With ``listing`` (a folder in the sandbox, and a dict), the same walk
        also fills the dict with each regular file under that folder. Setting
        ``stop`` ends the sandbox's walk early (``WalkStopped``).
        """
        active = self._active.get(str(peer.node_id), {})
        busy = set(active)
        reserved = sum(claim.reserved for name, claim in active.items() if name != exclude)
        stored = await in_thread(self._stored_bytes, peer, busy | {exclude}, listing, stop)
        return Usage(stored + reserved, self.quota())

    def _stored_bytes(
        self, peer: Peer, busy: set[str], listing: Listing | None, stop: threading.Event | None
    ) -> int:
        """Bytes in the peer's regular files (walked through descriptors), idle
        partials (old ones removed) and job workdirs (blocking)."""
        with self.tree(peer) as tree:
            total = tree.tally(listing, stop)
        total += _partial_bytes(self.partials(peer, create=False), busy)
        for workdir in self._job_dirs(str(peer.node_id)):
            try:
                work = Tree(workdir)
            except (FileNotFoundError, NotADirectoryError):
                continue
            with work:
                total += work.tally(None, stop)
        return total

    # --- blocking steps of the requests ---------------------------------------------------

    def _file_target(self, remote: str) -> tuple[tuple[str, ...], str]:
        """An upload's parts in the sandbox and its path from the sandbox root."""
        parts = self.parts(remote)
        if not parts:
            raise ConfigError(
                f"{self._where(remote)} is your folder itself: name a file to copy to"
            )
        return parts, "/".join(parts)

    def _replaced_size(self, peer: Peer, parts: tuple[str, ...], remote: str) -> int:
        """Bytes of the file an upload will replace (0: none); a folder cannot be replaced."""
        where = self._where(remote)
        with self.tree(peer) as tree:
            st = self._lstat(tree, parts, remote)
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
            st = self._lstat(tree, parts[:end], remote)
            if st is None:
                continue
            if not stat.S_ISDIR(st.st_mode):
                raise ConfigError(
                    f"cannot create {self._where(remote)}: {parts[end - 1]!r} there is a file"
                )
            return

    def _check_folder_target(self, peer: Peer, parts: tuple[str, ...], remote: str) -> None:
        with self.tree(peer) as tree:
            st = self._lstat(tree, parts, remote)
            if st is None:
                self._check_parents(tree, parts, remote)
            elif not stat.S_ISDIR(st.st_mode):
                raise ConfigError(
                    f"{self._where(remote)} is a file, not a folder: pick another name"
                )

    def _place_file(
        self, peer: Peer, fd: int, mode: int, partial: tuple[Path, Path], remote: str
    ) -> None:
        """Rename a finished upload into place, through the sandbox's descriptors."""
        part, meta = partial
        os.fchmod(fd, mode & 0o777)  # set-id and sticky bits never travel
        if self.owner is not None:
            os.fchown(fd, *self.owner)
        refusal = f"{self._where(remote)} became a folder during the upload"
        self._move_in(peer, part, remote, Tree.place, (IsADirectoryError, refusal))
        meta.unlink(missing_ok=True)

    def _place_folder(self, peer: Peer, temp: Path, remote: str) -> None:
        """Move an unpacked folder (unpacked for :attr:`owner` already) into place:
        renamed when new, merged into an existing one."""
        refusal = f"{self._where(remote)} is not a folder: pick another name"
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
            with self.tree(peer) as tree:
                move(tree, source, staged.name, self.parts(remote))
        except in_the_way[0]:
            raise ConfigError(in_the_way[1]) from None
        except OSError as exc:
            raise self._refusal(exc, remote) from None
        finally:
            os.close(source)


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
        async with asyncio.timeout(_FINISH_WAIT):
            while await stream.read_frame() is not None:
                pass


def _ignore(_count: int) -> None:
    return None


async def _consumer_end(stream: Stream, answered: asyncio.Event) -> None:
    """Wait for the consumer to end its side; raise when it did before ``answered``."""
    while await stream.read_frame() is not None:
        pass
    if not answered.is_set():
        raise ConnectionLostError("the consumer ended the request before the file was sent")


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
    if not future.done():
        future.cancel()
    future.add_done_callback(swallow)


@contextlib.asynccontextmanager
async def _channel_of(listener: Listener, watch: asyncio.Future[Any]) -> AsyncIterator[Channel]:
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


# --- blocking helpers of the service -------------------------------------------------------------


def _guarded(function: Callable[..., T], *args: Any) -> T:
    """Turn the OS errors a request can meet into refusals that say what happened."""
    try:
        return function(*args)
    except OSError as exc:
        raise os_refusal(exc) from None


def _partial_key(
    relative: str, size: int, *, source: str = "", sha256: bytes | None = None
) -> tuple[str, dict[str, Any]]:
    """The name a partial upload is kept under, and what is written beside it.

    A consumer names its file by ``source`` (its identity, size and mtime), on
    QUIC and on the data channel alike, so either path resumes what the other
    left; an older consumer's FilePut names it by its SHA-256 instead.
    """
    if sha256 is not None:
        digest = sha256.hex()
        text = f"{relative}\n{size}\n{digest}"
        expected: dict[str, Any] = {"path": relative, "size": size, "sha256": digest}
    else:
        text = f"{relative}\n{size}\nsource:{source}"
        expected = {"path": relative, "size": size, "source": source}
    return hashlib.sha256(text.encode()).hexdigest()[:32], expected


def _kept_offset(part: Path, meta: Path, expected: dict[str, Any]) -> int:
    """Bytes of a kept partial upload of exactly this file, or 0 (stale ones removed)."""
    try:
        recorded = json.loads(meta.read_text())
        size = part.stat().st_size
    except (OSError, ValueError):
        _discard(part, meta)
        return 0
    if not isinstance(recorded, dict) or any(recorded.get(k) != v for k, v in expected.items()):
        _discard(part, meta)
        return 0
    return min(size, int(expected["size"]))


def _start_partial(part: Path, meta: Path, expected: dict[str, Any]) -> None:
    part.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    temp = meta.with_suffix(".tmp")
    temp.write_text(json.dumps({**expected, "started": time.time()}))
    os.replace(temp, meta)
    with part.open("wb"):
        pass


def _truncate_and_hash(fd: int, offset: int, hasher: Hasher) -> None:
    truncate_at(fd, offset)
    hash_file(fd, offset, hasher)


def _discard(part: Path, meta: Path) -> None:
    for path in (part, meta):
        with contextlib.suppress(OSError):
            path.unlink()


def _partial_bytes(partials: Path, busy: set[str]) -> int:
    """Bytes in the idle partial uploads of one peer; old ones are removed.

    The partials folder is the agent's own (no job reaches it).
    """
    total = 0
    now = time.time()
    with contextlib.suppress(FileNotFoundError), os.scandir(partials) as entries:
        for entry in entries:
            stem = entry.name.split(".", 1)[0]
            if stem in busy:
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if now - st.st_mtime > PARTIAL_TTL:
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
                continue
            if stat.S_ISDIR(st.st_mode):
                with Tree(entry.path) as folder:
                    total += folder.tally()
            elif stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total
