"""``gpumesh dashboard``: the browser's way into this home's control server.

Asks the control server of this home, over its owner-only unix socket, for a
one-time login URL and prints it (``--open`` also hands it to a browser). It
starts nothing: with no control server, or one that serves no TCP, it says in
one line what to run.
"""

from __future__ import annotations

import http.client
import json
import socket
import webbrowser
from pathlib import Path

import click

from gpumesh.cli._common import get_node
from gpumesh.errors import AgentError, GPUMeshError
from gpumesh.store.sockets import socket_name

__all__ = ["dashboard", "login_url"]

_SOCKET = "control.sock"
_START = "start it with `gpumesh-control` (it serves the dashboard on 127.0.0.1:8080)"


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, home: Path, timeout: float) -> None:
        super().__init__("gpumesh", timeout=timeout)
        self._home = home

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            with socket_name(self._home, _SOCKET) as name:
                sock.connect(name)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def login_url(home: Path, *, timeout: float = 10.0) -> str:
    """A one-time dashboard login URL from ``home``'s running control server."""
    if not (home / _SOCKET).is_socket():
        raise AgentError(f"no control server runs for {home}: {_START}")
    conn = _UnixConnection(home, timeout)
    try:
        conn.request("POST", "/api/v1/auth/login-codes", body=b"{}",
                     headers={"content-type": "application/json"})  # fmt: skip
        response = conn.getresponse()
        body = response.read()
    except OSError:
        raise AgentError(f"the control server of {home} does not answer: {_START}") from None
    finally:
        conn.close()
    try:
        data = json.loads(body)
    except ValueError:
        raise AgentError(f"the control server of {home} sent no JSON: {_START}") from None
    if response.status != 200:
        message = data.get("message", f"HTTP {response.status}")
        if "TCP" in message:
            message += " (run `gpumesh-control` without --no-tcp)"
        raise GPUMeshError(f"the control server refused a login URL: {message}")
    return str(data["url"])


@click.command(
    name="dashboard",
    epilog="""\b
Examples:
  gpumesh-control &                    # serves the dashboard on 127.0.0.1:8080
  gpumesh dashboard                    # prints http://127.0.0.1:8080/#code=...
  gpumesh dashboard --open             # and opens it in a browser
""",
)
@click.option("--open", "open_browser", is_flag=True, help="Open the URL in a browser too.")
def dashboard(open_browser: bool) -> None:
    """Print a one-time URL that signs a browser into this node's dashboard.

    The code in the URL's fragment is good for one sign-in within 5 minutes;
    the browser keeps an HttpOnly session cookie. The dashboard is served by
    this home's running control server (`gpumesh-control`).
    """
    node = get_node()
    url = login_url(node.home.path)
    click.echo(url)
    if open_browser and not webbrowser.open(url):
        click.echo("No browser could be opened here: open the URL above yourself.", err=True)
