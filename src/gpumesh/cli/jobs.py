"""``gpumesh jobs``"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import click

from gpumesh.cli._common import emit_json
from gpumesh.cli._table import Column, escape, print_table
from gpumesh.protocol.states import JobRole, JobState
from gpumesh.units import format_duration, format_size

if TYPE_CHECKING:
    from gpumesh.client.views.joblist import JobListEntry

COLUMNS = [
    Column("ID"),
    # On a narrow terminal the command gives way first, then it and the creation
    # time go under their row, and only then is a peer's name (and its arrow) of
    # more than 20 characters cut.
    Column("PEER", gives_way=1, least=22),
    Column("STATE"),
    Column("EXIT"),
    Column("ATTEMPT"),
    Column("GPU"),
    Column("COMMAND", gives_way=2, least=16, below=True),
    Column("CREATED", below=True, named_below=True),
    Column("TIME"),
]


@click.command(
    epilog="\b\nExamples:\n  gpumesh jobs\n  gpumesh jobs --limit 100 --json\n"
    "  gpumesh jobs --offline"
)
@click.option("--limit", type=int, default=20, show_default=True, help="How many, newest first.")
@click.option(
    "--offline",
    is_flag=True,
    help="Do not ask providers where unfinished jobs stand: show the states last recorded.",
)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable output.")
def jobs(limit: int, offline: bool, as_json: bool) -> None:
    """List jobs this node submitted (to a peer) and hosted (for a peer).

    Unfinished submitted jobs are first refreshed from their providers (all at
    once, a few seconds at most; a provider that did not answer last time is
    not waited on, but asked again in the background). A job whose provider
    does not answer shows its last known state and "no answer since HH:MM",
    when that state was confirmed; one its provider no longer knows shows "gone".
    """
    from gpumesh.cli._node import node_client

    query = f"limit={limit}&offline={'true' if offline else 'false'}"
    # Sent first: the node process looks while this process loads the decoder.
    answer = node_client().send("GET", f"/api/v1/jobs?{query}")
    from gpumesh.client.views.joblist import JobListEntry

    entries = answer.answer(list[JobListEntry])
    if as_json:
        emit_json(entries)
        return
    if not entries:
        click.echo("No jobs yet. Start one with `gpumesh run --peer NAME -- COMMAND`.")
        return
    _print(entries)


def _confirmed(j: JobListEntry) -> float:
    """When a job's state was last known for sure (as :func:`last_confirmed`)."""
    return next(t for t in (j.unknown_since, j.confirmed_at, j.created_at) if t is not None)


def _print(records: list[JobListEntry]) -> None:
    """The table of ``records``."""
    colors: dict[str, str] = {
        JobState.SUCCEEDED: "green",
        JobState.FAILED: "red",
        JobState.CANCELLED: "yellow",
        JobState.PREEMPTED: "magenta",
        JobState.RUNNING: "cyan",
    }
    now = time.time()
    rows = []
    for j in records:
        peer = f"→ {j.peer}" if j.role == JobRole.SUBMITTED else f"← {j.peer}"
        if j.role == JobRole.SUBMITTED and not j.peer:  # no provider holds it now
            peer = f"→ ({'moving' if j.hops else 'queued'}{': ' + j.group if j.group else ''})"
        elif j.role == JobRole.SUBMITTED and len(j.hops) > 1:
            peer += f" (moved {len(j.hops) - 1}×)"
        color = colors.get(j.state, "white")
        state = j.state
        duration = j.duration
        if j.unknown_since is not None or j.provider_forgot:
            color = "yellow"
            when = time.strftime("%H:%M", time.localtime(_confirmed(j)))
            state = "gone" if j.provider_forgot else f"{state}, no answer since {when}"
            if j.started_at is not None:  # not counting on past what is known
                duration = max(0.0, _confirmed(j) - j.started_at)
        command = " ".join(j.command) or f"({j.image})"
        gpu = ",".join(j.gpus) or "-"
        if j.gpu_memory or j.peak_gpu_memory:
            # asked / measured, so users can right-size --gpu-memory
            asked = format_size(j.gpu_memory) if j.gpu_memory else "?"
            peak = format_size(j.peak_gpu_memory) if j.peak_gpu_memory else "?"
            gpu += f" {asked}/{peak}"
        rows.append(
            [
                j.job_id,
                escape(peer),
                f"[{color}]{escape(state)}[/{color}]",
                "-" if j.exit_code is None else str(j.exit_code),
                f"{j.attempt}/{j.retries + 1}",
                escape(gpu),
                escape(command),
                f"{format_duration(now - j.created_at)} ago",
                format_duration(duration) if duration is not None else "-",
            ]
        )
    print_table(COLUMNS, rows)
    _explain(records)


def _explain(records: list[JobListEntry]) -> None:
    """Why some states are not known: on stderr, so piped rows stay rows."""
    told: set[str] = set()
    for j in records:
        if j.unknown_since is not None and j.peer not in told:
            told.add(j.peer)
            why = j.unknown_reason or "it did not answer"
            note = f"gpumesh: {j.peer}'s jobs show the state it last confirmed: {why}"
        elif j.provider_forgot and j.role == JobRole.SUBMITTED:
            note = (
                f"gpumesh: {j.peer} no longer knows job {j.job_id} (pruned there, or "
                f"its home was reset); it was last known {j.state}"
            )
        else:
            continue
        click.echo(click.style(note, fg="yellow"), err=True)
    for j in records:
        out = j.outputs
        if out is not None and out.state != "complete":
            line = (
                f"gpumesh: job {j.job_id}'s outputs: {out.files} file"
                f"{'' if out.files == 1 else 's'} ({format_size(out.bytes)}) in {out.dir}, "
                f"{out.state}"
            )
            click.echo(
                click.style(line + (f"; {out.note}" if out.note else ""), dim=True), err=True
            )
