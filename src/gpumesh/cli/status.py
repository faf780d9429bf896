"""``gpumesh status``"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from gpumesh.cli._common import emit_json
from gpumesh.cli._node import node_client
from gpumesh.protocol.states import JobRole
from gpumesh.units import format_duration, format_size

if TYPE_CHECKING:
    from gpumesh.client.views.owner import RelayingView
    from gpumesh.daemon.client import NodeClient


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
    client = node_client()
    # Sent first: the node process looks while this process loads the decoder.
    answer = client.send("GET", f"/api/v1/status?offline={'true' if offline else 'false'}")
    from gpumesh.client.views.node import StatusView

    st = answer.answer(StatusView)
    if as_json:
        emit_json(st)
        return
    sharing = (
        click.style(f"yes, on udp {st.listen} (pid {st.agent_pid})", fg="green")
        if st.sharing
        else _not_sharing(Path(st.home), st.listen)
    )
    click.echo(f"Node     {click.style(st.name, bold=True)}")
    click.echo(f"Id       {st.node_id}")
    click.echo(f"Home     {st.home}")
    click.echo(f"Sharing  {sharing}")
    if st.relay:
        if not st.sharing:
            relay_line = f"{st.relay} (used when sharing or when a direct dial fails)"
        else:
            registered = (st.relay_state or "").startswith("registered as")
            relay_line = click.style(
                f"{st.relay}, {st.relay_state}", fg="green" if registered else "yellow"
            )
        click.echo(f"Relay    {relay_line}")
    for link in st.connections:
        click.echo(f"Peer     {link['peer']} connected, path {link['path']}")
    if st.relaying is not None:
        _relaying_lines(st.relaying)
    for shell in st.sessions.shells:
        since = _clock(shell.since)
        click.echo(f"Shell    {shell.peer} in {shell.image} since {since} (id {shell.id})")
    for entry in st.sessions.desktops:
        since = _clock(entry.since)
        click.echo(f"Desktop  {entry.peer} connected ({entry.kind}) since {since} (id {entry.id})")
    for cuda in st.sessions.cuda:
        held = format_size(cuda.memory)
        click.echo(f"CUDA     {cuda.peer}: {held} on {cuda.device} (pid {cuda.pid}, id {cuda.id})")
    if st.gpu_source == "simulated":
        click.echo(click.style("GPUs     SIMULATED (test mode, not real hardware)", fg="red"))
    if st.gpus:
        for gpu in st.gpus:
            used, total = format_size(gpu.memory_used), format_size(gpu.memory_total)
            owner = f"; in use by its owner ({gpu.owner}): guests wait" if gpu.owner else ""
            click.echo(f"GPU {gpu.index}    {gpu.name}, {used} used of {total}{owner}")
    else:
        click.echo("GPUs     no NVIDIA GPU (CPU-only jobs)")
    if st.paused_since is not None:
        since = _clock(st.paused_since)
        click.echo(
            click.style(
                f"Paused   since {since}: the machine is yours; peers get nothing", fg="yellow"
            )
            + " (`gpumesh resume` offers it again)"
        )
    state = click.style(st.state, fg="yellow") if st.state != "idle" else "idle"
    submitted = f"{st.jobs_submitted_running} submitted running"
    if st.jobs_submitted_unknown:
        since = time.strftime("%H:%M", time.localtime(min(_unknown_since(client))))
        count = st.jobs_submitted_unknown
        submitted += click.style(f" ({count} no answer since {since})", fg="yellow")
    click.echo(f"Jobs     {state}: {st.jobs_hosted_running} running here, {submitted}")
    for waiting in st.queue:
        until = f" until {_clock(waiting.wait_until)}" if waiting.wait_until else ""
        what = "moving" if waiting.moving else "queued"
        click.echo(f"Queue    {waiting.job_id} {what}{until}: {waiting.message}")
    click.echo(f"Peers    {st.peers} paired, {st.allowed} allowed")


def _relaying_lines(relaying: RelayingView) -> None:
    """``Relaying`` lines: the bounds, who can be reached through this node, and each
    session with its bytes."""
    sessions = relaying.sessions
    click.echo(
        f"Relaying for peers: {len(sessions)} of {relaying.max_sessions} sessions, "
        f"{format_size(relaying.rate)}/s in all, {format_size(relaying.bytes_relayed)} so far"
    )
    if relaying.registered:
        click.echo(f"Relaying reachable through this node: {', '.join(relaying.registered)}")
    for session in sessions:
        click.echo(
            f"Relaying {session.a} -> {session.b}: {format_size(session.bytes)} "
            f"({session.state}, {format_duration(session.age)})"
        )
    refused = ", ".join(f"{code} {count}" for code, count in sorted(relaying.refusals.items()))
    if refused:
        click.echo(f"Relaying refused: {refused}")


def _unknown_since(client: NodeClient) -> list[float]:
    """When each submitted job whose provider did not answer was last confirmed, as
    the node process just recorded it (no provider is asked again)."""
    from gpumesh.client.views.joblist import JobListEntry

    listed = client.call("GET", "/api/v1/jobs?limit=1000&offline=true", list[JobListEntry])
    found = [
        entry.unknown_since
        for entry in listed
        if entry.role == JobRole.SUBMITTED and entry.unknown_since is not None
    ]
    return found or [time.time()]


def _clock(unix_time: float) -> str:
    return time.strftime("%H:%M", time.localtime(unix_time))


def _not_sharing(home: Path, listen: str) -> str:
    """``no``, how the last share ended when it is known, and how to share."""
    from gpumesh.daemon.record import last_share_end

    hint = f"run `gpumesh share`; would listen on udp {listen}"
    ended = last_share_end(home)
    if ended is None:
        return f"no ({hint})"
    ago = format_duration(max(0.0, time.time() - ended[0]))
    return f"no (the last share ended {ago} ago: {ended[1]}; {hint})"
