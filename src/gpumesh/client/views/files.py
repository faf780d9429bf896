"""The shape of ``gpumesh cp --json``: one finished copy."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from gpumesh.client.files import CopyResult

__all__ = ["COPY_EVENTS", "CopyProgressView", "CopyRetryingView", "CopyStartedView", "CopyView"]


class CopyView(msgspec.Struct):
    """A copy, either way, of a file or a folder."""

    direction: str
    """``upload`` or ``download``."""
    kind: str
    """``file`` or ``dir``."""
    peer: str
    local: str
    remote: str
    """The path in the peer's sandbox, from its root."""
    size: int
    """Bytes of the file, or of the folder's tar."""
    content: int
    """Bytes of file contents (a folder's files, without the tar's headers)."""
    hash: str
    """``blake3``, or ``sha256`` with an older peer."""
    digest: str
    seconds: float
    transferred: int
    """Bytes that crossed the network."""
    resumed_from: int
    attempts: int
    offsets: list[int]
    """Where each attempt started."""
    mb_per_s: float
    skipped: list[str]
    """Entries of a folder left out, each with why."""
    channel: str
    """``tls`` (the data channel) or ``quic``."""
    congestion: str
    no_channel: str
    """With ``quic``: why not the data channel."""

    @classmethod
    def of(cls, result: CopyResult) -> CopyView:
        return cls(
            direction=result.direction,
            kind=result.kind,
            peer=result.peer,
            local=str(result.local),
            remote=result.remote,
            size=result.size,
            content=result.content,
            hash=result.hash,
            digest=result.digest,
            seconds=round(result.seconds, 3),
            transferred=result.transferred,
            resumed_from=result.resumed_from,
            attempts=result.attempts,
            offsets=result.offsets,
            mb_per_s=round(result.mb_per_s, 1),
            skipped=result.skipped,
            channel=result.channel,
            congestion=result.congestion,
            no_channel=result.no_channel,
        )


class CopyStartedView(msgspec.Struct):
    """A copy began: what is copied (``data.bin -> alice-pc:/data.bin``), its bytes."""

    label: str
    total: int


class CopyProgressView(msgspec.Struct):
    done: int
    """Bytes in place so far, resumed ones included."""
    total: int


class CopyRetryingView(msgspec.Struct):
    """The link was lost: why, and the attempt about to start."""

    message: str
    attempt: int


COPY_EVENTS: dict[str, type] = {
    "copystarted": CopyStartedView,
    "copyprogress": CopyProgressView,
    "copyretrying": CopyRetryingView,
    "end": CopyView,
}
"""``POST /api/v1/copies?stream=true``'s events; ``end`` is the copy's view."""
