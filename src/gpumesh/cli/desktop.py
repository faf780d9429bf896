"""``gpumesh desktop``: share this machine's VNC or RDP server, or reach a peer's."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Literal, cast

import click

from gpumesh.cli._common import emit_json, get_node, json_option
from gpumesh.cli._complete import complete_peer
from gpumesh.cli._node import node_client, peer_change

if TYPE_CHECKING:
    from gpumesh.client.views.desktop import DesktopDoctorView, TunnelView


@click.group(
    epilog="""\b
Examples:
  # the owner of the machine
  gpumesh desktop doctor             # is a VNC or RDP server listening here?
  gpumesh desktop share --vnc        # offer 127.0.0.1:5900 while this node shares
  gpumesh desktop allow bob-laptop   # its own allowlist, empty until you add someone
  gpumesh desktop deny bob-laptop    # cuts bob's open desktop connections at once
  gpumesh desktop share stop
  # a peer it allowed
  gpumesh desktop connect alice-pc   # then: vncviewer 127.0.0.1::15900
\b
The desktop is the one thing peers can reach outside a container, so it is
opt-in twice: share it, and name who may use it. `gpumesh deny` revokes it too.
"""
)
def desktop() -> None:
    """Share this machine's VNC or RDP server with chosen peers, or use a peer's."""


@desktop.command(
    short_help="Is a VNC/RDP server listening here? Who may use it?",
    epilog="\b\nExamples:\n  gpumesh desktop doctor\n  gpumesh desktop doctor --json",
)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable output.")
def doctor(as_json: bool) -> None:
    """Check for a VNC or RDP server on 127.0.0.1 (ports 5900-5909, 3389 and the
    shared one), warn when one also listens beyond loopback (jobs' containers and
    the LAN reach it), and show the share, its allowlist and who is connected."""
    from gpumesh.client.views.desktop import DesktopDoctorView

    report = node_client().call("GET", "/api/v1/desktop/doctor", DesktopDoctorView)
    if as_json:
        emit_json(report)
        return
    _print_report(report)


def _print_report(report: DesktopDoctorView) -> None:
    from gpumesh.client.desktop import INSTALL_HINTS, exposure_warning
    from gpumesh.protocol.desktop import DesktopKind

    ok, warn = click.style("ok", fg="green"), click.style("!!", fg="yellow")
    for server in report.servers:
        said = f" ({server.greeting})" if server.greeting else ""
        click.echo(f"{ok}  {server.kind} server listening on 127.0.0.1:{server.port}{said}")
        if server.exposed:
            click.echo(f"{warn}  {exposure_warning(server.kind, server.port, server.exposed)}")
    kinds = {server.kind for server in report.servers}
    for kind in (DesktopKind.VNC, DesktopKind.RDP):
        if kind not in kinds:
            click.echo(f"--  no {kind} server on 127.0.0.1; {INSTALL_HINTS[kind]}")
    if not report.shared:
        click.echo("--  the desktop is not shared (`gpumesh desktop share --vnc` or --rdp)")
    else:
        state = ok if report.share_answers else warn
        answers = "" if report.share_answers else ", but nothing listens there now"
        click.echo(
            f"{state}  shared: {report.share_kind} on 127.0.0.1:{report.share_port}{answers}"
        )
        if not report.sharing:
            click.echo(f"{warn}  offered only while this node shares: run `gpumesh share`")
    names = ", ".join(report.allowed)
    if names:
        click.echo(f"{ok}  may use it: {names}")
    else:
        click.echo("--  nobody may use it yet (`gpumesh desktop allow PEER`)")
    for entry in report.connected:
        since = time.strftime("%H:%M", time.localtime(float(entry.get("since", "0"))))
        click.echo(f"{ok}  {entry['peer']} connected ({entry['kind']}) since {since}")
    if not report.owner_checked:
        click.echo(
            f"{warn}  this system cannot tell which user opens a local connection: on a "
            "shared machine, other accounts could use a `desktop connect` tunnel from here"
        )


@desktop.command(
    short_help="Offer the local VNC/RDP server (`share stop` ends it).",
    epilog="""\b
Examples:
  gpumesh desktop share --vnc          # 127.0.0.1:5900
  gpumesh desktop share --rdp          # 127.0.0.1:3389
  gpumesh desktop share --vnc --port 5901
  gpumesh desktop share stop
