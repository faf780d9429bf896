"""Copying files and folders to and from a peer's sandbox (``gpumesh cp``).

Owns the consumer's side of the file requests: telling ``peer:path`` from a
local path, choosing the destination name the way ``cp`` does, streaming with
progress callbacks, checking every copy end to end against its hash (BLAKE3,
or SHA-256 with a peer from before that choice: see
:mod:`gpumesh.files.hashing`), and resuming. File bytes go over a data
channel (TLS on TCP, opened and authorised by the QUIC request, see
:mod:`gpumesh.transport.channel`) when a direct path exists and neither side
turned it off; when one cannot be opened the copy falls back to QUIC at once,
silently. An upload resumes from the partial file the provider kept (it says
where in ``FileResume`` or ``ChannelOffer``); a download keeps a local
``NAME.gpumesh-part`` and asks for the rest with ``FileGet(offset)``. Either
way the partial is the same whichever path carried its bytes, so a copy
dropped on one path resumes on the other. A dropped link (or a provider that
stops answering) is retried a few times, each retry resuming; a later
``gpumesh cp`` of the same file resumes too. Folders travel as one tar, never
resumed, unpacked all or nothing, over the data channel too when one opens
(:mod:`gpumesh.client.bulk`).

Nothing here prints; results and progress go to the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import shutil
import stat
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from gpumesh import platform
from gpumesh.errors import (
    ConfigError,
    ConnectionLostError,
    GPUMeshError,
    LimitError,
    NotFoundError,
    ProtocolError,
    UnreachableError,
)
from gpumesh.files.hashing import SHA256, label, new_hasher, offered, taken
from gpumesh.protocol.messages import (
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
)
from gpumesh.units import format_size

if TYPE_CHECKING:
    from gpumesh.client.bulk import Unpacked
    from gpumesh.client.node import Node
    from gpumesh.files.transfer import Hasher
    from gpumesh.store.db import Peer
    from gpumesh.transport.channel import Channel
    from gpumesh.transport.session import Session
    from gpumesh.transport.stream import Stream

__all__ = [
    "PART_SUFFIX",
    "CopyCallbacks",
    "CopyResult",
    "Location",
    "copy",
    "download",
    "parse_location",
    "upload",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

PART_SUFFIX = ".gpumesh-part"
"""Added to a download's name until it is complete and verified."""
RETRIES = 3
"""Retries after a dropped link, each resuming where the last attempt stopped."""
STALL_TIMEOUT = 20.0
"""Seconds without any progress after which a link counts as dropped."""
RESPONSE_TIMEOUT = 300.0
"""Seconds to wait for an answer that may first need the provider to re-hash a
partial file (resuming a large upload)."""
_BACKOFF = (1.0, 2.0, 4.0, 8.0)
"""Seconds before each retry: long enough for a restarted agent to come back."""


def _ignore(*_args: object) -> None:
    return None


@dataclass
class CopyCallbacks:
    """Where a copy reports while it runs."""

    started: Callable[[str, int], None] = _ignore
    """(what is copied, e.g. ``data.bin -> alice-pc:/data.bin``; bytes in all) once known."""
    progress: Callable[[int, int], None] = _ignore
    """(bytes in place so far, resumed ones included; bytes in all)."""
    retrying: Callable[[GPUMeshError, int], None] = _ignore
    """(why the link was lost, the attempt about to start)."""


@dataclass
class CopyResult:
    direction: str
    """``upload`` or ``download``."""
    kind: str
    """``file`` or ``dir``."""
    peer: str
    local: Path
    """The local file or folder, as written."""
    remote: str
    """The path in the peer's sandbox, from its root (``/data/x.bin``)."""
    size: int
    """Bytes of the file, or of the folder's tar."""
    digest: str
    """The hash both ends agreed on for the whole file (or tar), in hex."""
    seconds: float
    """Wall time of the whole copy: hashing, dialling, retries."""
    transferred: int = 0
    """Bytes that crossed the network in this call."""
    offsets: list[int] = field(default_factory=list)
    """Where each attempt started: a first one over 0 resumed an earlier copy."""
    skipped: list[str] = field(default_factory=list)
    """Entries of a folder left out, each with why."""
    channel: str = "quic"
    """What carried the bytes of the last attempt: ``tls`` (the data channel) or ``quic``."""
    hash: str = SHA256
    """Which hash ``digest`` is: ``blake3``, or ``sha256`` with an older peer."""
    congestion: str = ""
    """The data channel's TCP congestion control (``bbr`` where the kernel offers it);
    empty when no data channel was opened."""
    no_channel: str = ""
    """With ``quic``: why not the data channel (a :class:`gpumesh.client.bulk.NoChannel`:
    ``off``, ``relayed``, ``blocked`` (one failed to open recently, so it was not
    tried), ``failed``, ``not offered``)."""
    folder_content: int = 0
    """A folder's bytes of file contents (without the tar's headers and padding)."""

    @property
    def resumed_from(self) -> int:
        """Bytes already in place when this copy began (0: it started from scratch)."""
        return self.offsets[0] if self.offsets else 0

    @property
    def attempts(self) -> int:
        return len(self.offsets)

    @property
    def content(self) -> int:
        """Bytes of file contents: what a user means by the size of a copy (a
        folder's tar adds at least 512 bytes of header a file, and padding)."""
        return self.folder_content if self.kind == "dir" else self.size

    @property
    def mb_per_s(self) -> float:
        return self.transferred / self.seconds / 1e6 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class Location:
    peer: str | None
    """The peer's name or id prefix; None: a local path."""
    path: str


