"""``gpumesh peers``"""

from __future__ import annotations

import time

import click

from gpumesh.cli._common import emit_json
from gpumesh.identity.hints import dial_order
from gpumesh.units import format_duration


@click.command(epilog="\b\nExamples:\n  gpumesh peers\n  gpumesh peers --json")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable output.")
def peers(as_json: bool) -> None:
    """List paired peers: access, last seen, the path last used, addresses."""
    from gpumesh.cli._node import node_client

    answer = node_client().send("GET", "/api/v1/peers")
    from gpumesh.client.views.peers import PeerView

    rows = answer.answer(list[PeerView])
    if as_json:
        emit_json(rows)
        return
    if not rows:
        click.echo("No peers yet. Pair with `gpumesh pair '<code>'` (see `gpumesh pair-code`).")
        return
    from gpumesh.cli._table import Column, escape, print_table

    now = time.time()
    rows_shown = []
    for p in rows:
        access = "[green]allowed[/green]" if p.allowed else "[red]denied[/red]"
        if p.last_seen is None:
            seen = "never"
        elif now - p.last_seen < 2:
            seen = "just now"
        else:
            seen = f"{format_duration(now - p.last_seen)} ago"
        addresses = ", ".join(dial_order(p.last_address, p.addresses))
        if p.relay:
            addresses += f" (relay {p.relay})" if addresses else f"relay {p.relay}"
        rows_shown.append(
            [
                escape(p.name),
                p.node_id[:12],
                access,
                seen,
                escape(p.last_path or "-"),
                escape(addresses),
            ]
        )
    # The addresses give way first on a narrow terminal: the first one whole and
    # how many more (`--json` and piped output have them all).
    columns = [
        Column("NAME", gives_way=1, least=10),
        Column("ID"),
        Column("ACCESS"),
        Column("LAST SEEN"),
        Column("PATH"),
        Column("ADDRESSES", gives_way=2, least=12, compact=first_and_count),
    ]
    print_table(columns, rows_shown)


def first_and_count(cell: str) -> str:
    """``a, b (relay r)`` as ``a +2``: the first address and how many more."""
    first, *rest = cell.split(", ")
    if not rest:
        return cell
    return f"{first} +{len(rest) + (1 if ' (relay ' in rest[-1] else 0)}"
