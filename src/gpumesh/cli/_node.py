"""The thin CLI's way to this home's node process (:mod:`gpumesh.daemon.client`).

Imports only the standard library and the base floor until a command asks for
the node process; the commands that use it (``run``, ``logs``, ``jobs``,
``cancel``) import this instead of the client layer.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

if TYPE_CHECKING:
    from gpumesh.cli._notes import ViewPrinter
    from gpumesh.client.views.peers import PeerView
    from gpumesh.daemon.client import NodeClient

__all__ = [
    "follow",
    "node_client",
    "node_enabled",
    "node_home",
    "owner_change",
    "owner_client",
    "peer_change",
]


def node_enabled() -> bool:
    """Whether commands go through the node process (``$GPUMESH_NODE`` is not ``off``)."""
    from gpumesh.daemon import enabled

    return enabled()


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
    commands share; ``env_items`` are all ``KEY=VALUE``."""
    from gpumesh.settings import ENV_IMAGE, env

    return {
        "image": image or env(ENV_IMAGE),
        "env": dict(item.split("=", 1) for item in env_items),
        "gpu_memory": gpu_memory,
        "retries": retries,
        "timeout": timeout,
        "mounts": list(mounts),
    }


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


def owner_client() -> NodeClient | None:
    """Where an owner's action on this home goes (``deny``, an owner's cancel, the
    desktop and CUDA shares): its node process, which runs its share and so acts on
    it at once (started when none runs); None when ``$GPUMESH_NODE`` keeps commands
    in this process and no node process holds the home, so nothing shares."""
    from gpumesh.daemon.client import NodeClient
    from gpumesh.daemon.record import holder

    if node_enabled():
        return node_client()
    home = node_home()
    return NodeClient(home) if holder(home) is not None else None


V = TypeVar("V")


def owner_change(
    method: str, path: str, view: type[V], here: Callable[[], V], body: Any = None
) -> V:
    """An owner's change (an allowlist, the desktop or CUDA share): ``method path``
    through the node process (:func:`owner_client`), its answer as ``view``; or
    ``here()`` in this process when no node process runs, so nothing shares."""
    client = owner_client()
    if client is None:
        return here()
    import msgspec

    return msgspec.convert(client.call(method, path, body), view)


def peer_change(peer: str, route: str, change: Callable[[Any, str], Any]) -> PeerView:
    """Put ``peer`` on an allowlist or take it off: ``POST
    /api/v1/peers/{peer}/{route}`` (``deny``, ``desktop/allow``, ``cuda/deny``…)
    through the node process, or ``change(node, peer)`` here (:func:`owner_change`)."""
    from urllib.parse import quote

    from gpumesh.cli._common import get_node
    from gpumesh.client.views.peers import PeerView

    path = f"/api/v1/peers/{quote(peer, safe='')}/{route}"
    return owner_change("POST", path, PeerView, lambda: PeerView.of(change(get_node(), peer)))


RESUME_TRIES = 5
"""Node processes in a row that may die under one follow before it gives up."""


def follow(
    job_id: str, printer: ViewPrinter, *, live: bool = True, after: int = 0
) -> dict[str, Any]:
    """Print a job's events through the node process until the stream ends; the
    job's result (the ``end`` event's view); ``after``: the sequence number of the
    last event already printed. A node process that dies meanwhile is
    replaced, and the follow resumes after the last numbered event it printed, so
    no output is lost or repeated."""
    from urllib.parse import quote

    from gpumesh.daemon.client import NodeUnavailableError
    from gpumesh.errors import error_from_code

    client = node_client()
    failures = 0
    while True:
        path = (
            f"/api/v1/jobs/{quote(job_id, safe='')}/events"
            f"?follow={'true' if live else 'false'}&after={after}"
        )
        try:
            for event in client.events(path):
                if event.event == "end":
                    result: dict[str, Any] = event.data
                    return result
                if event.event == "error":
                    raise error_from_code(str(event.data["code"]), str(event.data["message"]))
                printer.show(event.event, event.data)
                if event.id is not None:
                    after = event.id
                    failures = 0
        except NodeUnavailableError as exc:
            failures += 1
            if failures > RESUME_TRIES:
                from gpumesh.errors import AgentError

                raise AgentError(
                    f"the node process kept failing while following job {job_id} ({exc.detail}): "
                    f"see {node_home() / 'logs' / 'node.log'}"
                ) from None
            client = node_client()