def parse_location(text: str) -> Location:
    """``peer:path`` is remote, anything else local (scp's rule: a colon before any slash).

    A local name with a colon can be written ``./name:with:colons``. On Windows
    a single letter before the colon is a drive (``C:\\data``, ``C:/data``,
    ``C:data`` are local); a one-letter peer is
    then named by its id prefix.
    """
    head, sep, tail = text.partition(":")
    if sep and head and "/" not in head and "\\" not in head and not _is_drive(head):
        return Location(head, tail)
    return Location(None, text)


def _is_drive(head: str) -> bool:
    return len(head) == 1 and head.isascii() and head.isalpha() and platform.system() == "windows"


async def copy(
    node: Node,
    source: str,
    destination: str,
    *,
    retries: int = RETRIES,
    callbacks: CopyCallbacks | None = None,
    stall_timeout: float = STALL_TIMEOUT,
    fast_path: bool = True,
) -> CopyResult:
    """Copy between here and a peer's sandbox; exactly one side is ``peer:path``.

    ``fast_path=False`` keeps file bytes on QUIC (so does ``data_channel = off``).
    """
    src, dst = parse_location(source), parse_location(destination)
    if src.peer is not None and dst.peer is not None:
        raise ConfigError("both sides name a peer: one side must be a local path")
    if src.peer is None and dst.peer is None:
        raise ConfigError("neither side names a peer: write one side as PEER:PATH")
    options: dict[str, Any] = {
        "retries": retries,
        "callbacks": callbacks,
        "stall_timeout": stall_timeout,
        "fast_path": fast_path,
    }
    if dst.peer is not None:
        return await upload(node, dst.peer, Path(src.path), dst.path, **options)
    assert src.peer is not None
    return await download(node, src.peer, src.path, Path(dst.path), **options)


# --- uploads ---------------------------------------------------------------------------------


async def upload(
    node: Node,
    peer_query: str,
    local: Path,
    remote: str,
    *,
    retries: int = RETRIES,
    callbacks: CopyCallbacks | None = None,
    stall_timeout: float = STALL_TIMEOUT,
    fast_path: bool = True,
) -> CopyResult:
    """Copy a local file or folder into the peer's sandbox at ``remote``."""
    started = time.perf_counter()
    callbacks = callbacks or CopyCallbacks()
    peer = node.peer(peer_query)
    try:
        st = os.stat(local)
    except FileNotFoundError:
        raise NotFoundError(f"{local} does not exist") from None
    except NotADirectoryError:
        raise NotFoundError(f"{local} does not exist (a folder in its path is a file)") from None
    except PermissionError:
        raise ConfigError(f"cannot read {local}: permission denied") from None
    if stat.S_ISDIR(st.st_mode):
        copier: _Copy = _FolderUpload(node, peer, local, remote, callbacks, stall_timeout)
    elif stat.S_ISREG(st.st_mode):
        copier = _FileUpload(node, peer, local, remote, callbacks, stall_timeout, st)
    else:
        raise ConfigError(f"{local} is not a regular file (a device, pipe or socket)")
    copier.allow_channel(fast_path)
    return await copier.run(retries, started)


def _name_of(local: Path) -> str:
    name = Path(os.path.abspath(local)).name
    if not name:
        raise ConfigError(f"{local} has no name to copy it under: give a remote file name")
    return name


