"""``gpumesh pair``"""

from __future__ import annotations

import click

from gpumesh.cli._common import emit_json, get_node


@click.command(
    epilog="""\b
Examples:
  gpumesh pair 'gpm1_...'
  gpumesh pair --rekey 'gpm1_...'     # the peer was reinstalled and has a new key
"""
)
@click.argument("code")
@click.option("--rekey", is_flag=True, help="Accept a new key for an already-paired peer name.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable output.")
def pair(code: str, rekey: bool, as_json: bool) -> None:
    """Pair with a peer: verify its CODE, store it, and allow it.

    Pairing is mutual: the peer must also pair with your code
    (`gpumesh pair-code`) before either of you can use the other. A code
    pairs once; a peer you denied stays denied (`gpumesh allow PEER`).
    """
    node = get_node()
    peer = node.pair(code, rekey=rekey)
    if as_json:
        emit_json(
            {
                "name": peer.name,
                "node_id": peer.node_id,
                "addresses": peer.addresses,
                "allowed": peer.allowed,
            }
        )
        return
    name = click.style(peer.name, bold=True)
    if not peer.allowed:
        click.echo(
            f"Paired with {name} ({peer.node_id.short}), still denied: pairing never lifts a "
            f"denial; `gpumesh allow {peer.name}` lets them use this node again."
        )
        click.echo(f"  addresses  {', '.join(peer.addresses) or '-'}")
        return
    click.echo(f"Paired with {name} ({peer.node_id.short}), allowed.")
    click.echo(f"  addresses  {', '.join(peer.addresses) or '-'}")
    click.echo("They must also pair with your code (`gpumesh pair-code`) before you can connect.")
