"""The provider's file service: one sandbox folder per peer, its quota, and `gpumesh cp`.

Owns ``$GPUMESH_HOME/files/<peer node id>/`` (each peer's sandbox: a peer
reaches its own folder only, never another peer's or anything else of the
provider's), the partial uploads kept for resuming in
``files/.partial/<peer node id>/``, and the requests ``FileStat``,
``FilePut``, ``FileGet``, ``DirPut`` and ``DirGet``.

Paths: a remote path names a place inside the sandbox; a leading ``/`` is the
sandbox root. :func:`sandbox_parts` is the pure check every request goes
through (no ``..``, no NUL, control characters or backslashes, no component
over 255 bytes); :meth:`FileService.resolve` then resolves symlinks and
refuses any that lead out of the sandbox. Only regular files and folders are
served: devices, pipes and sockets are refused.

Uploads land in a partial file outside the sandbox, are hashed while they
arrive, and are renamed into place only when their SHA-256 matches the one
announced in ``FilePut``. A partial upload is kept, keyed by (path, size,
sha256) with those written beside it, when the link drops or the agent dies,
and the next ``FilePut`` of the same file resumes after the bytes already
there (re-hashing them from disk first, so the final check still covers the
whole file). Every upload is checked against the peer's ``file_quota`` before
a byte is written.

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
import queue
import secrets
import shutil
import stat
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol, TypeVar, cast

from gpumesh.agent.blocking import in_thread
from gpumesh.errors import (
    AccessDeniedError,
    AgentError,
    ConfigError,
    ConnectionLostError,
    GPUMeshError,
    LimitError,
    NotFoundError,
    ProtocolError,
)
from gpumesh.protocol.messages import (
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
from gpumesh.units import format_size, parse_size

if TYPE_CHECKING:
    from gpumesh.agent.server import Agent, RequestContext
    from gpumesh.files.pack import PackPlan
    from gpumesh.store.db import Peer
    from gpumesh.transport.stream import Stream

__all__ = [
    "CHUNK",
    "FileService",
    "FileSink",
    "Hasher",
    "Worker",
    "file_chunks",
    "hash_file",
    "info_for",
    "sandbox_parts",
    "sandbox_path",
    "shown",
    "tar_chunks",
    "unpack_from",
    "worker",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

CHUNK = 1 << 20
"""Bytes read from (or gathered for) a file per blocking call."""
_DEPTH = 4
"""Blocking calls queued ahead on a worker: enough to overlap disk and network,
few enough that memory stays a few MiB whatever the file size."""
MAX_NAME_BYTES = 255
PARTIALS = ".partial"
"""Folder under ``files/`` holding partial uploads (node ids never start with a dot)."""
PARTIAL_TTL = 7 * 86400.0
"""Partial uploads untouched this long are removed (they count against the quota)."""
_FINISH_WAIT = 30.0
"""How long a finished download waits for the consumer to end its side."""
_TAKEOVER_WAIT = 30.0
"""How long a resumed upload waits for the dropped attempt it replaces to let go."""


class Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...

    def digest(self) -> bytes: ...


# --- paths -----------------------------------------------------------------------------------


def sandbox_parts(remote: str) -> tuple[str, ...]:
    """The checked components of a sandbox path; ``()`` is the sandbox root.

    Pure: no file system access. A leading ``/`` is the sandbox root, and
    empty and ``.`` components are dropped. Raises ``AccessDeniedError`` for
    ``..`` anywhere (even when it would stay inside), and ``ConfigError`` for
    names no peer should send: NUL and other control characters, backslashes
    (a Windows separator here would be part of a name), components longer
    than 255 bytes.
    """
    parts = []
    for part in remote.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            raise AccessDeniedError(
                f"{remote!r} climbs out with '..': remote paths stay inside your folder"
            )
        if any(ord(char) < 0x20 or ord(char) == 0x7F for char in part):
            raise ConfigError(f"{remote!r} has a control character in a name; rename it")
        if "\\" in part:
            raise ConfigError(f"{remote!r} has a backslash in a name; separate folders with /")
        try:
            encoded = part.encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigError(f"{remote!r} is not valid UTF-8; rename it") from None
        if len(encoded) > MAX_NAME_BYTES:
            raise ConfigError(f"a name in {remote!r} is longer than {MAX_NAME_BYTES} bytes")
        parts.append(part)
    return tuple(parts)


def sandbox_path(root: Path, remote: str) -> Path:
    """Where ``remote`` lies under the sandbox ``root``, symlinks not yet considered."""
    return root.joinpath(*sandbox_parts(remote))


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def shown(remote: str) -> str:
    """A remote path as users write it: from the sandbox root, with a leading ``/``."""
    text = "/" + "/".join(part for part in remote.split("/") if part not in ("", "."))
    return text if text.isprintable() else repr(text)


# --- blocking I/O off the event loop (used by both ends) -------------------------------------


class Worker:
    """One daemon thread running blocking calls in the order given.

    A daemon thread, so a slow disk never keeps a stopping process alive. Calls
    after one that failed are skipped (a write after a failed write must not
    leave a hole).
    """

    def __init__(self, cleanup: Callable[[], object] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._cleanup = cleanup
        self._jobs: queue.SimpleQueue[
            tuple[Callable[..., Any], tuple[Any, ...], asyncio.Future[Any]] | None
        ] = queue.SimpleQueue()
        self._failed: BaseException | None = None
        self._pending: deque[asyncio.Future[Any]] = deque()
        threading.Thread(target=self._run, name="gpumesh-files", daemon=True).start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            function, args, future = job
            if self._failed is not None:
                outcome: tuple[Any, BaseException | None] = (None, self._failed)
            else:
                try:
                    outcome = (function(*args), None)
                except BaseException as exc:
                    self._failed = exc
                    outcome = (None, exc)
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
                self._loop.call_soon_threadsafe(_settle, future, *outcome)
        if self._cleanup is not None:
            with contextlib.suppress(Exception):
                self._cleanup()

    def submit(self, function: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        future: asyncio.Future[T] = self._loop.create_future()
        self._jobs.put((function, args, future))
        return future

    async def call(self, function: Callable[..., T], *args: Any) -> T:
        return await self.submit(function, *args)

    async def pipeline(self, function: Callable[..., Any], *args: Any) -> None:
        """Queue a call whose result is not needed; wait only while too many are queued."""
        self._pending.append(self.submit(function, *args))
        while len(self._pending) > _DEPTH:
            await self._pending.popleft()

    async def drain(self) -> None:
        """Wait for every queued call; raises the first failure."""
        while self._pending:
            await self._pending.popleft()

    def close(self) -> None:
        """Stop after the calls already queued (then run ``cleanup``)."""
        for future in self._pending:  # abandoned: their errors are not news
            future.add_done_callback(_swallow)
        self._pending.clear()
        self._jobs.put(None)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _swallow(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


@contextlib.asynccontextmanager
async def worker(cleanup: Callable[[], object] | None = None) -> AsyncIterator[Worker]:
    """A :class:`Worker` for one transfer; ``cleanup`` (closing its file) runs on its
    thread after every queued call, so no call ever meets a closed descriptor."""
    running = Worker(cleanup)
    try:
        yield running
    finally:
        running.close()


def hash_file(fd: int, length: int, hasher: Hasher) -> None:
    """Feed the first ``length`` bytes of an open file to ``hasher`` (blocking)."""
    position = 0
    while position < length:
        data = os.pread(fd, min(CHUNK, length - position), position)
        if not data:
            raise AgentError("a file shrank while it was read; try again")
        hasher.update(data)
        position += len(data)


async def file_chunks(
    runner: Worker, fd: int, offset: int, end: int, hasher: Hasher | None = None
) -> AsyncGenerator[bytes, None]:
    """Bytes ``offset..end`` of an open file in ``CHUNK`` pieces, read (and hashed) ahead."""

    def read(position: int, size: int) -> bytes:
        data = os.pread(fd, size, position)
        if len(data) != size:
            raise ConfigError("the file shrank while it was being sent; copy it again")
        if hasher is not None:
            hasher.update(data)
        return data

    ahead: deque[asyncio.Future[bytes]] = deque()
    position = offset
    try:
        while ahead or position < end:
            while position < end and len(ahead) < _DEPTH:
                size = min(CHUNK, end - position)
                ahead.append(runner.submit(read, position, size))
                position += size
            yield await ahead.popleft()
    finally:
        for future in ahead:
            future.add_done_callback(_swallow)


class FileSink:
    """Writes arriving chunks at the end of an open file and hashes them, off the loop."""

    def __init__(self, runner: Worker, fd: int, hasher: Hasher) -> None:
        self._runner = runner
        self._fd = fd
        self._hasher = hasher
        self._buffer: list[bytes] = []
        self._buffered = 0

    async def write(self, data: bytes) -> None:
        self._buffer.append(data)
        self._buffered += len(data)
        if self._buffered >= CHUNK:
            await self._flush()

    async def _flush(self) -> None:
        if self._buffer:
            pieces = self._buffer
            self._buffer = []
            self._buffered = 0
            await self._runner.pipeline(self._write, pieces)

    def _write(self, pieces: list[bytes]) -> None:
        # One writev per batch, no copy into a bigger buffer.
        written = os.writev(self._fd, pieces)
        for piece in pieces:
            if written < len(piece):  # a short write: the rest one piece at a time
                view = memoryview(piece)[written:]
                while view:
                    view = view[os.write(self._fd, view) :]
            written = max(0, written - len(piece))
            self._hasher.update(piece)

    async def finish(self) -> None:
        """Write what is buffered and wait until every byte is in the file."""
        await self._flush()
        await self._runner.drain()


class _Stopped(Exception):
    """The consumer of a tar went away; the packing thread stops."""


async def tar_chunks(plan: PackPlan, hasher: Hasher) -> AsyncGenerator[bytes, None]:
    """``write_tar(plan)`` as chunks of about 1 MiB, packed and hashed on a thread."""
    from gpumesh.files.pack import write_tar

    loop = asyncio.get_running_loop()
    chunks: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue(maxsize=_DEPTH)
    stop = threading.Event()

    class _Writer:
        def write(self, data: bytes) -> int:
            if stop.is_set():
                raise _Stopped
            hasher.update(data)
            asyncio.run_coroutine_threadsafe(chunks.put(bytes(data)), loop).result()
            return len(data)

        def flush(self) -> None:
            return None

    def produce() -> None:
        outcome: bytes | BaseException | None = None
        try:
            write_tar(plan, cast(BinaryIO, _Writer()))
        except _Stopped:
            return
        except BaseException as exc:
            outcome = exc
        if not stop.is_set():
            asyncio.run_coroutine_threadsafe(chunks.put(outcome), loop).result()

    producer = in_thread(produce)
    try:
        while (chunk := await chunks.get()) is not None:
            if isinstance(chunk, BaseException):
                raise chunk
            yield chunk
        await producer
    finally:
        stop.set()
        while not producer.done():  # let a blocked put finish, so the thread sees `stop`
            while not chunks.empty():
                chunks.get_nowait()
            await asyncio.wait({producer}, timeout=0.05)
        if not producer.cancelled():
            producer.exception()


class _FolderModes:
    """The permission bits of the folders in a tar stream, read from its headers.

    ``unpack_tar`` (through tarfile's ``data`` filter) keeps files' modes but
    gives every folder the default one; these are applied after it succeeds,
    so a private folder (0o700) stays private.
    """

    _MAX_META = 1 << 20

    def __init__(self) -> None:
        self.modes: dict[str, int] = {}
        self._header = bytearray()
        self._skip = 0
        self._meta: bytearray | None = None
        self._meta_kind = b""
        self._meta_size = 0
        self._long_name: str | None = None
        self._done = False

    def feed(self, data: bytes) -> None:
        view = memoryview(data)
        while view and not self._done:
            if self._skip:
                step = min(self._skip, len(view))
                if self._meta is not None and len(self._meta) < self._meta_size:
                    self._meta += view[: min(step, self._meta_size - len(self._meta))]
                self._skip -= step
                view = view[step:]
                if not self._skip and self._meta is not None:
                    self._end_meta()
                continue
            take = 512 - len(self._header)
            self._header += view[:take]
            view = view[take:]
            if len(self._header) == 512:
                self._parse(bytes(self._header))
                self._header.clear()

    def _parse(self, block: bytes) -> None:
        if not block.strip(b"\0"):
            self._done = True  # the end-of-archive marker
            return
        size = _tar_number(block[124:136])
        kind = block[156:157]
        self._skip = size + (-size % 512)
        if kind in (b"x", b"g", b"L"):
            self._meta_kind = kind
            self._meta_size = size if size <= self._MAX_META else 0
            self._meta = bytearray()
            if not self._skip:
                self._end_meta()
            return
        name = self._long_name or _tar_text(block[0:100])
        prefix = _tar_text(block[345:500]) if block[257:262] == b"ustar" else ""
        if self._long_name is None and prefix:
            name = f"{prefix}/{name}"
        self._long_name = None
        if kind == b"5":
            path = "/".join(part for part in name.split("/") if part not in ("", "."))
            if path:
                self.modes[path] = _tar_number(block[100:108]) & 0o7777

    def _end_meta(self) -> None:
        data, self._meta = bytes(self._meta or b""), None
        if self._meta_kind == b"L":
            self._long_name = data.rstrip(b"\0").decode("utf-8", "replace")
        elif self._meta_kind == b"x":
            for record in _pax_records(data):
                key, _, value = record.partition(b"=")
                if key == b"path":
                    self._long_name = value.decode("utf-8", "replace")

    def apply(self, root: Path) -> None:
        """Set the recorded modes on the folders under ``root`` (never through a symlink)."""
        real_root = os.path.realpath(root)
        for path, mode in self.modes.items():
            target = root / path
            if target.is_symlink() or not target.is_dir():
                continue
            if not _inside(os.path.realpath(target), real_root):
                continue
            # As for files: no group/other write, no set-id bits; and the owner
            # keeps full access, so the folder can be replaced or removed later.
            os.chmod(target, (mode & 0o755) | 0o700)


def _tar_number(field: bytes) -> int:
    if field[:1] and field[0] & 0x80:  # base-256, for numbers octal cannot hold
        return int.from_bytes(field[1:], "big")
    text = field.split(b"\0", 1)[0].strip()
    return int(text, 8) if text else 0


def _tar_text(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", "replace")


def _pax_records(data: bytes) -> Iterator[bytes]:
    position = 0
    while position < len(data):
        length_text, space, _ = data[position : position + 20].partition(b" ")
        if not space or not length_text.isdigit() or int(length_text) <= 0:
            return
        length = int(length_text)
        yield data[position + len(length_text) + 1 : position + length].rstrip(b"\n")
        position += length


class _Feed:
    """A read-only file for ``unpack_tar`` on a thread, fed chunks from the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, hasher: Hasher) -> None:
        self.loop = loop
        self.chunks: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=_DEPTH)
        self.hasher = hasher
        self.folders = _FolderModes()
        self.aborted = False
        self._current = memoryview(b"")
        self._eof = False

    def read(self, size: int = -1, /) -> bytes:
        while not self._current and not self._eof:
            chunk = asyncio.run_coroutine_threadsafe(self.chunks.get(), self.loop).result()
            if self.aborted:
                raise OSError(errno.ECONNABORTED, "the transfer stopped")
            if chunk is None:
                self._eof = True
            else:
                self.hasher.update(chunk)
                self.folders.feed(chunk)
                self._current = memoryview(chunk)
        if size < 0:
            size = len(self._current)
        data = bytes(self._current[:size])
        self._current = self._current[size:]
        return data

    def drain(self) -> None:
        """Consume what is left until the end of the section."""
        while self.read(CHUNK):
            pass


