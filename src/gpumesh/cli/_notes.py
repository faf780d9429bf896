"""What a followed job's events print (:class:`ViewPrinter`, on the control API's
views, as the node process streams them).

Imports nothing heavy: ``logs`` and ``run`` through the node process use it.
"""

from __future__ import annotations

import binascii
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING

import click

from gpumesh.errors import ExitCode
from gpumesh.protocol.states import FINAL_STATES, JobState
from gpumesh.units import format_size

if TYPE_CHECKING:
    from typing import Any

    from gpumesh.client.views.jobs import JobResultView, Moved, Status
    from gpumesh.client.views.outputs import OutputsView
    from gpumesh.client.views.runs import PlacedView, PullingView
    from gpumesh.daemon.client import SseEvent

__all__ = [
    "RESTARTS_ON_MOVE",
    "ReconnectNotes",
    "RunReader",
    "StepNotes",
    "ViewPrinter",
    "exit_status_of",
    "moved_line",
    "state_note",
]


def state_note(view: Status, *, numbered: bool, job_id: str) -> str | None:
    """The note a job's new state gets on stderr, if any."""
    state, attempt, message, exited = view.state, view.attempt, view.message, view.exited
    if numbered and state == JobState.STARTING:
        return f"--- attempt {attempt} ---"
    if numbered and state in FINAL_STATES:
        code = "" if view.exit_code is None else f", exit {view.exit_code}"
        plain_exit = exited or state == JobState.SUCCEEDED
        detail = "" if plain_exit or not message else f": {message}"
        return f"--- {state}{code}{detail} ---"
    if state == JobState.STARTING and attempt > 1:
        return f"attempt {attempt} starting"
    if state == JobState.RETRYING:
        return message
    if state == JobState.CANCELLED:
        return f"job {job_id} cancelled"
    if state == JobState.PREEMPTED:
        return f"job {job_id} preempted: {message}"
    if state == JobState.QUEUED and message:
        return f"job {job_id} {message}"  # waiting in this node's queue
    if state == JobState.FAILED and not exited:
        return f"job failed: {message}"  # it never exited on its own
    return None


def moved_line(view: Moved) -> str:
    """The marker line between two hops of a moved job."""
    unread = f"; its output there could not all be read: {view.unread}" if view.unread else ""
    return (
        f"--- moved from {view.left} ({view.reason}) to {view.to}, "
        f"attempt {view.attempt}{unread} ---"
    )


class ReconnectNotes:
    """What a follow says while its link is down: why, once, and again only when the
    reason changes (a re-dial every few seconds would print the same line each time).
    Anything the job sends again ends the outage (:meth:`heard`)."""

    def __init__(self) -> None:
        self._last = ""

    def note(self, message: str) -> str | None:
        """The line to show for a failed (re)connection with ``message``; None: said."""
        if message == self._last:
            return None
        self._last = message
        return f"{message} (reconnecting; Ctrl-C stops following)"

    def heard(self) -> None:
        self._last = ""


def exit_status_of(state: str, exit_code: int | None) -> int:
    """The CLI's exit status for a finished job, as `docker run` would give it."""
    if state == JobState.CANCELLED:
        return ExitCode.INTERRUPTED
    if state == JobState.PREEMPTED:
        return ExitCode.PREEMPTED
    return exit_code if exit_code is not None else ExitCode.JOB_NOT_RUN


