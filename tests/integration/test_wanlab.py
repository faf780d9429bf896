"""The WAN lab for real (scripts/wanlab.sh + scripts/wanemu.py): two namespaces
joined by the user-space link, with its delay and its loss, and nothing left after.

Timing is only ever asserted as a lower bound (the link must hold packets back
at least its delay; a loaded machine only adds to that). Needs root,
iproute2 and /dev/net/tun; in CI these are never skipped.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WANLAB = ROOT / "scripts" / "wanlab.sh"
PREFIX = "gmwt"

# Host A: accept one connection, hash what arrives, print the hash.
_SERVER = """
import hashlib, socket, sys
with socket.socket() as listener:
    listener.bind(("10.77.0.1", 5001))
    listener.listen()
    print("listening", flush=True)
    conn, _ = listener.accept()
    digest = hashlib.sha256()
    while piece := conn.recv(1 << 20):
        digest.update(piece)
    print(digest.hexdigest(), flush=True)
"""

# Host B: time the TCP connect (one round trip), then send stdin's bytes.
_CLIENT = """
import socket, sys, time
data = sys.stdin.buffer.read()
started = time.perf_counter()
sock = socket.create_connection(("10.77.0.1", 5001), timeout=60)
print(f"{(time.perf_counter() - started) * 1000:.1f}", flush=True)
sock.sendall(data)
sock.close()
"""


def _wanlab(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, GPUMESH_WANLAB_PREFIX=PREFIX, PYTHON=sys.executable)
    return subprocess.run(
        ["bash", str(WANLAB), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture
def lab(network_lab: None) -> Iterator[None]:
    yield
    down = _wanlab("down")
    assert down.returncode == 0, down.stderr
    check = _wanlab("check")
    assert check.returncode == 0, check.stderr  # no namespace, no link process left


def _transfer(data: bytes) -> tuple[float, str]:
    """(connect ms, SHA-256 that host A received) of one TCP connection from B to A."""
    with subprocess.Popen(
        ["bash", str(WANLAB), "exec", "A", sys.executable, "-c", _SERVER],
        env=dict(os.environ, GPUMESH_WANLAB_PREFIX=PREFIX),
        stdout=subprocess.PIPE,
        text=True,
    ) as server:
        try:
            assert server.stdout is not None
            assert server.stdout.readline().strip() == "listening"
            client = subprocess.run(
                ["bash", str(WANLAB), "exec", "B", sys.executable, "-c", _CLIENT],
                env=dict(os.environ, GPUMESH_WANLAB_PREFIX=PREFIX),
                input=data,
                capture_output=True,
                timeout=120,
                check=True,
            )
            received = server.stdout.readline().strip()
            server.wait(timeout=60)
        finally:
            if server.poll() is None:
                server.kill()
    return float(client.stdout.decode().strip()), received


def _counters(text: str) -> dict[str, tuple[int, int, int]]:
    """{'A->B': (offered, delivered, lost), ...} from ``wanlab.sh stats``."""
    found = {}
    for line in text.splitlines():
        match = re.match(r"(A->B|B->A): (\d+) packets, (\d+) delivered .*?, (\d+) lost", line)
        if match:
            found[match.group(1)] = (int(match.group(2)), int(match.group(3)), int(match.group(4)))
    return found


def _settled(direction: str) -> tuple[int, int, int]:
    """``direction``'s counters once nothing the link took is still on its way: the
    last packets of a transfer (its FIN's ACK) may wait out their delay when the
    transfer is already done. As they are after a generous ceiling, if never."""
    deadline = time.monotonic() + 10
    while True:
        offered, delivered, lost = _counters(_wanlab("stats").stdout)[direction]
        if offered == delivered + lost or time.monotonic() > deadline:
            return offered, delivered, lost
        time.sleep(0.1)


def test_the_link_delays_every_packet_and_delivers_bytes_intact(lab: None) -> None:
    up = _wanlab("up", "--delay", "40")
    assert up.returncode == 0, up.stderr
    assert "congestion control: A " in up.stdout + up.stderr  # it says what TCP uses
    data = os.urandom(4 << 20)
    connect_ms, received = _transfer(data)
    assert received == hashlib.sha256(data).hexdigest()
    assert connect_ms >= 80  # SYN and SYN-ACK each waited 40 ms
    text = _wanlab("stats").stdout
    stats = _counters(text)
    assert stats["B->A"][0] > len(data) // 1500  # the bytes went through the link
    assert all(lost == 0 for _, _, lost in stats.values())
    # The hosts' devices queue enough for a link process that waits for a CPU (the
    # default 500 dropped bursts), and stats says what they dropped anyway.
    for side in ("A", "B"):
        queue = _wanlab("exec", side, "cat", "/sys/class/net/wan/tx_queue_len")
        assert queue.stdout.strip() == "20000"
        assert re.search(rf"^host {side}: \d+ packets dropped by its wan device", text, re.M)

    # Restarting only the link, with loss, under the running hosts.
    relinked = _wanlab("link", "--delay", "5", "--loss", "5", "--seed", "3")
    assert relinked.returncode == 0, relinked.stderr
    _connect_ms, received = _transfer(data)
    assert received == hashlib.sha256(data).hexdigest()  # TCP repaired every loss
    offered, delivered, lost = _settled("B->A")
    assert lost > 0 and offered == delivered + lost
    # 5% of some 3,000 packets: far from none and from half, whatever the seed draws.
    assert 0.01 < lost / offered < 0.15


def test_down_without_a_lab_is_harmless_and_leaves_nothing(lab: None) -> None:
    assert _wanlab("down").returncode == 0
    assert _wanlab("link", "--delay", "1").returncode != 0  # no lab: a clear refusal
