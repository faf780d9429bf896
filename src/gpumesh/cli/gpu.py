"""``gpumesh gpu``"""

from __future__ import annotations

import click

from gpumesh.cli._common import emit_json, fail
from gpumesh.errors import ExitCode


@click.command(epilog="\b\nExamples:\n  gpumesh gpu\n  gpumesh gpu --json")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable output.")
def gpu(as_json: bool) -> None:
    """Show this machine's NVIDIA GPUs: memory, utilisation, temperature, processes.

    Reads NVML first, then `nvidia-smi`; says so clearly when there is no GPU.
    """
    from gpumesh.cli._node import node_client

    answer = node_client().send("GET", "/api/v1/gpus")
    from gpumesh.client.views.node import GpusView
    from gpumesh.units import format_size

    inventory = answer.answer(GpusView)
    gpus = inventory.gpus
    if as_json:
        emit_json(inventory)
    elif inventory.source == "simulated":
        click.echo(
            click.style("SIMULATED GPUs (test mode, not real hardware)", fg="red", bold=True)
        )
    if not gpus:  # the same exit code with --json (its "gpus" then is empty)
        fail(
            "no NVIDIA GPU found (NVML and nvidia-smi are unavailable); install the NVIDIA "
            "driver to share a GPU",
            ExitCode.FAILED,
        )
    if as_json:
        return
    from gpumesh.cli._table import Column, escape, print_table

    rows = [
        [
            str(g.index),
            escape(g.name),
            f"{format_size(g.memory_used)} / {format_size(g.memory_total)}",
            "-" if g.utilization is None else f"{g.utilization}%",
            "-" if g.temperature is None else f"{g.temperature}°C",
            "-" if g.processes is None else str(g.processes),
        ]
        for g in gpus
    ]
    columns = [Column("GPU"), Column("NAME", gives_way=1, least=12), Column("MEMORY")]
    columns += [Column("UTIL"), Column("TEMP"), Column("PROCS")]
    if any(g.owner for g in gpus):  # the share took them back (reclaim_on_gpu_use)
        columns.append(Column("OWNER USES", gives_way=2))
        for row, g in zip(rows, gpus, strict=True):
            row.append(escape(g.owner) if g.owner else "-")
    print_table(columns, rows)
    click.echo(f"source: {inventory.source}", err=True)
