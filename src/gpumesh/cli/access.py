"""``gpumesh allow`` and ``gpumesh deny``"""

from __future__ import annotations

import click

from gpumesh.cli._common import get_node
from gpumesh.cli._complete import complete_peer


@click.command(epilog="\b\nExamples:\n  gpumesh allow bob-laptop\n  gpumesh allow k3x9")
@click.argument("peer", shell_complete=complete_peer)
def allow(peer: str) -> None:
    """Let a paired PEER (name or id prefix) use this node again."""
    record = get_node().allow(peer)
    click.echo(f"{record.name} ({record.node_id.short}) is allowed.")


@click.command(epilog="\b\nExamples:\n  gpumesh deny bob-laptop")
@click.argument("peer", shell_complete=complete_peer)
def deny(peer: str) -> None:
    """Revoke PEER's access (name or id prefix) at once.

    Its next request is refused; a running `gpumesh share` closes its open
    connections (shells, copies, follows) and cancels its running jobs now.
    """
    record = get_node().deny(peer)
    click.echo(
        f"{record.name} ({record.node_id.short}) is denied; its open connections are closed "
        "and its running jobs cancelled."
    )
