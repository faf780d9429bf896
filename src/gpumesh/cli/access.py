"""``gpumesh allow`` and ``gpumesh deny``: through the node process, which runs
this home's share and so applies them at once."""

from __future__ import annotations

import click

from gpumesh.cli._complete import complete_peer
from gpumesh.cli._node import peer_change


@click.command(epilog="\b\nExamples:\n  gpumesh allow bob-laptop\n  gpumesh allow k3x9")
@click.argument("peer", shell_complete=complete_peer)
def allow(peer: str) -> None:
    """Let a paired PEER (name or id prefix) use this node again."""
    record = peer_change(peer, "allow")
    click.echo(f"{record.name} ({record.node_id[:12]}) is allowed.")


@click.command(epilog="\b\nExamples:\n  gpumesh deny bob-laptop")
@click.argument("peer", shell_complete=complete_peer)
def deny(peer: str) -> None:
    """Revoke PEER's access (name or id prefix) at once.

    Its next request is refused; a running `gpumesh share` closes its open
    connections (shells, copies, follows) and cancels its running jobs now.
    """
    record = peer_change(peer, "deny")
    click.echo(
        f"{record.name} ({record.node_id[:12]}) is denied; its open connections are closed "
        "and its running jobs cancelled."
    )