@contextlib.asynccontextmanager
async def unpack_from(
    dest: Path, limit: int, hasher: Hasher
) -> AsyncIterator[Callable[[bytes | None], Awaitable[None]]]:
    """Unpack a tar into ``dest`` (all or nothing) on a thread while chunks arrive.

    Yields ``feed``: ``await feed(chunk)`` for each chunk, ``await feed(None)``
    at the end, which waits for the unpacking to finish and raises what it
    raised; a refusal (a bad entry, the limit) is raised by the next ``feed``.
    Leaving the block any other way aborts and removes what was unpacked.
    """
    from gpumesh.files.pack import unpack_tar

    loop = asyncio.get_running_loop()
    source = _Feed(loop, hasher)

    def unpack() -> int:
        content = unpack_tar(cast(BinaryIO, source), dest, limit)
        source.drain()  # a tar reader may stop before the last padding
        source.folders.apply(dest)
        return content

    unpacking = in_thread(unpack)
    finished = False

    async def feed(chunk: bytes | None) -> None:
        nonlocal finished
        if source.chunks.full() or unpacking.done():
            putting = asyncio.ensure_future(source.chunks.put(chunk))
            either: set[asyncio.Future[Any]] = {putting, unpacking}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if not putting.done():
                putting.cancel()
            if unpacking.done() and not (chunk is None and putting.done()):
                await unpacking  # it stopped early: raises why
                raise ProtocolError("the archive ended before its announced size")
        else:
            source.chunks.put_nowait(chunk)
        if chunk is None:
            await unpacking
            finished = True

    try:
        yield feed
    finally:
        if not finished:
            source.aborted = True
            while not unpacking.done():
                while not source.chunks.empty():
                    source.chunks.get_nowait()
                with contextlib.suppress(asyncio.QueueFull):
                    source.chunks.put_nowait(None)
                await asyncio.wait({unpacking}, timeout=0.05)
            if not unpacking.cancelled() and unpacking.exception() is None:
                await in_thread(shutil.rmtree, dest, True)


