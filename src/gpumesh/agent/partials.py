"""Partial uploads kept for resuming, and the uploads in flight that write them.

Owns each peer's ``files/.partial/<peer node id>/`` (the agent's own, no job
reaches it): a partial upload is kept under a key made of its path, size and
source (an older consumer's FilePut names its file by its SHA-256 instead),
with those written beside it, so the next upload of the same file, over QUIC
or a data channel, resumes after the bytes already there; partials untouched
for :data:`PARTIAL_TTL` are removed. :class:`InFlight` holds each upload in
progress (what it reserves of the quota, and how to stop it), so a newer
upload of the same file takes over from one whose link dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import stat
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpumesh.errors import AgentError, ConnectionLostError
from gpumesh.files.sandbox import Tree
from gpumesh.files.transfer import Hasher, hash_file, truncate_at

if TYPE_CHECKING:
    from gpumesh.store.peers import Peer
    from gpumesh.transport.stream import Stream

__all__ = [
    "PARTIALS",
    "PARTIAL_TTL",
    "Claim",
    "InFlight",
    "discard",
    "kept_offset",
    "partial_bytes",
    "partial_key",
    "start_partial",
    "truncate_and_hash",
]

PARTIALS = ".partial"
"""Folder under ``files/`` holding partial uploads (node ids never start with a dot)."""
PARTIAL_TTL = 7 * 86400.0
"""Partial uploads untouched this long are removed (they count against the quota)."""
_TAKEOVER_WAIT = 30.0
"""How long a resumed upload waits for the dropped attempt it replaces to let go."""


@dataclass
class Claim:
    """An upload in progress: what it holds of the quota, and how to stop it."""

    reserved: int
    stream: Stream | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)


class InFlight:
    """The uploads in progress, each holding a name in its peer's partials."""

    def __init__(self, provider: str) -> None:
        self.provider = provider
        """This provider's name, for the refusal of an upload that cannot take over."""
        self._active: dict[str, dict[str, Claim]] = {}
        """Peer id -> name in its partials folder -> the upload writing it."""

    @contextlib.asynccontextmanager
    async def claim(
        self, peer: Peer, key: str, reserve: int, stream: Stream | None
    ) -> AsyncIterator[Claim]:
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
                    f"{self.provider} is still finishing an earlier upload of this file; "
                    "try again in a minute"
                ) from None
        claim = Claim(reserve, stream)
        active[key] = claim
        try:
            yield claim
        finally:
            if active.get(key) is claim:
                del active[key]
            claim.done.set()

    def held(self, peer: Peer, exclude: str = "") -> tuple[set[str], int]:
        """The names the peer's uploads in progress hold, and the bytes they reserve
        (all but ``exclude``'s)."""
        active = self._active.get(str(peer.node_id), {})
        reserved = sum(claim.reserved for name, claim in active.items() if name != exclude)
        return set(active), reserved


# --- blocking helpers ----------------------------------------------------------------------------


def partial_key(
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


def kept_offset(part: Path, meta: Path, expected: dict[str, Any]) -> int:
    """Bytes of a kept partial upload of exactly this file, or 0 (stale ones removed)."""
    try:
        recorded = json.loads(meta.read_text())
        size = part.stat().st_size
    except (OSError, ValueError):
        discard(part, meta)
        return 0
    if not isinstance(recorded, dict) or any(recorded.get(k) != v for k, v in expected.items()):
        discard(part, meta)
        return 0
    return min(size, int(expected["size"]))


def start_partial(part: Path, meta: Path, expected: dict[str, Any]) -> None:
    part.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    temp = meta.with_suffix(".tmp")
    temp.write_text(json.dumps({**expected, "started": time.time()}))
    os.replace(temp, meta)
    with part.open("wb"):
        pass


def truncate_and_hash(fd: int, offset: int, hasher: Hasher) -> None:
    """Drop what lies past ``offset`` (a write cut short), then hash the part kept."""
    truncate_at(fd, offset)
    hash_file(fd, offset, hasher)


def discard(part: Path, meta: Path) -> None:
    for path in (part, meta):
        with contextlib.suppress(OSError):
            path.unlink()


def partial_bytes(partials: Path, busy: set[str]) -> int:
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
