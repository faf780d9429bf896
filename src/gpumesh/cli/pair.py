"""``gpumesh pair``"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from gpumesh.cli._common import emit_json, get_node, run_async

if TYPE_CHECKING:
    from gpumesh.client.node import PairCheck


@click.command(
    epilog="""\b
Examples:
  gpumesh pair 'gpm1_...'
  gpumesh pair --rekey 'gpm1_...'     # the peer was reinstalled and has a new key
  gpumesh pair --offline 'gpm1_...'   # do not check whether they paired you
"""
)
@click.argument("code")
@click.option("--rekey", is_flag=True, help="Accept a new key for an already-paired peer name.")
@click.option(
    "--offline", is_flag=True, help="Do not dial the peer to check whether it paired you."
)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable output.")
def pair(code: str, rekey: bool, offline: bool, as_json: bool) -> None:
    """Pair with a peer: verify its CODE, store it, and allow it.

    Pairing is mutual: the peer must also pair with your code
    (`gpumesh pair-code`) before either of you can use the other. After
    pairing, one short dial (a few seconds at most) tells whether the peer
    has paired you too, has not yet, or cannot be reached now; --offline, or
    a code without addresses or relay, skips it.
    """
    node = get_node()
    peer = node.pair(code, rekey=rekey)
    check: PairCheck | None = None
    if not offline and (peer.addresses or peer.relay):
        check = run_async(node.check_paired_back(peer.name))
    if as_json:
        from gpumesh.client.views.peers import PairView

        emit_json(PairView.of(peer, check))
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
    click.echo(_paired_back(peer.name, check))


def _paired_back(name: str, check: PairCheck | None) -> str:
    """One line saying whether ``name`` can be used now, and what to do if not."""
    from gpumesh.client.node import PairState

    if check is None:
        return "They must also pair with your code (`gpumesh pair-code`) before you can connect."
    if check.state is PairState.READY:
        return click.style(f"{name} has paired you too: ready.", fg="green")
    if check.state is PairState.NOT_PAIRED:
        return (
            f"{name} has not paired you yet: send them your code "
            f"(`gpumesh pair-code` prints it) and they run `gpumesh pair` with it."
        )
    if check.state is PairState.UNREACHABLE:
        # A node answers only while it shares: one that only uses others' GPUs
        # never does, and nothing is wrong with that.
        return (
            f"{name} did not answer, so whether it paired you too is not known yet: "
            f"that is expected if {name} only uses GPUs and does not share its own "
            f"(`gpumesh connect {name}` checks once it shares)."
        )
    return click.style(f"{name} refuses you: {check.detail}", fg="yellow")
