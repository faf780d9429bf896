"""``gpumesh dashboard``: the browser's way into this home's node process.

Goes through the home's node process (started in the background when none
runs, as ``gpumesh jobs`` does), asks it to serve the API on TCP at
``$GPUMESH_API_ADDR`` (default 127.0.0.1:8080) when it does not yet, and prints
a one-time sign-in URL at the home's own ``<random>.localhost`` name.

``--open`` never puts that URL on a browser's command line, which every local
user can read in ``/proc``: the browser is handed a file in the home, readable
by the owner alone, that sends it on to the URL (as Jupyter does). A browser
packaged as a snap or a flatpak cannot read the home's hidden folder; then the
URL is printed for the owner to open, with why. A node process serving TCP no
longer exits for being idle: ``gpumesh daemon stop`` ends it.
"""

from __future__ import annotations

import contextlib
import html
import os
import shutil
import subprocess
import webbrowser
from pathlib import Path
from typing import TYPE_CHECKING

import click

from gpumesh.cli._node import node_home
from gpumesh.settings import ENV_API_ADDR, ENV_API_TOKEN, env

if TYPE_CHECKING:
    from gpumesh.daemon.client import NodeClient

__all__ = [
    "OPEN_FILE",
    "dashboard",
    "desktop_packaging",
    "login_url",
    "redirect_page",
    "sandboxed_browser",
]

OPEN_FILE = "dashboard-login.html"
"""The home's 0600 page that sends a browser on to a fresh sign-in URL."""
_SANDBOXED = ("/snap/", "/var/lib/snapd/", "/var/lib/flatpak/", "/.local/share/flatpak/")
"""Where snap and flatpak packages and their launchers live."""
_LAUNCHER_MARKS = (b"/snap/bin/", b"snap run", b"flatpak run")
"""What a wrapper script (Ubuntu's ``/usr/bin/firefox``) runs a sandboxed browser with."""
_OPENERS = frozenset({"xdg-open", "gio", "gvfs-open", "kde-open", "kde-open5", "exo-open"})
"""Programs that open the desktop's default browser, which ``xdg-settings`` names."""
_FLATPAK_APPS = (
    "/var/lib/flatpak/exports/share/applications",
    "~/.local/share/flatpak/exports/share/applications",
)
"""Where flatpak puts its apps' desktop files."""


def login_url(client: NodeClient, listen: str | None = None) -> tuple[str, str]:
    """A one-time sign-in URL from the node process behind ``client``, which is
    asked to serve TCP first (at ``listen``, else its ``$GPUMESH_API_ADDR``); and
    one line saying what serves it, until when."""
    from gpumesh.client.bodies import TcpBody
    from gpumesh.client.views.node import LoginCodeView
    from gpumesh.control.views import NodeProcessView

    body = TcpBody(listen=listen or "")
    process = client.call("POST", "/api/v1/node/tcp", NodeProcessView, body, timeout=60)
    answer = client.call("POST", "/api/v1/auth/login-codes", LoginCodeView, timeout=60)
    tcp = [address for address in process.api if address.startswith("http")]
    where = f" on {tcp[-1].split('://', 1)[1]}" if tcp else ""
    until = " until `gpumesh daemon stop`" if process.detached else ""
    how = "" if process.detached else ", in the foreground"
    served = f"The node process (pid {process.pid}{how}) serves the dashboard{where}{until}."
    return answer.url, served


def redirect_page(url: str) -> str:
    """A page that sends a browser on to ``url`` at once (no script: a file page
    may have scripts turned off), with a link for one that does not follow."""
    target = html.escape(url, quote=True)
    return (
        '<!doctype html>\n<html><head><meta charset="utf-8">\n'
        f'<meta http-equiv="refresh" content="0;url={target}">\n'
        "<title>GPUMesh dashboard</title></head>\n"
        f'<body><p><a href="{target}">Open the GPUMesh dashboard</a></p></body></html>\n'
    )


