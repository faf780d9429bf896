"""Keeping this node's records fresh in a public registry while it shares.

``share --public`` publishes a signed listing (GPUs, idle or busy, region,
contact) and, with ``announce_addresses`` (implied), an address record for
paired peers; both are refreshed well within the registry's TTL, at once when
asked (``gpumesh sync``), and a signed withdrawal removes the listing when
sharing stops. A registry that is down or refuses is logged and retried: it
never stops the sharing itself.

What the node looks like right now comes from callables the caller passes
(``snapshot``, ``addresses``), so this module never reaches into the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from gpumesh.client.registry import (
    RegistryClient,
    SequenceClock,
    address_record_of,
    listing_of,
    withdrawal_of,
)
from gpumesh.errors import GPUMeshError
from gpumesh.identity.keys import Identity
from gpumesh.protocol.listing import GpuListing
from gpumesh.version import __version__

__all__ = ["Publisher", "Snapshot"]

logger = logging.getLogger(__name__)

RETRY_AFTER = 30.0
"""Seconds before trying again after the registry failed or refused."""


@dataclass(frozen=True)
class Snapshot:
    """The node as a listing shows it."""

    gpus: list[GpuListing]
    idle: bool


@dataclass
class Publisher:
    """Publishes this node's listing and/or address record and keeps them fresh."""

    client: RegistryClient
    identity: Identity
    name: str
    snapshot: Callable[[], Awaitable[Snapshot]]
    addresses: Callable[[], list[str]]
    relay: str = ""
    region: str = ""
    contact: str = ""
    listing: bool = True
    """Publish a GPU listing (``share --public``); False: the address record only."""
    announce: bool = True
    """Publish an address record for paired peers (``announce_addresses``)."""
    show_addresses: bool = False
    """Put this node's public addresses in its listing too (``share --show-addresses``);
    by default a listing carries none."""
    refresh: float | None = None
    """Seconds between refreshes; default a third of the registry's TTL."""
    clock: Callable[[], float] = time.time
    last_error: GPUMeshError | None = None
    published: int = 0
    """Records the registry accepted."""
    _seqs: SequenceClock = field(init=False)
    _wake: asyncio.Event = field(init=False, default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._seqs = SequenceClock(self.clock)

    async def publish_once(self) -> float:
        """Publish every record now; the registry's TTL. Raises what the registry said."""
        ttl = 0.0
        if self.listing:
            now = await self.snapshot()
            record = listing_of(
                self.identity,
                self._seqs.next(),
                name=self.name,
                gpus=now.gpus,
                idle=now.idle,
                region=self.region,
                contact=self.contact,
                version=__version__,
                addresses=self.addresses() if self.show_addresses else None,
            )
            ttl = await self.client.apublish(self.identity, record)
            self.published += 1
        if self.announce:
            record_a = address_record_of(
                self.identity, self._seqs.next(), self.addresses(), self.relay
            )
            ttl = await self.client.apublish(self.identity, record_a)
            self.published += 1
        return ttl

    def refresh_now(self) -> None:
        """Publish again at once (``gpumesh sync`` asks through a signal)."""
        self._wake.set()

    async def run(self, first_wait: float = 0.0) -> None:
        """Publish and refresh until cancelled (after ``first_wait`` seconds, or a
        :meth:`refresh_now`); failures are logged and retried."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), first_wait)
        while True:
            self._wake.clear()
            try:
                ttl = await self.publish_once()
            except GPUMeshError as exc:
                self.last_error = exc
                logger.warning("publishing to %s failed: %s", self.client.url, exc.message)
                wait = RETRY_AFTER
            else:
                self.last_error = None
                wait = self.refresh or max(5.0, ttl / 3 if ttl else 300.0)
                logger.info("published to %s; next refresh in %.0fs", self.client.url, wait)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait)

    async def withdraw(self) -> None:
        """Remove the listing now (a signed withdrawal); the address record just expires."""
        if not self.listing:
            return
        await self.client.apublish(self.identity, withdrawal_of(self.identity, self._seqs.next()))
