"""What ``gpumesh share`` does for the public registry: start, report, withdraw.

Kept apart from ``share.py``: it wires the agent's view of its GPUs and jobs
into a :class:`~gpumesh.client.publishing.Publisher` and prints one line per
outcome. ``SIGUSR1`` (sent by ``gpumesh sync``) asks for a refresh now.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from dataclasses import dataclass
from typing import Any

import click

from gpumesh.client.publishing import Publisher, Snapshot
from gpumesh.client.registry import RegistryClient, registry_url
from gpumesh.errors import ConfigError, GPUMeshError
from gpumesh.protocol.listing import GpuListing

__all__ = ["Publishing", "check", "start"]

WITHDRAW_TIMEOUT = 5.0


@dataclass
class Publishing:
    publisher: Publisher
    task: asyncio.Task[None]

    async def stop(self) -> None:
        """Stop refreshing and withdraw the listing (signed), saying how it went."""
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        with contextlib.suppress(NotImplementedError, RuntimeError):
            asyncio.get_running_loop().remove_signal_handler(signal.SIGUSR1)
        if not self.publisher.listing:
            return
        url = self.publisher.client.url
        try:
            async with asyncio.timeout(WITHDRAW_TIMEOUT):
                await self.publisher.withdraw()
        except (GPUMeshError, TimeoutError) as exc:
            why = exc.message if isinstance(exc, GPUMeshError) else "no answer"
            click.echo(
                click.style(
                    f"  could not withdraw the listing from {url} ({why}); it expires by itself",
                    fg="yellow",
                ),
                err=True,
            )
            return
        click.echo(f"Withdrew the public listing from {url}.", err=True)


def check(config: Any, public: bool, show_addresses: bool = False) -> None:
    """Refuse ``--public`` without a registry, before sharing starts (announce_addresses
    alone needs none: paired peers then hand this node's record on), and
    ``--show-addresses`` without ``--public``."""
    if show_addresses and not public:
        raise ConfigError(
            "--show-addresses puts addresses in the public listing: use it with --public"
        )
    if public:
        registry_url(str(config.get("rendezvous_url")))


async def start(
    node: Any,
    agent: Any,
    *,
    public: bool,
    region: str | None,
    contact: str,
    show_addresses: bool = False,
) -> Publishing | None:
    """Publish now and keep refreshing; None when this node publishes nothing."""
    config = node.home.config
    announce = public or config.get("announce_addresses") == "true"
    if announce and not public and not str(config.get("rendezvous_url")):
        click.echo("  no rendezvous_url: paired peers hand this node's addresses on (`sync`)")
        announce = False
    if not announce:
        # `gpumesh sync` signals every running share: one that publishes nothing
        # must not die of SIGUSR1's default action.
        with contextlib.suppress(NotImplementedError, RuntimeError):
            asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, lambda: None)
        return None
    url = registry_url(str(config.get("rendezvous_url")))

    async def snapshot() -> Snapshot:
        reports, _source = await agent.gpus.report()
        gpus = [
            GpuListing(r.name[:96], r.memory_total, min(r.available, r.memory_total))
            for r in reports
        ]
        return Snapshot(gpus=gpus, idle=not agent.store.unfinished_hosted_jobs())

    publisher = Publisher(
        client=RegistryClient(url),
        identity=node.home.identity,
        name=config.node_name,
        snapshot=snapshot,
        addresses=node.advertised_addresses,
        relay=config.relay,
        region=region if region is not None else str(config.get("region")),
        contact=contact,
        listing=public,
        announce=True,
        show_addresses=show_addresses,
    )
    what = "listed publicly" if public else "address record published"
    try:
        ttl = await publisher.publish_once()
    except GPUMeshError as exc:
        click.echo(
            click.style(f"  registry {url}: not published ({exc.message}); retrying", fg="yellow"),
            err=True,
        )
        first_wait = 30.0
    else:
        first_wait = max(5.0, ttl / 3)
        where = f" in region {publisher.region}" if public and publisher.region else ""
        if show_addresses:
            where += f", with its addresses ({', '.join(node.advertised_addresses()) or 'none'})"
        click.echo(f"  registry {url}: {what}{where}, refreshed every {first_wait / 60:.0f} min")
        if public:
            click.echo("  a listing grants nothing: people still pair with you before they run")

    with contextlib.suppress(NotImplementedError, RuntimeError):
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, publisher.refresh_now)
    return Publishing(publisher, asyncio.create_task(publisher.run(first_wait)))