""",
)
@click.argument("action", required=False, type=click.Choice(["stop"]))
@click.option("--vnc", "kind", flag_value="vnc", help="A VNC server (port 5900 unless --port).")
@click.option("--rdp", "kind", flag_value="rdp", help="An RDP server (port 3389 unless --port).")
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    help="The server's port on 127.0.0.1 (the kind is guessed from it without --vnc/--rdp).",
)
@json_option
def share(action: str | None, kind: str | None, port: int | None, as_json: bool) -> None:
    """Offer this machine's desktop server on 127.0.0.1 to the peers on the desktop
    allowlist while this node shares; `share stop` ends it and its connections.

    Returns at once; the share is remembered. Peers reach that one port, nothing else.
    Warns when the server also listens beyond loopback (then jobs' containers and the
    LAN reach it without GPUMesh).
    """
    from gpumesh.client.bodies import DesktopShareBody
    from gpumesh.client.desktop import exposure, exposure_warning
    from gpumesh.client.views.owner import DesktopShareView
    from gpumesh.errors import BadRequestError
    from gpumesh.protocol.desktop import DesktopKind, kind_for_port

    if action == "stop":
        if kind or port:
            raise BadRequestError("`desktop share stop` takes no --vnc, --rdp or --port")
        stopped = node_client().call("DELETE", "/api/v1/desktop/share", DesktopShareView)
        if as_json:
            emit_json(stopped)
        elif stopped.shared:
            click.echo("The desktop is no longer shared.")
        else:
            click.echo("The desktop was not shared.")
        return
    if kind is not None:
        chosen = DesktopKind(kind)
        port = port or chosen.server_port
    elif port is not None:
        chosen = kind_for_port(port)
    else:
        chosen, port = DesktopKind.VNC, DesktopKind.VNC.server_port

    kind_text = cast("Literal['vnc', 'rdp', 'tcp']", str(chosen))  # a DesktopKind's value
    body = DesktopShareBody(kind=kind_text, port=port)
    shared = node_client().call("POST", "/api/v1/desktop/share", DesktopShareView, body)
    assert shared.port is not None
    exposed = exposure(shared.port)
    if exposed:
        warning = exposure_warning(str(shared.kind), shared.port, exposed)
        click.echo(click.style(f"WARNING: {warning}", fg="yellow"), err=True)
    if as_json:
        emit_json(shared)
        return
    click.echo(f"Sharing the desktop: {shared.kind} on 127.0.0.1:{shared.port}.")
    if not get_node().home.store.desktop_allowed_ids():
        click.echo("Nobody may use it yet: `gpumesh desktop allow PEER`.")
    if not shared.sharing:
        click.echo("Offered while this node shares: run `gpumesh share`.")


@desktop.command(epilog="\b\nExamples:\n  gpumesh desktop allow bob-laptop")
@click.argument("peer", shell_complete=complete_peer)
@json_option
def allow(peer: str, as_json: bool) -> None:
    """Let a paired PEER (name or id prefix) use the shared desktop.

    The desktop allowlist is separate from the one for jobs and files.
    """
    peer_change(
        peer,
        "desktop/allow",
        as_json,
        lambda r: f"{r.name} ({r.node_id[:12]}) may use the desktop.",
    )


@desktop.command(
    short_help="Take a peer off the desktop allowlist; cuts its sessions.",
    epilog="\b\nExamples:\n  gpumesh desktop deny bob-laptop",
)
@click.argument("peer", shell_complete=complete_peer)
@json_option
def deny(peer: str, as_json: bool) -> None:
    """Take PEER off the desktop allowlist; a running `gpumesh share` cuts its open
    desktop connections at once (its jobs and files are untouched)."""
    peer_change(
        peer,
        "desktop/deny",
        as_json,
        lambda r: (
            f"{r.name} ({r.node_id[:12]}) may no longer use the desktop; its open "
            "desktop connections are closed."
        ),
    )


@desktop.command(
    short_help="Tunnel a peer's desktop to 127.0.0.1 and say what to run.",
    epilog="""\b
Examples:
  gpumesh desktop connect alice-pc                  # VNC: 127.0.0.1:15900, RDP: 13389
  gpumesh desktop connect alice-pc --bind 127.0.0.1:5999
\b
Then, while it runs:
  vncviewer 127.0.0.1::15900
  xfreerdp /v:127.0.0.1:13389      (Windows: mstsc /v:127.0.0.1:13389)
""",
)
@click.argument("peer", envvar="GPUMESH_PEER", shell_complete=complete_peer)
@click.option(
    "--bind",
    "bind_text",
    metavar="[HOST:]PORT",
    help="Loopback address to listen on (default 127.0.0.1:15900 for VNC, :13389 for RDP).",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print where it listens as JSON, then one line of JSON per connection as it "
    'opens, with what carries it: {"connection": 1, "path": "channel"} (or "quic").',
)
def connect(peer: str, bind_text: str | None, as_json: bool) -> None:
    """Tunnel PEER's shared desktop to a loopback port until Ctrl-C, and say what
    to run. Only this user's programs may connect (Linux). PEER is a name or an
    id prefix; $GPUMESH_PEER is the default."""
    import json

    import msgspec

    from gpumesh.client.bodies import TunnelBody
    from gpumesh.client.views.desktop import (
        TUNNEL_EVENTS,
        TunnelConnectionView,
        TunnelRefusedView,
        TunnelView,
        TunnelWarningView,
    )

    tunnel = node_client().send(
        "POST", "/api/v1/desktop/connect", TunnelBody(peer=peer, bind=bind_text)
    )
    try:
        for event in tunnel.events(TUNNEL_EVENTS):
            view = event.view
            if isinstance(view, TunnelView) and as_json:
                emit_json(view)
            elif isinstance(view, TunnelView):
                _print_ready(view)
            elif isinstance(view, TunnelConnectionView):
                if as_json:  # one compact line each: a script reads them as they come
                    click.echo(json.dumps(msgspec.to_builtins(view)))
            elif isinstance(view, TunnelRefusedView):
                who = f"uid {view.uid}" if view.uid is not None else "an unknown user"
                click.echo(f"Refused a connection from {who}: not this user.", err=True)
            elif isinstance(view, TunnelWarningView):
                click.echo(f"warning: a desktop connection was refused: {view.message}", err=True)
    except KeyboardInterrupt:
        click.echo("Tunnel closed.", err=True)


def _print_ready(tunnel: TunnelView) -> None:
    click.echo(
        f"{tunnel.provider}'s desktop ({tunnel.kind}) is on {tunnel.listen}; "
        "keep this running and use:"
    )
    for command in tunnel.commands:
        click.echo(f"  {command}")
    if not tunnel.owner_checked:
        click.echo(
            "note: this system cannot tell which user opens a local connection, so other "
            "accounts on this machine could use the tunnel while it runs",
            err=True,
        )
    click.echo("Ctrl-C closes it.", err=True)