def info_for(remote: str, path: Path) -> FileInfo:
    """What is at ``path`` (blocking: a folder is scanned for its tar size)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return FileInfo(path=remote, exists=False, kind="", size=0, mode=0, mtime=0.0)
    except NotADirectoryError:
        return FileInfo(path=remote, exists=False, kind="", size=0, mode=0, mtime=0.0)
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISDIR(st.st_mode):
        from gpumesh.files.pack import scan, tar_size

        size = tar_size(scan(path))
        return FileInfo(
            path=remote, exists=True, kind="dir", size=size, mode=mode, mtime=st.st_mtime
        )
    if stat.S_ISREG(st.st_mode):
        return FileInfo(
            path=remote, exists=True, kind="file", size=st.st_size, mode=mode, mtime=st.st_mtime
        )
    return FileInfo(path=remote, exists=True, kind="", size=0, mode=mode, mtime=st.st_mtime)


# --- the service ----------------------------------------------------------------------------

Handler = Callable[["FileService", "RequestContext", Message], Awaitable[None]]


def _refusing(handler: Handler) -> Handler:
    """OS errors met while serving become refusals that say what happened."""

    @functools.wraps(handler)
    async def wrapped(service: FileService, ctx: RequestContext, message: Message) -> None:
        try:
            await handler(service, ctx, message)
        except OSError as exc:
            logger.debug("file request failed", exc_info=True)
            raise _os_error(exc) from None

    return wrapped


@dataclass
class _Active:
    """An upload in progress: what it holds of the quota, and how to stop it."""

    reserved: int
    stream: Stream | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(frozen=True)
class _Usage:
    used: int
    quota: int

    def check(self, provider: str, extra: int) -> None:
        if self.used + extra > self.quota:
            raise LimitError(
                f"{provider} keeps at most {format_size(self.quota)} of files for you (its "
                f"file_quota); {format_size(self.used)} is in use and this needs "
                f"{format_size(extra)} more: free space in your folder there, or ask its "
                "owner to raise file_quota"
            )


class FileService:
    """Each allowed peer's sandbox on this provider."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.root = agent.home.path / "files"
        self._active: dict[str, dict[str, _Active]] = {}
        """Peer id -> name in its partials folder -> the upload writing it."""

    # --- places -------------------------------------------------------------------------

    def sandbox(self, peer: Peer) -> Path:
        path = self.root / str(peer.node_id)
        if not path.is_dir():
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.root.chmod(0o700)
            path.mkdir(mode=0o700, exist_ok=True)
        return path

    def partials(self, peer: Peer) -> Path:
        path = self.root / PARTIALS / str(peer.node_id)
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        return path

    def resolve(self, peer: Peer, remote: str) -> Path:
        """The real path of ``remote`` in the peer's sandbox; refused when it leads out."""
        try:
            parts = sandbox_parts(remote)
        except GPUMeshError as exc:
            raise type(exc)(f"{self.agent.name} refused {exc.message}") from None
        root = self.sandbox(peer)
        real_root = os.path.realpath(root)
        real = os.path.realpath(root.joinpath(*parts))
        if not _inside(real, real_root):
            raise AccessDeniedError(
                f"{self.agent.name} refused {remote!r}: a symlink there leads outside your folder"
            )
        return Path(real)

    def _locate_file(self, peer: Peer, remote: str, where: str) -> tuple[Path, str]:
        """An upload's real target and its path relative to the sandbox (blocking)."""
        target = self.resolve(peer, remote)
        root = os.path.realpath(self.sandbox(peer))
        if str(target) == root:
            raise ConfigError(f"{where} is your folder itself: name a file to copy to")
        return target, os.path.relpath(target, root)

    def quota(self) -> int:
        return parse_size(str(self.agent.home.config.get("file_quota")))

    # --- requests -----------------------------------------------------------------------

    @_refusing
    async def handle_stat(self, ctx: RequestContext, message: Message) -> None:
        assert isinstance(message, FileStat)
        path = await in_thread(self.resolve, ctx.peer, message.path)
        info = await in_thread(_guarded, info_for, message.path, path)
        ctx.stream.send_message(info, end=True)

    @_refusing
    async def handle_get(self, ctx: RequestContext, message: Message) -> None:
        assert isinstance(message, FileGet)
        path = await in_thread(self.resolve, ctx.peer, message.path)
        where = f"{self.agent.name}:{shown(message.path)}"
        fd = await in_thread(_guarded, _open_regular, path, where)
        async with worker(cleanup=lambda: os.close(fd)) as runner:
            st = os.fstat(fd)
            if message.offset > st.st_size:
                raise ProtocolError(
                    f"asked for {where} from byte {message.offset}, past its end "
                    f"({st.st_size} bytes)"
                )
            stream = ctx.stream
            stream.send_message(
                FileInfo(
                    path=message.path,
                    exists=True,
                    kind="file",
                    size=st.st_size,
                    mode=stat.S_IMODE(st.st_mode),
                    mtime=st.st_mtime,
                )
            )
            hasher = hashlib.sha256()
            # The whole file's hash goes in FileDone: the part the peer already
            # has is hashed first, on the worker, ahead of the reads.
            runner.submit(hash_file, fd, message.offset, hasher).add_done_callback(_swallow)
            chunks = file_chunks(runner, fd, message.offset, st.st_size, hasher)
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    await stream.send_data(chunk)
            stream.end_data()
            stream.send_message(FileDone(size=st.st_size, sha256=hasher.digest()), end=True)
        await _until_finished(stream)
        logger.info("[%s] sent %s (%d bytes)", ctx.peer.name, where, st.st_size - message.offset)

    @_refusing
    async def handle_put(self, ctx: RequestContext, message: Message) -> None:
        assert isinstance(message, FilePut)
        peer, name = ctx.peer, self.agent.name
        where = f"{name}:{shown(message.path)}"
        target, relative = await in_thread(self._locate_file, peer, message.path, where)
        digest = message.sha256.hex()
        key = hashlib.sha256(f"{relative}\n{message.size}\n{digest}".encode()).hexdigest()[:32]
        partials = self.partials(peer)
        part, meta = partials / f"{key}.part", partials / f"{key}.json"
        expected = {"path": relative, "size": message.size, "sha256": digest}
        async with self._claim(peer, key, message.size, ctx.stream):
            replaced = await in_thread(_guarded, _replaced_size, target, where)
            offset = await in_thread(_kept_offset, part, meta, expected)
            usage = await self._usage(peer, exclude=key)
            usage.check(name, message.size - replaced)
            if offset == 0:
                await in_thread(_guarded, _start_partial, part, meta, expected)
            fd = await in_thread(_guarded, os.open, part, os.O_RDWR)
            async with worker(cleanup=lambda: os.close(fd)) as runner:
                await self._receive_file(
                    ctx, runner, fd, offset, message, target, part, meta, where
                )
        ctx.stream.send_message(FileDone(size=message.size, sha256=message.sha256), end=True)
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
        target: Path,
        part: Path,
        meta: Path,
        where: str,
    ) -> None:
        stream = ctx.stream
        hasher = hashlib.sha256()
        # Drop whatever lies past the offset (a write cut short by a crash),
        # then hash the kept part, all before a new byte is appended.
        await runner.call(_truncate_and_hash, fd, offset, hasher)
        stream.send_message(FileResume(offset=offset))
        sink = FileSink(runner, fd, hasher)
        received = offset
        try:
            while chunk := await stream.read_data():
                received += len(chunk)
                if received > message.size:
                    raise ProtocolError(f"the upload to {where} is larger than announced")
                await sink.write(chunk)
            await sink.finish()
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
        if hasher.digest() != message.sha256:
            await in_thread(_discard, part, meta)
            raise ProtocolError(
                f"the upload to {where} does not match its SHA-256 and was discarded; copy it again"
            )
        await runner.call(_guarded, _place_file, fd, message.mode, part, meta, target, where)

    @_refusing
    async def handle_dir_get(self, ctx: RequestContext, message: Message) -> None:
        assert isinstance(message, DirGet)
        path = await in_thread(self.resolve, ctx.peer, message.path)
        where = f"{self.agent.name}:{shown(message.path)}"
        plan, st = await in_thread(_guarded, _plan_folder, path, where)
        from gpumesh.files.pack import tar_size

        size = tar_size(plan)
        stream = ctx.stream
        stream.send_message(
            FileInfo(
                path=message.path,
                exists=True,
                kind="dir",
                size=size,
                mode=stat.S_IMODE(st.st_mode),
                mtime=st.st_mtime,
            )
        )
        hasher = hashlib.sha256()
        sent = 0
        async with contextlib.aclosing(tar_chunks(plan, hasher)) as chunks:
            async for chunk in chunks:
                sent += len(chunk)
                await stream.send_data(chunk)
        if sent != size:
            raise AgentError(f"{where} changed while it was packed; copy it again")
        stream.end_data()
        stream.send_message(FileDone(size=size, sha256=hasher.digest()), end=True)
        await _until_finished(stream)
        logger.info("[%s] sent folder %s (%d bytes of tar)", ctx.peer.name, where, size)

    @_refusing
    async def handle_dir_put(self, ctx: RequestContext, message: Message) -> None:
        assert isinstance(message, DirPut)
        peer, name = ctx.peer, self.agent.name
        target = await in_thread(self.resolve, peer, message.path)
        where = f"{name}:{shown(message.path)}"
        await in_thread(_guarded, _check_folder_target, target, where)
        temp_name = f"dir-{secrets.token_hex(8)}"
        temp = self.partials(peer) / temp_name
        stream = ctx.stream
        async with self._claim(peer, temp_name, message.size, None):
            usage = await self._usage(peer, exclude=temp_name)
            usage.check(name, message.size)
            stream.send_message(FileResume(offset=0))
            hasher = hashlib.sha256()
            received = 0
            limit = max(0, usage.quota - usage.used)
            try:
                async with unpack_from(temp, limit, hasher) as feed:
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
                await in_thread(_guarded, _place_folder, temp, target, where)
            finally:
                await in_thread(shutil.rmtree, temp, True)
        stream.send_message(FileDone(size=received, sha256=hasher.digest()), end=True)
        logger.info("[%s] received folder %s (%d bytes of tar)", peer.name, where, received)

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
                    f"{self.agent.name} is still finishing an earlier upload of this file; "
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

    async def _usage(self, peer: Peer, exclude: str) -> _Usage:
        """Bytes the peer holds here: its sandbox, its partial uploads, uploads in flight."""
        active = self._active.get(str(peer.node_id), {})
        busy = set(active)
        reserved = sum(claim.reserved for name, claim in active.items() if name != exclude)
        stored = await in_thread(
            _stored_bytes, self.sandbox(peer), self.partials(peer), busy | {exclude}
        )
        return _Usage(stored + reserved, self.quota())


