"""``gpumesh init``"""

from __future__ import annotations

import click

from gpumesh.cli._common import emit_json, get_node


@click.command(
    epilog="""\b
Examples:
  gpumesh init --name alice-pc
  GPUMESH_HOME=~/.gpumesh-bob gpumesh init --name bob-laptop   # a second node of yours
"""
)
@click.option(
    "--name", envvar="GPUMESH_NODE_NAME", show_envvar=True, help="Node name (default: hostname)."
)
@click.option("--force", is_flag=True, help="Replace an existing identity (peers must pair again).")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable output.")
def init(name: str | None, force: bool, as_json: bool) -> None:
    """Create this node's Ed25519 identity and config.

    Re-running init never silently replaces an identity: it refuses unless
    --force is given. The home ($GPUMESH_HOME, default ~/.gpumesh) must be a
    folder you own that nobody else may write in, or one GPUMesh makes.
    """
    node = get_node()
    replacing = force and node.home.initialized
    if replacing:
        click.echo(
            click.style("warning:", fg="yellow", bold=True)
            + " replacing this node's identity: every peer will have to pair again",
            err=True,
        )
    info = node.init(name, force=force)
    if as_json:
        from gpumesh.client.views.node import NodeView

        emit_json(NodeView.of(info))
        return
    click.echo(f"Initialized node {click.style(info.name, bold=True)}")
    click.echo(f"  id    {info.node_id}")
    click.echo(f"  home  {info.home}")
    click.echo("Next: `gpumesh pair-code` to introduce this node, or `gpumesh share` to share it.")