class _Copy:
    """One copy, attempted up to 1 + retries times."""

    direction = ""
    kind = ""

    def __init__(
        self,
        node: Node,
        peer: Peer,
        local: Path,
        remote: str,
        callbacks: CopyCallbacks,
        stall_timeout: float,
    ) -> None:
        self.node = node
        self.peer = peer
        self.local = local
        self.remote = remote
        self.callbacks = callbacks
        self.stall_timeout = stall_timeout
        self.result = CopyResult(
            direction=self.direction,
            kind=self.kind,
            peer=peer.name,
            local=local,
            remote=remote,
            size=0,
            digest="",
            seconds=0.0,
        )
        self.done = 0
        """Bytes in place at the far end (or here) so far."""
        self.fast = False
        """Try the data channel (cleared for good once one could not be opened)."""

    def allow_channel(self, fast_path: bool) -> None:
        """Whether the data channel may be tried at all (the user's and the config's word)."""
        from gpumesh.client.bulk import NoChannel

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
                raise _local_error(exc) from None
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

    def advance(self, count: int, total: int) -> None:
        self.done += count
        self.result.transferred += count
        self.callbacks.progress(self.done, total)

    def remote_label(self, path: str) -> str:
        return f"{self.peer.name}:{_shown(path)}"

    def use_channel(self, session: Session) -> bool:
        """Whether to ask for a data channel now (if not, ``result.no_channel`` says why)."""
        from gpumesh.client.bulk import why_no_channel

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
        from gpumesh.client.bulk import NoChannel

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
        from gpumesh.client.bulk import open_channel

        channel = await open_channel(self.node, session, self.peer, offer, self.stall_timeout)
        if channel is not None:
            self.result.congestion = channel.congestion
        return channel

    def progress_from_thread(self, total: int) -> Callable[[int], None]:
        loop = asyncio.get_running_loop()

        def report(count: int) -> None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self.advance, count, total)

        return report


def _shown(remote: str) -> str:
    return "/" + "/".join(part for part in remote.split("/") if part not in ("", "."))


def _into(remote: str, name: str) -> str:
    return f"{remote.rstrip('/')}/{name}"


def _is_folder_path(remote: str) -> bool:
    """``peer:``, ``peer:/`` and ``peer:dir/`` name a folder to copy into."""
    return _shown(remote) == "/" or remote.endswith("/")


def _watch(stream: Stream, kind: type[T]) -> asyncio.Task[T]:
    """Read the provider's answer while we send: a refusal mid-way stops the sending."""

    def stop_sending(task: asyncio.Task[T]) -> None:
        if task.cancelled():
            return
        error = task.exception()
        if isinstance(error, GPUMeshError):
            stream.fail(error)

    task = asyncio.ensure_future(stream.expect(kind))
    task.add_done_callback(stop_sending)
    return task


async def _finish_task(task: asyncio.Task[Any]) -> None:
    if not task.done():
        task.cancel()
    with contextlib.suppress(BaseException):
        await task


class _Upload(_Copy):
    """What file and folder uploads share: where the copy lands."""

    target: str | None = None
    size = 0

    async def settle_target(self, session: Session) -> str:
        """Decide the remote path once: into a remote folder under the local name, as cp does."""
        if self.target is not None:
            return self.target
        target = self.remote
        if _is_folder_path(target):
            target = _into(target, _name_of(self.local))
        else:
            info = await self.stat_remote(session, target)
            if info.exists and info.kind == "dir":
                target = _into(target, _name_of(self.local))
        self.target = target
        self.result.remote = _shown(target)
        self.callbacks.started(f"{self.local} -> {self.remote_label(target)}", self.size)
        return target


