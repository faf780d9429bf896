"""Routes of discovery: a search of the public registry, and ``sync`` (re-publish
this node's records, refresh every paired peer's addresses)."""

from __future__ import annotations

import os

import msgspec

from gpumesh.blocking import in_thread
from gpumesh.client.bodies import SearchBody, SyncPeersBody
from gpumesh.client.discovery import refresh_peers
from gpumesh.client.registry import RegistryClient, SearchFilters, registry_url
from gpumesh.client.views.registry import SearchView, SyncView
from gpumesh.control.call import Call
from gpumesh.control.routes.share import sharing_of

__all__ = ["post_search", "post_sync"]


async def post_search(call: Call) -> object:
    """One page of the registry's listings, each signature checked by this node."""
    body: SearchBody = call.body
    url = registry_url(str(call.node.home.config.get("rendezvous_url")))
    filters = SearchFilters(**msgspec.structs.asdict(body))  # the same fields
    page = await in_thread(RegistryClient(url).search, filters)
    return SearchView.of(page)


async def post_sync(call: Call) -> object:
    """Re-publish a running share's records now (with a registry), then refresh every
    paired peer: its signed address record looked up, and dialled unless not asked."""
    body: SyncPeersBody = call.body
    node = call.node
    node.home.require_initialized()
    url = str(node.home.config.get("rendezvous_url")).rstrip("/")
    registry = RegistryClient(url, timeout=body.timeout) if url else None
    republished = None
    if url:
        sharing = sharing_of(call)
        if sharing.active:
            sharing.republish()
            republished = os.getpid()
    results = await refresh_peers(node, registry, timeout=body.timeout, dial=body.dial)
    return SyncView.of(url, republished, results)
