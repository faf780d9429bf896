"""``gpumesh search``: find shared GPUs in the public registry (``rendezvous_url``)."""

from __future__ import annotations

import click

from gpumesh.cli._common import emit_json
from gpumesh.cli._node import node_client
from gpumesh.cli._table import Column, escape, print_table
from gpumesh.units import format_size, parse_size

COLUMNS = [
    # On a narrow terminal names are cut to 20 characters, GPUs to 16; then the
    # contact goes under its row, whole; only then are names cut further.
    Column("NAME", gives_way=2, least=20),
    Column("ID"),
    Column("GPUS (FREE/TOTAL)", gives_way=1, least=16),
    Column("STATE"),
    Column("REGION"),
    Column("CONTACT", below=True, named_below=True),
]


@click.command(
    epilog="""\b
Examples:
  gpumesh search --gpu 4090 --vram 8GB --idle
  gpumesh search --region us-west --json
  gpumesh search --vram 40GB --vram-of total --limit 50
\b
Listings are metadata signed by each node (checked here, so the registry cannot
forge one). A listing grants nothing: contact the owner, exchange pairing codes
(`gpumesh pair-code`, `gpumesh pair`), then run.
"""
)
@click.option("--gpu", metavar="TEXT", default="", help="Part of a GPU model name, e.g. 4090.")
@click.option("--vram", metavar="SIZE", default="", help="A GPU with at least this much, e.g. 8GB.")
@click.option(
    "--vram-of",
    type=click.Choice(["free", "total"]),
    default="free",
    show_default=True,
    help="Compare --vram with the GPU's free or total memory.",
)
@click.option("--idle", is_flag=True, help="Only nodes running no job now.")
@click.option("--region", metavar="R", default="", help="Only nodes in this region.")
@click.option(
    "--limit",
    type=click.IntRange(1, 100),
    default=20,
    show_default=True,
    help="Listings on this page (1-100).",
)
@click.option("--cursor", metavar="TEXT", default="", help="Where the previous page ended.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable output.")
def search(
    gpu: str,
    vram: str,
    vram_of: str,
    idle: bool,
    region: str,
    limit: int,
    cursor: str,
    as_json: bool,
) -> None:
    """Search the public registry for shared GPUs.

    Uses the registry at the `rendezvous_url` setting. Every listing's signature
    is verified by this node before it is shown.
    """
    from gpumesh.client.bodies import SearchBody
    from gpumesh.client.views.registry import SearchView

    body = SearchBody(
        gpu=gpu,
        vram=parse_size(vram) if vram else 0,
        vram_total=vram_of == "total",
        idle=idle,
        region=region,
        limit=limit,
        cursor=cursor,
    )
    page = node_client().call("POST", "/api/v1/registry/search", SearchView, body)
    if as_json:
        emit_json(page)
        return
    if not page.listings:
        click.echo("No listing matches on the registry (rendezvous_url).")
        return
    rows = []
    for listing in page.listings:
        gpus = ", ".join(
            f"{g.name} {format_size(g.memory_free)}/{format_size(g.memory_total)}"
            for g in listing.gpus
        )
        rows.append(
            [
                escape(listing.name),
                listing.node_id[:12],
                escape(gpus or "no GPU"),
                "idle" if listing.idle else "busy",
                escape(listing.region or "-"),
                escape(listing.contact or "-"),
            ]
        )
    print_table(COLUMNS, rows)
    if page.next:
        click.echo(f"More: gpumesh search ... --cursor {page.next}")
    click.echo(
        "A listing grants nothing: contact the owner, exchange pairing codes "
        "(`gpumesh pair-code`, `gpumesh pair`), then run."
    )
