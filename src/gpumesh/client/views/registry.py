"""The shapes of the public registry's commands: ``search`` and ``sync``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from gpumesh.client.discovery import PeerRefresh
    from gpumesh.client.registry import FoundListing, SearchPage

__all__ = ["ListingGpuView", "ListingView", "PeerSyncView", "SearchView", "SyncView"]


class ListingGpuView(msgspec.Struct):
    name: str
    memory_total: int
    """Bytes."""
    memory_free: int
    """Bytes free when the listing was made."""


class ListingView(msgspec.Struct):
    """One listing, its signature checked by this node. It grants nothing: pair first."""

    node_id: str
    name: str
    gpus: list[ListingGpuView]
    idle: bool
    region: str
    contact: str
    """How to reach the owner, as they wrote it (ask them for a pairing code)."""
    version: str
    addresses: list[str]
    published_at: float
    """Unix time the node made the listing."""

    @classmethod
    def of(cls, found: FoundListing) -> ListingView:
        listing = found.listing
        return cls(
            node_id=str(listing.node_id),
            name=listing.name,
            gpus=[ListingGpuView(g.name, g.memory_total, g.memory_free) for g in listing.gpus],
            idle=listing.idle,
            region=listing.region,
            contact=listing.contact,
            version=listing.version,
            addresses=list(listing.addresses),
            published_at=listing.timestamp,
        )


class SearchView(msgspec.Struct):
    """``search --json``: one page of listings and the cursor of the next (empty: none)."""

    listings: list[ListingView]
    next: str

    @classmethod
    def of(cls, page: SearchPage) -> SearchView:
        return cls([ListingView.of(found) for found in page.listings], page.next)


class PeerSyncView(msgspec.Struct):
    """One paired peer after ``sync``."""

    name: str
    node_id: str
    moved: bool
    """A signed address record (from the registry, or handed on by a paired peer)
    named new addresses, now stored."""
    addresses: list[str]
    reachable: bool | None
    """None: not dialled (``--no-dial``)."""
    path: str
    note: str
    found_via: str = ""
    """The paired peer whose answer gave its new addresses; empty: none did (or the
    registry did, with ``moved``)."""
    registry_note: str = ""
    """Why the registry could not be asked for this peer (the start of ``note``);
    empty when it was, or none is configured."""


class SyncView(msgspec.Struct):
    """``sync --json``."""

    registry: str
    """The rendezvous_url used; empty when none is configured."""
    republished_by: int | None
    """Pid of the running ``share`` asked to re-publish; None when none runs."""
    peers: list[PeerSyncView]

    @classmethod
    def of(cls, registry: str, republished: int | None, peers: list[PeerRefresh]) -> SyncView:
        return cls(
            registry,
            republished,
            [
                PeerSyncView(
                    p.name,
                    p.node_id,
                    p.moved,
                    p.addresses,
                    p.reachable,
                    p.path,
                    p.note,
                    p.found_via,
                    p.registry_note,
                )
                for p in peers
            ],
        )