class _FileUpload(_Upload):
    direction = "upload"
    kind = "file"

    def __init__(
        self,
        node: Node,
        peer: Peer,
        local: Path,
        remote: str,
        callbacks: CopyCallbacks,
        stall_timeout: float,
        st: os.stat_result,
    ) -> None:
        super().__init__(node, peer, local, remote, callbacks, stall_timeout)
        self.st = st
        self.size = st.st_size
        self.result.size = self.size
        self.source = _source_id(local, st)
        self.legacy: bytes | None = None
        """The file's SHA-256, hashed before sending, once the provider turned down a
        FilePut without it (a provider from before the hash negotiation)."""

    async def attempt(self, session: Session) -> None:
        target = await self.settle_target(session)
        if self.use_channel(session) and await self.attempt_channel(session, target):
            return
        if self.legacy is None and await self.attempt_quic(session, target):
            return
        await self.attempt_quic_legacy(session, target)

    async def attempt_channel(self, session: Session, target: str) -> bool:
        """Send over a data channel, hashing while sending; False: none could be opened."""
        from gpumesh.transport.channel import send_file

        stream = session.open_stream()
        asked = offered()
        stream.send_message(
            ChannelPut(
                path=target,
                size=self.size,
                mode=stat.S_IMODE(self.st.st_mode),
                source=self.source,
                hashes=asked,
            )
        )
        offer = await self.offer(stream)
        channel = None if offer is None else await self.open_channel(session, offer)
        if offer is None or channel is None:
            self.no_channel(stream, session, UnreachableError("no data channel"), offer is not None)
            return False
        try:
            hash_name = taken(offer.hash, asked)
            self.start_at(offer.offset)
        except ProtocolError:
            channel.close()
            raise
        self.result.channel = "tls"
        # Any answer before ours is a refusal: it stops the sending.
        answer = _watch(stream, FileDone)
        answer.add_done_callback(lambda _answer: channel.abort())
        hasher = new_hasher(hash_name)
        try:
            fd = os.open(self.local, os.O_RDONLY | platform.BINARY)
            report = self.progress_from_thread(self.size)
            try:
                await _pump(channel, fd, send_file, offer.offset, self.size, hasher, report)
            except ConnectionLostError:
                if answer.done() and not answer.cancelled() and answer.exception() is not None:
                    await answer  # the provider's refusal says more than the broken channel
                raise
            _check_unchanged(self.local, os.stat(self.local), self.st)
            digest = hasher.digest()
            stream.send_message(FileDone(size=self.size, digest=digest), end=True)
            done = await self.within(RESPONSE_TIMEOUT, answer)
        finally:
            await _finish_task(answer)
            channel.close()
            session.link.forget_stream(stream.stream_id)
        self.confirmed(done, hash_name, digest)
        return True

    async def attempt_quic(self, session: Session, target: str) -> bool:
        """Send over QUIC, hashing while sending, the hash after the bytes; False: the
        provider predates that (and wants the SHA-256 up front)."""
        from gpumesh.files.transfer import file_chunks, hash_file, swallow, worker

        self.result.channel = "quic"
        stream = session.open_stream()
        asked = offered()
        stream.send_message(
            FilePut(
                path=target,
                size=self.size,
                mode=stat.S_IMODE(self.st.st_mode),
                source=self.source,
                hashes=asked,
            )
        )
        try:
            resume = await self.within(RESPONSE_TIMEOUT, stream.expect(FileResume))
        except ProtocolError as exc:
            # Most likely a provider whose FilePut must carry the SHA-256; if it
            # was something else, the upload with the SHA-256 meets it again.
            logger.debug("copy: %s refused a FilePut without its SHA-256: %s", self.peer.name, exc)
            session.link.forget_stream(stream.stream_id)
            return False
        hash_name = taken(resume.hash, asked)
        self.start_at(resume.offset)
        answer = _watch(stream, FileDone)
        hasher = new_hasher(hash_name)
        try:
            fd = os.open(self.local, os.O_RDONLY | platform.BINARY)
            async with worker(cleanup=lambda: os.close(fd)) as runner:
                # The part the provider kept is hashed here first, ahead of the reads.
                runner.submit(hash_file, fd, resume.offset, hasher).add_done_callback(swallow)
                await self.send_chunks(
                    stream, file_chunks(runner, fd, resume.offset, self.size, hasher)
                )
                _check_unchanged(self.local, os.fstat(fd), self.st)
            digest = hasher.digest()
            stream.end_data()
            stream.send_message(FileDone(size=self.size, digest=digest), end=True)
            done = await self.within(RESPONSE_TIMEOUT, answer)
        finally:
            await _finish_task(answer)
            session.link.forget_stream(stream.stream_id)
        self.confirmed(done, hash_name, digest)
        return True

    async def attempt_quic_legacy(self, session: Session, target: str) -> None:
        """Send over QUIC as to a provider from before the hash negotiation: the
        file's SHA-256 in FilePut, hashed before sending."""
        from gpumesh.blocking import in_thread
        from gpumesh.files.transfer import file_chunks, worker

        if self.legacy is None:
            self.legacy = await in_thread(_hash_path, self.local, self.st)
        self.result.channel = "quic"
        stream = session.open_stream()
        stream.send_message(
            FilePut(
                path=target,
                size=self.size,
                mode=stat.S_IMODE(self.st.st_mode),
                digest=self.legacy,
            )
        )
        resume = await self.within(RESPONSE_TIMEOUT, stream.expect(FileResume))
        self.start_at(resume.offset)
        answer = _watch(stream, FileDone)
        try:
            fd = os.open(self.local, os.O_RDONLY | platform.BINARY)
            async with worker(cleanup=lambda: os.close(fd)) as runner:
                await self.send_chunks(stream, file_chunks(runner, fd, resume.offset, self.size))
                _check_unchanged(self.local, os.fstat(fd), self.st)
            stream.end_data()
            stream.finish()
            done = await self.within(RESPONSE_TIMEOUT, answer)
        finally:
            await _finish_task(answer)
            session.link.forget_stream(stream.stream_id)
        self.confirmed(done, SHA256, self.legacy)

    def start_at(self, offset: int) -> None:
        if offset > self.size:
            raise ProtocolError(f"{self.peer.name} asked to resume past the end of the file")
        self.result.offsets.append(offset)
        self.done = offset
        self.callbacks.progress(self.done, self.size)

    async def send_chunks(self, stream: Stream, chunks: AsyncGenerator[bytes, None]) -> None:
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                await self.within(self.stall_timeout, stream.send_data(chunk))
                self.advance(len(chunk), self.size)

    def confirmed(self, done: FileDone, hash_name: str, digest: bytes) -> None:
        """Check the provider's FileDone against what was sent."""
        if done.size != self.size or done.digest != digest:
            raise ProtocolError(f"{self.peer.name} confirmed a different file than was sent")
        self.result.hash = hash_name
        self.result.digest = digest.hex()

    def gave_up(self, exc: GPUMeshError) -> GPUMeshError:
        if self.done and self.done < self.size:
            return type(exc)(
                f"{exc.message}; {self.peer.name} keeps what arrived (about "
                f"{format_size(self.done)} of {format_size(self.size)}): run the same "
                "`gpumesh cp` again to resume"
            )
        return type(exc)(exc.message)


