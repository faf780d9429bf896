"""Shell completion: names from the local store, and the PowerShell script.

Click drives completion: the script a shell sources (``gpumesh completion
SHELL``) runs ``gpumesh`` again at each Tab press with ``_GPUMESH_COMPLETE``
set, and click asks the parameter being typed for its ``shell_complete``.
The functions here answer for peers, groups and jobs from the node's own
database (read-only, no network, see :mod:`gpumesh.store.names`); anything
in the way gives no suggestions, never an error.

Click's own PowerShell support (click 8.5 and later) is replaced by
:class:`gpumesh.cli._powershell.PowerShellComplete`, so every supported click
completes the same way and the word under the cursor, not the end of the line,
is completed. That module (and click's completion machinery) is loaded at a
Tab press only: every command names these completers, and must not pay for it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from click.shell_completion import CompletionItem

    from gpumesh.store.names import NameHint

# The lookups (and the sqlite3 they need) are imported at a Tab press only: the
# commands that name these completers must not pay for them when they run.

__all__ = [
    "SHELLS",
    "complete_group",
    "complete_job",
    "complete_peer",
    "complete_peer_path",
    "complete_submitted_job",
]

SHELLS = ("bash", "zsh", "fish", "powershell")


def _db_path(ctx: click.Context) -> Path | None:
    from gpumesh.settings import home_dir

    home = ctx.find_root().params.get("home")
    try:
        return home_dir(home) / "gpumesh.db"
    except (RuntimeError, OSError):  # no --home, no $GPUMESH_HOME and no home directory
        return None


def _items(
    ctx: click.Context, lookup: Callable[[Path], list[NameHint]], incomplete: str
) -> list[CompletionItem]:
    from click.shell_completion import CompletionItem

    db_path = _db_path(ctx)
    if db_path is None:
        return []
    return [
        CompletionItem(entry.name, help=entry.hint or None)
        for entry in lookup(db_path)
        if entry.name.startswith(incomplete)
    ]


def complete_peer(
    ctx: click.Context, param: click.Parameter, incomplete: str
) -> list[CompletionItem]:
    """Names of paired peers."""
    from gpumesh.store.names import peer_names

    return _items(ctx, peer_names, incomplete)


def complete_group(
    ctx: click.Context, param: click.Parameter, incomplete: str
) -> list[CompletionItem]:
    """Names of the groups this node created or joined."""
    from gpumesh.store.names import group_names

    return _items(ctx, group_names, incomplete)


def complete_job(
    ctx: click.Context, param: click.Parameter, incomplete: str
) -> list[CompletionItem]:
    """Ids of jobs submitted from here and hosted here, newest first."""
    from gpumesh.store.names import job_ids

    return _items(ctx, job_ids, incomplete.lower())


def complete_submitted_job(
    ctx: click.Context, param: click.Parameter, incomplete: str
) -> list[CompletionItem]:
    """Ids of jobs submitted from here, newest first."""
    from gpumesh.protocol.states import JobRole
    from gpumesh.store.names import job_ids

    return _items(ctx, lambda db: job_ids(db, role=JobRole.SUBMITTED), incomplete.lower())


def complete_peer_path(
    ctx: click.Context, param: click.Parameter, incomplete: str
) -> list[CompletionItem]:
    """``PEER:`` for each paired peer, and local paths.

    Paths on the peer are not offered: listing them would take a connection.
    The local paths' entry comes first: click's bash script empties what it
    gathered when it meets a ``file`` entry, so after the peers it wiped them
    (bash then completes files only when no peer matches)."""
    from click.shell_completion import CompletionItem

    if ":" in incomplete:
        return []
    local = [CompletionItem(incomplete, type="file")]
    if incomplete.startswith(("/", ".", "~")):
        return local
    from gpumesh.store.names import peer_names

    peers = _items(ctx, peer_names, incomplete)
    return local + [CompletionItem(f"{p.value}:", help=p.help) for p in peers]
