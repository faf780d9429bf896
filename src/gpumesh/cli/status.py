"""``gpumesh status``"""

from __future__ import annotations

import time
from pathlib import Path

import click

from gpumesh.cli._common import emit_json, get_node
from gpumesh.protocol.states import JobRole


@click.command(epilog="\b\nExamples:\n  gpumesh status\n  gpumesh status --json")
@click.option(
    "--offline",
    is_flag=True,
    help="Do not ask providers where submitted jobs stand: count them as last recorded.",
)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable output.")
def status(offline: bool, as_json: bool) -> None:
    """Show this node: identity, whether it is sharing, GPUs, running jobs, peers.

    Unfinished submitted jobs are first refreshed from their providers by this
    home's node process, as in `gpumesh jobs` (a few seconds at most, and not
    waiting again on a provider that did not answer).
    """
    node = get_node()
    unknown: list[float] = []
    if not offline and node.home.initialized and node.home.store.unconfirmed_submitted_jobs():
        # The node process asks the providers, as for `gpumesh jobs`: it keeps the
        # sessions, and knows which providers went silent (not waited on again).
        from gpumesh.cli._node import node_client
        from gpumesh.client.views.joblist import JobListEntry

        listed = node_client().call("GET", "/api/v1/jobs?limit=1000", list[JobListEntry])
        unknown = [
            entry.unknown_since
            for entry in listed
            if entry.role == JobRole.SUBMITTED and entry.unknown_since is not None
        ]
    st = node.status()
    if as_json:
        from gpumesh.client.views.node import StatusView

        emit_json(StatusView.of(st, submitted_unknown=len(unknown)))
        return
    sharing = (
        click.style(f"yes, on udp {st.listen} (pid {st.agent.pid})", fg="green")
        if st.agent
        else _not_sharing(st.home, st.listen)
    )
    click.echo(f"Node     {click.style(st.name, bold=True)}")
    click.echo(f"Id       {st.node_id}")
    click.echo(f"Home     {st.home}")
    click.echo(f"Sharing  {sharing}")
    if st.relay:
        from gpumesh.store.home import RelayState

        if st.agent is None:
            relay_line = f"{st.relay} (used when sharing or when a direct dial fails)"
        elif st.agent.relay_state is RelayState.REGISTERED:
            relay_line = click.style(f"{st.relay}, {st.agent.relay_text}", fg="green")
        else:
            relay_line = click.style(f"{st.relay}, {st.agent.relay_text}", fg="yellow")
        click.echo(f"Relay    {relay_line}")
    for link in st.agent.links if st.agent else []:
        click.echo(f"Peer     {link['peer']} connected, path {link['path']}")
    from gpumesh.client.owner import open_sessions
    from gpumesh.units import format_size

    sessions = open_sessions(st.agent)
    for shell in sessions.shells:
        since = _clock(shell["since"])
        click.echo(f"Shell    {shell['peer']} in {shell['image']} since {since} (id {shell['id']})")
    for entry in sessions.desktops:
        since = _clock(entry["since"])
        click.echo(
            f"Desktop  {entry['peer']} connected ({entry['kind']}) since {since} (id {entry['id']})"
        )
    for cuda in sessions.cuda:
        held = format_size(cuda.memory)
        click.echo(f"CUDA     {cuda.peer}: {held} on {cuda.device} (pid {cuda.pid}, id {cuda.id})")
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
    submitted = f"{st.running_submitted} submitted running"
    if unknown:
        since = time.strftime("%H:%M", time.localtime(min(unknown)))
        submitted += click.style(f" ({len(unknown)} no answer since {since})", fg="yellow")
    click.echo(f"Jobs     {state}: {st.running_hosted} running here, {submitted}")
    click.echo(f"Peers    {st.peers} paired, {st.allowed} allowed")


def _clock(unix_time: str) -> str:
    try:
        return time.strftime("%H:%M", time.localtime(float(unix_time)))
    except ValueError:
        return "?"


def _not_sharing(home: Path, listen: str) -> str:
    """``no``, how the last share ended when it is known, and how to share."""
    from gpumesh.daemon.record import last_share_end
    from gpumesh.units import format_duration

    hint = f"run `gpumesh share`; would listen on udp {listen}"
    ended = last_share_end(home)
    if ended is None:
        return f"no ({hint})"
    ago = format_duration(max(0.0, time.time() - ended[0]))
    return f"no (the last share ended {ago} ago: {ended[1]}; {hint})"