async def _pump(channel: Channel, fd: int, pump: Callable[..., None], *args: Any) -> None:
    """Run a channel pump on its own thread, which closes ``fd`` when it ends.

    Leaving early (cancelled, stopped) aborts the channel, so the thread ends
    too (closing the channel then waits for the thread to let go of it).
    """
    from gpumesh.blocking import in_thread

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


def _source_id(path: Path, st: os.stat_result) -> str:
    """Names a local file for resuming its upload: which file, which version of it."""
    text = f"{os.path.abspath(path)}\n{st.st_dev}:{st.st_ino}\n{st.st_size}\n{st.st_mtime_ns}"
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:32]


def _hash_path(path: Path, st: os.stat_result) -> bytes:
    """The SHA-256 of a local file, for a provider that wants it before the bytes."""
    from gpumesh.files.transfer import hash_file

    hasher = new_hasher(SHA256)
    fd = os.open(path, os.O_RDONLY | platform.BINARY)
    try:
        hash_file(fd, st.st_size, hasher)
        _check_unchanged(path, os.fstat(fd), st)
    finally:
        os.close(fd)
    return hasher.digest()


def _check_unchanged(path: Path, now: os.stat_result, before: os.stat_result) -> None:
    if now.st_size != before.st_size or now.st_mtime_ns != before.st_mtime_ns:
        raise ConfigError(f"{path} changed while it was being copied; copy it again")


class _FolderUpload(_Upload):
    direction = "upload"
    kind = "dir"

    async def prepare(self) -> None:
        from gpumesh.blocking import in_thread
        from gpumesh.files.pack import scan, tar_size

        self.plan = await in_thread(scan, self.local, [self.node.home.path])
        self.size = await in_thread(tar_size, self.plan)
        self.result.size = self.size
        self.result.folder_content = self.plan.total_bytes
        self.result.skipped = [f"{s.path}: {s.reason}" for s in self.plan.skipped]

    async def attempt(self, session: Session) -> None:
        from gpumesh.client.bulk import NoChannel, answer_after_offer, send_tar

        target = await self.settle_target(session)
        wanted = self.use_channel(session)
        stream = session.open_stream()
        asked = offered()
        stream.send_message(DirPut(path=target, size=self.size, hashes=asked, channel=wanted))
        try:
            offer, resume = await answer_after_offer(stream, FileResume)
            hash_name = taken(resume.hash, asked)
            self.result.offsets.append(0)
            self.done = 0
            self.callbacks.progress(0, self.size)
            digest = None
            if offer is not None:
                self.result.channel = "tls"
                digest = await send_tar(
                    self.node,
                    session,
                    self.peer,
                    stream,
                    offer,
                    self.plan,
                    self.size,
                    hash_name,
                    lambda count: self.advance(count, self.size),
                    self.stall_timeout,
                )
                if digest is None:
                    self.fast = False
                    self.result.no_channel = NoChannel.FAILED
            elif wanted:
                self.result.no_channel = NoChannel.NOT_OFFERED
            if digest is not None:
                stream.finish()
                done = await self.within(RESPONSE_TIMEOUT, stream.expect(FileDone))
            else:
                self.result.channel = "quic"
                digest, done = await self._send_quic(stream, hash_name)
        except BaseException:
            # The provider stops at once (its channel too) rather than when it stalls.
            with contextlib.suppress(GPUMeshError):
                stream.abort()
            raise
        finally:
            session.link.forget_stream(stream.stream_id)
        if done.size != self.size or done.digest != digest:
            raise ProtocolError(f"{self.peer.name} confirmed a different folder than was sent")
        self.result.hash, self.result.digest = hash_name, digest.hex()

    async def _send_quic(self, stream: Stream, hash_name: str) -> tuple[bytes, FileDone]:
        """The tar as DATA on the request's stream; its hash and the provider's answer."""
        from gpumesh.files.transfer import tar_chunks

        hasher = new_hasher(hash_name)
        answer = _watch(stream, FileDone)
        try:
            async with contextlib.aclosing(tar_chunks(self.plan, hasher)) as chunks:
                async for chunk in chunks:
                    await self.within(self.stall_timeout, stream.send_data(chunk))
                    self.advance(len(chunk), self.size)
            if self.done != self.size:
                raise ConfigError(f"{self.local} changed while it was packed; copy it again")
            stream.end_data()
            stream.finish()
            done = await self.within(RESPONSE_TIMEOUT, answer)
        finally:
            await _finish_task(answer)
        return hasher.digest(), done


