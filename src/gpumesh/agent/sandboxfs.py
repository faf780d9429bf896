"""What every service that works in a peer's sandbox shares: paths, usage, refusals.

Owns the pure check of a remote path (:func:`sandbox_parts`: no ``..``, no
NUL, control characters or backslashes, no component over 255 bytes), how a
path is shown to users, a peer's usage against its ``file_quota``, and how an
OS error met while serving a peer becomes the one-line refusal it is sent.
The file service (:mod:`gpumesh.agent.files`) owns the sandboxes themselves;
the app and job services use these through it and from here. Never touches
the file system.
"""

from __future__ import annotations

import errno
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ParamSpec

from gpumesh.errors import AccessDeniedError, AgentError, ConfigError, GPUMeshError, LimitError
from gpumesh.units import format_size

__all__ = [
    "MAX_NAME_BYTES",
    "Listing",
    "Usage",
    "os_refusal",
    "refusing",
    "sandbox_parts",
    "sandbox_path",
    "shown",
]

logger = logging.getLogger(__name__)

P = ParamSpec("P")

MAX_NAME_BYTES = 255

Listing = tuple[Sequence[str], dict[str, tuple[int, int]]]
"""A folder in a sandbox (its parts), and the dict a walk fills with its regular
files: path from that folder -> (size, mtime_ns)."""


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


def shown(remote: str) -> str:
    """A remote path as users write it: from the sandbox root, with a leading ``/``."""
    text = "/" + "/".join(part for part in remote.split("/") if part not in ("", "."))
    return text if text.isprintable() else repr(text)


@dataclass(frozen=True)
class Usage:
    """What a peer keeps on this provider, against its ``file_quota``."""

    used: int
    quota: int

    def check(self, provider: str, extra: int) -> None:
        """Refuse ``extra`` more bytes past the quota, saying what to do."""
        if self.used + extra > self.quota:
            raise LimitError(
                f"{provider} keeps at most {format_size(self.quota)} of files for you (its "
                f"file_quota); {format_size(self.used)} is in use and this needs "
                f"{format_size(extra)} more: free space in your folder there, or ask its "
                "owner to raise file_quota"
            )


def os_refusal(exc: OSError) -> GPUMeshError:
    """An OS error met while serving a peer, as the refusal it is sent."""
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


def refusing(handler: Callable[P, Awaitable[None]]) -> Callable[P, Awaitable[None]]:
    """A request handler whose OS errors become refusals that say what happened."""

    @functools.wraps(handler)
    async def wrapped(*args: P.args, **kwargs: P.kwargs) -> None:
        try:
            await handler(*args, **kwargs)
        except OSError as exc:
            logger.debug("%s failed", handler.__qualname__, exc_info=True)
            raise os_refusal(exc) from None

    return wrapped
