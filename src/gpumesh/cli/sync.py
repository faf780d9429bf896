"""``gpumesh sync``: re-publish to the registry now and refresh paired peers' addresses."""

from __future__ import annotations

import os
import signal

import click

from gpumesh.cli._common import emit_json, get_node, run_async


@click.command(
    epilog="""\b
Examples:
  gpumesh sync                  # re-publish now, refresh every paired peer
  gpumesh sync --no-dial        # only look addresses up, dial nobody
  gpumesh sync --json
\b
Peers' addresses come from signed records in the registry (rendezvous_url),
published by nodes with `announce_addresses = true` or `share --public`; a
record is accepted only when signed by the key you paired with.
"""
)
@click.option("--timeout", type=float, default=5.0, show_default=True, help="Seconds per peer.")
@click.option("--no-dial", "no_dial", is_flag=True, help="Do not dial peers to check them.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable output.")
def sync(timeout: float, no_dial: bool, as_json: bool) -> None:
    """Re-publish this node's records now and refresh paired peers' addresses.

    With a registry configured, a running `gpumesh share --public` (or with
    announce_addresses) re-publishes at once, and each paired peer's signed
    address record is looked up; then every peer is dialled to refresh the
    path that works. Without one, only the dialling is done.
    """
    from gpumesh.client.discovery import refresh_peers
    from gpumesh.client.registry import RegistryClient

    node = get_node()
    node.home.require_initialized()
    url = str(node.home.config.get("rendezvous_url")).rstrip("/")
    registry = RegistryClient(url, timeout=timeout) if url else None
    republished = _ask_share_to_republish(node) if url else None
    results = run_async(refresh_peers(node, registry, timeout=timeout, dial=not no_dial))
    if as_json:
        from gpumesh.client.views.registry import SyncView

        emit_json(SyncView.of(url, republished, results))
        return
    if not url:
        click.echo(
            "No registry is configured (rendezvous_url): addresses were only refreshed "
            "by dialling paired peers. Set one with "
            "`gpumesh config set rendezvous_url http://HOST:8080`."
        )
    elif republished is None:
        click.echo(f"Registry {url}: no `gpumesh share` runs here, nothing to re-publish.")
    else:
        click.echo(f"Registry {url}: asked `gpumesh share` (pid {republished}) to re-publish now.")
    if not results:
        click.echo("No paired peers.")
        return
    for result in results:
        if result.reachable is None:
            state = "not dialled"
        elif result.reachable:
            state = f"reachable ({result.path})"
        else:
            state = "unreachable"
        moved = "moved, addresses updated: " if result.moved else ""
        line = f"{result.name}: {moved}{', '.join(result.addresses) or 'no address'}; {state}"
        if result.note:
            line += f" - {result.note}"
        click.echo(line)


def _ask_share_to_republish(node: object) -> int | None:
    """Signal the running `gpumesh share` of this home (SIGUSR1); its pid, or None."""
    from gpumesh.client.node import Node

    assert isinstance(node, Node)
    running = node.home.read_agent_info()
    if running is None:
        return None
    try:
        os.kill(running.pid, signal.SIGUSR1)
    except (ProcessLookupError, PermissionError):
        return None
    return running.pid
