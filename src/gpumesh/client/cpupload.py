"""Uploads: a local file or folder copied into a peer's sandbox.

Owns where an upload lands (into a remote folder under the local name, as
``cp`` does); a file sent over a data channel or QUIC, hashed while it is
sent and checked against the provider's hash, resumed from the partial file
the provider kept (it says where in ``FileResume`` or ``ChannelOffer``,
whichever path carried the earlier bytes), or, to a provider from before the
hash negotiation, sent with its SHA-256 up front; and a folder sent as one
tar, never resumed (:mod:`gpumesh.client.bulk` when a data channel opens).
A local file that changes while it is copied fails the copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import stat
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from gpumesh import platform
from gpumesh.blocking import in_thread
from gpumesh.client.bulk import NoChannel, answer_after_offer, send_tar, threadsafe
from gpumesh.client.cpretry import RESPONSE_TIMEOUT, Copier, run_pump, shown
from gpumesh.errors import (
    ConfigError,
    ConnectionLostError,
    GPUMeshError,
    ProtocolError,
    UnreachableError,
)
from gpumesh.files.hashing import SHA256, new_hasher, offered, taken
from gpumesh.files.pack import scan, tar_size
from gpumesh.files.transfer import file_chunks, hash_file, swallow, tar_chunks, worker
from gpumesh.protocol.messages import ChannelPut, DirPut, FileDone, FilePut, FileResume
from gpumesh.transport.channel import send_file
from gpumesh.units import format_size

if TYPE_CHECKING:
    from gpumesh.client.files import CopyCallbacks, CopyResult
    from gpumesh.client.node import Node
    from gpumesh.store.peers import Peer
    from gpumesh.transport.session import Session
    from gpumesh.transport.stream import Stream

__all__ = ["FileUpload", "FolderUpload"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class _Upload(Copier):
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
        self.result.remote = shown(target)
        self.callbacks.started(f"{self.local} -> {self.remote_label(target)}", self.size)
        return target


class FileUpload(_Upload):
    def __init__(
        self,
        node: Node,
        peer: Peer,
        local: Path,
        remote: str,
        callbacks: CopyCallbacks,
        stall_timeout: float,
        result: CopyResult,
        st: os.stat_result,
    ) -> None:
        super().__init__(node, peer, local, remote, callbacks, stall_timeout, result)
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

        stream, asked = self.put(ChannelPut, session, target)
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
            report = threadsafe(lambda count: self.advance(count, self.size))
            try:
                await run_pump(channel, fd, send_file, offer.offset, self.size, hasher, report)
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

        self.result.channel = "quic"
        stream, asked = self.put(FilePut, session, target)
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

    def put(
        self, kind: type[ChannelPut | FilePut], session: Session, target: str
    ) -> tuple[Stream, list[str]]:
        """Ask for the file to be put at ``target``, offering the hashes this side knows."""
        stream = session.open_stream()
        asked = offered()
        stream.send_message(
            kind(
                path=target,
                size=self.size,
                mode=stat.S_IMODE(self.st.st_mode),
                source=self.source,
                hashes=asked,
            )
        )
        return stream, asked

    def start_at(self, offset: int) -> None:
        if offset > self.size:
            raise ProtocolError(f"{self.peer.name} asked to resume past the end of the file")
        self.begin(offset, self.size)

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


class FolderUpload(_Upload):
    async def prepare(self) -> None:
        self.plan = await in_thread(scan, self.local, [self.node.home.path])
        self.size = await in_thread(tar_size, self.plan)
        self.result.size = self.size
        self.result.folder_content = self.plan.total_bytes
        self.result.skipped = [f"{s.path}: {s.reason}" for s in self.plan.skipped]

    async def attempt(self, session: Session) -> None:
        target = await self.settle_target(session)
        wanted = self.use_channel(session)
        stream = session.open_stream()
        asked = offered()
        stream.send_message(DirPut(path=target, size=self.size, hashes=asked, channel=wanted))
        try:
            offer, resume = await answer_after_offer(stream, FileResume)
            hash_name = taken(resume.hash, asked)
            self.begin(0, self.size)
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


def _name_of(local: Path) -> str:
    name = Path(os.path.abspath(local)).name
    if not name:
        raise ConfigError(f"{local} has no name to copy it under: give a remote file name")
    return name


def _into(remote: str, name: str) -> str:
    return f"{remote.rstrip('/')}/{name}"


def _is_folder_path(remote: str) -> bool:
    """``peer:``, ``peer:/`` and ``peer:dir/`` name a folder to copy into."""
    return shown(remote) == "/" or remote.endswith("/")


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


def _source_id(path: Path, st: os.stat_result) -> str:
    """Names a local file for resuming its upload: which file, which version of it."""
    text = f"{os.path.abspath(path)}\n{st.st_dev}:{st.st_ino}\n{st.st_size}\n{st.st_mtime_ns}"
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:32]


def _hash_path(path: Path, st: os.stat_result) -> bytes:
    """The SHA-256 of a local file, for a provider that wants it before the bytes."""

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
