"""``gpumesh allow`` and ``gpumesh deny``: through the node process, which runs
this home's share and so applies them at once."""

from __future__ import annotations

import click

from gpumesh.cli._common import json_option
from gpumesh.cli._complete import complete_peer
from gpumesh.cli._node import peer_change


@click.command(epilog="\b\nExamples:\n  gpumesh allow bob-laptop\n  gpumesh allow k3x9")
@click.argument("peer", shell_complete=complete_peer)
@json_option
def allow(peer: str, as_json: bool) -> None:
    """Let a paired PEER (name or id prefix) use this node again."""
    peer_change(peer, "allow", as_json, lambda r: f"{r.name} ({r.node_id[:12]}) is allowed.")


@click.command(epilog="\b\nExamples:\n  gpumesh deny bob-laptop")
@click.argument("peer", shell_complete=complete_peer)
@json_option
def deny(peer: str, as_json: bool) -> None:
    """Revoke PEER's access (name or id prefix) at once.

    Its next request is refused; a running `gpumesh share` closes its open
    connections (shells, copies, follows) and cancels its running jobs now.
    """
    peer_change(
        peer,
        "deny",
        as_json,
        lambda r: (
            f"{r.name} ({r.node_id[:12]}) is denied; its open connections are closed "
            "and its running jobs cancelled."
        ),
    )
