"""netcheck behind real NATs: host A of the NAT lab (scripts/natlab.sh) behind its
MASQUERADE router, a `gpumesh-relay` process on the public segment.

- a router that keeps one mapping per socket (MASQUERADE): both of the relay's
  ports see A from one public address (hole punching can work); the router drops
  unsolicited packets, so the relay's probe from its second port never gets in;
- the same router with ``--random-fully`` (a new public port per destination,
  "symmetric"): the two ports see A from two addresses: it maps by destination;
- the path MTU over the lab's veths (MTU 1500): 1472 bytes of UDP payload.

The lab has a prefix of its own, so it never meets test_nat.py's. Needs root,
iproute2 and iptables.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.usefixtures("network_lab", "gpumesh_processes")

NATLAB = Path(__file__).resolve().parents[2] / "scripts" / "natlab.sh"
PREFIX = "gmnc"
RELAY = "203.0.113.1:4799"


def _natlab(*args: str) -> None:
    result = subprocess.run(
        ["bash", str(NATLAB), *args],
        env=dict(os.environ, GPUMESH_NATLAB_PREFIX=PREFIX),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, (args, result.stderr)


def _in(namespace: str, *command: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, GPUMESH_HOME=str(home))
    env.pop("GPUMESH_LOG", None)
    return subprocess.run(
        ["ip", "netns", "exec", f"{PREFIX}{namespace}", *command],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Path]:
    """A home folder for host A (never initialised); the lab is built by each test
    and always taken down."""
    try:
        yield tmp_path / "a"
    finally:
        _natlab("down")
        _natlab("check")


def _netcheck_behind(mode: tuple[str, ...], home: Path, log: Path) -> dict[str, Any]:
    _natlab("up", *mode)
    with log.open("w") as out:
        relay = subprocess.Popen(
            ["ip", "netns", "exec", f"{PREFIX}P", sys.executable, "-m", "gpumesh.relay.main",
             "--open", "--listen", RELAY],
            stdout=out,
            stderr=out,
            text=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while "listening on" not in log.read_text():
            assert relay.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        command = (sys.executable, "-m", "gpumesh", "netcheck", "--relay", RELAY, "--json")
        result = _in("A", *command, home=home)
        assert result.returncode == 0, (result.stdout, result.stderr)
        data: dict[str, Any] = json.loads(result.stdout)
        return data
    finally:
        relay.send_signal(signal.SIGINT)
        try:
            relay.wait(timeout=10)
        except subprocess.TimeoutExpired:
            relay.kill()
            relay.wait(timeout=10)


def _rows(data: dict[str, Any]) -> dict[str, dict[str, str]]:
    return {check["name"]: check for check in data["checks"]}


@pytest.mark.timeout(60)
def test_netcheck_tells_a_nat_that_keeps_one_mapping_from_one_that_maps_by_destination(
    lab: Path, tmp_path: Path
) -> None:
    kept = _netcheck_behind(("drop",), lab, tmp_path / "relay-kept.log")
    assert kept["reachable"] is True and isinstance(kept["udp_ms"], float)
    assert kept["public_address"].startswith("203.0.113.2:")  # the router's address
    assert kept["mapping"] == "independent"
    assert kept["inbound"] is False  # the router drops what nobody asked for
    assert (kept["mtu"], kept["mtu_capped"]) == (1472, False)  # 1500 less IPv4 and UDP
    rows = _rows(kept)
    assert (
        rows["nat"]["status"] == "ok" and "from both of the relay's ports" in rows["nat"]["detail"]
    )
    assert "filtered" in rows["inbound"]["detail"]

    symmetric = _netcheck_behind(("drop", "--random-fully"), lab, tmp_path / "relay-sym.log")
    assert symmetric["public_address"].startswith("203.0.113.2:")
    assert symmetric["mapping"] == "by-destination"
    nat = _rows(symmetric)["nat"]
    assert nat["status"] == "warn" and "maps by destination" in nat["detail"]
    assert "and as 203.0.113.2:" in nat["detail"]
