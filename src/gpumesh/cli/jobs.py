"""``gpumesh jobs``"""

from __future__ import annotations

import time

import click

from gpumesh.cli._common import emit_json, get_node
from gpumesh.units import format_duration, format_size


@click.command(epilog="\b\nExamples:\n  gpumesh jobs\n  gpumesh jobs --limit 100 --json")
@click.option("--limit", type=int, default=20, show_default=True, help="How many, newest first.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable output.")
def jobs(limit: int, as_json: bool) -> None:
    """List jobs this node submitted (to a peer) and hosted (for a peer)."""
    node = get_node()
    records = node.home.store.jobs(limit=limit)
    if as_json:
        emit_json(
            [
                {
                    "job_id": j.job_id,
                    "role": j.role,
                    "peer": j.peer_name,
                    "state": j.state,
                    "exit_code": j.exit_code,
                    "attempt": j.attempt,
                    "retries": j.retries,
                    "image": j.image,
                    "command": j.command,
                    "gpus": j.gpus,
                    "gpu_memory": j.gpu_memory,
                    "peak_gpu_memory": j.peak_gpu_memory,
                    "created_at": j.created_at,
                    "started_at": j.started_at,
                    "finished_at": j.finished_at,
                    "duration": j.duration,
                    "message": j.message,
                    "output_dropped": j.output_dropped,
                }
                for j in records
            ]
        )
        return
    if not records:
        click.echo("No jobs yet. Start one with `gpumesh run --peer NAME -- COMMAND`.")
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    colors = {"succeeded": "green", "failed": "red", "cancelled": "yellow", "running": "cyan"}
    now = time.time()
    rows = []
    for j in records:
        peer = f"→ {j.peer_name}" if j.role == "submitted" else f"← {j.peer_name}"
        color = colors.get(j.state, "white")
        command = " ".join(j.command) or f"({j.image})"
        gpu = ",".join(j.gpus) or "-"
        if j.gpu_memory or j.peak_gpu_memory:
            # asked / measured, so users can right-size --gpu-memory
            asked = format_size(j.gpu_memory) if j.gpu_memory else "?"
            peak = format_size(j.peak_gpu_memory) if j.peak_gpu_memory else "?"
            gpu += f" {asked}/{peak}"
        rows.append(
            (
                j.job_id,
                peer,
                (j.state, color),
                "-" if j.exit_code is None else str(j.exit_code),
                f"{j.attempt}/{j.retries + 1}",
                gpu,
                command[:40],
                f"{format_duration(now - j.created_at)} ago",
                format_duration(j.duration) if j.duration is not None else "-",
            )
        )
    headers = ("ID", "PEER", "STATE", "EXIT", "ATTEMPT", "GPU", "COMMAND", "CREATED", "TIME")
    widths = []
    for index, header in enumerate(headers):
        cells = [row[index][0] if isinstance(row[index], tuple) else row[index] for row in rows]
        widths.append(max(len(header), *(len(str(cell)) for cell in cells)))
    console = Console()
    # COMMAND is the one column that gives way on a narrow terminal.
    others = sum(w for h, w in zip(headers, widths, strict=True) if h != "COMMAND")
    command_width = max(7, min(widths[6], console.width - others - 2 * (len(headers) - 1)))
    table = Table(box=None, pad_edge=False)
    for header, width in zip(headers, widths, strict=True):
        if header == "COMMAND":
            table.add_column(header, no_wrap=True, overflow="ellipsis", width=command_width)
        else:
            table.add_column(header, no_wrap=True, min_width=width)
    for row in rows:
        state, color = row[2]
        table.add_row(
            row[0],
            escape(row[1]),
            f"[{color}]{state}[/{color}]",
            *(escape(str(cell)) for cell in row[3:]),
        )
    console.print(table)
