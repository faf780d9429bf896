"""``gpumesh daemon``: this home's node process (status, stop)."""

from __future__ import annotations

import time
from pathlib import Path

import click

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
"""
)
def daemon() -> None:
    """This home's node process: it serves the control API on
    $GPUMESH_HOME/control.sock and talks to peers for `run`, `logs`, `jobs` and
    `cancel`, keeping sessions to recently used peers warm. The first of those
    commands starts it in the background (it exits after $GPUMESH_NODE_IDLE
    seconds without a request, 600 by default, unless `gpumesh dashboard` made
    it serve TCP); `gpumesh share` and `gpumesh-control` are node processes in
    the foreground."""


@daemon.command()
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable output.")
def status(as_json: bool) -> None:
    """Whether a node process runs for this home: pid, version, sharing, API addresses,
    the warm sessions it keeps to peers, and the one UDP port and relay registrations
    its outgoing links use."""
    import json

    from gpumesh.daemon.client import NodeClient, NodeUnavailableError
    from gpumesh.daemon.record import holder

    home = _home()
    view = None
    if holder(home) is not None:
        try:
            view = NodeClient(home).call("GET", "/api/v1/node", timeout=10)
        except NodeUnavailableError:
            view = None
    if as_json:
        click.echo(json.dumps({"running": view is not None, "node": view}, indent=2))
        return
    if view is None:
        click.echo(f"No node process runs for {home}; the next command that needs one starts it.")
        return
    where = "background" if view["detached"] else "foreground"
    idle = view["idle_exit"]
    click.echo(f"Node process of {home}")
    click.echo(f"  pid       {view['pid']} ({where}, up {_ago(view['started_at'])})")
    click.echo(f"  version   {view['version']}")
    click.echo(f"  sharing   {'yes' if view['sharing'] else 'no'}")
    for address in view["api"]:
        click.echo(f"  api       {address}")
    click.echo(f"  idle exit {'never' if idle is None else f'after {idle:g} s without a request'}")
    warm = view["warm_sessions"]
    click.echo(f"  warm      {len(warm)} session{'' if len(warm) == 1 else 's'}")
    for session in warm:
        click.echo(
            f"    {session['peer']}  {session['path']}, {session['uses']} requests, "
            f"idle {session['idle']:g} s"
        )
    outgoing = view.get("outgoing")
    if outgoing is not None:
        port = outgoing["port"]
        links = outgoing["links"]
        where = f"UDP port {port}, {links} link{'' if links == 1 else 's'}"
        where = "not open yet" if port is None else where
        click.echo(f"  outgoing  {where}")
        for relay in outgoing["relays"]:
            click.echo(f"    relay {relay['relay']}  {relay['state']}")


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
