"""``gpumesh pair``"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from gpumesh.cli._common import emit_json

if TYPE_CHECKING:
    from gpumesh.client.views.peers import PairView


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
    from gpumesh.cli._node import node_client
    from gpumesh.client.bodies import PairBody
    from gpumesh.client.views.peers import PairView

    # The node process pairs (and dials the peer once to check): it keeps the
    # session it opened warm for what comes next.
    body = PairBody(code=code.strip(), rekey=rekey, offline=offline)
    paired = node_client().call("POST", "/api/v1/peers/pair", PairView, body)
    if as_json:
        emit_json(paired)
        return
    name = click.style(paired.name, bold=True)
    addresses = ", ".join(paired.addresses) or "-"
    if not paired.allowed:
        click.echo(
            f"Paired with {name} ({paired.node_id[:12]}), still denied: pairing never lifts a "
            f"denial; `gpumesh allow {paired.name}` lets them use this node again."
        )
        click.echo(f"  addresses  {addresses}")
        return
    click.echo(f"Paired with {name} ({paired.node_id[:12]}), allowed.")
    click.echo(f"  addresses  {addresses}")
    click.echo(_paired_back(paired))


def _paired_back(paired: PairView) -> str:
    """One line saying whether the peer can be used now, and what to do if not."""
    from gpumesh.client.views.peers import PairState

    name = paired.name
    if paired.paired_back is None:
        return "They must also pair with your code (`gpumesh pair-code`) before you can connect."
    if paired.paired_back == PairState.READY:
        return click.style(f"{name} has paired you too: ready.", fg="green")
    if paired.paired_back == PairState.NOT_PAIRED:
        return (
            f"{name} has not paired you yet: send them your code "
            f"(`gpumesh pair-code` prints it) and they run `gpumesh pair` with it."
        )
    if paired.paired_back == PairState.UNREACHABLE:
        # A node answers only while it shares: one that only uses others' GPUs
        # never does, and nothing is wrong with that.
        return (
            f"{name} did not answer, so whether it paired you too is not known yet: "
            f"that is expected if {name} only uses GPUs and does not share its own "
            f"(`gpumesh connect {name}` checks once it shares)."
        )
    return click.style(f"{name} refuses you: {paired.paired_back_reason or ''}", fg="yellow")
