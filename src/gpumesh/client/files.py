"""Copying files and folders to and from a peer's sandbox (``gpumesh cp``).

Owns the consumer's side of the file requests as callers use it: telling
``peer:path`` from a local path (:func:`copy`), what is reported while a copy
runs (:class:`CopyCallbacks`) and what it did (:class:`CopyResult`). Every
copy is checked end to end against its hash (BLAKE3, or SHA-256 with a peer
from before that choice: see :mod:`gpumesh.files.hashing`). File bytes go
over a data channel (TLS on TCP, opened and authorised by the QUIC request,
see :mod:`gpumesh.transport.channel`) when a direct path exists and neither
side turned it off; when one cannot be opened the copy falls back to QUIC at
once, silently. An upload resumes from the partial file the provider kept; a
download keeps a local ``NAME.gpumesh-part`` and asks for the rest. Either
way the partial is the same whichever path carried its bytes, so a copy
dropped on one path resumes on the other. A dropped link (or a provider that
stops answering) is retried a few times, each retry resuming; a later
``gpumesh cp`` of the same file resumes too. Folders travel as one tar, never
resumed, unpacked all or nothing, over the data channel too when one opens
(:mod:`gpumesh.client.bulk`).

The attempts and their retries are :mod:`gpumesh.client.cpretry`'s; the
uploads :mod:`gpumesh.client.cpupload`'s and the downloads
:mod:`gpumesh.client.cpdownload`'s.

Nothing here prints; results and progress go to the caller.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gpumesh import platform
from gpumesh.client.cpdownload import Download
from gpumesh.client.cpretry import Copier
from gpumesh.client.cpupload import FileUpload, FolderUpload
from gpumesh.errors import ConfigError, GPUMeshError, NotFoundError
from gpumesh.files.hashing import SHA256

if TYPE_CHECKING:
    from gpumesh.client.node import Node
    from gpumesh.store.peers import Peer

__all__ = [
    "CopyCallbacks",
    "CopyResult",
    "Location",
    "copy",
    "parse_location",
]

RETRIES = 3
"""Retries after a dropped link, each resuming where the last attempt stopped."""
STALL_TIMEOUT = 20.0
"""Seconds without any progress after which a link counts as dropped."""


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
    started = time.perf_counter()
    callbacks = callbacks or CopyCallbacks()
    copier: Copier
    if dst.peer is not None:
        peer = node.peer(dst.peer)
        local = Path(src.path)
        try:
            st = os.stat(local)
        except FileNotFoundError:
            raise NotFoundError(f"{local} does not exist") from None
        except NotADirectoryError:
            raise NotFoundError(
                f"{local} does not exist (a folder in its path is a file)"
            ) from None
        except PermissionError:
            raise ConfigError(f"cannot read {local}: permission denied") from None
        if stat.S_ISDIR(st.st_mode):
            result = _result("upload", "dir", peer, local, dst.path)
            copier = FolderUpload(node, peer, local, dst.path, callbacks, stall_timeout, result)
        elif stat.S_ISREG(st.st_mode):
            result = _result("upload", "file", peer, local, dst.path)
            copier = FileUpload(node, peer, local, dst.path, callbacks, stall_timeout, result, st)
        else:
            raise ConfigError(f"{local} is not a regular file (a device, pipe or socket)")
    else:
        assert src.peer is not None
        peer = node.peer(src.peer)
        result = _result("download", "", peer, Path(dst.path), src.path)
        copier = Download(node, peer, Path(dst.path), src.path, callbacks, stall_timeout, result)
    copier.allow_channel(fast_path)
    return await copier.run(retries, started)


def _result(direction: str, kind: str, peer: Peer, local: Path, remote: str) -> CopyResult:
    """What a copy fills in as it runs (``kind``: empty until a download learns it)."""
    return CopyResult(
        direction=direction,
        kind=kind,
        peer=peer.name,
        local=local,
        remote=remote,
        size=0,
        digest="",
        seconds=0.0,
    )
