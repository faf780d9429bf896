"""Names for the unix sockets in a home (the control API's, shells').

A unix socket's path must fit in 108 bytes with its NUL, and a home's path may
be longer: such a socket is then reached through a descriptor of its folder
(``/proc/self/fd/N/NAME``), where the system has those paths. Elsewhere a path
that is too long is refused as ENAMETOOLONG, which callers treat like any other
socket they cannot use.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["SUN_PATH_MAX", "socket_name"]

SUN_PATH_MAX = 107
"""The longest unix socket path, without its NUL."""


@contextlib.contextmanager
def socket_name(folder: Path, name: str) -> Iterator[str]:
    """A name for the socket ``name`` in ``folder`` that bind and connect accept,
    valid inside the block."""
    direct = str(folder / name)
    if len(os.fsencode(direct)) <= SUN_PATH_MAX:
        yield direct
        return
    from gpumesh import platform  # here: the thin CLI's paths are short

    if not platform.has("procfd"):
        raise OSError(errno.ENAMETOOLONG, "too long for a unix socket", direct)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{name}"
    finally:
        os.close(fd)
