"""The thin CLI's way to this home's node process (:mod:`gpumesh.daemon.client`).

Imports only the standard library and the base floor until a command asks for
the node process. The commands that talk to peers through it (``run``,
``logs``, ``jobs``, ``cancel``, ``cp``, ``exec``, ``app``, ``connect``,
``pair``, ``pair-code``, ``peers``, ``dashboard``; ``status`` for its job
refresh) and the owner's actions
(``allow``, ``deny``, the desktop and CUDA shares and allowlists) import this
instead of the client layer, which runs in the node process.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from gpumesh.cli._complete import complete_peer

if TYPE_CHECKING:
    from gpumesh.cli._notes import ViewPrinter
    from gpumesh.client.views.jobs import JobResultView
    from gpumesh.client.views.peers import PeerView
    from gpumesh.daemon.client import NodeClient

__all__ = [
    "env_of",
    "follow",
    "node_client",
    "node_home",
    "peer_change",
    "peer_option",
    "running_client",
]


def peer_option(help: str, **attrs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--peer``, as the commands that name a provider take it: from $GPUMESH_PEER
    too, completed with paired peers' names; ``attrs``: ``required``, ``default``."""
    return click.option(
        "--peer",
        envvar="GPUMESH_PEER",
        show_envvar=True,
        shell_complete=complete_peer,
        help=help,
        **attrs,
    )


def job_options(
    image: str | None,
    env_items: tuple[str, ...],
    gpu_memory: str | None,
    retries: int | None,
    timeout: str | None,
    mounts: tuple[str, ...],
) -> dict[str, Any]:
    """A job's options, as keyword arguments of the bodies of ``run`` and ``app run``
    (:class:`~gpumesh.client.bodies.JobBody`, ``AppRunBody``), from the flags both
    commands share (``env_items`` as :func:`env_of` reads them)."""
    from gpumesh.settings import ENV_IMAGE, env

    return {
        "image": image or env(ENV_IMAGE),
        "env": env_of(env_items),
        "gpu_memory": gpu_memory,
        "retries": retries,
        "timeout": timeout,
        "mounts": list(mounts),
    }


def env_of(env_items: tuple[str, ...]) -> dict[str, str]:
    """``--env KEY=VALUE`` items as a mapping (the node process checks keys and
    values); an item without ``=`` raises the job spec's error that names it."""
    if not all("=" in item for item in env_items):
        from gpumesh.client.jobspec import parse_env

        parse_env(env_items)
    return dict(item.split("=", 1) for item in env_items)


def node_home() -> Path:
    """The home of ``--home`` / ``$GPUMESH_HOME``, refused when not initialised (as
    the in-process commands refuse it)."""
    from gpumesh.errors import NotInitializedError
    from gpumesh.settings import home_dir
    from gpumesh.store.trust import check_home

    home = home_dir(click.get_current_context().find_root().obj)
    check_home(home)  # another user's folder must not answer for this node
    if not (home / "identity.key").exists():
        raise NotInitializedError(
            f"no GPUMesh node in {home}: run `gpumesh init --name NAME` first "
            "(or set GPUMESH_HOME to your node's folder)"
        )
    return home


def node_client() -> NodeClient:
    """A client of this home's node process, started when none runs."""
    from gpumesh.daemon.client import connect

    return connect(node_home())


def running_client() -> NodeClient | None:
    """A client of this home's node process when one runs; None (nothing started)
    when none does."""
    from gpumesh.daemon.client import NodeClient
    from gpumesh.daemon.record import holder

    home = node_home()
    return NodeClient(home) if holder(home) is not None else None


def peer_change(peer: str, route: str, as_json: bool, said: Callable[[PeerView], str]) -> None:
    """Put ``peer`` on an allowlist or take it off: ``POST
    /api/v1/peers/{peer}/{route}`` (``deny``, ``desktop/allow``, ``cuda/deny``…)
    through the node process, which runs this home's share and so acts on it at
    once. Prints the peer's view as JSON, or the line ``said`` makes of it."""
    from urllib.parse import quote

    from gpumesh.client.views import to_json
    from gpumesh.client.views.peers import PeerView

    path = f"/api/v1/peers/{quote(peer, safe='')}/{route}"
    record = node_client().call("POST", path, PeerView)
    click.echo(to_json(record) if as_json else said(record))


def follow(
    job_id: str, printer: ViewPrinter, *, live: bool = True, after: int = 0
) -> JobResultView:
    """Print a job's events through the node process until the stream ends; the
    job's result (the ``end`` event's view); ``after``: the sequence number of the
    last event already printed. A node process that dies meanwhile is
    replaced, and the follow resumes after the last numbered event it printed, so
    no output is lost or repeated (:func:`~gpumesh.daemon.client.job_events`)."""
    from gpumesh.daemon.client import job_events

    log = str(node_home() / "logs" / "node.log")
    events = job_events(node_client, job_id, log, live=live, after=after)
    while True:
        try:
            event = next(events)
        except StopIteration as end:
            result: JobResultView = end.value
            return result
        printer.show(event.view)