# --- downloads -------------------------------------------------------------------------------


async def download(
    node: Node,
    peer_query: str,
    remote: str,
    local: Path,
    *,
    retries: int = RETRIES,
    callbacks: CopyCallbacks | None = None,
    stall_timeout: float = STALL_TIMEOUT,
    fast_path: bool = True,
) -> CopyResult:
    """Copy a file or folder from the peer's sandbox to ``local``."""
    started = time.perf_counter()
    callbacks = callbacks or CopyCallbacks()
    peer = node.peer(peer_query)
    copier = _Download(node, peer, local, remote, callbacks, stall_timeout)
    copier.allow_channel(fast_path)
    return await copier.run(retries, started)


class _Download(_Copy):
    direction = "download"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.info: FileInfo | None = None
        self.dest: Path | None = None

    async def attempt(self, session: Session) -> None:
        if self.info is None:
            info = await self.stat_remote(session, self.remote)
            where = self.remote_label(self.remote)
            if not info.exists:
                raise NotFoundError(f"{where} does not exist")
            if info.kind not in ("file", "dir"):
                raise ConfigError(f"{where} is not a regular file (a device, pipe or socket)")
            self.dest = _local_target(self.local, self.remote, self.peer.name, info.kind)
            self.info = info
            self.result.kind = info.kind
            self.result.local = self.dest
            self.result.remote = _shown(self.remote)
            self.callbacks.started(f"{where} -> {self.dest}", info.size)
        assert self.dest is not None
        if self.info.kind == "dir":
            await self._get_folder(session, self.dest)
        elif not await self._get_file(session, self.dest):
            await self._get_file(session, self.dest)  # the kept part was stale: once more

    def _part_offset(self, part: Path) -> int:
        assert self.info is not None
        try:
            offset = part.stat().st_size
        except FileNotFoundError:
            offset = 0
        if offset > self.info.size:
            offset = 0  # the remote file shrank since: the part is stale
        return offset

    async def _get_file(self, session: Session, dest: Path) -> bool:
        """Fetch the file (resuming a kept part); False when that part proved stale."""
        if self.use_channel(session):
            fetched = await self._get_file_channel(session, dest)
            if fetched is not None:
                return fetched
        return await self._get_file_quic(session, dest)

    async def _get_file_channel(self, session: Session, dest: Path) -> bool | None:
        """``_get_file`` over a data channel; None: none could be opened."""
        from gpumesh.blocking import in_thread

        part = dest.with_name(dest.name + PART_SUFFIX)
        offset = self._part_offset(part)
        stream = session.open_stream()
        asked = offered()
        # Not ended until FileDone is read: an early end tells the provider we gave up.
        stream.send_message(ChannelGet(path=self.remote, offset=offset, hashes=asked))
        try:
            info = await self.within(RESPONSE_TIMEOUT, stream.expect(FileInfo))
        except (ProtocolError, UnreachableError) as exc:
            self.no_channel(stream, session, exc)
            return None
        offer = await self.offer(stream)
        channel = None if offer is None else await self.open_channel(session, offer)
        if offer is None or channel is None:
            self.no_channel(stream, session, UnreachableError("no data channel"), offer is not None)
            return None
        try:
            if info.kind != "file":
                raise ProtocolError(f"{self.peer.name} answered a file request with {info.kind}")
            if offer.offset != offset or offset > info.size:
                raise ProtocolError(f"{self.peer.name} offered the file from the wrong byte")
            hash_name = taken(info.hash, asked)
            size = info.size
            self.result.channel = "tls"
            self.result.size = size
            self.result.offsets.append(offset)
            self.done = offset
            self.callbacks.progress(offset, size)
            hasher = new_hasher(hash_name)
            fd = os.open(part, os.O_RDWR | os.O_CREAT | platform.BINARY, 0o600)
            report = self.progress_from_thread(size)
            await _pump(channel, fd, _resume_and_receive, offset, size - offset, hasher, report)
            done = await self.within(RESPONSE_TIMEOUT, stream.expect(FileDone))
            # The pump returned: every byte of the file is in the part.
            if not await self.matches(done, size, size, (hash_name, hasher), part, offset):
                return False
            await in_thread(_place_part, info, part, dest)
        finally:
            with contextlib.suppress(GPUMeshError):
                stream.finish()
            channel.close()
            session.link.forget_stream(stream.stream_id)
        return True

    async def _get_file_quic(self, session: Session, dest: Path) -> bool:
        from gpumesh.files.transfer import FileSink, worker

        part = dest.with_name(dest.name + PART_SUFFIX)
        assert self.info is not None
        offset = self._part_offset(part)
        self.result.channel = "quic"
        stream = session.open_stream()
        try:
            # Not ended: our side of the stream carries the credit for the data.
            asked = offered()
            stream.send_message(FileGet(path=self.remote, offset=offset, hashes=asked))
            info = await self.within(RESPONSE_TIMEOUT, stream.expect(FileInfo))
            if info.kind != "file":
                raise ProtocolError(f"{self.peer.name} answered a file request with {info.kind}")
            hash_name = taken(info.hash, asked)
            size = info.size
            self.result.size = size
            self.result.offsets.append(offset)
            self.done = offset
            self.callbacks.progress(offset, size)
            hasher = new_hasher(hash_name)
            fd = os.open(part, os.O_RDWR | os.O_CREAT | platform.BINARY, 0o600)
            async with worker(cleanup=lambda: os.close(fd)) as runner:
                await runner.call(_truncate_and_hash, fd, offset, hasher)
                sink = FileSink(runner, fd, hasher)
                # The first bytes may wait for the provider to hash what we have.
                wait = RESPONSE_TIMEOUT
                while chunk := await self.within(wait, stream.read_data()):
                    wait = self.stall_timeout
                    if self.done + len(chunk) > size:
                        raise ProtocolError(f"{self.peer.name} sent more than the file's size")
                    await sink.write(chunk)
                    self.advance(len(chunk), size)
                await sink.finish()
                done = await self.within(RESPONSE_TIMEOUT, stream.expect(FileDone))
                if not await self.matches(done, self.done, size, (hash_name, hasher), part, offset):
                    return False
                await runner.call(_place_download, fd, info, part, dest)
        finally:
            with contextlib.suppress(GPUMeshError):
                stream.finish()
            session.link.forget_stream(stream.stream_id)
        return True

    async def matches(
        self,
        done: FileDone,
        received: int,
        size: int,
        hashed: tuple[str, Hasher],
        part: Path,
        offset: int,
    ) -> bool:
        """Whether the part (``received`` bytes) holds the file the provider hashed;
        when not, it is removed, and False means a kept part was stale (fetch once
        more from 0)."""
        from gpumesh.blocking import in_thread

        hash_name, hasher = hashed
        digest = hasher.digest()
        if received == size == done.size and done.digest == digest:
            self.result.hash, self.result.digest = hash_name, digest.hex()
            return True
        await in_thread(part.unlink)
        if offset > 0:
            return False
        raise ProtocolError(
            f"the copy of {self.remote_label(self.remote)} did not match its {label(hash_name)} "
            "hash (did it change meanwhile?) and was removed; copy it again"
        )

    async def _get_folder(self, session: Session, dest: Path) -> None:
        from gpumesh.blocking import in_thread
        from gpumesh.client.bulk import NoChannel, answer_after_offer, receive_tar

        temp = dest.with_name(dest.name + PART_SUFFIX)
        await in_thread(_remove, temp)
        wanted = self.use_channel(session)
        stream = session.open_stream()
        try:
            asked = offered()
            # Not ended: credit flows back (over QUIC), or the end says we are done.
            stream.send_message(DirGet(path=self.remote, hashes=asked, channel=wanted))
            offer, info = await answer_after_offer(stream, FileInfo)
            if info.kind != "dir":
                raise ProtocolError(f"{self.peer.name} answered a folder request with {info.kind}")
            hash_name = taken(info.hash, asked)
            size = info.size
            self.result.size = size
            self.result.offsets.append(0)
            self.done = 0
            self.callbacks.progress(0, size)
            unpacked: Unpacked | None = None
            if offer is not None:
                self.result.channel = "tls"
                unpacked = await receive_tar(
                    self.node,
                    session,
                    self.peer,
                    stream,
                    offer,
                    size,
                    hash_name,
                    temp,
                    lambda count: self.advance(count, size),
                    self.stall_timeout,
                )
                if unpacked is None:
                    self.fast = False
                    self.result.no_channel = NoChannel.FAILED
            elif wanted:
                self.result.no_channel = NoChannel.NOT_OFFERED
            try:
                if unpacked is None:
                    self.result.channel = "quic"
                    unpacked = await self._get_folder_quic(stream, temp, size, hash_name)
                await in_thread(_place_folder_download, temp, dest)
            finally:
                await in_thread(_remove, temp)
            self.result.hash, self.result.digest = hash_name, unpacked.digest.hex()
            self.result.folder_content = unpacked.content
        finally:
            with contextlib.suppress(GPUMeshError):
                stream.finish()
            session.link.forget_stream(stream.stream_id)

    async def _get_folder_quic(
        self, stream: Stream, temp: Path, size: int, hash_name: str
    ) -> Unpacked:
        """The tar as DATA on the request's stream, unpacked into ``temp``; its hash
        and bytes of content."""
        from gpumesh.client.bulk import Unpacked
        from gpumesh.files.transfer import unpack_from

        hasher = new_hasher(hash_name)
        async with unpack_from(temp, size, hasher) as feed:
            while chunk := await self.within(self.stall_timeout, stream.read_data()):
                if self.done + len(chunk) > size:
                    raise ProtocolError(f"{self.peer.name} sent more than the folder's size")
                await feed(chunk)
                self.advance(len(chunk), size)
            content = await feed(None)
        done = await self.within(RESPONSE_TIMEOUT, stream.expect(FileDone))
        if self.done != size or done.size != size or done.digest != hasher.digest():
            raise ProtocolError(
                f"the copy of {self.remote_label(self.remote)} did not match its "
                f"{label(hash_name)} hash and was removed; copy it again"
            )
        return Unpacked(done.digest, content)

    def gave_up(self, exc: GPUMeshError) -> GPUMeshError:
        if self.info is not None and self.info.kind == "file" and 0 < self.done < self.info.size:
            return type(exc)(
                f"{exc.message}; {format_size(self.done)} of {format_size(self.info.size)} is "
                f"kept in {self.dest}{PART_SUFFIX}: run the same `gpumesh cp` again to resume"
            )
        return type(exc)(exc.message)


