"""What ``gpumesh app sync`` prints of a sync done by the node process, as text:
the one place both ways of printing it read (the command, and the head start of
gpumesh.cli.launch, which prints it before click loads). Imports neither click
nor anything else a thin command's start-up avoids."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpumesh.client.views.apps import SyncView

__all__ = ["dry_run_lines", "sync_line", "view_output", "view_summary"]


def sync_line(peer: str, remote: str, sent: int, size: int, deleted: int, unchanged: int) -> str:
    from gpumesh.units import format_size

    return (
        f"synced {remote} on {peer}: {sent} sent ({format_size(size)}), {deleted} deleted, "
        f"{unchanged} unchanged"
    )


def dry_run_lines(
    sent: list[str], deleted: list[str], skipped: list[tuple[str, str]], unchanged: int
) -> list[str]:
    return [
        *(f"send    {path}" for path in sent),
        *(f"delete  {path}" for path in deleted),
        *(f"skip    {path}  ({reason})" for path, reason in skipped),
        f"dry run: {len(sent)} to send, {len(deleted)} to delete, "
        f"{unchanged} unchanged; nothing sent",
    ]


def view_output(view: SyncView, *, as_json: bool, dry_run: bool) -> list[str]:
    """The texts ``app sync`` echoes (each followed by a newline) for the node
    process's view of its sync."""
    if as_json:
        from gpumesh.client.views import to_json

        return [to_json(view)]
    if dry_run:
        skipped = [(s.path, s.rule) for s in view.skipped]
        return dry_run_lines(view.sent, view.deleted, skipped, view.files_unchanged)
    return [view_summary(view)]


def view_summary(view: SyncView) -> str:
    """The one line that says what a sync did."""
    return sync_line(
        view.peer, view.remote, view.files_sent, view.bytes_sent,
        view.files_deleted, view.files_unchanged,
    )  # fmt: skip
