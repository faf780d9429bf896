"""Every other user of an endpoint's socket, as its one
:class:`~gpumesh.transport.endpoint.PacketRoute`.

A node's socket carries, beside QUIC, the relay protocol three ways: as a client
of each relay it registers with (a ``gpumesh-relay``, or a peer that relays for
its peers), in punching probes between nodes, and, on a node that relays for its
peers, as the relay itself (:class:`PacketServer`). :class:`Routes` tells them
apart: a packet only a relay receives (Hello, Register, Connect...) goes to the
server; one from a relay this socket registered with goes to that relay's
client, unless it is Data of a session the client does not hold (then it is the
server's: two nodes may each relay for the other); a probe goes to every
client (only the one holding its session answers it); anything else from
elsewhere is the server's, or dropped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from gpumesh.protocol import relay as wire
from gpumesh.protocol.addresses import Address

if TYPE_CHECKING:
    from gpumesh.transport.quic import LinkPath
    from gpumesh.transport.relayclient import RelayClient

__all__ = ["TO_RELAY", "PacketServer", "Routes"]

TO_RELAY = frozenset(
    message.TYPE
    for message in (
        wire.Hello,
        wire.Register,
        wire.Connect,
        wire.Accept,
        wire.Decline,
        wire.KeepAlive,
        wire.ReachTest,
    )
)
"""Packet types only a relay receives."""


class PacketServer(Protocol):
    """A relay served on this socket (a node relaying for its peers)."""

    def handle(self, packet: bytes, source: Address, now: float) -> None:
        """One relay packet for the relay (it answers through the endpoint)."""
        ...

    def forward_run(self, buffer: bytes, segment: int, source: Address) -> bool:
        """A GRO run of ``segment``-byte packets from ``source``: whether the relay
        forwarded it whole (else each packet comes to :meth:`handle`)."""
        ...

    def close(self) -> None:
        """The endpoint is closing."""
        ...


class Routes:
    """The relay clients of one socket, and the relay it serves, if any."""

    def __init__(self) -> None:
        self.clients: dict[Address, RelayClient] = {}
        self.server: PacketServer | None = None

    @property
    def has_paths(self) -> bool:
        return any(client.has_paths for client in self.clients.values())

    def path_for_virtual(self, address: tuple[Any, ...]) -> LinkPath | None:
        paths = (client.path_for_virtual(address) for client in self.clients.values())
        return next((path for path in paths if path is not None), None)

    def from_direct(self, source: Address, now: float) -> Address | None:
        virtuals = (client.from_direct(source, now) for client in self.clients.values())
        return next((virtual for virtual in virtuals if virtual is not None), None)

    def unwrap_run(
        self, buffer: bytes, segment: int, source: Address
    ) -> tuple[Address, list[bytes]] | None:
        client = self.clients.get(source)
        if client is not None:
            run = client.unwrap_run(buffer, segment, source)
            if run is not None:
                return run
        if self.server is not None and self.server.forward_run(buffer, segment, source):
            return source, []
        return None

    def handle(self, packet: bytes, source: Address, now: float) -> tuple[Address, bytes] | None:
        kind = packet[0] if packet else -1
        client = self.clients.get(source)
        server = self.server
        if server is not None and (
            kind in TO_RELAY
            or (client is None and kind != wire.Probe.TYPE)
            or (kind == wire.T_DATA and client is not None and not client.holds(packet))
        ):
            server.handle(packet, source, now)
            return None
        if client is not None:
            if kind == wire.Close.TYPE and server is not None:
                server.handle(packet, source, now)  # each ignores a session it lacks
            return client.handle(packet, source, now)
        for each in self.clients.values():
            each.handle(packet, source, now)  # a probe: its session's client takes it
        return None

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        if self.server is not None:
            self.server.close()
