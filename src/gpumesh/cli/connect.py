"""``gpumesh connect``"""

from __future__ import annotations

import click

from gpumesh.cli._common import emit_json, get_node, run_async
from gpumesh.cli._complete import complete_peer


@click.command(
    epilog="""\b
Examples:
  gpumesh connect alice-pc
  gpumesh connect k3x9 --json
  gpumesh connect alice-pc --speed 256MB     # also measure upload throughput
"""
)
@click.argument("peer", envvar="GPUMESH_PEER", shell_complete=complete_peer)
@click.option(
    "--timeout", type=float, help="Seconds to wait for an answer (config connect_timeout)."
)
@click.option("--speed", metavar="SIZE", help="Also push SIZE bytes (e.g. 256MB) and report MB/s.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable output.")
def connect(peer: str, timeout: float | None, speed: str | None, as_json: bool) -> None:
    """Dial PEER, prove identities both ways, and report path and round-trip time.

    PEER is a name or an id prefix; $GPUMESH_PEER is the default.
    """
    from gpumesh.units import parse_size

    node = get_node()
    size = parse_size(speed) if speed else 0
    result = run_async(node.connect(peer, timeout=timeout))
    throughput = run_async(node.throughput(peer, size)) if size else None
    if as_json:
        from gpumesh.client.views.peers import ConnectView

        emit_json(ConnectView.of(result, throughput))
        return
    where = "" if " " in result.path else f" via {result.address}"
    click.echo(
        f"{click.style(result.peer.name, bold=True)} is reachable: path "
        f"{click.style(result.path, fg='green')}{where}, "
        f"rtt {result.rtt_ms:.2f} ms (connect {result.connect_ms:.0f} ms"
        + ("" if result.punch_ms is None else f", punched in {result.punch_ms:.0f} ms")
        + ")"
    )
    if throughput:
        from gpumesh.units import format_rate, format_size

        rate = format_rate(throughput.bytes, throughput.seconds)
        click.echo(f"upload {rate} ({format_size(throughput.bytes)})")
