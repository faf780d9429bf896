"""A LAN of network namespaces for LAN discovery's tests and bench (root, iproute2).

One namespace (``lanx``) holds a bridge; each node's namespace (``lana``, ``lanb``,
``lanc``) has one interface on it, ``lan0``, at 10.77.0.N/24, and no route
anywhere else: no registry, no relay, no internet. Run as a script, this module is
also the lab's listener and sender in a namespace: ``capture FILE`` records every
datagram to the announcements' group and port (one hex line each, with its
source), ``send FILE HOST`` sends the recorded datagrams to HOST, and ``flood
HOST COUNT`` sends COUNT datagrams of junk.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from gpumesh.client.node import Node
from gpumesh.client.views.peers import PeerView
from gpumesh.daemon.client import NodeClient, NodeUnavailableError
from gpumesh.store.config import DEFAULT_LAN_PORT
from gpumesh.transport.lan import GROUP

BRIDGE = "lanx"
SUBNET = "10.77.0"
NAMESPACES = {"a": "lana", "b": "lanb", "c": "lanc"}


def ip_of(key: str) -> str:
    return f"{SUBNET}.{' abc'.index(key)}"


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


def _quiet(*args: str) -> None:
    subprocess.run(args, check=False, capture_output=True, timeout=30)


def remove() -> None:
    for ns in (*NAMESPACES.values(), BRIDGE):
        pids = subprocess.run(
            ["ip", "netns", "pids", ns], capture_output=True, text=True, check=False
        ).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        _quiet("ip", "netns", "del", ns)


@contextlib.contextmanager
def bridge() -> Iterator[None]:
    """The namespaces on one bridge, removed (with whatever runs in them) after."""
    remove()
    try:
        _run("ip", "netns", "add", BRIDGE)
        inside = ("ip", "netns", "exec", BRIDGE)
        _run(*inside, "ip", "link", "add", "br0", "type", "bridge", "mcast_snooping", "0")
        _run(*inside, "ip", "link", "set", "br0", "up")
        for key, ns in NAMESPACES.items():
            _run("ip", "netns", "add", ns)
            _run(
                "ip",
                "link",
                "add",
                f"lan{key}x",
                "netns",
                BRIDGE,
                "type",
                "veth",
                "peer",
                "name",
                "lan0",
                "netns",
                ns,
            )
            _run(*inside, "ip", "link", "set", f"lan{key}x", "master", "br0", "up")
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ip_of(key)}/24", "dev", "lan0")
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "lan0", "up")
        yield
    finally:
        remove()


def drop_multicast(key: str) -> None:
    """A firewall in ``key``'s namespace that drops multicast both ways."""
    for chain in ("INPUT", "OUTPUT"):
        where = "-d"
        _run(
            "ip",
            "netns",
            "exec",
            NAMESPACES[key],
            "iptables",
            "-A",
            chain,
            where,
            "224.0.0.0/4",
            "-j",
            "DROP",
        )


def make_home(home: Path, name: str, host: str, port: int, **config: str) -> tuple[Node, str]:
    """An initialised home whose pairing code says ``host:port``; its code."""
    node = Node(home)
    node.init(name)
    settings = node.home.reload_config()
    values = {
        "listen_host": host,
        "listen_port": str(port),
        "lan_interval": "1s",
        "lan_reprobe": "1s",
        "connect_timeout": "3",
        "job_network": "none",
        **config,
    }
    for key, value in values.items():
        settings.set(key, value)
    settings.save()
    node.home.reload_config()
    return node, node.pairing_code()


def set_config(home: Path, **config: str) -> None:
    node = Node(home)
    try:
        settings = node.home.reload_config()
        for key, value in config.items():
            settings.set(key, value)
        settings.save()
    finally:
        node.close()


@dataclass
class Running:
    """A node process (``gpumesh daemon run``) in a namespace."""

    key: str
    home: Path
    process: subprocess.Popen[bytes]
    started: float = field(default_factory=time.monotonic)

    @property
    def log(self) -> str:
        path = self.home / "logs" / "gpumesh.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def peers(self) -> dict[str, PeerView]:
        try:
            found = NodeClient(self.home).call("GET", "/api/v1/peers", list[PeerView], timeout=5)
        except NodeUnavailableError:
            return {}
        return {p.name: p for p in found}

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def start(key: str, home: Path, *, share: bool, log: str = "debug") -> Running:
    env = dict(os.environ, GPUMESH_HOME=str(home), GPUMESH_LOG="warning")
    env.pop("GPUMESH_NODE_IDLE", None)
    args = [
        "ip",
        "netns",
        "exec",
        NAMESPACES[key],
        sys.executable,
        "-m",
        "gpumesh",
        "daemon",
        "run",
        *(["--share"] if share else []),
    ]
    process = subprocess.Popen(
        args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    return Running(key, home, process)


def until(
    check: Callable[[], object], what: str, within: float = 30.0, every: float = 0.05
) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, f"timed out ({within:g} s) waiting until {what}"
        time.sleep(every)


def helper(key: str, *args: str) -> subprocess.Popen[bytes]:
    """This module run as a script in ``key``'s namespace."""
    return subprocess.Popen(
        ["ip", "netns", "exec", NAMESPACES[key], sys.executable, __file__, *args],
        stdout=subprocess.DEVNULL,
    )


# --- run as a script, in a namespace -------------------------------------------------


def _capture(out: Path) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("0.0.0.0", DEFAULT_LAN_PORT))
    index = socket.if_nametoindex("lan0")
    request = struct.pack("4s4si", socket.inet_aton(GROUP), socket.inet_aton("0.0.0.0"), index)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, request)
    with out.open("a") as file:
        while True:
            data, source = sock.recvfrom(65535)
            file.write(f"{source[0]} {data.hex()}\n")
            file.flush()


def _send(recorded: Path, host: str) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("0.0.0.0", DEFAULT_LAN_PORT))
    for line in recorded.read_text().splitlines():
        sock.sendto(bytes.fromhex(line.split()[1]), (host, DEFAULT_LAN_PORT))


def _flood(host: str, count: int) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for n in range(count):
        junk = b"gmL\x01" + os.urandom(n % 400) if n % 2 else os.urandom(n % 1400)
        sock.sendto(junk, (host, DEFAULT_LAN_PORT))


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    if command == "capture":
        _capture(Path(rest[0]))
    elif command == "send":
        _send(Path(rest[0]), rest[1])
    elif command == "flood":
        _flood(rest[0], int(rest[1]))
