"""netcheck over real loopback sockets: against a real relay (in this process, and as
a `gpumesh-relay` process for the command), one that is not running, an older one,
one whose second port stays silent, and settings that are not addresses.

(A NAT that maps by destination, for real: test_netcheck_nat.py.)
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import msgspec
import pytest

from gpumesh.client.netcheck import NO_NAT, Netcheck, netcheck
from gpumesh.errors import ExitCode, RelayError
from gpumesh.protocol import relay as wire
from gpumesh.protocol.addresses import Address
from gpumesh.relay import RelayConfig, serve
from tests.integration.node import cli
from tests.integration.tcpmiddleboxes import middleboxes
from tests.integration.test_cli import _free_udp_port, _init, running_share
from tests.integration.test_relay_node import _start_relay, _stop

pytestmark = pytest.mark.usefixtures("gpumesh_processes")


def _run(relay: str, **options: object) -> Netcheck:
    async def scenario() -> Netcheck:
        return await netcheck(relay, **options)  # type: ignore[arg-type]

    return asyncio.run(asyncio.wait_for(scenario(), 30))


def _rows(result: Netcheck) -> dict[str, tuple[str, str]]:
    return {check.name: (check.status, check.detail) for check in result.checks}


def test_against_a_real_relay_on_loopback() -> None:
    async def scenario() -> Netcheck:
        server = await serve(RelayConfig(host="127.0.0.1", port=0, open=True))
        try:
            return await netcheck(server.address_text, relay_tcp="off")
        finally:
            server.close()

    result = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert [check.name for check in result.checks] == ["udp", "nat", "inbound", "mtu", "tcp"]
    assert all(check.status == "ok" for check in result.checks), result.checks
    udp = result.udp
    assert udp is not None and 0 < udp.rtt < 0.5 and udp.samples >= 3
    assert udp.mapping == NO_NAT and udp.inbound is True
    assert udp.probe_port and udp.observed == udp.observed_second == udp.local
    assert (result.mtu.payload, result.mtu.capped) == (wire.MAX_PACKET, True)
    rows = _rows(result)
    assert rows["nat"][1].startswith("no NAT: the relay sees this node's own address 127.0.0.1:")
    assert rows["mtu"][1] == "1500+ bytes of UDP payload reach the relay (the most it answers)"
    assert rows["tcp"] == ("ok", "not tried: relay_tcp is off")
    assert result.reachable and not result.setting_error


def test_the_tcp_row_asks_where_the_node_would_go() -> None:
    """The TCP client is handed the relay's host and port 443 (or ``relay_tcp``), the
    proxy and a timeout; its one-line error is the row, the proxy shown without its
    credentials."""
    calls: list[tuple[str, int, str | None]] = []

    async def answers(host: str, port: int, *, proxy: str | None, timeout: float) -> float:
        calls.append((host, port, proxy))
        return 0.0125

    async def refuses(host: str, port: int, *, proxy: str | None, timeout: float) -> float:
        raise RelayError("the proxy proxy.example.org:3128 refused CONNECT: 403 Forbidden")

    dead = f"127.0.0.1:{_free_udp_port()}"
    result = _run(dead, tcp_round_trip=answers)
    assert calls == [("127.0.0.1", 443, None)]
    assert _rows(result)["tcp"] == ("ok", "127.0.0.1:443 answers over TCP in 12.5 ms")
    assert result.reachable  # over TCP only: the command exits 0
    proxy = "http://user:secret@proxy.example.org:3128"
    result = _run(dead, relay_tcp="tcp.example.org:8443", proxy=proxy, tcp_round_trip=answers)
    assert calls[-1] == ("tcp.example.org", 8443, proxy)
    assert "through the proxy proxy.example.org:3128" in _rows(result)["tcp"][1]
    result = _run(dead, proxy=proxy, tcp_round_trip=refuses)
    assert _rows(result)["tcp"] == (
        "fail",
        "the proxy proxy.example.org:3128 refused CONNECT: 403 Forbidden",
    )
    assert not result.reachable
    assert "secret" not in repr(result)
    result = _run(dead, relay_tcp="not an address", tcp_round_trip=answers)
    assert _rows(result)["tcp"] == (
        "fail",
        "not tried: invalid relay_tcp address 'not an address'",
    )


def test_the_tcp_row_against_a_relay_over_tcp_and_what_stands_between(tmp_path: Path) -> None:
    """A real `gpumesh-relay --tcp`: straight, through a CONNECT proxy, a proxy that
    refuses CONNECT, a middlebox that breaks TLS, a port where nothing listens."""
    proc, udp, tcp = _start_tcp_relay(tmp_path)
    try:
        result = _run(udp, relay_tcp=tcp)
        assert all(check.status == "ok" for check in result.checks), result.checks
        status, detail = _rows(result)["tcp"]
        assert detail.startswith(f"{tcp} answers over TCP in ") and detail.endswith(" ms")
        assert result.tcp.rtt is not None and 0 < result.tcp.rtt < 2
        with middleboxes("127.0.0.1", tmp_path) as boxes:
            proxy = f"http://127.0.0.1:{boxes.start_connect_proxy()}"
            result = _run(udp, relay_tcp=tcp, proxy=proxy)
            assert _rows(result)["tcp"][0] == "ok" and boxes.connects == [tcp]
            assert f"through the proxy {proxy[7:]}" in _rows(result)["tcp"][1]
            refusing = boxes.start_connect_proxy(refuse=True)
            result = _run(udp, relay_tcp=tcp, proxy=f"http://127.0.0.1:{refusing}")
            status, detail = _rows(result)["tcp"]
            # UDP works: a TCP that fails leaves this node without the fallback, a warning
            assert status == "warn" and "\n" not in detail
            assert f"the proxy 127.0.0.1:{refusing} refused CONNECT" in detail
            assert "403 Forbidden" in detail
            assert result.reachable  # UDP still works
            breaker = boxes.start_tls_breaker()
            result = _run(udp, relay_tcp=f"127.0.0.1:{breaker}")
            status, detail = _rows(result)["tcp"]
            assert status == "warn" and f"TLS to 127.0.0.1:{breaker} failed" in detail
        closed = f"127.0.0.1:{_free_tcp_port()}"
        status, detail = _rows(_run(udp, relay_tcp=closed))["tcp"]
        assert status == "warn" and "refused" in detail and closed in detail
        # UDP gets nowhere, TCP does: the command says so and exits 0.
        home, dead = tmp_path / "home", f"127.0.0.1:{_free_udp_port()}"
        result = cli(home, "netcheck", "--relay", dead, "--json", GPUMESH_RELAY_TCP=tcp)
        assert result.returncode == 0, result.stdout
        data = json.loads(result.stdout)
        assert (data["udp_ms"], data["tcp_address"], data["reachable"]) == (None, tcp, True)
        assert isinstance(data["tcp_ms"], float)
        assert [(c["name"], c["status"]) for c in data["checks"]] == [
            ("udp", "fail"),
            ("tcp", "ok"),
        ]
    finally:
        _stop(proc)


def test_a_relay_that_is_not_running_is_one_line_at_once() -> None:
    relay = f"127.0.0.1:{_free_udp_port()}"
    started = time.monotonic()
    result = _run(relay, relay_tcp="off")
    assert time.monotonic() - started < 2  # ICMP says so: no waiting for the timeout
    assert [check.name for check in result.checks] == ["udp", "tcp"]
    status, detail = _rows(result)["udp"]
    assert status == "fail" and "\n" not in detail
    assert detail == f"{relay}: refused over UDP (nothing listens on that port)"
    assert not result.reachable and not result.setting_error


def test_a_relay_that_stays_silent_times_out_with_one_line() -> None:
    with _silent_port() as port:
        result = _run(f"127.0.0.1:{port}", relay_tcp="off", timeout=0.6)
    assert _rows(result)["udp"] == ("fail", f"127.0.0.1:{port}: no answer over UDP in 0.6 s")


def test_a_relay_address_this_machine_cannot_send_to() -> None:
    result = _run("255.255.255.255:4799", relay_tcp="off")  # broadcast: refused locally
    assert _rows(result)["udp"] == (
        "fail",
        "255.255.255.255:4799: cannot send over UDP: Permission denied",
    )


def test_relay_settings_that_are_not_addresses() -> None:
    for text in ("a b", "relay.example.org:99999", "[::1"):
        result = _run(text)
        status, detail = _rows(result)["udp"]
        assert status == "fail" and detail.startswith(f"invalid relay address {text!r}"), detail
        assert _rows(result)["tcp"][0] == "fail"  # its host is the relay's: not tried
        assert result.setting_error and not result.reachable
    result = _run("", relay_tcp="off")
    assert _rows(result)["udp"] == ("fail", "no relay configured") and result.setting_error
    result = _run("no-such-host.invalid:4799", relay_tcp="off")
    assert _rows(result)["udp"][1].startswith("cannot resolve the relay no-such-host.invalid")
    assert not result.setting_error


def test_an_older_relay_and_a_second_port_that_does_not_answer() -> None:
    """Seen from a public address (a NAT, as far as netcheck can tell): an older relay
    names no second port, and a second port may be firewalled."""

    async def scenario(probe_port: int | None) -> Netcheck:
        async with _fake_relay(probe_port, "198.51.100.7:4000") as address:
            return await netcheck(f"{address[0]}:{address[1]}", relay_tcp="off")

    with _silent_port() as silent:
        older = asyncio.run(asyncio.wait_for(scenario(None), 30))
        blocked = asyncio.run(asyncio.wait_for(scenario(silent), 30))
    assert _rows(older)["udp"][0] == "ok"
    status, detail = _rows(older)["nat"]
    assert status == "warn" and detail.startswith("behind NAT, seen as 198.51.100.7:4000;")
    assert "older gpumesh-relay" in detail
    assert _rows(older)["mtu"] == ("warn", "not measured: the relay is an older gpumesh-relay")
    status, detail = _rows(blocked)["nat"]
    assert status == "warn" and f"second port (udp {silent}) did not answer" in detail
    assert _rows(blocked)["inbound"] == (
        "ok",
        "unsolicited packets are filtered: peers reach this node by hole punching or through "
        "the relay",
    )
    assert blocked.udp is not None and blocked.udp.mapping is None
    assert blocked.mtu.payload == wire.MAX_PACKET


def test_the_command(tmp_path: Path) -> None:
    home = tmp_path / "home"  # never initialised: netcheck needs no identity
    proc, relay = _start_relay(tmp_path, "--open")
    try:
        result = cli(home, "netcheck", "--relay", relay, "--json")
        assert result.returncode == 0, result.stderr
        data = json.loads(result.stdout)
        assert (data["relay"], data["relay_address"], data["reachable"]) == (relay, relay, True)
        assert data["mapping"] == "none" and data["inbound"] is True
        assert (data["mtu"], data["mtu_capped"]) == (1500, True)
        assert isinstance(data["udp_ms"], float) and data["node_relay"] is None
        assert [c["name"] for c in data["checks"]][:4] == ["udp", "nat", "inbound", "mtu"]
        table = cli(home, "netcheck", GPUMESH_RELAY=relay)
        assert table.returncode == 0 and table.stderr == ""
        assert table.stdout.splitlines()[0].split()[:3] == ["CHECK", "STATE", "DETAIL"]
        assert table.stdout.splitlines()[1].split()[:3] == ["udp", "ok", relay]
    finally:
        _stop(proc)
    gone = cli(home, "netcheck", "--relay", relay)
    assert gone.returncode == ExitCode.UNREACHABLE and gone.stderr == ""
    assert gone.stdout.splitlines()[0].split() == ["CHECK", "STATE", "DETAIL", "FIX"]
    line = next(line for line in gone.stdout.splitlines() if line.startswith("udp"))
    assert "fail" in line and "refused over UDP" in line and "check that gpumesh-relay" in line
    bad = cli(home, "netcheck", "--json", GPUMESH_RELAY="a b:c:d")
    assert bad.returncode == ExitCode.USAGE and bad.stderr == ""
    udp = json.loads(bad.stdout)["checks"][0]
    assert (udp["name"], udp["status"]) == ("udp", "fail")
    assert udp["detail"].startswith("invalid relay address 'a b:c:d'")
    none = cli(home, "netcheck")
    assert none.returncode == ExitCode.USAGE and "no relay configured" in none.stdout


def test_the_command_says_what_the_node_process_uses(tmp_path: Path) -> None:
    """A sharing node process registered with the relay: its registration is a row (and
    ``node_relay``); netcheck itself neither starts nor stops it."""
    home = tmp_path / "alice"
    _init(home, "alice-pc", _free_udp_port())
    proc, relay = _start_relay(tmp_path, "--open")
    try:
        assert cli(home, "config", "set", "relay", relay).returncode == 0
        assert cli(home, "daemon", "stop").returncode == 0
        assert json.loads(cli(home, "netcheck", "--json").stdout)["node_relay"] is None
        # ... and none was started for it.
        assert "No node process runs" in cli(home, "daemon", "status").stdout
        with running_share(home):
            deadline = time.monotonic() + 15
            while not str(_status(home).get("relay_state")).startswith("registered"):
                assert time.monotonic() < deadline, _status(home)
                time.sleep(0.1)
            data = json.loads(cli(home, "netcheck", "--json").stdout)
        assert data["node_relay"].startswith("registered as 127.0.0.1:")
        node = data["checks"][-1]
        assert (node["name"], node["status"]) == ("node", "ok")
        assert node["detail"] == f"the node process's relay: {data['node_relay']}"
    finally:
        _stop(proc)
        cli(home, "daemon", "stop")


def _status(home: Path) -> dict[str, object]:
    status: dict[str, object] = json.loads(cli(home, "status", "--json", "--offline").stdout)
    return status


# --- helpers ---------------------------------------------------------------------------------


def _start_tcp_relay(tmp_path: Path) -> tuple[subprocess.Popen[str], str, str]:
    """A `gpumesh-relay --open` on loopback, over UDP and TCP (self-signed):
    ``(process, udp address, tcp address)``."""
    udp = f"127.0.0.1:{_free_udp_port()}"
    log = tmp_path / "tcp-relay.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpumesh.relay.main", "--open", "--listen", udp,
             "--tcp", "127.0.0.1:0"],
            stdout=out, stderr=out, text=True,
        )  # fmt: skip
    deadline = time.monotonic() + 15
    while (found := re.search(r"and tcp (\S+)", log.read_text())) is None:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    return proc, udp, found.group(1)


def _free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def _silent_port() -> Iterator[int]:
    """A bound UDP port that reads nothing and answers nothing (and so sends no ICMP)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


class _FakeRelay(asyncio.DatagramProtocol):
    """Answers a padded Hello with a Challenge naming ``observed``: without a
    ``probe_port`` (None: as an older relay encodes it), or naming ``probe_port``.
    Nothing else is answered."""

    def __init__(self, probe_port: int | None, observed: str) -> None:
        self.probe_port = probe_port
        self.observed = observed
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.DatagramTransport) -> None:  # type: ignore[override]
        self.transport = transport

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if len(data) < wire.HELLO_MIN_SIZE or data[0] != wire.Hello.TYPE:
            return
        fields: list[object] = [bytes(32), self.observed]
        if self.probe_port is not None:
            fields.append(self.probe_port)
        packet = b"\x02GM\x01" + msgspec.msgpack.encode(fields)
        assert self.transport is not None
        self.transport.sendto(packet, addr)


@asynccontextmanager
async def _fake_relay(probe_port: int | None, observed: str) -> AsyncIterator[Address]:
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(
        lambda: _FakeRelay(probe_port, observed), local_addr=("127.0.0.1", 0)
    )
    try:
        host, port = transport.get_extra_info("sockname")[:2]
        yield (host, port)
    finally:
        transport.close()