async def _until_finished(stream: Stream) -> None:
    """Keep a download's stream until the consumer ends it.

    The consumer returns credit while it reads the last chunks; were the
    stream forgotten before that credit arrives, it would open a new request.
    """
    with contextlib.suppress(GPUMeshError, TimeoutError):
        async with asyncio.timeout(_FINISH_WAIT):
            while await stream.read_frame() is not None:
                pass


# --- blocking helpers of the service -------------------------------------------------------------


def _guarded(function: Callable[..., T], *args: Any) -> T:
    """Turn the OS errors a request can meet into refusals that say what happened."""
    try:
        return function(*args)
    except OSError as exc:
        raise _os_error(exc) from None


def _os_error(exc: OSError) -> GPUMeshError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return LimitError("the provider's disk is full")
    if exc.errno == errno.ENOTDIR:
        return ConfigError("a folder in that path is a file on the provider")
    if exc.errno == errno.EISDIR:
        return ConfigError("that path is a folder on the provider")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return AccessDeniedError("the provider may not touch that path (permission denied)")
    if exc.errno == errno.ENAMETOOLONG:
        return ConfigError("that path is too long for the provider's file system")
    return AgentError(f"the provider could not do that: {exc.strerror or exc}")


def _open_regular(path: Path, where: str) -> int:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
        raise NotFoundError(f"{where} does not exist") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        if stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"{where} is a folder")
        raise AccessDeniedError(f"{where} is not a regular file (a device, pipe or socket)")
    os.set_blocking(fd, True)
    return fd


