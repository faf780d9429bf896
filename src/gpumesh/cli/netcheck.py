"""``gpumesh netcheck``"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from gpumesh.cli._common import emit_json, get_node, run_async
from gpumesh.errors import ExitCode, GPUMeshError

if TYPE_CHECKING:
    from gpumesh.client.checks import Check

_STATE = {"ok": "[green]ok[/green]", "warn": "[yellow]warn[/yellow]", "fail": "[red]fail[/red]"}

EPILOG = """\b
Examples:
  gpumesh netcheck
  gpumesh netcheck --json
  gpumesh netcheck --relay relay.example.org:4799
  HTTPS_PROXY=http://proxy.example.org:3128 gpumesh netcheck
\b
Exit codes: 0 when the relay answers over UDP or TCP (a row may still warn
or fail), 4 when it answers over neither, 2 when no relay is set or its
address is invalid."""


@click.command(epilog=EPILOG)
@click.option(
    "--relay",
    metavar="HOST[:PORT]",
    help="Check this relay instead of the one set (`gpumesh config get relay`).",
)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable output.")
def netcheck(relay: str | None, as_json: bool) -> None:
    """Check the network between this machine and its relay.

    One row each: UDP to the relay (round trip), the NAT (this machine's public
    address; whether the NAT maps by destination, which stops hole punching),
    whether unsolicited packets get in, the path MTU towards the relay, and
    the relay over TCP (`relay_tcp`, through HTTPS_PROXY when set). Runs here,
    from sockets of its own, in a few seconds; a running node process is asked
    what its relay registration is (none is started).
    """
    from gpumesh.client.netcheck import netcheck as check
    from gpumesh.client.netcheck import relay_settings, with_node
    from gpumesh.client.views.node import NetcheckView
    from gpumesh.transport.relaytcp import proxy_from_environment

    node = get_node()
    relay_set, relay_tcp = relay_settings(node.home.config)
    proxy = proxy_from_environment()
    result = run_async(
        check(relay if relay is not None else relay_set, relay_tcp=relay_tcp, proxy=proxy)
    )
    if node.home.initialized:
        result = with_node(result, _node_relay())
    if as_json:
        emit_json(NetcheckView.of(result))
    else:
        _print(result.checks)
    if not result.reachable:
        raise SystemExit(ExitCode.USAGE if result.setting_error else ExitCode.UNREACHABLE)


def _node_relay() -> str | None:
    """What this home's node process says of its relay, when one runs (never started)."""
    from gpumesh.cli._node import running_client
    from gpumesh.client.views.node import StatusView

    client = running_client()
    if client is None:
        return None
    try:
        status = client.call("GET", "/api/v1/status?offline=true", StatusView, timeout=10)
    except GPUMeshError:  # it stopped meanwhile, or is busy: nothing to say of it
        return None
    return status.relay_state


def _print(checks: list[Check]) -> None:
    from gpumesh.cli._table import Column, escape, print_table

    columns = [Column("CHECK"), Column("STATE"), Column("DETAIL", below=True)]
    rows = [[c.name, _STATE[c.status], escape(c.detail)] for c in checks]
    if any(c.fix for c in checks):  # a column of fixes only when there is one
        columns.append(Column("FIX", below=True, named_below=True))
        for row, check in zip(rows, checks, strict=True):
            row.append(escape(check.fix))
    print_table(columns, rows)
