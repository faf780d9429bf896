"""Printing a job's live events: output to stdout/stderr, attempts and states to stderr."""

from __future__ import annotations

import sys

import click

from gpumesh.cli._notes import ReconnectNotes, StepNotes, dropped_note, state_note
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
        self.steps = StepNotes(quiet=quiet, explain=explain)
        self.outage = ReconnectNotes()

    def note(self, text: str) -> None:
        if not self.quiet:
            click.echo(click.style(f"gpumesh: {text}", dim=True), err=True)

    def stdout(self, data: bytes) -> None:
        self.outage.heard()  # (each callback of an event from the provider says so)
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()

    def stderr(self, data: bytes) -> None:
        self.outage.heard()
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
        self.outage.heard()
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
        self.steps.accepted(accepted.job_id, accepted.provider, list(accepted.gpus))

    def pull(self, pull: ImagePull) -> None:
        """The provider pulls the image: a bar on a terminal, a line at each end else."""
        self.steps.pull(
            pull.image, pull.layers, pull.layers_done, pull.downloaded, pull.total, pull.done
        )

    def upload(self, sent: int, total: int) -> None:
        self.steps.upload(sent, total)

    def placed(self, placement: Placement) -> None:
        chosen = placement.chosen
        assert chosen is not None
        every = [(c.name, c.eligible, c.reason) for c in placement.candidates]
        self.steps.placed(chosen.name, chosen.reason, every)

    def reconnecting(self, error: GPUMeshError) -> None:
        if (line := self.outage.note(error.message)) is not None:
            self.note(line)

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
