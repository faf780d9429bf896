"""``gpumesh share`` and ``gpumesh share stop``: requests to the node process,
which owns sharing (:mod:`gpumesh.daemon.sharing`); ``share`` follows its output."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from gpumesh.cli._common import DURATION, fail, get_node
from gpumesh.errors import ExitCode

if TYPE_CHECKING:
    from gpumesh.client.bodies import ShareOptions
    from gpumesh.control.shareviews import ShareLine, ShareView
    from gpumesh.daemon.client import NodeClient

__all__ = ["echo_line", "options_of", "share", "share_options"]

F = TypeVar("F", bound=Callable[..., Any])


def share_options(command: F) -> F:
    """The options of a share, on ``share`` and ``daemon run``."""
    for option in reversed(
        (
            click.option(
                "--host", help="Address to listen on (config listen_host, default 0.0.0.0)."
            ),
            click.option(
                "--port",
                type=int,
                help="UDP port to listen on (config listen_port, default 47000).",
            ),
            click.option(
                "--max-vram", metavar="SIZE", help="Most GPU memory one job may ask for, e.g. 16GB."
            ),
            click.option(
                "--public",
                is_flag=True,
                help="List this node's GPUs (metadata only) in the registry at rendezvous_url "
                "while sharing; withdrawn when sharing stops. A listing grants nothing.",
            ),
            click.option(
                "--region", metavar="R", help="Region shown in the listing (config region)."
            ),
            click.option(
                "--contact", metavar="TEXT", default="", help="How people reach you, e.g. an email."
            ),
            click.option(
                "--show-addresses",
                is_flag=True,
                help="With --public: put this node's public addresses in the listing (default: "
                "none; paired peers find them through the address record anyway).",
            ),
        )
    ):
        command = option(command)
    return command


def options_of(flags: dict[str, Any]) -> tuple[ShareOptions, bool]:
    """The share options the flags give (checked: a bad value is one line), and
    whether any was given at all."""
    from gpumesh.client.bodies import ShareOptions

    given = any(value not in (None, False, "") for value in flags.values())
    options = ShareOptions(
        host=flags.pop("host"),
        port=flags.pop("port"),
        max_vram=flags.pop("max_vram"),
        public=flags.pop("public"),
        region=flags.pop("region"),
        contact=flags.pop("contact"),
        show_addresses=flags.pop("show_addresses"),
    )
    options.check()
    return options, given


@click.group(
    invoke_without_command=True,
    epilog="""\b
Examples:
  gpumesh share                        # share and follow; Ctrl-C stops sharing
  gpumesh share --detach               # share and return; it goes on in the node process
  gpumesh share --port 47001
  gpumesh share --public --region us-west --contact 'matrix:@alice:example.org'
                                       # also list the GPUs in the registry (rendezvous_url)
  gpumesh share stop                   # stop sharing
  gpumesh share --print-systemd-unit > gpumesh-share.service
                                       # keep sharing across reboots (see the unit's header)
""",
)
@share_options
@click.option(
    "--detach",
    is_flag=True,
    help="Return once sharing has started; it goes on in the node process until "
    "`gpumesh share stop`.",
)
@click.option(
    "--print-systemd-unit",
    "print_unit",
    is_flag=True,
    help="Print a systemd unit that runs this home's node process (`gpumesh daemon run`) "
    "with these options at boot, as this user, and exit.",
)
@click.pass_context
def share(ctx: click.Context, /, detach: bool, print_unit: bool, **flags: Any) -> None:
    """Share this machine with paired, allowed peers.

    Asks this home's node process to share (starting it if none runs) and
    follows what it says: the pairing code, then how it goes. Ctrl-C stops
    sharing; --detach returns and leaves it sharing. While the home already
    shares, `gpumesh share` with no options (or the same ones) follows it, and
    Ctrl-C then only stops following. Peers on the allowlist are served;
    everyone else gets a typed refusal. Sharing needs Linux; macOS and Windows
    machines work as consumers.

    Jobs reach what config job_network says: by default (internet) DNS and the
    internet, never this machine, other containers, link-local or private
    addresses. That takes firewall rules only root installs: as another user,
    share refuses it until you choose job_network none or bridge.
    """
    if ctx.invoked_subcommand is not None:
        return
    from gpumesh.daemon.sharing import require_linux

    require_linux()
    node = get_node()
    node.home.require_initialized()
    options, given = options_of(flags)
    if print_unit:
        _print_unit(node.home.path, options)
        return
    import signal

    from gpumesh.cli._node import node_client

    # A SIGTERM (`kill`, a service manager) ends this command as Ctrl-C does.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    from gpumesh.control.shareviews import ShareView

    client = node_client()
    running = client.call("GET", "/api/v1/share", ShareView, timeout=30)
    started = not running.sharing
    if running.sharing and not given:
        view = running
    else:
        try:
            view = client.call("POST", "/api/v1/share", ShareView, options)
        except KeyboardInterrupt:
            if not started:
                raise
            # Asked while it starts: the node process stops it once it has.
            stopped = _stop(client)
            if stopped is not None:
                _follow(client, node.home.path, stopped, started=True, detach=False, stopping=True)
            return
    _follow(client, node.home.path, view, started=started, detach=detach)


def _stop(client: NodeClient, timeout: float = 60.0) -> ShareView | None:
    """Stop this home's share; the share as it ended, or None when none ran."""
    from gpumesh.control.shareviews import ShareView
    from gpumesh.errors import NotFoundError

    try:
        return client.call("DELETE", "/api/v1/share", ShareView, timeout=timeout)
    except NotFoundError:
        return None


