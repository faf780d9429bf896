"""Printing a job's live events: output to stdout/stderr, attempts and states to stderr."""

from __future__ import annotations

import sys
from typing import Any

import click

from gpumesh.cli._notes import dropped_note, state_note
from gpumesh.client.jobs import (
    JobCallbacks,
    JobEvent,
    Output,
    OutputDropped,
    Reconnecting,
    StatusChanged,
)
from gpumesh.client.placement import Placement
from gpumesh.errors import GPUMeshError
from gpumesh.protocol.messages import ImagePull, JobAccepted, JobStatus
from gpumesh.units import format_size

__all__ = ["JobPrinter"]


class JobPrinter:
    """Callbacks that write a job's output like `docker run` does, plus short notes."""

    def __init__(
        self, *, quiet: bool = False, numbered: bool = False, explain: bool = False
    ) -> None:
        self.quiet = quiet
        self.explain = explain
        self.numbered = numbered
        """Mark every attempt's start and the end (for `logs`, which replays history)."""
        self.attempt = 0
        self._progress: object | None = None
        self._pull_bar: object | None = None
        self._pull_task: Any = None
        self._pull_noted = False

    def note(self, text: str) -> None:
        if not self.quiet:
            click.echo(click.style(f"gpumesh: {text}", dim=True), err=True)

    def stdout(self, data: bytes) -> None:
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()

    def stderr(self, data: bytes) -> None:
        sys.stderr.buffer.write(data)
        sys.stderr.buffer.flush()

    def show(self, event: JobEvent) -> None:
        """One event of a followed job."""
        if isinstance(event, Output):
            (self.stdout if event.stream == "stdout" else self.stderr)(event.data)
        elif isinstance(event, StatusChanged):
            self.changed(event)
        elif isinstance(event, OutputDropped):
            self.dropped(event.count)
        elif isinstance(event, Reconnecting):
            self.reconnecting(event.error)

    def status(self, status: JobStatus) -> None:
        self.changed(StatusChanged.of(status))

    def changed(self, change: StatusChanged) -> None:
        status = change.status
        note = state_note(
            numbered=self.numbered,
            state=change.state,
            attempt=status.attempt,
            exit_code=status.exit_code,
            message=status.message,
            exited=change.exited,
            job_id=status.job_id,
            peak_gpu_memory=status.peak_gpu_memory,
        )
        if note is not None:
            self.note(note)
        self.attempt = status.attempt

    def accepted(self, accepted: JobAccepted) -> None:
        if sys.stderr.isatty():
            where = f"GPU {', '.join(accepted.gpus)}" if accepted.gpus else "no GPU"
            self.note(f"job {accepted.job_id} on {accepted.provider} ({where})")

    def pull(self, pull: ImagePull) -> None:
        """The provider pulls the image: a bar on a terminal, a line at each end else."""
        if self.quiet:
            return
        layers = f"{pull.layers_done}/{pull.layers} layers"
        if not sys.stderr.isatty():
            if not self._pull_noted:
                self.note(f"the provider is pulling {pull.image}")
                self._pull_noted = True
            if pull.done:
                self.note(f"pulled {pull.image}: {layers}, {format_size(pull.downloaded)} fetched")
            return
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

        if self._pull_bar is None:
            bar = Progress(
                TextColumn(f"[dim]gpumesh: pulling {pull.image}"),
                BarColumn(),
                DownloadColumn(binary_units=False),
                TextColumn("[dim]{task.fields[layers]}"),
                transient=True,
            )
            bar.start()
            self._pull_task = bar.add_task("pull", total=pull.total or None, layers=layers)
            self._pull_bar = bar
        assert isinstance(self._pull_bar, Progress)
        self._pull_bar.update(
            self._pull_task, completed=pull.downloaded, total=pull.total or None, layers=layers
        )
        if pull.done:
            self._pull_bar.stop()
            self.note(f"pulled {pull.image}: {layers}, {format_size(pull.downloaded)} fetched")

    def upload(self, sent: int, total: int) -> None:
        if self.quiet or not sys.stderr.isatty():
            return
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TransferSpeedColumn,
        )

        if self._progress is None:
            progress = Progress(
                "[dim]gpumesh: uploading workdir",
                BarColumn(),
                DownloadColumn(binary_units=False),
                TransferSpeedColumn(),
                transient=True,
                console=None,
            )
            progress.start()
            self._task = progress.add_task("upload", total=total)
            self._progress = progress
        assert isinstance(self._progress, Progress)
        self._progress.update(self._task, completed=sent)
        if sent >= total:
            self._progress.stop()

    def placed(self, placement: Placement) -> None:
        chosen = placement.chosen
        assert chosen is not None
        self.note(f"placing on {chosen.name}: {chosen.reason}")
        for candidate in placement.candidates:
            if candidate is chosen:
                continue
            if self.explain or not candidate.eligible:
                verdict = "also fits" if candidate.eligible else "skipped"
                self.note(f"  {candidate.name}: {verdict}: {candidate.reason}")

    def reconnecting(self, error: GPUMeshError) -> None:
        self.note(f"link lost ({error.message}); reconnecting")

    def dropped(self, count: int) -> None:
        # Part of the output itself (where it is missing), so shown even with --quiet.
        click.echo(click.style(dropped_note(count), fg="yellow"), err=True)

    def callbacks(self) -> JobCallbacks:
        return JobCallbacks(
            stdout=self.stdout,
            stderr=self.stderr,
            status=self.status,
            accepted=self.accepted,
            pull=self.pull,
            upload=self.upload,
            placed=self.placed,
            reconnecting=self.reconnecting,
            dropped=self.dropped,
        )
