"""``gpumesh status``"""

from __future__ import annotations

import click

from gpumesh.cli._common import emit_json, get_node


@click.command(epilog="\b\nExamples:\n  gpumesh status\n  gpumesh status --json")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable output.")
def status(as_json: bool) -> None:
    """Show this node: identity, whether it is sharing, GPUs, running jobs, peers."""
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
                "relay": st.relay or None,
                "relay_state": st.agent.relay_state if st.agent and st.relay else None,
                "connections": st.agent.links if st.agent else [],
                "peers": st.peers,
                "allowed": st.allowed,
                "gpu_source": st.gpu_source,
                "gpus": [
                    {
                        "index": g.index,
                        "name": g.name,
                        "memory_total": g.memory_total,
                        "memory_used": g.memory_used,
                    }
                    for g in st.gpus
                ],
                "state": "busy" if st.running_hosted else "idle",
                "jobs_hosted_running": st.running_hosted,
                "jobs_submitted_running": st.running_submitted,
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
    if st.relay:
        if st.agent is None:
            relay_line = f"{st.relay} (used when sharing or when a direct dial fails)"
        elif st.agent.relay_state.startswith("registered"):
            relay_line = click.style(f"{st.relay}, {st.agent.relay_state}", fg="green")
        else:
            relay_line = click.style(f"{st.relay}, {st.agent.relay_state}", fg="yellow")
        click.echo(f"Relay    {relay_line}")
    for link in st.agent.links if st.agent else []:
        click.echo(f"Peer     {link['peer']} connected, path {link['path']}")
    from gpumesh.units import format_size

    if st.gpu_source == "simulated":
        click.echo(click.style("GPUs     SIMULATED (test mode, not real hardware)", fg="red"))
    if st.gpus:
        for gpu in st.gpus:
            used, total = format_size(gpu.memory_used), format_size(gpu.memory_total)
            click.echo(f"GPU {gpu.index}    {gpu.name}, {used} used of {total}")
    else:
        click.echo("GPUs     no NVIDIA GPU (CPU-only jobs)")
    # Busy means GPUMesh jobs here, whether or not they hold a GPU.
    state = click.style("busy", fg="yellow") if st.running_hosted else "idle"
    click.echo(
        f"Jobs     {state}: {st.running_hosted} running here, "
        f"{st.running_submitted} submitted running"
    )
    click.echo(f"Peers    {st.peers} paired, {st.allowed} allowed")