def echo_line(line: ShareLine) -> None:
    """Print one line a share said, in its tone."""
    text = line.text
    if line.tone == "warn":
        text = click.style(text, fg="yellow")
    elif line.tone == "alarm":
        text = click.style(text, fg="red", bold=True)
    click.echo(text, err=line.err)


def _follow(
    client: NodeClient,
    home: Path,
    view: ShareView,
    *,
    started: bool,
    detach: bool,
    stopping: bool = False,
) -> None:
    """Print the share's output from its first line; until it stops, unless ``detach``.
    Ctrl-C stops the share this command ``started``, else only stops following;
    ``stopping``: it was asked to stop already."""
    from gpumesh.control.shareviews import ShareLine, ShareView
    from gpumesh.control.views import NodeProcessView
    from gpumesh.daemon.client import NodeUnavailableError

    output = {"line": ShareLine, "end": ShareView}
    seen = view.first_line - 1
    pid: int | None = 0 if stopping else None
    while True:
        try:
            if pid is None:
                path = f"/api/v1/share/output?after={seen}&follow=false"
                for event in client.events(path, output):
                    if isinstance(event.view, ShareLine):
                        echo_line(event.view)
                        seen = event.view.seq
                pid = client.call("GET", "/api/v1/node", NodeProcessView, timeout=30).pid
                if detach:
                    click.echo(
                        f"Sharing goes on in the node process (pid {pid}); "
                        "`gpumesh share stop` stops it.",
                        err=True,
                    )
                    return
                click.echo(
                    "Press Ctrl-C or run `gpumesh share stop` to stop."
                    if started
                    else "Following this home's share: Ctrl-C stops following, "
                    "`gpumesh share stop` stops sharing.",
                    err=True,
                )
            for event in client.events(f"/api/v1/share/output?after={seen}", output):
                if isinstance(event.view, ShareLine):
                    echo_line(event.view)
                    seen = event.view.seq
                elif isinstance(event.view, ShareView):
                    return
        except KeyboardInterrupt:
            if not started or stopping:
                click.echo(
                    "Stopped following; this home still shares (`gpumesh share stop` stops it).",
                    err=True,
                )
                return
            stopping = True
            _stop(client)
            pid = pid or 0  # the rest of the output is followed, not printed again
        except NodeUnavailableError:
            fail(
                f"the node process (pid {pid}) of {home} ended while sharing; `gpumesh daemon "
                f"status` says how, and {home / 'logs'} has its log",
                ExitCode.FAILED,
            )


def _print_unit(home: Path, options: ShareOptions) -> None:
    import getpass

    from gpumesh.client.service import node_command, systemd_unit

    unit = systemd_unit(
        home.resolve(), user=getpass.getuser(), command=node_command(), extra_args=options.flags()
    )
    click.echo(unit, nl=False)


@share.command()
@click.option(
    "--timeout", type=DURATION, default="60s", show_default=True, help="How long to wait."
)
def stop(timeout: float) -> None:
    """Stop sharing this machine (the node process goes on serving commands)."""
    from gpumesh.cli._node import node_home, running_client

    client = running_client()
    if client is None or _stop(client, timeout) is None:  # what was asked for is so
        click.echo(f"No `gpumesh share` is running for {node_home()}: nothing to stop.")
        return
    from gpumesh.control.views import NodeProcessView

    pid = client.call("GET", "/api/v1/node", NodeProcessView, timeout=30).pid
    click.echo(f"Stopped sharing (node process pid {pid}).")
