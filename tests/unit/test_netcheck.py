"""client/netcheck without the network: what each finding reads as, the sizes of
path MTU probes, where TCP is tried, and what a proxy setting may show."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpumesh.client.checks import FAIL, OK, WARN
from gpumesh.client.netcheck import (
    BY_DESTINATION,
    INDEPENDENT,
    NO_NAT,
    RELAYED_PACKET,
    TCP_FAILED,
    TCP_NOT_TRIED,
    TCP_OFF,
    TCP_OK,
    Mtu,
    Netcheck,
    TcpResult,
    UdpResult,
    _proxy_shown,
    classify_mapping,
    describe_inbound,
    describe_nat,
    inbound_check,
    mtu_check,
    relay_settings,
    sized_hello,
    tcp_check,
    with_node,
)
from gpumesh.client.views import to_json
from gpumesh.client.views.node import NetcheckView
from gpumesh.protocol import relay as wire
from gpumesh.store.config import Config


def _udp(
    observed: str | None = "203.0.113.2:40000",
    second: str | None = "203.0.113.2:40000",
    *,
    probe_port: int = 4800,
    inbound: bool | None = False,
) -> UdpResult:
    return UdpResult(0.012, 5, "10.0.1.2:40000", observed, probe_port, second, inbound)


def test_the_mapping_from_the_addresses_seen() -> None:
    local = "10.0.1.2:40000"
    assert classify_mapping(local, local, None) == NO_NAT
    assert classify_mapping(local, "203.0.113.2:40000", "203.0.113.2:40000") == INDEPENDENT
    assert classify_mapping(local, "203.0.113.2:40000", "203.0.113.2:51234") == BY_DESTINATION
    assert classify_mapping(local, "203.0.113.2:40000", "198.51.100.9:40000") == BY_DESTINATION
    assert classify_mapping(local, "203.0.113.2:40000", None) is None  # no second answer
    assert classify_mapping(local, None, None) is None


def test_what_the_nat_reads_as_in_doctor_and_netcheck() -> None:
    none = UdpResult(0.01, 5, "10.0.1.2:4", "10.0.1.2:4", 4800, "10.0.1.2:4", True)
    status, line, fix = describe_nat(none)
    assert (status, fix) == (OK, "")
    assert line == "no NAT: the relay sees this node's own address 10.0.1.2:4"

    status, line, _ = describe_nat(_udp())
    assert status == OK and line.startswith("behind NAT, seen as 203.0.113.2:40000 from both")
    assert "hole punching works" in line

    status, line, fix = describe_nat(_udp(second="203.0.113.2:51234"))
    assert status == WARN and "and as 203.0.113.2:51234 from the relay's second port" in line
    assert "maps by destination" in line and "peers need the relay" in line and fix

    status, line, fix = describe_nat(_udp(second=None, probe_port=0))
    assert status == WARN and "older gpumesh-relay" in line and fix == "update gpumesh-relay"

    status, line, fix = describe_nat(_udp(second=None))
    assert status == WARN and "second port (udp 4800) did not answer" in line and fix

    assert describe_nat(_udp(observed=None))[0] == WARN
    assert "filtered" in describe_inbound(_udp())
    assert "get in" in describe_inbound(_udp(inbound=True))
    assert inbound_check(_udp(inbound=None)).status == WARN


def test_every_line_is_one_line() -> None:
    udp = [_udp(), _udp(second="203.0.113.2:1"), _udp(second=None), _udp(probe_port=0)]
    lines = [describe_nat(u)[1] for u in udp] + [describe_inbound(u) for u in udp]
    lines += [mtu_check(Mtu(size)).detail for size in (1500, 1472, 1200)]
    assert all("\n" not in line for line in lines)


def test_the_mtu_row() -> None:
    capped = mtu_check(Mtu(wire.MAX_PACKET, capped=True))
    assert capped.status == OK
    assert capped.detail == "1500+ bytes of UDP payload reach the relay (the most it answers)"
    ethernet = mtu_check(Mtu(1472))
    assert (
        ethernet.status == OK
        and "1472 bytes" in ethernet.detail
        and "MTU of 1500" in ethernet.detail
    )
    small = mtu_check(Mtu(RELAYED_PACKET - 1))
    assert small.status == WARN and f"less than the {RELAYED_PACKET} bytes" in small.detail
    assert mtu_check(Mtu(RELAYED_PACKET)).status == OK
    unknown = mtu_check(Mtu(None, why="the relay is an older gpumesh-relay"))
    assert (unknown.status, unknown.detail) == (
        WARN,
        "not measured: the relay is an older gpumesh-relay",
    )


def test_sized_hellos_are_the_size_asked_and_decode() -> None:
    for size in range(len(wire.hello_packet()), wire.MAX_PACKET + 1):
        packet = sized_hello(size)
        assert len(packet) in (size, size - 1), size
        assert isinstance(wire.decode_packet(packet), wire.Hello)
    # Only where msgpack's length prefix grows is the size itself out of reach.
    assert [s for s in range(98, 1501) if len(sized_hello(s)) != s] == [263]


def test_a_proxy_is_shown_without_its_credentials() -> None:
    assert _proxy_shown(None) is None
    assert _proxy_shown("http://user:secret@proxy.example.org:3128") == "proxy.example.org:3128"
    assert _proxy_shown("proxy.example.org:3128") == "proxy.example.org:3128"
    assert _proxy_shown("https://proxy.example.org") == "proxy.example.org"
    assert "secret" not in str(_proxy_shown("http://u:secret@[::1:3128"))


def test_the_tcp_row() -> None:
    ok = tcp_check(TcpResult(TCP_OK, "relay.example.org:443", rtt=0.0234), udp_works=True)
    assert (ok.status, ok.detail) == (OK, "relay.example.org:443 answers over TCP in 23.4 ms")
    proxied = TcpResult(TCP_OK, "r:443", rtt=0.001, proxy="proxy.example.org:3128")
    assert "through the proxy proxy.example.org:3128" in tcp_check(proxied, udp_works=True).detail
    assert tcp_check(TcpResult(TCP_OFF), udp_works=True).status == OK
    off = tcp_check(TcpResult(TCP_OFF), udp_works=False)
    assert off.status == WARN and "UDP fails" in off.detail and off.fix
    bad = TcpResult(TCP_NOT_TRIED, error="invalid relay_tcp address 'a b': no")
    row = tcp_check(bad, udp_works=True)
    assert row.status == FAIL and row.detail.startswith("not tried: invalid relay_tcp")
    assert "gpumesh config set relay_tcp" in row.fix
    refused = TcpResult(
        TCP_FAILED, "r:443", proxy="p:3128", error="proxy p:3128 refused CONNECT: 403 Forbidden"
    )
    row = tcp_check(refused, udp_works=False)
    assert (row.status, row.detail) == (FAIL, "proxy p:3128 refused CONNECT: 403 Forbidden")
    assert "HTTPS_PROXY (p:3128)" in row.fix


def test_settings_that_do_not_parse_come_as_their_text(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = Config.load(tmp_path / "config.toml")
    monkeypatch.setenv("GPUMESH_RELAY", "relay.example.org:4799")
    assert relay_settings(config)[0] == "relay.example.org:4799"
    monkeypatch.setenv("GPUMESH_RELAY", "a b:c:d")
    assert relay_settings(config)[0] == "a b:c:d"
    monkeypatch.setenv("GPUMESH_RELAY_TCP", "relay.example.org:99999")
    assert relay_settings(config) == ("a b:c:d", "relay.example.org:99999")
    monkeypatch.delenv("GPUMESH_RELAY")
    monkeypatch.delenv("GPUMESH_RELAY_TCP")
    assert relay_settings(config) == ("", "")


def test_the_json_view_and_the_node_row() -> None:
    udp = _udp(inbound=True)
    tcp = TcpResult(TCP_FAILED, "relay.example.org:443", error="TCP to relay: refused")
    result = Netcheck(
        "relay.example.org",
        ("203.0.113.1", 4799),
        udp,
        Mtu(1472),
        tcp,
        False,
        [],
    )
    assert result.reachable
    view = NetcheckView.of(with_node(result, "registered as 203.0.113.2:47000"))
    assert (view.relay_address, view.udp_ms, view.mapping) == (
        "203.0.113.1:4799",
        12.0,
        INDEPENDENT,
    )
    assert (view.mtu, view.mtu_capped, view.tcp_ms, view.inbound) == (1472, False, None, True)
    assert view.node_relay == "registered as 203.0.113.2:47000"
    assert [(c.name, c.status) for c in view.checks] == [("node", OK)]
    assert with_node(result, "refusing").checks[-1].status == WARN
    assert with_node(result, None) is result
    assert '"mapping": "independent"' in to_json(view)
    unreachable = Netcheck("r", None, None, Mtu(None), TcpResult(TCP_FAILED, "r:443"), False, [])
    assert not unreachable.reachable
