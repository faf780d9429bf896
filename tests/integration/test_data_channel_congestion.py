"""The data channel's TCP congestion control: BBR where the kernel offers it, else
the system's default, and both ends say which one they have.

Real sockets on loopback. What is asserted comes from the kernel's own lists
(``/proc/sys/net/ipv4/tcp_available_congestion_control`` and the namespace's
default), never a hard-coded name. In a fresh network namespace whose default
is set to another one (root only), a channel that did not ask for BBR would show
that one: that is where the preference is proven, not only observed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from gpumesh.client.node import Node
from tests.conftest import _in_ci
from tests.integration.conftest import arun, pair_both
from tests.integration.test_cp import _copy_sharing

PROC = Path("/proc/sys/net/ipv4")

# A Listener and a dial on loopback; prints each end's congestion control as
# the Channel reports it and as the kernel reads it back from the socket.
_PAIR = """
import asyncio, json, socket
from gpumesh.blocking import in_thread
from gpumesh.transport.channel import Listener, dial, server_context
from gpumesh.identity.keys import Identity

async def main():
    identity = Identity.generate()
    ticket = bytes(range(32))
    listener = Listener("127.0.0.1", server_context(identity), ticket, peer="127.0.0.1")
    accepting = in_thread(listener.accept, 5.0, 5.0)
    client = await in_thread(dial, "127.0.0.1", listener.port, identity.public_key, ticket, 5.0)
    server = await accepting
    def kernel(channel):
        raw = channel.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
        return raw.split(b"\\0", 1)[0].decode()
    ends = {
        "client": [client.congestion, kernel(client)],
        "server": [server.congestion, kernel(server)],
    }
    client.close()
    server.close()
    return ends

print(json.dumps(asyncio.run(main())))
"""


def _linux_tcp() -> None:
    if not hasattr(__import__("socket"), "TCP_CONGESTION") or not PROC.is_dir():
        pytest.skip("no TCP_CONGESTION socket option here (not Linux)")


def _available() -> list[str]:
    return (PROC / "tcp_available_congestion_control").read_text().split()


def _expected(default: str) -> str:
    return "bbr" if "bbr" in _available() else default


def _channel_ends(prefix: list[str]) -> dict[str, list[str]]:
    result = subprocess.run(
        [*prefix, sys.executable, "-c", _PAIR],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    ends: dict[str, list[str]] = json.loads(result.stdout)
    return ends


def test_both_ends_of_a_channel_report_the_congestion_control_they_have() -> None:
    _linux_tcp()
    ends = _channel_ends([])
    default = (PROC / "tcp_congestion_control").read_text().strip()
    expected = _expected(default)
    for end, (reported, kernel) in ends.items():
        assert reported == kernel, f"{end} reports {reported}, its socket has {kernel}"
        assert reported == expected, f"{end}: {reported}; available: {_available()}"


def test_the_channel_asks_for_bbr_where_the_default_is_another() -> None:
    """In a namespace whose default is not BBR, the channel still gets BBR if the kernel has it."""
    _linux_tcp()
    missing = None
    if os.geteuid() != 0:
        missing = "needs root (network namespaces)"
    elif shutil.which("ip") is None:
        missing = "ip is not installed"
    if missing:
        if _in_ci():
            pytest.fail(missing)
        pytest.skip(missing)
    namespace = f"gmcc{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", namespace], check=True, timeout=30)
    try:
        inside = ["ip", "netns", "exec", namespace]
        subprocess.run([*inside, "ip", "link", "set", "lo", "up"], check=True, timeout=30)
        # A namespace may only default to an allowed one (reno always is).
        default = _set_default_other_than_bbr(inside)
        ends = _channel_ends(inside)
    finally:
        subprocess.run(["ip", "netns", "del", namespace], check=False, timeout=30)
    expected = _expected(default)
    assert ends == {"client": [expected, expected], "server": [expected, expected]}


def _set_default_other_than_bbr(inside: list[str]) -> str:
    for name in [n for n in _available() if n != "bbr"]:
        result = subprocess.run(
            [*inside, "sysctl", "-qw", f"net.ipv4.tcp_congestion_control={name}"],
            capture_output=True,
            timeout=30,
            check=False,
        )
        if result.returncode == 0:
            return name
    pytest.fail(f"could not set any of {_available()} but bbr as a namespace's default")


@pytest.fixture
def nodes(make_node) -> tuple[Node, Node]:  # type: ignore[no-untyped-def]
    alice, bob = make_node("alice"), make_node("bob")
    pair_both(alice, bob)
    return alice, bob


def test_a_copy_over_the_channel_reports_its_congestion_control(nodes, tmp_path: Path) -> None:
    """``CopyResult.congestion`` (``cp --json``'s ``congestion``) is the channel's."""
    _linux_tcp()
    alice, bob = nodes
    source = tmp_path / "data.bin"
    source.write_bytes(os.urandom(256 * 1024))
    up = arun(_copy_sharing(alice, bob, str(source), "alice:/data.bin"))
    quic = arun(_copy_sharing(alice, bob, str(source), "alice:/again.bin", fast_path=False))
    default = (PROC / "tcp_congestion_control").read_text().strip()
    assert up.channel == "tls"
    assert up.congestion == _expected(default)
    assert (quic.channel, quic.congestion) == ("quic", "")
