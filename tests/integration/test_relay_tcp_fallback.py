"""The relay client's TCP fallback, on loopback against a real relay: UDP and TCP
race, the winner carries the registration, UDP is tried again and taken back once
it answers and no session rides TCP, and when neither works the one line names both.

UDP to the relay goes through a gate in this process (a UDP forwarder that can
drop everything, silently, as a firewall does), so the same relay is reachable
over UDP or not as the test says.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from gpumesh.errors import UnreachableError
from gpumesh.identity.keys import Identity
from gpumesh.protocol.addresses import Address
from gpumesh.relay.config import RelayConfig
from gpumesh.relay.server import RelayServer, serve
from gpumesh.transport.endpoint import QuicEndpoint
from gpumesh.transport.relayclient import RelayClient
from gpumesh.transport.relaytcp import RelayTcp, relay_tcp_round_trip
from gpumesh.transport.udp import UdpSocket, open_udp_socket
from tests.integration.tcpmiddleboxes import middleboxes

CEILING = 20.0
"""Generous: nothing here is timed, only waited for."""


class Gate(asyncio.DatagramProtocol):
    """UDP between one node and the relay, forwarded while open, dropped while shut."""

    def __init__(self, relay: Address) -> None:
        self.relay = relay
        self.open = True
        self.node: Address | None = None
        self.front: asyncio.DatagramTransport | None = None
        self.back: asyncio.DatagramTransport | None = None
        self.dropped = 0

    async def start(self) -> Address:
        loop = asyncio.get_running_loop()
        self.front, _ = await loop.create_datagram_endpoint(
            lambda: _Side(self, from_node=True), local_addr=("127.0.0.1", 0)
        )
        self.back, _ = await loop.create_datagram_endpoint(
            lambda: _Side(self, from_node=False), local_addr=("127.0.0.1", 0)
        )
        address: Address = self.front.get_extra_info("sockname")[:2]
        return address

    def passed(self, data: bytes, source: Address, *, from_node: bool) -> None:
        if not self.open:
            self.dropped += 1
            return
        if from_node:
            self.node = source
            assert self.back is not None
            self.back.sendto(data, self.relay)
        elif self.node is not None:
            assert self.front is not None
            self.front.sendto(data, self.node)

    def close(self) -> None:
        for transport in (self.front, self.back):
            if transport is not None:
                transport.close()


class _Side(asyncio.DatagramProtocol):
    def __init__(self, gate: Gate, *, from_node: bool) -> None:
        self.gate = gate
        self.from_node = from_node

    def datagram_received(self, data: bytes, addr: Address) -> None:
        self.gate.passed(data, addr[:2], from_node=self.from_node)


async def _until(check: Callable[[], bool], what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + CEILING
    while not check():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def _client(
    relay_udp: Address, tcp: RelayTcp | None, *, serving: bool = False
) -> tuple[QuicEndpoint, RelayClient]:
    endpoint = QuicEndpoint(UdpSocket(open_udp_socket("127.0.0.1", 0)))
    client = RelayClient(
        endpoint,
        relay_udp,
        "the test relay",
        Identity.generate(),
        serving=serving,
        authorize=lambda key: True,
        tcp=tcp,
    )
    endpoint.relay = client
    client.start()
    return endpoint, client


Scenario = Callable[[RelayServer, Gate, RelayTcp], Awaitable[None]]


def _run(scenario: Scenario) -> None:
    async def main() -> None:
        config = RelayConfig(
            host="127.0.0.1", port=0, open=True, tcp_host="127.0.0.1", tcp_port=0, keepalive=1.0
        )
        server = await serve(config)
        gate = Gate(server.address)
        await gate.start()
        assert server.tcp_address is not None
        tcp = RelayTcp("127.0.0.1", server.tcp_address[1], udp_retry=0.3)
        try:
            await scenario(server, gate, tcp)
        finally:
            gate.close()
            server.close()

    asyncio.run(main())


def _gate_address(gate: Gate) -> Address:
    assert gate.front is not None
    address: Address = gate.front.get_extra_info("sockname")[:2]
    return address


def test_where_udp_answers_it_wins_the_race_and_tcp_is_let_go() -> None:
    async def scenario(server: RelayServer, gate: Gate, tcp: RelayTcp) -> None:
        endpoint, client = _client(_gate_address(gate), tcp)
        try:
            await client.wait_registered(CEILING)
            assert not client.over_tcp
            assert not client.registered_as.endswith("(over tcp)")
            # the TCP stream raced beside it is closed, at both ends
            await _until(lambda: server.stats()["tcp_connections"] == 0, "TCP let go")
            assert server.core.registration_count == 1
        finally:
            endpoint.close()

    _run(scenario)


def test_udp_silently_dropped_tcp_carries_the_registration_then_udp_is_taken_back() -> None:
    async def scenario(server: RelayServer, gate: Gate, tcp: RelayTcp) -> None:
        gate.open = False
        endpoint, client = _client(_gate_address(gate), tcp)
        try:
            await client.wait_registered(CEILING)
            assert client.over_tcp
            assert client.registered_as.endswith("(over tcp)")
            assert server.stats()["tcp_connections"] == 1
            # keep-alives ride TCP: the registration outlives several keep-alive periods
            await asyncio.sleep(3.5)
            assert client.registered.is_set() and client.over_tcp
            dropped = gate.dropped
            await asyncio.sleep(1.0)
            assert gate.dropped > dropped  # UDP is tried again, in the background
            gate.open = True
            await _until(lambda: client.registered.is_set() and not client.over_tcp, "UDP back")
            await _until(lambda: server.stats()["tcp_connections"] == 0, "TCP closed")
            assert server.core.registration_count == 1  # the TCP registration went with it
        finally:
            endpoint.close()

    _run(scenario)


def test_a_session_riding_tcp_keeps_it_until_it_ends() -> None:
    async def scenario(server: RelayServer, gate: Gate, tcp: RelayTcp) -> None:
        gate.open = False
        serving_endpoint, serving = _client(server.address, None, serving=True)
        endpoint, client = _client(_gate_address(gate), tcp)
        try:
            await serving.wait_registered(CEILING)
            await client.wait_registered(CEILING)
            path = await client.open_path(serving.identity.public_key, CEILING)
            assert path.over_tcp
            assert path.describe() == "relayed (tcp) via the test relay"
            gate.open = True
            await asyncio.sleep(1.5)  # several UDP retries answered meanwhile
            assert client.over_tcp and path.relay_open
            client.forget(path)
            await _until(lambda: client.registered.is_set() and not client.over_tcp, "UDP back")
        finally:
            endpoint.close()
            serving_endpoint.close()

    _run(scenario)


def test_when_neither_path_answers_the_one_line_names_both() -> None:
    async def scenario(server: RelayServer, gate: Gate, tcp: RelayTcp) -> None:
        gate.open = False
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            port = closed.getsockname()[1]  # bound, never listening: refused
            endpoint, client = _client(_gate_address(gate), RelayTcp("127.0.0.1", port))
            try:
                with pytest.raises(UnreachableError) as caught:
                    await client.wait_registered(2.0)
            finally:
                endpoint.close()
        message = caught.value.message
        assert "no answer over UDP within 2s" in message
        assert f"TCP to 127.0.0.1:{port}: connection refused" in message
        assert "\n" not in message

    _run(scenario)


def test_a_web_server_that_is_no_relay_is_named_as_such(tmp_path: Path) -> None:
    async def scenario() -> None:
        with middleboxes("127.0.0.1", tmp_path) as boxes:
            port = boxes.start_web_server()
            with pytest.raises(UnreachableError) as caught:
                await relay_tcp_round_trip("127.0.0.1", port, timeout=CEILING)
        assert caught.value.message == (
            f"127.0.0.1:{port} is not a gpumesh relay over TCP, it answered: 404 Not Found"
        )

    asyncio.run(scenario())
