"""A relayed dial does not hold its first request for hole punching.

Punching may never get through even though the peer's probes arrive: a firewall
in front of the provider that drops new flows from the dialer lets the provider's
probes out but never lets the dialer's in (the WAN lab's hole-punched row). The
dial returns on the relay at once, and the link moves to the punched path under
QUIC, mid-session, when punching finds one.

Real agent, real ``gpumesh-relay``, real QUIC on loopback. The firewall is a
filter on what the provider's relay client is handed (the one stand-in here):
while it is closed it drops every packet the dialer sends straight to the
provider, and it holds the dialer's relayed QUIC packets back until the dialer
has answered one of the provider's probes, so the dial can only finish after
the peer's probes got through, the case where a dial used to wait. No timing
decides: a dial that waited for punching to settle could not end while the
firewall stays closed (``give_up`` is raised past the test's ceiling)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

import gpumesh.transport.session as session_module
from gpumesh.client.node import Node
from gpumesh.protocol import relay as wire
from gpumesh.protocol.addresses import Address
from gpumesh.protocol.messages import Ping, Pong
from gpumesh.protocol.punch import PunchConfig
from gpumesh.transport.relayclient import RelayClient
from gpumesh.transport.session import RelayHint, open_session
from tests.integration.conftest import arun, sharing_relayed
from tests.integration.test_outgoing_socket import CEILING

NEVER = 3600.0


class Firewall:
    """What a stateful firewall in front of the provider lets through, applied to
    the packets its relay client is handed."""

    def __init__(self, client: RelayClient) -> None:
        self.closed = True
        self.dialer_heard = asyncio.Event()
        """Set when a probe answer from the dialer arrived (and was dropped): the
        dialer heard the provider's probe."""
        self.dropped_direct = 0
        self._relay = client.relay_address
        self._handle: Callable[[bytes, Address, float], tuple[Address, bytes] | None]
        self._handle = client.handle
        self._unwrap = client.unwrap_run
        client.handle = self.handle  # type: ignore[method-assign]
        client.unwrap_run = self.unwrap_run  # type: ignore[method-assign]

    def handle(self, packet: bytes, source: Address, now: float) -> tuple[Address, bytes] | None:
        if self.closed and source != self._relay:
            self.dropped_direct += 1
            if not wire.is_data(packet):
                message = wire.decode_packet(packet)
                if isinstance(message, wire.Probe) and message.reply:
                    self.dialer_heard.set()
            return None
        if source == self._relay and wire.is_data(packet) and not self.dialer_heard.is_set():
            return None  # the dialer's relayed QUIC waits until it heard a probe
        return self._handle(packet, source, now)

    def unwrap_run(
        self, buffer: bytes, segment: int, source: Address
    ) -> tuple[Address, list[bytes]] | None:
        if not self.dialer_heard.is_set():
            return None  # one packet at a time, through handle
        return self._unwrap(buffer, segment, source)


def test_a_relayed_dial_returns_while_punching_is_still_under_way(
    relayed_alice: tuple[Node, Node, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    alice, bob, relay = relayed_alice
    # Punching that never settles by itself within the test (neither side gives up).
    monkeypatch.setattr(
        "gpumesh.transport.relayclient.PunchConfig",
        lambda: PunchConfig(give_up=NEVER),
    )
    # Should a wait for punching come back under its old name, it cannot end either.
    monkeypatch.setattr(session_module, "PUNCH_SETTLE", NEVER, raising=False)

    async def scenario() -> None:
        async with sharing_relayed(alice, bob) as agent:
            assert agent.relay is not None
            firewall = Firewall(agent.relay)
            async with asyncio.timeout(CEILING):
                session = await open_session(
                    bob.home.identity, "bob", [], alice.home.identity.public_key,
                    timeout=CEILING, relays=[RelayHint(relay)],
                )  # fmt: skip
            try:
                path = session.relayed
                assert path is not None
                # The peer's probes got through before the dial ended; ours did not.
                assert firewall.dialer_heard.is_set() and path.puncher.heard_from
                assert path.direct is None and not path.settled.is_set()
                async with asyncio.timeout(CEILING):
                    assert isinstance(await session.request(Ping(sent=0.0)), Pong)
                assert session.path.startswith("relayed via ")
                # The firewall opens: punching gets through and the same link moves.
                firewall.closed = False
                async with asyncio.timeout(CEILING):
                    await path.settled.wait()
                    assert isinstance(await session.request(Ping(sent=1.0)), Pong)
                assert session.path.startswith("direct (hole-punched) 127.0.0.1:")
                assert not session.link.is_closed
            finally:
                session.close()

    arun(scenario())
