"""What a node does with LAN discovery: the keys it announces with, and the dial a
hint leads to.

:class:`LanPeers` gives :class:`~gpumesh.transport.lan.LanDiscovery` the paired,
allowed peers' keys (from each pair's X25519 secret, computed once per key) and
last-known addresses, and hears back which peer announced which address. A hint
is never trusted: the peer is dialled there through the usual authenticated dial
(the pinned key is checked, no relay, no registry), at most once per
:data:`DIAL_GAP` seconds per peer, so a replayed announcement costs at most one
failed dial. Only once the peer's Welcome came is the address stored with the
path ``lan`` (``gpumesh peers`` shows it) and the session kept warm in place of
any other to that peer (a relayed one included): the LAN path is preferred.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from gpumesh.errors import GPUMeshError, IdentityError
from gpumesh.protocol.addresses import parse_address
from gpumesh.protocol.lan import Gate, lan_key
from gpumesh.transport.lan import LanPeer, is_lan_host
from gpumesh.transport.session import open_session

if TYPE_CHECKING:
    from gpumesh.client.node import Node
    from gpumesh.store.peers import Peer

__all__ = ["DIAL_GAP", "LAN_PATH", "LanPeers"]

logger = logging.getLogger(__name__)

LAN_PATH = "lan"
"""The path ``peers`` shows for a peer last reached at the address it announced on
the LAN."""
DIAL_GAP = 10.0
"""Seconds between two dials of the same peer that LAN announcements lead to."""


class LanPeers:
    """The node's side of LAN discovery (needs the node's session pool)."""

    def __init__(
        self, node: Node, *, gap: float = DIAL_GAP, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.node = node
        self._clock = clock
        self._gate = Gate(gap)
        self._secrets: dict[bytes, bytes | None] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.dials = 0
        """LAN dials started (each one a hint that was worth checking)."""

    def peers(self) -> list[LanPeer]:
        """The allowed paired peers: keys both ways and where they were last known.
        (A denied peer is neither told where this node is nor listened to.)"""
        identity = self.node.home.identity
        mine = identity.public_key
        secrets: dict[bytes, bytes | None] = {}
        found = []
        for peer in self.node.home.store.peers():
            if not peer.allowed:
                continue
            if peer.public_key in self._secrets:
                secret = self._secrets[peer.public_key]
            else:
                try:
                    secret = identity.shared_secret(peer.public_key)
                except IdentityError:
                    secret = None
            secrets[peer.public_key] = secret
            if secret is None:
                continue
            found.append(
                LanPeer(
                    str(peer.node_id),
                    send_key=lan_key(secret, mine, peer.public_key),
                    listen_key=lan_key(secret, peer.public_key, mine),
                    hosts=_hosts(peer),
                )
            )
        self._secrets = secrets
        return found

    def heard(self, peer_id: str, address: tuple[str, int]) -> None:
        """``peer_id`` announced ``address`` on the LAN: dial it there unless this
        node already reaches it there."""
        pool = self.node.pool
        if pool is None:
            return
        pool.note_lan(peer_id, address)
        try:
            peer = self.node.home.store.peer_by_id(peer_id)
        except GPUMeshError:
            return  # unpaired meanwhile
        if not peer.allowed:
            return
        text = f"{address[0]}:{address[1]}"
        warm = pool.current(peer_id)
        if warm is not None and warm.session.relayed is None and warm.session.address == address:
            if not warm.session.lan:
                warm.session.lan = True
                self.node.home.store.touch_peer(peer.node_id, address=text, path=LAN_PATH)
            return
        if warm is None and peer.last_address == text and peer.last_path == LAN_PATH:
            return  # known: the next dial goes there first
        if not self._gate.ready(peer_id, self._clock()):
            logger.debug("LAN hint for %s at %s: dialled it lately, not again yet", peer.name, text)
            return
        task = asyncio.ensure_future(self._dial(peer, address))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _dial(self, peer: Peer, address: tuple[str, int]) -> None:
        pool = self.node.pool
        if pool is None:
            return
        self.dials += 1
        text = f"{address[0]}:{address[1]}"
        logger.info("LAN: %s announced %s; dialling it there", peer.name, text)
        home = self.node.home
        try:
            session = await open_session(
                home.identity,
                home.config.node_name,
                [address],
                server_key=peer.public_key,
                timeout=home.config.connect_timeout,
                peer_label=peer.name,
                via=pool.outgoing,
            )
        except (GPUMeshError, OSError) as exc:
            why = exc.message if isinstance(exc, GPUMeshError) else str(exc)
            logger.info("LAN: no session with %s at %s: %s", peer.name, text, why)
            return
        try:
            await session.established()
        except GPUMeshError as exc:
            logger.info("LAN: %s at %s refused or failed: %s", peer.name, text, exc.message)
            session.close()
            return
        session.lan = True
        home.store.touch_peer(peer.node_id, address=text, path=LAN_PATH)
        await pool.adopt(peer, session)
        logger.info("LAN: session with %s at %s", peer.name, text)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _hosts(peer: Peer) -> tuple[str, ...]:
    """The IPv4 hosts of ``peer``'s last-working and paired addresses, re-probed by
    unicast (loopback and the like left out)."""
    hosts: list[str] = []
    for text in peer.dial_addresses():
        with contextlib.suppress(ValueError):
            host = parse_address(text)[0]
            if is_lan_host(host) and host not in hosts:
                hosts.append(host)
    return tuple(hosts)
