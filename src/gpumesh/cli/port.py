"""``gpumesh port``: a running job's ports on this machine's loopback until Ctrl-C."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from gpumesh.cli._common import emit_json

if TYPE_CHECKING:
    from gpumesh.client.views.ports import PortsView
    from gpumesh.daemon.client import Pending


@click.command(
    short_help="Reach a running job's ports on 127.0.0.1 until Ctrl-C.",
    epilog="""\b
Examples:
  gpumesh port 3f9c2a1b 8888              # 127.0.0.1:8888 -> port 8888 in the job
  gpumesh port 3f9c2a1b 8080:80 6006      # several at once
  gpumesh run --peer alice-pc --port 8888 -- jupyter lab --ip 0.0.0.0
                                          # the same while `run` follows the job
\b
Only jobs submitted from this node; only this user's programs may connect (Linux).
Nothing of the provider's host or its other containers is reachable.
""",
)
@click.argument("job_id", metavar="JOB")
@click.argument("ports", nargs=-1, required=True, metavar="[LOCAL:]CONTAINER...")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print where it listens as JSON, then one line of JSON per port as it first "
    "answers in the container.",
)
def port(job_id: str, ports: tuple[str, ...], as_json: bool) -> None:
    """Forward PORTS of the running job JOB (an id or a unique prefix) to 127.0.0.1
    here until Ctrl-C or the job ends: 127.0.0.1:LOCAL reaches CONTAINER inside the
    job's container. HTTP, WebSocket and any other TCP protocol pass."""
    from urllib.parse import quote

    from gpumesh.cli._node import node_client
    from gpumesh.client.bodies import PortsBody
    from gpumesh.protocol.ports import parse_ports

    parse_ports(list(ports))  # a usage error before anything is asked
    answer = node_client().send(
        "POST", f"/api/v1/jobs/{quote(job_id, safe='')}/ports", PortsBody(ports=list(ports))
    )
    try:
        print_forward_events(answer, as_json=as_json)
    except KeyboardInterrupt:
        click.echo("Forwarding ended.", err=True)


def print_forward_events(answer: Pending, *, as_json: bool = False, quiet: bool = False) -> None:
    """Print a forward's events until it ends: where it listens (unless ``quiet``, as
    ``run`` says nothing until a port answers), each port once it answers, refusals."""
    import json

    import msgspec

    from gpumesh.client.views.ports import (
        PORT_EVENTS,
        PortAnswersView,
        PortRefusedView,
        PortsView,
        PortWarningView,
    )

    for event in answer.events(PORT_EVENTS):
        view = event.view
        if isinstance(view, PortsView):
            if as_json:
                emit_json(view)
            elif not quiet:
                _print_ready(view)
        elif isinstance(view, PortAnswersView):
            if as_json:  # one compact line each: a script reads them as they come
                click.echo(json.dumps(msgspec.to_builtins(view)))
            else:
                click.echo(
                    f"gpumesh: {view.url} reaches port {view.container} of the job", err=True
                )
        elif isinstance(view, PortRefusedView):
            who = f"uid {view.uid}" if view.uid is not None else "an unknown user"
            click.echo(f"gpumesh: refused a connection from {who}: not this user", err=True)
        elif isinstance(view, PortWarningView):
            click.echo(f"gpumesh: {view.message}", err=True)


def _print_ready(ready: PortsView) -> None:
    for forward in ready.ports:
        state = "" if forward.listening else " (nothing listens there yet)"
        click.echo(
            f"127.0.0.1:{forward.local} -> port {forward.container} of job "
            f"{ready.job_id} on {ready.provider}{state}"
        )
    if not ready.owner_checked:
        click.echo(
            "note: this system cannot tell which user opens a local connection, so other "
            "accounts on this machine could use these ports while they are forwarded",
            err=True,
        )
    click.echo("Ctrl-C ends it.", err=True)
