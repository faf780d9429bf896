"""Whether a folder may be trusted as a node's home: owned by its user, and written
by nobody else.

Another account that pre-created the home in a shared place, or that may write in
it, could plant or swap the files the node trusts (its key, its database, the
node process's socket). Imports nothing heavy: the thin commands that talk to
the node process check the home too, and start light.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from gpumesh.errors import ConfigError

__all__ = ["check_home"]

_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


def check_home(path: Path) -> None:
    """Refuse a home that another account owns or may write in (an absent one passes:
    it is made 0700 by its user). ``path`` may be a link to a folder of the user's,
    but not a link another account made, which it could point elsewhere later."""
    if not hasattr(os, "geteuid"):
        return  # Windows: the home's privacy is its folder's ACL, from the user's profile
    uid = os.geteuid()
    try:
        link = os.lstat(path)
        found = os.stat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ConfigError(f"cannot use {path} as the home: {exc.strerror or exc}") from None
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (uid, 0):
        raise ConfigError(
            f"the home {path} is a link made by another user (uid {link.st_uid}); "
            "GPUMesh keeps its keys only in a home you own: use your own folder (the "
            "default is ~/.gpumesh) with --home or GPUMESH_HOME"
        )
    if not stat.S_ISDIR(found.st_mode):
        raise ConfigError(
            f"the home {path} is not a folder: use a folder of yours (the default is "
            "~/.gpumesh) with --home or GPUMESH_HOME"
        )
    if found.st_uid != uid:
        raise ConfigError(
            f"the home {path} belongs to another user (uid {found.st_uid}); GPUMesh keeps "
            "its keys only in a home you own: use your own folder (the default is "
            "~/.gpumesh) with --home or GPUMESH_HOME"
        )
    if found.st_mode & _OTHERS_WRITE:
        raise ConfigError(
            f"the home {path} is writable by other users (mode "
            f"{stat.S_IMODE(found.st_mode):04o}), who could plant files in it: "
            f"run `chmod 700 {path}` if only you have used it, or use a new folder"
        )