class ViewPrinter:
    """A followed job's events as the control API streams them: output to stdout and
    stderr as `docker run` writes it, attempts, states and steps as short notes."""

    def __init__(
        self,
        job_id: str,
        *,
        quiet: bool = False,
        numbered: bool = False,
        explain: bool = False,
        output_to_stderr: bool = False,
    ) -> None:
        self.job_id = job_id
        self.output_to_stderr = output_to_stderr
        """The job's stdout goes to stderr too (stdout is a --json's)."""
        self.numbered = numbered
        self.steps = StepNotes(quiet=quiet, explain=explain)
        self.outage = ReconnectNotes()

    def show(self, view: object) -> None:
        """One event of the stream: its view (:data:`~gpumesh.client.views.runs.RUN_EVENTS`)."""
        from gpumesh.client.views.jobs import Dropped, Moved, Output, Reconnecting, Status
        from gpumesh.client.views.outputs import OutputsView
        from gpumesh.client.views.runs import (
            AcceptedView,
            PlacedView,
            PullingView,
            QueuedView,
            UploadingView,
        )

        if not isinstance(view, Reconnecting):
            self.outage.heard()
        if isinstance(view, Output):
            to_stdout = view.stream == "stdout" and not self.output_to_stderr
            out = sys.stdout if to_stdout else sys.stderr
            # base64.b64decode is this, after importing struct and more.
            out.buffer.write(binascii.a2b_base64(view.data))
            out.buffer.flush()
        elif isinstance(view, Status):
            note = state_note(view, numbered=self.numbered, job_id=self.job_id)
            if note is not None:
                self.steps.note(note)
        elif isinstance(view, Dropped):
            dropped = (
                f"gpumesh: {format_size(view.count)} of output dropped here: the provider "
                "keeps only the newest part of a job's output (its job_log_limit)"
            )
            click.echo(click.style(dropped, fg="yellow"), err=True)
        elif isinstance(view, Reconnecting):
            if (line := self.outage.note(view.message)) is not None:
                self.steps.note(line)
        elif isinstance(view, Moved):
            click.echo(click.style(moved_line(view), fg="yellow"), err=True)
        elif isinstance(view, PlacedView):
            self.steps.placed(view)
        elif isinstance(view, PullingView):
            self.steps.pull(view)
        elif isinstance(view, AcceptedView):
            self.job_id = view.job_id
            self.steps.accepted(view.job_id, view.provider, view.gpus)
        elif isinstance(view, UploadingView):
            self.steps.upload(view.sent, view.total)
        elif isinstance(view, QueuedView):
            self.job_id = view.job_id
            self.steps.note(f"job {view.job_id} {view.message} (queued: Ctrl-C cancels it)")
        elif isinstance(view, OutputsView):
            self.outputs(view)

    def outputs(self, view: OutputsView) -> None:
        """Where a job's outputs came, once they did (or why they stopped: always said)."""
        count = f"{view.files} file{'' if view.files == 1 else 's'} ({format_size(view.bytes)})"
        if view.state == "stopped":
            click.echo(click.style(f"gpumesh: {view.note}", fg="yellow"), err=True)
            self.steps.note(f"outputs: {count} in {view.dir}")
        elif view.state == "receiving":
            self.steps.note(
                f"outputs: {count} in {view.dir} so far, more still coming: "
                f"`gpumesh jobs {view.job_id}` says when they are all there"
            )
        else:
            self.steps.note(f"outputs: {count} in {view.dir}")
            if view.note:
                self.steps.note(f"outputs: {view.note}")


class RunReader:
    """A run's events as the node process streams them (``POST /api/v1/jobs?stream=true``),
    each printed with ``printer``, and what a command needs should the stream break
    before the end: the job and its provider once accepted, and the id of the last
    event (where a follow of the job resumes)."""

    def __init__(self, printer: ViewPrinter) -> None:
        self.printer = printer
        self.job_id: str | None = None
        self.provider: str | None = None
        self.after = 0

    def read(self, events: Iterable[SseEvent]) -> JobResultView:
        """Print ``events`` (:data:`~gpumesh.client.views.runs.RUN_EVENTS`) up to the
        run's end; the end's view (the job's result). An ``error`` event is raised
        as its error (by the stream)."""
        from gpumesh.client.views.jobs import JobResultView
        from gpumesh.client.views.runs import AcceptedView, QueuedView

        for event in events:
            if isinstance(event.view, JobResultView):
                return event.view
            if isinstance(event.view, AcceptedView):
                self.job_id = event.view.job_id
                self.provider = event.view.provider
            elif isinstance(event.view, QueuedView):
                self.job_id, self.provider = event.view.job_id, ""  # no provider yet
            self.printer.show(event.view)
            if event.id is not None:
                self.after = event.id
        from gpumesh.daemon.client import NodeUnavailableError

        raise NodeUnavailableError.because("the event stream ended before the run's end")


