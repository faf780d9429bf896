"""``gpumesh cp``"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

import click

from gpumesh.cli._common import emit_json, json_option
from gpumesh.cli._complete import complete_peer_path

if TYPE_CHECKING:
    from gpumesh.client.bodies import CopyBody
    from gpumesh.client.views.files import CopyView


@click.command(
    epilog="""\b
Examples:
  gpumesh cp ./dataset.bin alice-pc:/dataset.bin
  gpumesh cp ./data alice-pc:/                 # the folder lands as /data
  gpumesh cp alice-pc:/out.bin ./out.bin
  gpumesh cp alice-pc:/results ./             # a folder, with its files' modes
\b
PEER:PATH is a path in your own folder on that peer (a leading / is its root);
other peers never see it. On Windows a single letter before the colon is a
drive: C:\\data and C:/data are local paths (name a one-letter peer by its id
prefix). A copy that stops (dropped link, restarted peer)
resumes where it stopped: gpumesh retries by itself, and running the same
command again resumes too. Every copy is checked end to end with BLAKE3
(SHA-256 with peers running an older version).
File and folder bytes take a TLS/TCP channel opened by the QUIC session when
a direct path exists, else QUIC (a channel that did not open is not tried
again with that peer for 10 minutes).
\b
Using copied files in a job: a job sees nothing of your folder until you
mount a folder of it, read-only unless :rw (copy once, mount in every job):
  gpumesh cp ./datasets alice-pc:/
  gpumesh run --peer alice-pc --mount /datasets:/data -- ls /data
""",
)
@click.argument("source", shell_complete=complete_peer_path)
@click.argument("destination", shell_complete=complete_peer_path)
@click.option(
    "-r", "--recursive", is_flag=True, help="Accepted for habit: folders always copy whole."
)
@click.option(
    "--retries",
    type=click.IntRange(0, 20),
    default=3,
    show_default=True,
    help="Retries after a dropped link, each resuming where it stopped.",
)
@click.option(
    "--no-fast-path",
    is_flag=True,
    help="Keep file bytes on QUIC: no TLS/TCP data channel (config: data_channel off).",
)
@click.option("-q", "--quiet", is_flag=True, help="No progress bar and no summary.")
@json_option
def cp(
    source: str,
    destination: str,
    recursive: bool,
    retries: int,
    no_fast_path: bool,
    quiet: bool,
    as_json: bool,
) -> None:
    """Copy SOURCE to DESTINATION; one of them is PEER:PATH.

    PEER is a paired peer's name or id prefix. Files and folders (recursively,
    with their permission bits) go both ways; when DESTINATION is an existing
    folder, SOURCE is copied into it under its own name, as cp does.
    """
    view = _CopyView(quiet=quiet or as_json)
    from gpumesh.client.bodies import CopyBody

    body = CopyBody(
        source=source,
        destination=destination,
        cwd=os.getcwd(),
        retries=retries,
        fast_path=not no_fast_path,
    )
    try:
        copied = _through_node(body, view)
    finally:
        view.close()
    if as_json:
        emit_json(copied)
    elif not quiet:
        view.summary(copied)


def _through_node(body: CopyBody, view: _CopyView) -> CopyView:
    """The copy done by the node process, its progress shown here; the copy's view.
    Ctrl-C (or this process ending) stops the copy where it is; running the same
    command again resumes it."""
    from gpumesh.cli._node import node_client
    from gpumesh.client.views.files import (
        COPY_EVENTS,
        CopyProgressView,
        CopyRetryingView,
        CopyStartedView,
        CopyView,
    )
    from gpumesh.daemon.client import NodeUnavailableError
    from gpumesh.errors import AgentError

    try:
        for event in node_client().events("/api/v1/copies?stream=true", COPY_EVENTS, "POST", body):
            done = event.view
            if isinstance(done, CopyView):
                return done
            if isinstance(done, CopyStartedView):
                view.started(done.label, done.total)
            elif isinstance(done, CopyProgressView):
                view.progress(done.done, done.total)
            elif isinstance(done, CopyRetryingView):
                view.retrying(done.message, done.attempt)
    except NodeUnavailableError:
        pass
    raise AgentError(
        "the node process stopped during the copy: run the same command again "
        "(it resumes where it stopped)"
    )


class _CopyView:
    """A Rich progress bar on stderr (only on a terminal), notes and the final summary."""

    def __init__(self, *, quiet: bool) -> None:
        self.quiet = quiet
        self.label = ""
        self._progress: Any = None
        self._task: Any = None

    def note(self, text: str) -> None:
        if self.quiet:
            return
        line = (
            click.style(f"gpumesh: {text}", dim=True) if sys.stderr.isatty() else f"gpumesh: {text}"
        )
        if self._progress is not None:
            self._progress.console.print(line, markup=False, highlight=False)
        else:
            click.echo(line, err=True)

    def started(self, label: str, total: int) -> None:
        self.label = label
        if self.quiet or not sys.stderr.isatty():
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        progress = Progress(
            TextColumn("{task.description}", markup=False),
            BarColumn(),
            DownloadColumn(binary_units=False),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=True,
        )
        progress.start()
        self._task = progress.add_task(label, total=max(total, 1))
        self._progress = progress

    def progress(self, done: int, total: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=done, total=max(total, 1))

    def retrying(self, error: object, attempt: int) -> None:
        self.note(f"link lost ({error}); retrying (attempt {attempt}), resuming where it stopped")

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def summary(self, result: CopyView) -> None:
        from gpumesh.units import format_rate, format_size

        what = "folder" if result.kind == "dir" else "file"
        line = (
            f"copied {what} {self.label}: {format_size(result.content)} in "
            f"{_seconds(result.seconds)}, {format_rate(result.transferred, result.seconds)}"
        )
        if result.resumed_from:
            line += f" (resumed at {format_size(result.resumed_from)})"
        elif result.attempts > 1:
            line += f" ({result.attempts} attempts)"
        self.note(line)
        if result.skipped:
            shown = "; ".join(result.skipped[:3])
            more = f" and {len(result.skipped) - 3} more" if len(result.skipped) > 3 else ""
            self.note(f"left out {len(result.skipped)} entries: {shown}{more}")


def _seconds(value: float) -> str:
    return f"{value:.1f}s" if value < 60 else f"{value / 60:.1f}m"
