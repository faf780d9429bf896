"""``gpumesh connect``"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from gpumesh.cli._common import DURATION, emit_json
from gpumesh.cli._complete import complete_peer

if TYPE_CHECKING:
    from gpumesh.client.views.peers import ConnectView


@click.command(
    epilog="""\b
Examples:
  gpumesh connect alice-pc
  gpumesh connect k3x9 --json
  gpumesh connect alice-pc --speed 256MB     # also measure upload throughput
  gpumesh connect alice-pc --fresh           # time a whole new dial
\b
Through this home's node process (the default), a warm session to PEER is
reused when there is one: the round trips are measured on it, "(warm session)"
says so (--json: "warm": true) and the connect time shown is that session's
own dial. Otherwise the node process dials now and keeps the session warm for
the next command. --fresh dials anew all the same (path, handshake and identity
proof timed now) and closes that session after; the warm one stays. --speed
pushes its bytes on the session the node process keeps.
"""
)
@click.argument("peer", envvar="GPUMESH_PEER", shell_complete=complete_peer)
@click.option(
    "--timeout",
    type=DURATION,
    help="How long to wait for an answer, e.g. 5s or 2m (config connect_timeout).",
)
@click.option("--speed", metavar="SIZE", help="Also push SIZE bytes (e.g. 256MB) and report MB/s.")
@click.option(
    "--fresh", is_flag=True, help="Dial anew even when a warm session exists, and time the dial."
)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable output.")
def connect(
    peer: str, timeout: float | None, speed: str | None, fresh: bool, as_json: bool
) -> None:
    """Dial PEER, prove identities both ways, and report path and round-trip time.

    PEER is a name or an id prefix; $GPUMESH_PEER is the default.
    """
    from gpumesh.units import format_rate, format_size, parse_size

    size = parse_size(speed) if speed else 0
    if timeout is not None and not 0 < timeout <= 3600:
        raise click.BadParameter("must be above 0 and at most 3600", param_hint="--timeout")
    view = _through_node(peer, timeout, size, fresh)
    if as_json:
        emit_json(view)
        return
    _show(view)
    mb_per_s = view.upload_mb_per_s
    rate = "-" if not mb_per_s else format_rate(mb_per_s * 1e6, 1.0)
    if size:
        click.echo(f"upload {rate} ({format_size(size)})")


def _through_node(peer: str, timeout: float | None, size: int, fresh: bool) -> ConnectView:
    """The node process's ``connect`` view."""
    from urllib.parse import quote, urlencode

    from gpumesh.cli._node import node_client
    from gpumesh.client.views.peers import ConnectView

    query: dict[str, str] = {}
    if timeout is not None:
        query["timeout"] = repr(timeout)
    if size:
        query["speed"] = str(size)
    if fresh:
        query["fresh"] = "true"
    path = f"/api/v1/peers/{quote(peer, safe='')}/connect"
    return node_client().call("POST", path + (f"?{urlencode(query)}" if query else ""), ConnectView)


def _show(view: ConnectView) -> None:
    """The line about the path."""
    where = "" if " " in view.path else f" via {view.address}"
    if view.warm:
        how = f"warm session: no dial now, its dial took {view.connect_ms:.0f} ms"
    else:
        how = f"connect {view.connect_ms:.0f} ms"
    punch = view.punch_ms
    click.echo(
        f"{click.style(view.peer, bold=True)} is reachable: path "
        f"{click.style(view.path, fg='green')}{where}, "
        f"rtt {view.rtt_ms:.2f} ms ({how}"
        + ("" if punch is None else f", punched in {punch:.0f} ms")
        + ")"
    )
