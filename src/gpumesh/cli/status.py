"""``gpumesh status``"""

from __future__ import annotations

import click

from gpumesh.cli._common import emit_json, get_node


@click.command(epilog="\b\nExamples:\n  gpumesh status\n  gpumesh status --json")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable output.")
def status(as_json: bool) -> None:
    """Show this node: identity, whether it is sharing, peers."""
    node = get_node()
    st = node.status()
    if as_json:
        emit_json(
            {
                "name": st.name,
                "node_id": st.node_id,
                "home": str(st.home),
                "sharing": st.agent is not None,
                "listen": st.listen,
                "agent_pid": st.agent.pid if st.agent else None,
                "peers": st.peers,
                "allowed": st.allowed,
            }
        )
        return
    sharing = (
        click.style(f"yes, on udp {st.listen} (pid {st.agent.pid})", fg="green")
        if st.agent
        else f"no (run `gpumesh share`; would listen on udp {st.listen})"
    )
    click.echo(f"Node     {click.style(st.name, bold=True)}")
    click.echo(f"Id       {st.node_id}")
    click.echo(f"Home     {st.home}")
    click.echo(f"Sharing  {sharing}")
    click.echo(f"Peers    {st.peers} paired, {st.allowed} allowed")
