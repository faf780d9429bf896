"""``gpumesh pair-code``"""

from __future__ import annotations

import sys

import click

from gpumesh.cli._common import emit_json, json_option


@click.command(
    name="pair-code",
    epilog="""\b
Examples:
  gpumesh pair-code                    # send the output to your peer
  gpumesh pair "$(ssh bob gpumesh pair-code)"
""",
)
@json_option
def pair_code(as_json: bool) -> None:
    """Print a signed pairing code for this node (valid for one hour).

    The code carries this node's name, public key and addresses. The peer
    pastes it into `gpumesh pair`; you paste theirs into yours.
    """
    from gpumesh.cli._node import node_client

    # The node process knows where a share it runs really listens.
    answer = node_client().send("GET", "/api/v1/pairing-code")
    from gpumesh.client.views.peers import PairingCodeView

    made = answer.answer(PairingCodeView)
    if as_json:
        emit_json(made)
        return
    click.echo(made.code)
    if sys.stdout.isatty():
        click.echo(
            "Give this code to your peer; it expires in 1 hour. They run: gpumesh pair '<code>'",
            err=True,
        )