def _plan_folder(path: Path, where: str) -> tuple[PackPlan, os.stat_result]:
    from gpumesh.files.pack import scan

    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        raise NotFoundError(f"{where} does not exist") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{where} is not a folder")
    return scan(path), st


def _replaced_size(target: Path, where: str) -> int:
    """Bytes of the file an upload will replace (0: none); a folder cannot be replaced."""
    try:
        st = os.stat(target)
    except (FileNotFoundError, NotADirectoryError):
        _check_parents(target, where)
        return 0
    if stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{where} is a folder: copy into it as {where.rstrip('/')}/NAME")
    if not stat.S_ISREG(st.st_mode):
        raise AccessDeniedError(f"{where} is not a regular file (a device, pipe or socket)")
    return st.st_size


def _check_parents(target: Path, where: str) -> None:
    """Refuse now, not after the transfer, when a file sits where a folder must go."""
    for parent in target.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"cannot create {where}: {parent.name!r} there is a file")
            return


def _check_folder_target(target: Path, where: str) -> None:
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise ConfigError(f"{where} is a file, not a folder: pick another name")
    if not target.exists():
        _check_parents(target, where)


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
    os.ftruncate(fd, offset)
    os.lseek(fd, offset, os.SEEK_SET)
    hash_file(fd, offset, hasher)


