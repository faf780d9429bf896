"""Moving file bytes off the event loop, for both ends of a copy.

Hashing, chunked reading and writing, and streaming tars run in worker threads
so the QUIC loop never stalls on disk. Used by the client (sending and
receiving files) and the agent (the sandbox service); knows nothing of peers.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import queue
import shutil
import threading
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol, TypeVar, cast

from gpumesh import platform
from gpumesh.blocking import in_thread
from gpumesh.errors import (
    AgentError,
    ConfigError,
    ProtocolError,
)

if TYPE_CHECKING:
    from gpumesh.files.pack import PackPlan


__all__ = [
    "CHUNK",
    "FileSink",
    "Hasher",
    "Worker",
    "file_chunks",
    "hash_file",
    "inside",
    "merge_into",
    "swallow",
    "tar_chunks",
    "unpack_from",
    "unpack_pieces",
    "worker",
]

T = TypeVar("T")

_DEPTH = 4
"""Blocking calls queued ahead on a worker: enough to overlap disk and network,
few enough that memory stays a few MiB whatever the file size."""
CHUNK = 1 << 20
"""Bytes read from (or gathered for) a file per blocking call."""


class Hasher(Protocol):
    """What checks a transfer's bytes (see :mod:`gpumesh.files.hashing` for which)."""

    def update(self, data: bytes | memoryview, /) -> object: ...

    def digest(self) -> bytes: ...


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
            future.add_done_callback(swallow)
        self._pending.clear()
        self._jobs.put(None)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def inside(path: str, root: str) -> bool:
    """Whether the real path ``path`` is ``root`` or below it."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def swallow(future: asyncio.Future[Any]) -> None:
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
        data = platform.pread(fd, min(CHUNK, length - position), position)
        if not data:
            raise AgentError("a file shrank while it was read; try again")
        hasher.update(data)
        position += len(data)


async def file_chunks(
    runner: Worker, fd: int, offset: int, end: int, hasher: Hasher | None = None
) -> AsyncGenerator[bytes, None]:
    """Bytes ``offset..end`` of an open file in ``CHUNK`` pieces, read (and hashed) ahead."""

    def read(position: int, size: int) -> bytes:
        data = platform.pread(fd, size, position)
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
            future.add_done_callback(swallow)


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

    def feed(self, data: bytes | memoryview) -> None:
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
            if not inside(os.path.realpath(target), real_root):
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
    """A read-only file for ``unpack_tar`` on a thread, over pieces from ``next_piece``
    (None: the end). With a ``hasher``, each piece is hashed as it is read."""

    def __init__(
        self,
        next_piece: Callable[[], bytes | memoryview | None],
        hasher: Hasher | None = None,
    ) -> None:
        self._next_piece = next_piece
        self.hasher = hasher
        self.folders = _FolderModes()
        self._current = memoryview(b"")
        self._eof = False

    def read(self, size: int = -1, /) -> bytes:
        while not self._current and not self._eof:
            piece = self._next_piece()
            if piece is None:
                self._eof = True
            else:
                if self.hasher is not None:
                    self.hasher.update(piece)
                self.folders.feed(piece)
                self._current = memoryview(piece)
        if size < 0:
            size = len(self._current)
        data = bytes(self._current[:size])
        self._current = self._current[size:]
        return data

    def drain(self) -> None:
        """Consume what is left until the end of the section."""
        while self.read(CHUNK):
            pass


def _unpack_feed(source: _Feed, dest: Path, limit: int) -> int:
    from gpumesh.files.pack import unpack_tar

    content = unpack_tar(cast(BinaryIO, source), dest, limit)
    source.drain()  # a tar reader may stop before the last padding
    source.folders.apply(dest)
    return content


def unpack_pieces(pieces: Iterator[memoryview], dest: Path, limit: int) -> int:
    """Unpack a tar arriving as ``pieces`` into ``dest``, all or nothing, reading every
    piece to the end (blocking; the pieces' producer hashes them). Returns bytes of
    content. The same unpacker, checks and limit as :func:`unpack_from`."""
    return _unpack_feed(_Feed(lambda: next(pieces, None)), dest, limit)


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
    loop = asyncio.get_running_loop()
    chunks: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=_DEPTH)
    aborted = False

    def next_chunk() -> bytes | None:
        chunk = asyncio.run_coroutine_threadsafe(chunks.get(), loop).result()
        if aborted:
            raise OSError(errno.ECONNABORTED, "the transfer stopped")
        return chunk

    unpacking = in_thread(_unpack_feed, _Feed(next_chunk, hasher), dest, limit)
    finished = False

    async def feed(chunk: bytes | None) -> None:
        nonlocal finished
        if chunks.full() or unpacking.done():
            putting = asyncio.ensure_future(chunks.put(chunk))
            either: set[asyncio.Future[Any]] = {putting, unpacking}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if not putting.done():
                putting.cancel()
            if unpacking.done() and not (chunk is None and putting.done()):
                await unpacking  # it stopped early: raises why
                raise ProtocolError("the archive ended before its announced size")
        else:
            chunks.put_nowait(chunk)
        if chunk is None:
            await unpacking
            finished = True

    try:
        yield feed
    finally:
        if not finished:
            aborted = True
            while not unpacking.done():
                while not chunks.empty():
                    chunks.get_nowait()
                with contextlib.suppress(asyncio.QueueFull):
                    chunks.put_nowait(None)
                await asyncio.wait({unpacking}, timeout=0.05)
            if not unpacking.cancelled() and unpacking.exception() is None:
                await in_thread(shutil.rmtree, dest, True)


def merge_into(source: Path, dest: Path) -> None:
    """Move ``source``'s entries into ``dest``: folders merge, anything else replaces."""
    for entry in os.scandir(source):
        target = dest / entry.name
        is_dir = entry.is_dir(follow_symlinks=False)
        target_is_dir = target.is_dir() and not target.is_symlink()
        if is_dir and target_is_dir:
            merge_into(Path(entry.path), target)
            continue
        if target_is_dir:
            shutil.rmtree(target)
        elif is_dir and (target.exists() or target.is_symlink()):
            target.unlink()  # os.replace cannot put a folder over a file
        os.replace(entry.path, target)
