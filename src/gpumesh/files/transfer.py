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
from gpumesh.files.pack import write_tar
from gpumesh.files.untar import unpack_stream

if TYPE_CHECKING:
    from gpumesh.files.pack import PackPlan


__all__ = [
    "CHUNK",
    "FileSink",
    "Hasher",
    "NoHash",
    "Worker",
    "file_chunks",
    "hash_file",
    "merge_into",
    "swallow",
    "tar_chunks",
    "truncate_at",
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


class NoHash:
    """A :class:`Hasher` that hashes nothing: for bytes checked another way (by their
    size, where QUIC protects them, or by a manifest's per-file hashes)."""

    def update(self, data: bytes | memoryview, /) -> None:
        return None

    def digest(self) -> bytes:
        return b""


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


def truncate_at(fd: int, offset: int) -> None:
    """Make ``offset`` the end of an open file and write from there (blocking).

    Bytes past ``offset`` (a write cut short) are dropped; a file that ends
    there already is not truncated at all. On ext4 truncating an empty file
    marks it as one being replaced, and its last close then starts writing
    back everything written since, inside the copy's time: a gigabyte copied
    onto disk waited for that at its end, where scp's and rsync's did not.
    """
    if os.fstat(fd).st_size != offset:
        os.ftruncate(fd, offset)
    os.lseek(fd, offset, os.SEEK_SET)


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


def unpack_pieces(
    pieces: Iterator[memoryview], dest: Path, limit: int, owner: tuple[int, int] | None = None
) -> int:
    """Unpack a tar arriving as ``pieces`` into ``dest``, all or nothing, reading every
    piece to the end (blocking; the pieces' producer hashes them). Returns bytes of
    content. The same unpacker, checks, limit and ``owner`` as :func:`unpack_from`."""
    return unpack_stream(lambda: next(pieces, None), dest, limit, owner)


@contextlib.asynccontextmanager
async def unpack_from(
    dest: Path, limit: int, hasher: Hasher, owner: tuple[int, int] | None = None
) -> AsyncIterator[Callable[[bytes | None], Awaitable[int]]]:
    """Unpack a tar into ``dest`` (all or nothing) on a thread while chunks arrive;
    ``owner`` (uid, gid): given everything unpacked, ``dest`` included.

    Yields ``feed``: ``await feed(chunk)`` for each chunk, ``await feed(None)``
    at the end, which waits for the unpacking to finish, raises what it raised,
    and returns the bytes of content unpacked (a chunk's feed returns 0); a
    refusal (a bad entry, the limit) is raised by the next ``feed``.
    Leaving the block any other way aborts and removes what was unpacked.
    """
    loop = asyncio.get_running_loop()
    chunks: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=_DEPTH)
    aborted = False

    def next_chunk() -> bytes | None:
        chunk = asyncio.run_coroutine_threadsafe(chunks.get(), loop).result()
        if aborted:
            raise OSError(errno.ECONNABORTED, "the transfer stopped")
        if chunk is not None:
            hasher.update(chunk)
        return chunk

    unpacking = in_thread(unpack_stream, next_chunk, dest, limit, owner)
    finished = False

    async def feed(chunk: bytes | None) -> int:
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
            content = await unpacking
            finished = True
            return content
        return 0

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
