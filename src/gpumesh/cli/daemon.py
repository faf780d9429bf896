"""``gpumesh daemon``: this home's node process (status, stop)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from gpumesh.cli._common import emit_json
from gpumesh.cli.share import share_options

if TYPE_CHECKING:
    from gpumesh.control.views import ShareEndedView

__all__ = ["daemon"]


def _home() -> Path:
    from gpumesh.settings import home_dir

    root = click.get_current_context().find_root()
    return home_dir(root.obj)


@click.group(
    epilog="""\b
Examples:
  gpumesh daemon status
  gpumesh daemon status --json
  gpumesh daemon stop
  gpumesh daemon run                   # in the foreground; Ctrl-C stops it
  gpumesh daemon run --max-vram 16GB   # ... sharing, as the systemd unit runs it
"""
)
def daemon() -> None:
    """This home's node process: the one resident process of a home. It shares
    this machine (`gpumesh share` asks it to), serves the control API on
    $GPUMESH_HOME/control.sock and talks to peers for `run`, `logs`, `jobs` and
    `cancel`, keeping sessions to recently used peers warm. The first command
    that needs it starts it in the background; it exits after
    $GPUMESH_NODE_IDLE seconds without a request (600 by default) unless it
    shares, has jobs that have not ended, or serves TCP (`gpumesh dashboard`).
    `gpumesh daemon run` and `gpumesh-control` run it in the foreground."""


@daemon.command()
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable output.")
def status(as_json: bool) -> None:
    """Whether a node process runs for this home: pid, version, sharing, API addresses,
    the warm sessions it keeps to peers, and the one UDP port and relay registrations
    its outgoing links use."""
    from gpumesh.control.views import DaemonStatusView, NodeProcessView
    from gpumesh.daemon.client import NodeClient, NodeUnavailableError
    from gpumesh.daemon.record import holder

    home = _home()
    view = None
    if holder(home) is not None:
        with contextlib.suppress(NodeUnavailableError):
            view = NodeClient(home).call("GET", "/api/v1/node", NodeProcessView, timeout=10)
    if as_json:
        emit_json(DaemonStatusView(running=view is not None, node=view))
        return
    if view is None:
        click.echo(f"No node process runs for {home}; the next command that needs one starts it.")
        from gpumesh.control.views import ShareEndedView
        from gpumesh.daemon.record import last_share_end

        ended = last_share_end(home)
        if ended is not None:
            click.echo(f"Sharing: {_not_sharing(ShareEndedView(*ended))}")
        return
    where = "background" if view.detached else "foreground"
    idle = view.idle_exit
    click.echo(f"Node process of {home}")
    click.echo(f"  pid       {view.pid} ({where}, up {_ago(view.started_at)})")
    click.echo(f"  version   {view.version}")
    click.echo(f"  sharing   {'yes' if view.sharing else _not_sharing(view.share_ended)}")
    for address in view.api:
        click.echo(f"  api       {address}")
    click.echo(f"  idle exit {'never' if idle is None else f'after {idle:g} s without a request'}")
    warm = view.warm_sessions
    click.echo(f"  warm      {len(warm)} session{'' if len(warm) == 1 else 's'}")
    for session in warm:
        click.echo(
            f"    {session.peer}  {session.path}, {session.uses} requests, idle {session.idle:g} s"
        )
    outgoing = view.outgoing
    if outgoing is not None:
        links = outgoing.links
        where = f"UDP port {outgoing.port}, {links} link{'' if links == 1 else 's'}"
        where = "not open yet" if outgoing.port is None else where
        click.echo(f"  outgoing  {where}")
        for relay in outgoing.relays:
            click.echo(f"    relay {relay.relay}  {relay.state}")


def _not_sharing(ended: ShareEndedView | None) -> str:
    """``no``, and when and how the home's last share ended if it is known."""
    return "no" if ended is None else f"no (the last share ended {_ago(ended.at)} ago: {ended.how})"


def _ago(started: float) -> str:
    from gpumesh.units import format_duration

    return format_duration(max(0.0, time.time() - started))


@daemon.command()
def stop() -> None:
    """Stop this home's node process (the next command that needs one starts it again)."""
    from gpumesh.daemon.client import stop as stop_node

    home = _home()
    pid = stop_node(home)
    if pid is None:
        click.echo(f"No node process runs for {home}.")
    else:
        click.echo(f"Stopped the node process of {home} (pid {pid}).")


@daemon.command(
    epilog="""\b
Examples:
  gpumesh daemon run                   # serve commands; share when `gpumesh share` asks
  gpumesh daemon run --port 47001      # and share from the start, on UDP 47001
"""
)
@share_options
@click.option(
    "--share", is_flag=True, help="Share from the start, with the defaults when no option is given."
)
def run(**flags: object) -> None:
    """Run this home's node process in the foreground (until Ctrl-C or SIGTERM).

    Given share options (or --share), it shares from the start, as
    `gpumesh share` would, and prints what the share says; a share that cannot
    start ends it with that error. This is what the systemd unit of
    `gpumesh share --print-systemd-unit` runs. A node process of this home that
    runs in the background hands over to it; a share it ran goes on here with
    the same options."""
    import asyncio

    from gpumesh.cli._common import get_node, setup_logging
    from gpumesh.cli.share import echo_line, options_of
    from gpumesh.daemon.process import run_node

    sharing = bool(flags.pop("share"))
    options, given = options_of(dict(flags))
    node = get_node()
    node.home.require_initialized()
    setup_logging(node.home.logs_dir, console_level="info")
    asyncio.run(
        run_node(
            node,
            listen=None,
            allow_remote=False,
            hosts=[],
            detached=False,
            announce=click.echo,
            title="gpumesh node process",
            share=options if sharing or given else None,
            echo=echo_line,
        )
    )
