"""Relaying for peers: a sharing node as the relay between two of its peers, and
its registrations with the peers that relay for it.

With ``relay_for_peers`` on, the share socket serves the relay protocol
(:class:`PeerRelay`: the same sans-I/O core as ``gpumesh-relay``, beside QUIC on
the one socket, told apart by :class:`~gpumesh.transport.routes.Routes`). Only a
key this node has paired and allowed may register, and a session joins two such
keys only; ``relay_for_peers_sessions`` and ``relay_for_peers_rate`` bound them
all together. Each end proves itself to the other inside QUIC, end to end: this
node forwards ciphertext and never looks inside. A deny here (or a pair no longer
allowed) ends the sessions it touches at once, at both ends.

Every sharing node also keeps a serving registration with each allowed peer
whose Welcome said it relays (:class:`FriendRegistrations`), so that its other
peers reach it through that peer when nothing else works.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from gpumesh.identity.keys import Identity, node_id_for
from gpumesh.protocol.addresses import Address, parse_address
from gpumesh.protocol.relaycore import RelayCore, RelayRules
from gpumesh.store.config import Config
from gpumesh.store.home import RelayedSession, Relaying
from gpumesh.store.peers import Peer
from gpumesh.transport.endpoint import QuicEndpoint
from gpumesh.transport.relayclient import RelayClient
from gpumesh.transport.routes import Routes

__all__ = ["FriendRegistrations", "PeerRelay", "peer_rules"]

logger = logging.getLogger(__name__)

TICK = 0.5
"""Seconds between expiry checks of the relay's registrations and sessions."""


def peer_rules(config: Config) -> RelayRules:
    """The rules of a node relaying for its peers: its settings' bounds; no byte or
    time cap on one session (the rate bounds them all)."""
    return RelayRules(
        max_registrations=1024,
        max_sessions_total=config.relay_for_peers_sessions,
        total_rate=config.relay_for_peers_rate,
        session_bytes=0,
        session_seconds=0,
    )


class PeerRelay:
    """The relay this node serves its peers on its share socket."""

    def __init__(
        self,
        endpoint: QuicEndpoint,
        rules: RelayRules,
        may_use: Callable[[bytes], bool],
        name_of: Callable[[str], str],
    ) -> None:
        """``may_use(key)``: the key is a paired peer this node allows; ``name_of``:
        a node id's peer name, for the owner's view."""
        self._endpoint = endpoint
        self._may_use = may_use
        self._name_of = name_of
        self._loop = asyncio.get_running_loop()
        self.core = RelayCore(rules, admit=may_use, may_pair=self.may_pair)
        self._ticks = self._loop.create_task(self._tick(), name="relay for peers")
        self._out: list[tuple[bytes, Address]] = []
        """What to send once the socket's wake-up is handled: one batch, so runs of
        equal packets to one peer leave in one write (GSO)."""

    def may_pair(self, requester: bytes, server: bytes) -> bool:
        """Whether a session may join the two keys: two different peers, both allowed."""
        return requester != server and self._may_use(requester) and self._may_use(server)

    def handle(self, packet: bytes, source: Address, now: float) -> None:
        try:
            out = self.core.handle(packet, source, now)
        except Exception:  # a bug costs one packet, never the share
            logger.exception("relaying for peers: failed on a packet from %s", source)
            return
        self._send(out)

    def forward_run(self, buffer: bytes, segment: int, source: Address) -> bool:
        """A run of Data packets of one session, received at once: accounted as a
        whole and forwarded as it came, when nothing stands in the way."""
        destination = self.core.forward_run(buffer, segment, source, self._loop.time())
        if destination is None:
            return False
        self._send([(buffer[o : o + segment], destination) for o in range(0, len(buffer), segment)])
        return True

    def _send(self, out: list[tuple[bytes, Address]]) -> None:
        if not out:
            return
        if not self._out:
            self._loop.call_soon(self._flush)
        self._out += out

    def _flush(self) -> None:
        out, self._out = self._out, []
        if out:
            self._endpoint.send_raw(out)

    def update(self, rules: RelayRules) -> None:
        """The settings or the allowlist changed: new bounds, and every session or
        registration of a key no longer allowed ends now."""
        now = self._loop.time()
        self.core.rules = rules
        out = self.core.end_pairs(self.may_pair, now)
        for key in self.core.registered_keys():
            if not self._may_use(key):
                logger.info("relaying for peers: %s is no longer allowed", node_id_for(key)[:12])
                out += self.core.drop_key(key, now)
        if out:
            self._endpoint.send_raw(out)

    def state(self) -> Relaying:
        """Who relays through this node now, and how much (``status``, the owner's view)."""
        stats = self.core.stats(self._loop.time())
        rules = self.core.rules
        return Relaying(
            sessions=[
                RelayedSession(
                    self._name_of(entry["a"]),
                    self._name_of(entry["b"]),
                    entry["bytes"],
                    entry["age"],
                    entry["state"],
                )
                for entry in stats["sessions"]
            ],
            registered=sorted(self._name_of(node_id_for(k)) for k in self.core.registered_keys()),
            max_sessions=rules.max_sessions_total,
            rate=rules.total_rate,
            bytes_relayed=stats["bytes_relayed"],
            refusals=stats["refusals"],
        )

    def close(self) -> None:
        self._ticks.cancel()
        out = self.core.shutdown(self._loop.time())
        if out:
            with contextlib.suppress(Exception):
                self._endpoint.send_raw(out)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK)
            out = self.core.tick(self._loop.time())
            if out:
                self._endpoint.send_raw(out)


class FriendRegistrations:
    """This share socket's serving registrations with the peers that relay for it."""

    def __init__(
        self,
        endpoint: QuicEndpoint,
        routes: Routes,
        identity: Identity,
        candidates: Callable[[], list[str]],
        authorize: Callable[[bytes], bool],
    ) -> None:
        self._endpoint = endpoint
        self._routes = routes
        self._identity = identity
        self._candidates = candidates
        self._authorize = authorize
        self.clients: dict[Address, RelayClient] = {}

    def refresh(self, peers: list[Peer]) -> None:
        """Register with each allowed peer that relays (at its last working IPv4
        address), and with no other."""
        wanted: dict[Address, Peer] = {}
        for peer in peers:
            address = _relay_address(peer) if peer.relays and peer.allowed else None
            if address is not None:
                wanted[address] = peer
        for address, client in list(self.clients.items()):
            if address not in wanted or wanted[address].name != client.peer:
                client.close()
                del self.clients[address]
                if self._routes.clients.get(address) is client:
                    del self._routes.clients[address]
        for address, peer in wanted.items():
            if address in self.clients or address in self._routes.clients:
                continue  # registered already (or it is the configured relay too)
            client = RelayClient(
                self._endpoint,
                address,
                f"peer {peer.name}",
                self._identity,
                serving=True,
                candidates=self._candidates,
                authorize=self._authorize,
                peer=peer.name,
            )
            logger.info("registering with %s, which relays for its peers", peer.name)
            self.clients[address] = self._routes.clients[address] = client
            client.start()


def _relay_address(peer: Peer) -> Address | None:
    """Where a peer's share socket was last reached, as an IPv4 literal (the share
    socket is IPv4, and no name is looked up here)."""
    for text in peer.dial_addresses():
        with contextlib.suppress(ValueError):
            host, port = parse_address(text)
            if host.count(".") == 3 and host.replace(".", "").isdigit():
                return host, port
    return None
