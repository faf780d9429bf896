"""What a share does for the public registry: start, report, withdraw.

Wires the agent's view of its GPUs and jobs into a
:class:`~gpumesh.client.publishing.Publisher` and says one line per outcome
(the share's output). ``POST /api/v1/share/publish`` (``gpumesh sync``) asks
for a refresh now.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from gpumesh.client.publishing import Publisher, Snapshot
from gpumesh.client.registry import RegistryClient, registry_url
from gpumesh.errors import GPUMeshError
from gpumesh.protocol.listing import GpuListing

SIMULATED_MARK = "(SIMULATED) "
"""Before each GPU's name in the listing of a node whose GPUs are simulated."""

if TYPE_CHECKING:
    from gpumesh.client.bodies import ShareOptions

__all__ = ["Publishing", "check", "start"]


class Say(Protocol):
    def __call__(self, text: str, *, err: bool = False, tone: str = "") -> None: ...


WITHDRAW_TIMEOUT = 5.0


@dataclass
class Publishing:
    publisher: Publisher
    task: asyncio.Task[None]
    say: Say

    async def stop(self) -> None:
        """Stop refreshing and withdraw the listing (signed), saying how it went."""
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        if not self.publisher.listing:
            return
        url = self.publisher.client.url
        try:
            async with asyncio.timeout(WITHDRAW_TIMEOUT):
                await self.publisher.withdraw()
        except (GPUMeshError, TimeoutError) as exc:
            why = exc.message if isinstance(exc, GPUMeshError) else "no answer"
            self.say(
                f"  could not withdraw the listing from {url} ({why}); it expires by itself",
                err=True,
                tone="warn",
            )
            return
        self.say(f"Withdrew the public listing from {url}.", err=True)


def check(config: Any, public: bool) -> None:
    """Refuse ``--public`` without a registry, before sharing starts (announce_addresses
    alone needs none: paired peers then hand this node's record on). The listing's
    own flags without ``--public`` are refused by :meth:`ShareOptions.check`."""
    if public:
        registry_url(str(config.get("rendezvous_url")))


async def start(node: Any, agent: Any, options: ShareOptions, say: Say) -> Publishing | None:
    """Publish now and keep refreshing; None when this node publishes nothing."""
    public = options.public
    config = node.home.config
    announce = public or bool(config.get("announce_addresses"))
    if announce and not public and not str(config.get("rendezvous_url")):
        say("  no rendezvous_url: paired peers hand this node's addresses on (`sync`)")
        announce = False
    if not announce:
        return None
    url = registry_url(str(config.get("rendezvous_url")))

    async def snapshot() -> Snapshot:
        reports, source = await agent.gpus.report()
        # Simulated GPUs (a test setting) say so in public too, in the name, which
        # every registry and searcher shows as it is.
        mark = SIMULATED_MARK if source == "simulated" else ""
        gpus = [
            GpuListing((mark + r.name)[:96], r.memory_total, min(r.available, r.memory_total))
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
        region=options.region if options.region is not None else str(config.get("region")),
        contact=options.contact,
        listing=public,
        announce=True,
        show_addresses=options.show_addresses,
    )
    what = "listed publicly" if public else "address record published"
    try:
        ttl = await publisher.publish_once()
    except GPUMeshError as exc:
        say(f"  registry {url}: not published ({exc.message}); retrying", err=True, tone="warn")
        first_wait = 30.0
    else:
        first_wait = max(5.0, ttl / 3)
        where = f" in region {publisher.region}" if public and publisher.region else ""
        if options.show_addresses:
            where += f", with its addresses ({', '.join(node.advertised_addresses()) or 'none'})"
        say(f"  registry {url}: {what}{where}, refreshed every {first_wait / 60:.0f} min")
        if public:
            say("  a listing grants nothing: people still pair with you before they run")
    return Publishing(publisher, asyncio.create_task(publisher.run(first_wait)), say)
