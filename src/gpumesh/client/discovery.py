"""Finding paired peers again after they moved: ``gpumesh sync``.

With a registry (``rendezvous_url``), each paired peer's address record is
looked up by its id and accepted only when it is signed by the key pinned at
pairing (:meth:`RegistryClient.lookup_addresses` checks that); new addresses
replace the stored hints, the allowed flag untouched. Every peer is then
dialled once, in parallel, so the path that works is remembered for the next
dial. Without a registry only that second step runs.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpumesh.errors import GPUMeshError

if TYPE_CHECKING:
    from gpumesh.client.node import Node
    from gpumesh.client.registry import RegistryClient
    from gpumesh.store.db import Peer

__all__ = ["PeerRefresh", "refresh_peer", "refresh_peers"]


@dataclass(frozen=True)
class PeerRefresh:
    """What ``sync`` learned about one paired peer."""

    name: str
    node_id: str
    moved: bool
    """The registry had a newer signed address record, now stored."""
    addresses: list[str]
    reachable: bool | None
    """None: not dialled."""
    path: str
    note: str
    """Why it is unreachable, or what the registry said (empty when all went well)."""


async def refresh_peer(
    node: Node, peer: Peer, registry: RegistryClient | None, *, timeout: float, dial: bool = True
) -> PeerRefresh:
    moved = False
    notes: list[str] = []
    if registry is not None:
        try:
            record = await registry.alookup_addresses(str(peer.node_id), peer.public_key)
        except GPUMeshError as exc:
            record = None
            notes.append(exc.message)
        if record is not None and (
            sorted(record.addresses) != sorted(peer.addresses)
            or (record.relay and record.relay != peer.relay)
        ):
            node.home.store.save_peer(
                peer.public_key, peer.name, record.addresses, record.relay or peer.relay
            )
            moved = True
    current = node.home.store.peer_by_id(peer.node_id)
    reachable: bool | None = None
    path = ""
    if dial:
        try:
            result = await node.connect(str(peer.node_id), pings=1, timeout=timeout)
        except GPUMeshError as exc:
            reachable = False
            notes.append(exc.message)
        else:
            reachable = True
            path = f"{result.path} {result.address}"
    return PeerRefresh(
        name=peer.name,
        node_id=str(peer.node_id),
        moved=moved,
        addresses=current.addresses,
        reachable=reachable,
        path=path,
        note="; ".join(notes),
    )


async def refresh_peers(
    node: Node, registry: RegistryClient | None, *, timeout: float = 5.0, dial: bool = True
) -> list[PeerRefresh]:
    """Refresh every paired peer at once (each in at most about ``timeout`` seconds)."""
    return list(
        await asyncio.gather(
            *(
                refresh_peer(node, peer, registry, timeout=timeout, dial=dial)
                for peer in node.peers()
            )
        )
    )
