"""``gpumesh sync``: re-publish to the registry now and refresh paired peers' addresses."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from gpumesh.cli._common import DURATION, emit_json

if TYPE_CHECKING:
    from gpumesh.client.views.registry import PeerSyncView


@click.command(
    epilog="""\b
Examples:
  gpumesh sync                  # re-publish now, refresh every paired peer
  gpumesh sync --no-dial        # only look addresses up, dial nobody
  gpumesh sync --json
\b
Peers' addresses come from signed records: in the registry (rendezvous_url),
published by nodes with `announce_addresses = true` or `share --public`, and
from paired peers that answer (each about itself, and about your other peers
that asked them to hand their record on). A record is accepted only when
signed by the key you paired with, and newer than the last one taken.
"""
)
@click.option(
    "--timeout", type=DURATION, default="5s", show_default=True, help="How long to wait per peer."
)
@click.option("--no-dial", "no_dial", is_flag=True, help="Do not dial peers to check them.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable output.")
def sync(timeout: float, no_dial: bool, as_json: bool) -> None:
    """Re-publish this node's records now and refresh paired peers' addresses.

    With a registry configured, a running `gpumesh share --public` (or with
    announce_addresses) re-publishes at once, and each paired peer's signed
    address record is looked up; then every peer is dialled to refresh the
    path that works. Registry or not, every peer that answers is asked for
    its current addresses and those of the peers that did not answer; a peer
    found that way is dialled again.
    """
    from gpumesh.cli._node import node_client
    from gpumesh.client.bodies import SyncPeersBody
    from gpumesh.client.views.registry import SyncView

    body = SyncPeersBody(timeout=timeout, dial=not no_dial)
    view = node_client().call("POST", "/api/v1/peers/sync", SyncView, body)
    if as_json:
        emit_json(view)
        return
    url, republished, results = view.registry, view.republished_by, view.peers
    if not url:
        click.echo(
            "No registry configured (rendezvous_url): refreshed from paired peers only. "
            "Set one with `gpumesh config set rendezvous_url http://HOST:47080`."
        )
    elif republished is None:
        click.echo(f"Registry {url}: no `gpumesh share` runs here, nothing to re-publish.")
    else:
        click.echo(
            f"Registry {url}: asked the node process (pid {republished}) to re-publish "
            "its share now."
        )
    if not results:
        click.echo("No paired peers.")
        return
    _print_results(results)


def _print_results(results: list[PeerSyncView]) -> None:
    from gpumesh.cli._table import Column, escape, print_table

    said = {result.registry_note for result in results}
    shared = said.pop() if len(said) == 1 else ""
    if shared:  # the registry failed as a whole: said once, not on every row
        click.echo(f"The registry could not be asked for any peer: {shared}")
    rows = []
    for result in results:
        note = result.note
        if shared:  # it comes first in the note (it may hold "; " itself)
            note = note.removeprefix(shared).removeprefix("; ")
        if result.reachable is None:
            state = "not dialled"
        elif result.reachable:
            state = f"yes ({result.path})"
        else:
            state = "no"
        if result.moved:
            changed = f"moved (via {result.found_via})" if result.found_via else "moved (registry)"
        else:
            changed = "-"
        rows.append(
            [
                escape(result.name),
                changed,
                escape(", ".join(result.addresses) or "no address"),
                escape(state),
                escape(note),
            ]
        )
    print_table(
        [
            Column("PEER", gives_way=3),
            Column("CHANGED"),
            Column("ADDRESSES", gives_way=2),
            Column("REACHABLE"),
            Column("NOTE", gives_way=1, below=True, named_below=True),
        ],
        rows,
    )
