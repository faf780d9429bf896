"""Downloads: a file or folder copied from a peer's sandbox to this machine.

Owns where a download lands (into a local folder under the remote name, as
``cp`` does), a file fetched over a data channel or QUIC into a local
``NAME.gpumesh-part`` (:data:`PART_SUFFIX`) and renamed into place only once
its hash matches the provider's, resumed with ``FileGet(offset)`` or
``ChannelGet(offset)`` after the part kept so far (whichever path carried it),
and a folder fetched as one tar, never resumed, unpacked all or nothing
(:mod:`gpumesh.client.bulk` when a data channel opens).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpumesh import platform
from gpumesh.blocking import in_thread
from gpumesh.client.bulk import NoChannel, Unpacked, answer_after_offer, receive_tar, threadsafe
from gpumesh.client.cpretry import RESPONSE_TIMEOUT, Copier, run_pump, shown
from gpumesh.errors import (
    ConfigError,
    GPUMeshError,
    NotFoundError,
    ProtocolError,
    UnreachableError,
)
from gpumesh.files.hashing import label, new_hasher, offered, taken
from gpumesh.files.transfer import FileSink, hash_file, truncate_at, unpack_from, worker
from gpumesh.platform import at_idle_priority
from gpumesh.protocol.messages import ChannelGet, DirGet, FileDone, FileGet, FileInfo
from gpumesh.transport.channel import receive_file
from gpumesh.units import format_size

if TYPE_CHECKING:
    from gpumesh.files.transfer import Hasher
    from gpumesh.transport.channel import Channel
    from gpumesh.transport.session import Session
    from gpumesh.transport.stream import Stream

__all__ = ["PART_SUFFIX", "Download", "remove_part"]

PART_SUFFIX = ".gpumesh-part"
"""Added to a download's name until it is complete and verified."""


class Download(Copier):
    """A file or folder copied from the peer's sandbox."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.info: FileInfo | None = None
        self.dest: Path | None = None

    async def attempt(self, session: Session) -> None:
        if self.info is None:
            info = await self.stat_remote(session, self.remote)
            where = self.remote_label(self.remote)
            self.dest = self.destination(info, where)
            self.info = info
            self.result.kind = info.kind
            self.result.local = self.dest
            self.result.remote = shown(self.remote)
            self.callbacks.started(f"{where} -> {self.dest}", info.size)
        assert self.dest is not None
        if self.info.kind == "dir":
            await self._get_folder(session, self.dest)
        elif not await self._get_file(session, self.dest):
            await self._get_file(session, self.dest)  # the kept part was stale: once more

    def destination(self, info: FileInfo, where: str) -> Path:
        """Where the remote ``info`` (at ``where``) goes here, once it is checked."""
        if not info.exists:
            raise NotFoundError(f"{where} does not exist")
        if info.kind not in ("file", "dir"):
            raise ConfigError(f"{where} is not a regular file (a device, pipe or socket)")
        return _local_target(self.local, self.remote, self.peer.name, info.kind)

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
            self.begin(offset, size)
            hasher = new_hasher(hash_name)
            fd = os.open(part, os.O_RDWR | os.O_CREAT | platform.BINARY, 0o600)
            report = threadsafe(lambda count: self.advance(count, size))
            pump = at_idle_priority(_resume_and_receive) if self.background else _resume_and_receive
            await run_pump(channel, fd, pump, offset, size - offset, hasher, report)
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
            self.begin(offset, size)
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
        temp = dest.with_name(dest.name + PART_SUFFIX)
        await in_thread(remove_part, temp)
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
            self.begin(0, size)
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
                await in_thread(remove_part, temp)
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


def remove_part(path: Path) -> None:
    """Remove a partial download, file or folder, if there is one."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path, ignore_errors=True)