RESTARTS_ON_MOVE = (
    "no outputs: a move restarts this job from the beginning (bring its checkpoints "
    "home with --outputs PATH to resume them)"
)


class StepNotes:
    """What the steps before a job runs print: where ``--group`` placed it, the
    provider's pull (a bar on a terminal, a line at each end else), acceptance (on
    a terminal), the workdir upload (a bar on a terminal)."""

    def __init__(self, *, quiet: bool = False, explain: bool = False) -> None:
        self.quiet = quiet
        self.explain = explain
        self._upload_bar: Any = None
        self._upload_task: Any = None
        self._pull_bar: Any = None
        self._pull_task: Any = None
        self._pull_noted = False
        self.restarts_on_move = False
        """The job may move and brings no outputs home: said once it is placed."""

    def note(self, text: str) -> None:
        """A note on stderr, dimmed (on a terminal), unless quiet."""
        if not self.quiet:
            click.echo(click.style(f"gpumesh: {text}", dim=True), err=True)

    def accepted(self, job_id: str, provider: str, gpus: list[str]) -> None:
        if sys.stderr.isatty():
            where = f"GPU {', '.join(gpus)}" if gpus else "no GPU"
            self.note(f"job {job_id} on {provider} ({where})")

    def placed(self, view: PlacedView) -> None:
        """Where ``--group`` placed the job, and why the other members were not chosen."""
        chosen = view.chosen.name
        self.note(f"placing on {chosen}: {view.chosen.reason}")
        if self.restarts_on_move:
            self.note(RESTARTS_ON_MOVE)
        for member in view.candidates:
            if member.name != chosen and (self.explain or not member.eligible):
                verdict = "also fits" if member.eligible else "skipped"
                self.note(f"  {member.name}: {verdict}: {member.reason}")

    def pull(self, view: PullingView) -> None:
        if self.quiet:
            return
        image, downloaded, total, done = view.image, view.downloaded, view.total, view.done
        layers, layers_done = view.layers, view.layers_done
        text = f"{layers_done}/{layers} layers"
        if not sys.stderr.isatty():
            if not self._pull_noted:
                self.note(f"the provider is pulling {image}")
                self._pull_noted = True
            if done:
                self.note(f"pulled {image}: {text}, {format_size(downloaded)} fetched")
            return
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

        if self._pull_bar is None:
            bar = Progress(
                TextColumn(f"[dim]gpumesh: pulling {image}"),
                BarColumn(),
                DownloadColumn(binary_units=False),
                TextColumn("[dim]{task.fields[layers]}"),
                transient=True,
            )
            bar.start()
            self._pull_task = bar.add_task("pull", total=total or None, layers=text)
            self._pull_bar = bar
        self._pull_bar.update(
            self._pull_task, completed=downloaded, total=total or None, layers=text
        )
        if done:
            self._pull_bar.stop()
            self.note(f"pulled {image}: {text}, {format_size(downloaded)} fetched")

    def upload(self, sent: int, total: int) -> None:
        if self.quiet or not sys.stderr.isatty():
            return
        from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

        if self._upload_bar is None:
            progress = Progress(
                "[dim]gpumesh: uploading workdir",
                BarColumn(),
                DownloadColumn(binary_units=False),
                TransferSpeedColumn(),
                transient=True,
                console=None,
            )
            progress.start()
            self._upload_task = progress.add_task("upload", total=total)
            self._upload_bar = progress
        self._upload_bar.update(self._upload_task, completed=sent)
        if sent >= total:
            self._upload_bar.stop()
