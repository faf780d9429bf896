"""One UDP socket for every outgoing link of a long-running process.

A command run on its own dials each peer from a socket of its own and, to go
through a relay, registers that socket with it. The node process instead keeps
one :class:`OutgoingSocket`: one QUIC endpoint on one IPv4 port carries all of
its client links (told apart by connection id, and FEC frames by peer
address), and one registration per relay, kept while the process runs and
renewed by the relay client itself when the relay forgets it, serves every
relayed dial. A second peer behind the same relay, or a re-dial after a drop,
costs no new socket and no new registration, and punching starts from the NAT
mapping the relay already knows.

IPv6 peers are still dialled from a socket of their own (the shared socket is
IPv4, as relays and punching are). The agent of a sharing node process keeps
its own listening socket: its port is the one peers dial and its relay
registration is a serving one; this socket only dials.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpumesh.errors import UnreachableError
from gpumesh.protocol.addresses import Address
from gpumesh.transport.endpoint import QuicEndpoint
from gpumesh.transport.relayclient import dialling_client
from gpumesh.transport.relaytcp import RelayTcp
from gpumesh.transport.routes import Routes
from gpumesh.transport.udp import UdpSocket, open_udp_socket

if TYPE_CHECKING:
    from gpumesh.identity.keys import Identity
    from gpumesh.transport.quic import QuicLink
    from gpumesh.transport.relayclient import RelayClient, RelayedPath

__all__ = ["OutgoingSocket", "OutgoingState", "RelayState"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RelayState:
    """One relay registration of the shared socket, as status shows it."""

    relay: str
    """The relay as configured (``host:port``)."""
    state: str
    """``registered as ADDR`` (``... (over tcp)``), ``registering`` or ``refused: ...``."""
    registrations: int
    """Times the relay accepted this socket (1 while it never lost it)."""


@dataclass(frozen=True)
class OutgoingState:
    port: int | None
    """The shared socket's local UDP port; None before the first dial."""
    links: int
    """QUIC links open on it now."""
    relays: list[RelayState]


class OutgoingSocket:
    """The shared dialling socket of a node process (opened at its first dial)."""

    def __init__(self, identity: Callable[[], Identity], host: str = "0.0.0.0") -> None:
        self._identity = identity
        """This node's identity, read at the first relay registration."""
        self.host = host
        self._endpoint: QuicEndpoint | None = None
        self._routes = Routes()
        self._registrations: dict[Address, int] = {}
        self._lock = asyncio.Lock()

    # --- the socket --------------------------------------------------------------------

    def endpoint(self) -> QuicEndpoint:
        """The shared endpoint, opened now if it is not yet."""
        if self._endpoint is None:
            try:
                udp = UdpSocket(open_udp_socket(self.host, 0))
            except OSError as exc:
                raise UnreachableError(f"cannot open a UDP socket: {exc}") from exc
            udp.report_refusals()
            endpoint = QuicEndpoint(udp)
            endpoint.relay = self._routes
            self._endpoint = endpoint
            logger.info("outgoing links share UDP port %d", endpoint.local_address[1])
        return self._endpoint

    def takes(self, address: Address) -> bool:
        """Whether a dial to ``address`` goes out through this socket (IPv4 only)."""
        return ":" not in address[0]

    async def dial(
        self, address: Address, where: str, expected_key: bytes, timeout: float
    ) -> QuicLink:
        """A new link to ``address`` from the shared socket, its key pinned."""
        return await self.endpoint().dial_link(address, where, expected_key, timeout, shared=True)

    # --- relays ------------------------------------------------------------------------

    async def relay_client(
        self,
        relay_address: Address,
        label: str,
        token: str,
        timeout: float,
        tcp: RelayTcp | None = None,
        peer: str = "",
    ) -> RelayClient:
        """This socket's registration with a relay: made at the first use, then kept
        (the relay client registers again by itself when the relay forgets it).
        ``peer``: the name of the paired peer that is the relay, if one is."""
        async with self._lock:
            client = self._routes.clients.get(relay_address)
            if client is not None and (
                client.token != token or client.tcp != tcp or client.peer != peer
            ):
                # The configured token (or TCP route) changed: register again with it.
                client.close()
                del self._routes.clients[relay_address]
                client = None
            if client is None:
                client = self._new_client(relay_address, label, token, tcp, peer)
        await client.wait_registered(timeout)
        return client

    def _new_client(
        self, relay_address: Address, label: str, token: str, tcp: RelayTcp | None, peer: str
    ) -> RelayClient:
        client = dialling_client(
            self.endpoint(), relay_address, label, self._identity(), token, tcp, peer=peer
        )
        self._registrations[relay_address] = 0

        was_registered = False

        def changed() -> None:
            nonlocal was_registered
            now_registered = client.registered.is_set()
            if now_registered and not was_registered:
                self._registrations[relay_address] += 1
            was_registered = now_registered

        client.on_change = changed
        self._routes.clients[relay_address] = client
        client.start()
        return client

    async def dial_relayed(
        self,
        relay_address: Address,
        label: str,
        token: str,
        peer_key: bytes,
        timeout: float,
        tcp: RelayTcp | None = None,
        *,
        peer: str = "",
    ) -> tuple[QuicLink, RelayedPath]:
        """A link to ``peer_key`` through a relay, over this socket's registration."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        client = await self.relay_client(relay_address, label, token, timeout, tcp, peer)
        path = await client.open_path(peer_key, max(0.5, deadline - loop.time()))
        try:
            link = await self.endpoint().dial_link(
                path.virtual,
                f"the peer through {client.named}",
                peer_key,
                max(0.5, deadline - loop.time()),
                path=path,
                shared=True,
            )
        except BaseException:
            client.forget(path)
            raise
        return link, path

    # --- status and the end ------------------------------------------------------------

    def state(self) -> OutgoingState:
        endpoint = self._endpoint
        relays = []
        for address, client in self._routes.clients.items():
            if client.registered.is_set():
                state = f"registered as {client.registered_as}"
            elif client.error is not None:
                state = f"refused: {client.error.message}"
            else:
                state = "registering"
            relays.append(RelayState(client.label, state, self._registrations.get(address, 0)))
        return OutgoingState(
            port=None if endpoint is None else endpoint.local_address[1],
            links=0 if endpoint is None else sum(not k.is_closed for k in endpoint.links),
            relays=relays,
        )

    def close(self) -> None:
        endpoint, self._endpoint = self._endpoint, None
        if endpoint is not None:
            with contextlib.suppress(Exception):
                endpoint.close()  # closes the relay clients too (its route)
        self._routes = Routes()
