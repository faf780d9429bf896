"""The provider's file service: one sandbox folder per peer, its quota, and `gpumesh cp`.

Owns ``$GPUMESH_HOME/files/<peer node id>/`` (each peer's sandbox: a peer
reaches its own folder only, never another peer's or anything else of the
provider's), what the peer keeps here counted against its ``file_quota``
(the sandbox, its partial uploads, what its jobs wrote into their uploaded
workdirs, and uploads in flight), and the requests ``FileStat``, ``FilePut``,
``FileGet``, ``DirPut`` and ``DirGet``, and their data-channel variants
``ChannelPut`` and ``ChannelGet`` (file bytes over a one-shot TLS/TCP channel,
see :mod:`gpumesh.transport.channel`; same checks, same partials, same hash
verdict). Uploads are served by :mod:`gpumesh.agent.filereceive` (resumed
from :mod:`gpumesh.agent.partials`), downloads by
:mod:`gpumesh.agent.filesend`, and the channels opened by
:mod:`gpumesh.agent.datachannel`; a tar (``DirPut``/``DirGet`` here, a job's
workdir, an app's files) takes a channel when its request asks for one, and
:attr:`FileService.channels` serves the job, app and desktop services too.

Paths: a remote path names a place inside the sandbox; a leading ``/`` is the
sandbox root. :func:`~gpumesh.agent.sandboxfs.sandbox_parts` is the pure check every request goes
through (no ``..``, no NUL, control characters or backslashes, no component
over 255 bytes). The sandbox is then only ever reached through
:class:`gpumesh.files.sandbox.Tree`: relative to directory descriptors, one
component at a time, never following a symlink (a path with a link anywhere
on it is refused), so a peer's running job, which can change the folder at
any instant, cannot turn a check into a use somewhere else. Only regular
files and folders are served: devices, pipes, sockets and links are refused.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from gpumesh.agent.datachannel import DataChannels
from gpumesh.agent.deps import Handlers, Provider, RequestContext, Settings
from gpumesh.agent.filereceive import FileReceiver
from gpumesh.agent.filesend import FileSender
from gpumesh.agent.partials import PARTIALS, InFlight, partial_bytes
from gpumesh.agent.sandboxfs import (
    Listing,
    Usage,
    os_refusal,
    refusing,
    sandbox_parts,
    sandbox_path,
    shown,
)
from gpumesh.blocking import in_thread
from gpumesh.errors import AccessDeniedError, ConfigError, GPUMeshError, NotFoundError
from gpumesh.files.pack import scan_tree, tar_size
from gpumesh.files.sandbox import Tree
from gpumesh.protocol.messages import (
    ChannelGet,
    ChannelPut,
    DirGet,
    DirPut,
    FileGet,
    FileInfo,
    FilePut,
    FileStat,
)
from gpumesh.units import parse_size

if TYPE_CHECKING:
    import threading

    from gpumesh.identity.keys import Identity
    from gpumesh.store.peers import Peer

__all__ = [
    "FileService",
    "sandbox_parts",
    "sandbox_path",
    "shown",
]


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
        self.in_flight = InFlight(provider.name)
        """The uploads in progress (each holds a name in its peer's partials)."""
        self.channels = DataChannels(provider, settings, identity)
        """The data channels this provider opens for file and tar bytes."""
        self.receiver = FileReceiver(self)
        """Serves the uploads: FilePut, ChannelPut, DirPut."""
        self.sender = FileSender(self)
        """Serves the downloads: FileGet, ChannelGet, DirGet."""

    def register(self, handlers: Handlers) -> None:
        handlers.add(FileStat, self.handle_stat)
        handlers.add(FilePut, self.receiver.handle_put)
        handlers.add(FileGet, self.sender.handle_get)
        handlers.add(DirPut, self.receiver.handle_dir_put)
        handlers.add(DirGet, self.sender.handle_dir_get)
        handlers.add(ChannelPut, self.receiver.handle_channel_put)
        handlers.add(ChannelGet, self.sender.handle_channel_get)

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

    def where(self, remote: str) -> str:
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

    # --- what is there: FileStat, and the checks uploads and downloads share ---------------

    @refusing
    async def handle_stat(self, ctx: RequestContext, message: FileStat) -> None:
        info = await in_thread(self._stat, ctx.peer, message.path)
        ctx.stream.send_message(info, end=True)

    def _stat(self, peer: Peer, remote: str) -> FileInfo:
        """What is at ``remote`` (blocking: a folder is scanned for its tar size)."""

        parts = self.parts(remote)
        with self.tree(peer) as tree:
            st = self.lstat(tree, parts, remote)
            if st is None:
                return FileInfo(path=remote, exists=False, kind="", size=0, mode=0, mtime=0.0)
            mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISDIR(st.st_mode):
                with self.subtree(tree, parts, remote) as folder:
                    size = tar_size(scan_tree(folder))
                kind = "dir"
            elif stat.S_ISREG(st.st_mode):
                size, kind = st.st_size, "file"
            else:
                size, kind = 0, ""
        return FileInfo(
            path=remote, exists=True, kind=kind, size=size, mode=mode, mtime=st.st_mtime
        )

    def lstat(self, tree: Tree, parts: Sequence[str], remote: str) -> os.stat_result | None:
        """What is at ``parts``, None when nothing; a link on the way or there is refused."""
        try:
            st = tree.lstat(parts)
        except OSError as exc:
            raise self.refusal(exc, remote) from None
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise self.link_refused(remote)
        return st

    def subtree(self, tree: Tree, parts: Sequence[str], remote: str) -> Tree:
        try:
            return tree.subtree(parts)
        except OSError as exc:
            raise self.refusal(exc, remote) from None

    def refusal(self, exc: OSError, remote: str) -> GPUMeshError:
        """An OS error met on a peer's path, as the refusal it sends back."""
        where = self.where(remote)
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
                raise self.refusal(exc, remote) from None

    # --- quota -----------------------------------------------------------------------------

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
        busy, reserved = self.in_flight.held(peer, exclude)
        stored = await in_thread(self._stored_bytes, peer, busy | {exclude}, listing, stop)
        return Usage(stored + reserved, self.quota())

    def _stored_bytes(
        self, peer: Peer, busy: set[str], listing: Listing | None, stop: threading.Event | None
    ) -> int:
        """Bytes in the peer's regular files (walked through descriptors), idle
        partials (old ones removed) and job workdirs (blocking)."""
        with self.tree(peer) as tree:
            total = tree.tally(listing, stop)
        total += partial_bytes(self.partials(peer, create=False), busy)
        for workdir in self._job_dirs(str(peer.node_id)):
            try:
                work = Tree(workdir)
            except (FileNotFoundError, NotADirectoryError):
                continue
            with work:
                total += work.tally(None, stop)
        return total