def sandboxed_browser(command: str) -> str | None:
    """``command``'s packaging when it is a snap or a flatpak (which cannot read a
    hidden folder of the home), else None. ``command`` is a browser's program, as
    :mod:`webbrowser` or ``$BROWSER`` names it."""
    found = shutil.which(command)
    if found is None:
        return None
    for path in (found, os.path.realpath(found)):
        if any(mark in path for mark in _SANDBOXED):
            return "flatpak" if "flatpak" in path else "snap"
    try:
        with open(found, "rb") as script:
            head = script.read(4096)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    marks = (mark for mark in _LAUNCHER_MARKS if mark in head)
    return next(("flatpak" if b"flatpak" in mark else "snap" for mark in marks), None)


def desktop_packaging(desktop_id: str) -> str | None:
    """A default browser's packaging from its desktop file's name: snapd names
    them ``SNAP_APP.desktop``; flatpak exports them to its own folders."""
    if "/" in desktop_id or not desktop_id.endswith(".desktop"):
        return None
    if any((Path(folder).expanduser() / desktop_id).exists() for folder in _FLATPAK_APPS):
        return "flatpak"
    stem = desktop_id.removesuffix(".desktop")
    return "snap" if "_" in stem and "." not in stem else None


def _default_browser() -> str | None:
    """The desktop file of the desktop's default browser (what an opener such as
    ``xdg-open`` starts), when ``xdg-settings`` can tell."""
    try:
        answer = subprocess.run(
            ["xdg-settings", "get", "default-web-browser"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return answer.stdout.strip() or None if answer.returncode == 0 else None


def _write_open_file(home: Path, url: str) -> Path:
    """The home's :data:`OPEN_FILE`, made anew for ``url``, 0600: whatever stood at
    its name (a link included) is removed, and ``O_EXCL`` never follows one."""
    path = home / OPEN_FILE
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(redirect_page(url))
    return path


def _browser_program() -> str | None:
    """The program :mod:`webbrowser` would run, when it names one."""
    try:
        controller = webbrowser.get()
    except webbrowser.Error:
        return None
    name = getattr(controller, "name", None)
    return name if isinstance(name, str) and name else None


def _open(home: Path, url: str) -> None:
    """Hand the browser a file that signs in, or say why the owner must open ``url``."""
    program = _browser_program()
    browser, packaging = program, sandboxed_browser(program) if program else None
    if program is not None and packaging is None and Path(program).name in _OPENERS:
        browser = _default_browser()
        packaging = desktop_packaging(browser) if browser else None
    if packaging is not None:
        click.echo(
            f"The browser {browser} is a {packaging} package and cannot read {home}: "
            "open the URL above in it yourself (it signs in once, within 5 minutes).",
            err=True,
        )
        return
    page = _write_open_file(home, url)
    # The browser needs none of our secrets in its environment either.
    os.environ.pop(ENV_API_TOKEN, None)
    if not webbrowser.open(page.as_uri()):
        click.echo("No browser could be opened here: open the URL above yourself.", err=True)


@click.command(
    name="dashboard",
    epilog="""\b
Examples:
  gpumesh dashboard                    # prints http://<name>.localhost:8080/#code=...
  gpumesh dashboard --open             # and opens it in a browser
  BROWSER=chromium gpumesh dashboard --open
  GPUMESH_API_ADDR=127.0.0.1:9090 gpumesh dashboard
  gpumesh daemon stop                  # stops serving it (the node process ends)
""",
)
@click.option(
    "--open",
    "open_browser",
    is_flag=True,
    help="Open it in a browser too ($BROWSER, else the system's), through a page in the "
    "home only you can read; never with the code on the browser's command line.",
)
def dashboard(open_browser: bool) -> None:
    """Print a one-time URL that signs a browser into this node's dashboard.

    The dashboard is served by this home's node process, started in the
    background when none runs; it is asked to serve TCP at $GPUMESH_API_ADDR
    (default 127.0.0.1:8080, loopback only) when it does not yet, and from then
    on stays until `gpumesh daemon stop`. The URL's host is this home's own
    secret name under .localhost (browsers resolve it to loopback): the session
    cookie counts there alone, so no other server on this machine can use it.
    The code in the URL's fragment is good for one sign-in within 5 minutes.
    """
    from gpumesh.daemon.client import connect

    home = node_home()
    url, served = login_url(connect(home), env(ENV_API_ADDR))
    click.echo(url)
    click.echo(served, err=True)
    if open_browser:
        _open(home, url)