def _discard(part: Path, meta: Path) -> None:
    for path in (part, meta):
        with contextlib.suppress(OSError):
            path.unlink()


def _place_file(fd: int, mode: int, part: Path, meta: Path, target: Path, where: str) -> None:
    os.fchmod(fd, mode & 0o777)  # set-id and sticky bits never travel
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.is_dir():
        raise ConfigError(f"{where} became a folder during the upload")
    os.replace(part, target)
    meta.unlink(missing_ok=True)


def _place_folder(temp: Path, target: Path, where: str) -> None:
    """Move an unpacked folder into place: renamed when new, merged into an existing one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.exists() and not target.is_symlink():
        os.rename(temp, target)
        return
    if not target.is_dir() or target.is_symlink():
        raise ConfigError(f"{where} is not a folder: pick another name")
    _merge(temp, target)


def _merge(source: Path, dest: Path) -> None:
    """Move ``source``'s entries into ``dest``: folders merge, anything else replaces."""
    for entry in os.scandir(source):
        target = dest / entry.name
        is_dir = entry.is_dir(follow_symlinks=False)
        target_is_dir = target.is_dir() and not target.is_symlink()
        if is_dir and target_is_dir:
            _merge(Path(entry.path), target)
            continue
        if target_is_dir:
            shutil.rmtree(target)
        elif is_dir and (target.exists() or target.is_symlink()):
            target.unlink()  # os.replace cannot put a folder over a file
        os.replace(entry.path, target)


def _stored_bytes(sandbox: Path, partials: Path, busy: set[str]) -> int:
    """Bytes in regular files under the sandbox and the idle partials (old ones removed)."""
    total = _tree_bytes(sandbox)
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
                total += _tree_bytes(Path(entry.path))
            elif stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


def _tree_bytes(root: Path) -> int:
    total = 0
    for folder, _dirs, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(folder, name))
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
    return total