def _local_error(exc: OSError) -> GPUMeshError:
    """An OS error met on this machine, as one line that says what to do."""
    import errno

    where = f" ({exc.filename})" if exc.filename else ""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return LimitError(f"this machine's disk is full{where}; free some space and copy again")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return ConfigError(f"permission denied{where}")
    return ConfigError(f"{exc.strerror or exc}{where}")


def _local_target(local: Path, remote: str, peer_name: str, kind: str) -> Path:
    """Where a download goes, as cp decides: into ``local`` when it is a folder."""
    text = str(local)
    if local.is_dir() or text.endswith(os.sep):
        parts = [p for p in remote.split("/") if p not in ("", ".")]
        name = parts[-1] if parts else peer_name
        dest = local / name
    else:
        dest = local
    if not dest.parent.is_dir():
        raise NotFoundError(f"{dest.parent} is not an existing folder: create it first")
    if kind == "file" and dest.is_dir():
        raise ConfigError(f"{dest} is a folder: give a file name to copy to")
    occupied = dest.is_symlink() or (dest.exists() and (not dest.is_dir() or any(dest.iterdir())))
    if kind == "dir" and occupied:
        raise ConfigError(f"{dest} already exists: remove it or choose another destination")
    return dest


def _truncate_and_hash(fd: int, offset: int, hasher: Hasher) -> None:
    from gpumesh.files.transfer import hash_file, truncate_at

    truncate_at(fd, offset)
    hash_file(fd, offset, hasher)


def _place_download(fd: int, info: FileInfo, part: Path, dest: Path) -> None:
    platform.chmod_open(fd, part, info.mode & 0o777)
    if info.mtime > 0:
        platform.utime_open(fd, part, info.mtime)
    os.replace(part, dest)


def _resume_and_receive(
    channel: Channel,
    fd: int,
    offset: int,
    count: int,
    hasher: Hasher,
    progress: Callable[[int], None],
) -> None:
    """After the part kept so far (hashed while the first new bytes arrive), the rest."""
    from gpumesh.files.transfer import truncate_at
    from gpumesh.transport.channel import receive_file

    truncate_at(fd, offset)
    receive_file(channel, fd, count, hasher, progress, offset)


def _place_part(info: FileInfo, part: Path, dest: Path) -> None:
    os.chmod(part, info.mode & 0o777)
    if info.mtime > 0:
        os.utime(part, (info.mtime, info.mtime))
    os.replace(part, dest)


def _place_folder_download(temp: Path, dest: Path) -> None:
    if dest.is_dir() and not dest.is_symlink():
        dest.rmdir()  # empty: checked before the transfer
    os.rename(temp, dest)


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path, ignore_errors=True)
