"""``gpumesh dashboard``: the browser's way into this home's node process.

Goes through the home's node process (started in the background when none
runs, as ``gpumesh jobs`` does), asks it to serve the API on TCP at
``$GPUMESH_API_ADDR`` (default 127.0.0.1:8080) when it does not yet, and prints
a one-time sign-in URL (``--open`` also hands it to a browser). A node process
serving TCP no longer exits for being idle: ``gpumesh daemon stop`` ends it.
"""

from __future__ import annotations

import webbrowser
from pathlib import Path
from typing import TYPE_CHECKING

import click

from gpumesh.cli._node import node_enabled, node_home

if TYPE_CHECKING:
    from gpumesh.daemon.client import NodeClient

__all__ = ["dashboard", "login_url"]


def login_url(client: NodeClient, listen: str | None = None) -> str:
    """A one-time sign-in URL from the node process behind ``client``, which is
    asked to serve TCP first (at ``listen``, else its ``$GPUMESH_API_ADDR``)."""
    client.call("POST", "/api/v1/node/tcp", {"listen": listen or ""}, timeout=60)
    answer = client.call("POST", "/api/v1/auth/login-codes", {}, timeout=60)
    return str(answer["url"])


def _running(home: Path) -> NodeClient:
    """The node process that already runs (``$GPUMESH_NODE=off``: none is started)."""
    from gpumesh.daemon.client import NodeClient, NodeUnavailableError
    from gpumesh.errors import AgentError

    client = NodeClient(home)
    try:
        client.call("GET", "/api/v1/node", timeout=10)
    except NodeUnavailableError:
        raise AgentError(
            f"no node process runs for {home} and GPUMESH_NODE=off keeps this command "
            "from starting one: start one with `gpumesh-control`, or unset GPUMESH_NODE"
        ) from None
    return client


@click.command(
    name="dashboard",
    epilog="""\b
Examples:
  gpumesh dashboard                    # prints http://127.0.0.1:8080/#code=...
  gpumesh dashboard --open             # and opens it in a browser
  GPUMESH_API_ADDR=127.0.0.1:9090 gpumesh dashboard
  gpumesh daemon stop                  # stops serving it (the node process ends)
""",
)
@click.option("--open", "open_browser", is_flag=True, help="Open the URL in a browser too.")
def dashboard(open_browser: bool) -> None:
    """Print a one-time URL that signs a browser into this node's dashboard.

    The dashboard is served by this home's node process, started in the
    background when none runs; it is asked to serve TCP at $GPUMESH_API_ADDR
    (default 127.0.0.1:8080, loopback only) when it does not yet, and from then
    on stays until `gpumesh daemon stop`. The code in the URL's fragment is good
    for one sign-in within 5 minutes; the browser keeps an HttpOnly session cookie.
    """
    from gpumesh.settings import ENV_API_ADDR, env

    if node_enabled():
        from gpumesh.cli._node import node_client

        client = node_client()
    else:
        client = _running(node_home())
    url = login_url(client, env(ENV_API_ADDR))
    click.echo(url)
    if open_browser and not webbrowser.open(url):
        click.echo("No browser could be opened here: open the URL above yourself.", err=True)
