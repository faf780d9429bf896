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
    from rich.markup import escape

    from gpumesh.cli._table import Column, print_table

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
            [
                j.job_id,
                escape(peer),
                f"[{color}]{escape(j.state)}[/{color}]",
                "-" if j.exit_code is None else str(j.exit_code),
                f"{j.attempt}/{j.retries + 1}",
                escape(gpu),
                escape(command),
                f"{format_duration(now - j.created_at)} ago",
                format_duration(j.duration) if j.duration is not None else "-",
            ]
        )
    # On a narrow terminal the command gives way first, then the peer's name.
    columns = [
        Column("ID"),
        Column("PEER", gives_way=1),
        Column("STATE"),
        Column("EXIT"),
        Column("ATTEMPT"),
        Column("GPU"),
        Column("COMMAND", gives_way=2),
        Column("CREATED"),
        Column("TIME"),
    ]
    print_table(columns, rows)
