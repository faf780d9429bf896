"""``share --public``, ``search`` and ``sync`` end to end: two real nodes, a real registry.

alice runs ``gpumesh share --public`` as a process (her GPUs simulated, as
the share banner says; NVIDIA hardware is the one thing faked); bob finds
her with ``gpumesh search``, pairs, and later finds her again through her
signed address record after she moved to another port.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumesh.client.registry import SequenceClock, address_record_of
from gpumesh.gpu.inventory import ENV_SIMULATED
from gpumesh.identity.keys import Identity
from gpumesh.protocol.listing import sign_record
from gpumesh.registry.config import RegistryConfig
from tests.integration.conftest import gpumesh
from tests.integration.node import shares, wait_shares
from tests.integration.public_registry import serve_registry
from tests.integration.test_cli import _free_udp_port, _init
from tests.integration.test_public_registry import _ForgingRegistry, _wire

pytestmark = pytest.mark.usefixtures("gpumesh_processes")

SIMULATED = {ENV_SIMULATED: "RTX-4090:24GB:4GB"}


def _share(home: Path, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, GPUMESH_HOME=str(home), **SIMULATED)
    env.pop("GPUMESH_LOG", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpumesh", "share", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    assert proc.stdout is not None
    lines = []
    # The banner ends with the pairing code's line; the registry's line comes before.
    while not any(line.startswith("Only paired") for line in lines):
        line = proc.stdout.readline()
        if not line or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"share did not start: {lines} {proc.communicate()}")
        lines.append(line)
    proc.banner = "".join(lines)  # type: ignore[attr-defined]
    return proc


def _stop(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=30)
    return err


@pytest.fixture
def homes(tmp_path: Path) -> Iterator[tuple[Path, Path, str]]:
    with serve_registry(str(tmp_path / "registry.db"), RegistryConfig()) as registry:
        alice, bob = tmp_path / "alice", tmp_path / "bob"
        _init(alice, "alice-pc", _free_udp_port())
        _init(bob, "bob-laptop")
        for home in (alice, bob):
            gpumesh(home, "config", "set", "rendezvous_url", registry.url)
            gpumesh(home, "config", "set", "connect_timeout", "3")
        yield alice, bob, registry.url


def _search(home: Path, *args: str) -> list[dict[str, object]]:
    done = gpumesh(home, "search", "--json", *args)
    assert done.returncode == 0, done.stderr
    listings: list[dict[str, object]] = json.loads(done.stdout)["listings"]
    return listings


def test_share_public_search_pair_withdraw_and_find_after_moving(
    homes: tuple[Path, Path, str],
) -> None:
    alice, bob, url = homes
    # From her key: a command would start her node process without the simulated GPUs
    # her share is started with.
    alice_id = str(Identity.load(alice / "identity.key").node_id)
    share = _share(alice, "--public", "--region", "us-west", "--contact", "alice@example.org")
    try:
        assert f"registry {url}: listed publicly in region us-west" in share.banner  # type: ignore[attr-defined]
        (found,) = _search(bob, "--gpu", "4090", "--vram", "4GB", "--idle", "--region", "us-west")
        assert found["node_id"] == alice_id
        assert found["name"] == "alice-pc"
        assert found["contact"] == "alice@example.org"
        assert found["gpus"] == [  # simulated, and the listing says so
            {
                "name": "(SIMULATED) RTX-4090",
                "memory_total": 24 * 1000**3,
                "memory_free": 20 * 1000**3,
            }
        ]
        assert found["addresses"] == []  # no address unless the owner asks
        assert _search(bob, "--vram", "21GB") == []
        # The listing granted nothing: bob is not paired, alice refuses him.
        assert gpumesh(bob, "pair", gpumesh(alice, "pair-code").stdout.strip()).returncode == 0
        refused = gpumesh(bob, "connect", "alice-pc")
        assert refused.returncode != 0
        assert gpumesh(alice, "pair", gpumesh(bob, "pair-code").stdout.strip()).returncode == 0
        synced = gpumesh(bob, "sync", "--json")
        assert synced.returncode == 0, synced.stderr
        (peer,) = json.loads(synced.stdout)["peers"]
        assert peer["reachable"] is True and peer["moved"] is False
    finally:
        err = _stop(share)
    assert f"Withdrew the public listing from {url}." in err
    assert _search(bob) == []

    # alice comes back on another port, announcing only her addresses.
    new_port = _free_udp_port()
    gpumesh(alice, "config", "set", "listen_port", str(new_port))
    gpumesh(alice, "config", "set", "announce_addresses", "true")
    share = _share(alice)
    try:
        assert "address record published" in share.banner  # type: ignore[attr-defined]
        assert _search(bob) == []  # addresses are not a listing
        moved = gpumesh(bob, "connect", "alice-pc", "--json")
        assert moved.returncode == 0, moved.stderr
        assert json.loads(moved.stdout)["address"] == f"127.0.0.1:{new_port}"
        (peer,) = json.loads(gpumesh(bob, "peers", "--json").stdout)
        assert f"127.0.0.1:{new_port}" in peer["addresses"]
    finally:
        _stop(share)


def test_share_public_without_registry_is_refused_before_sharing(tmp_path: Path) -> None:
    alice = tmp_path / "alice"
    _init(alice, "alice-pc", _free_udp_port())
    done = gpumesh(alice, "share", "--public")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: no registry is configured: set one with `gpumesh config set rendezvous_url "
        "http://HOST:47080` (a gpumesh-registry)"
    ]
    assert not shares(alice)


def test_share_public_show_addresses_puts_them_in_the_listing(
    homes: tuple[Path, Path, str],
) -> None:
    alice, bob, _url = homes
    port = gpumesh(alice, "config", "get", "listen_port").stdout.strip()
    share = _share(alice, "--public", "--show-addresses")
    try:
        assert f"with its addresses (127.0.0.1:{port}" in share.banner  # type: ignore[attr-defined]
        (found,) = _search(bob)
        addresses = found["addresses"]
        assert isinstance(addresses, list) and f"127.0.0.1:{port}" in addresses
        # what the running share read at start: config set says a restart applies it
        changed = gpumesh(alice, "config", "set", "announce_addresses", "true")
        assert changed.stdout.splitlines() == [
            "announce_addresses = true",
            "The running `gpumesh share` read announce_addresses when it started: restart it "
            "(`gpumesh share stop`, then `gpumesh share ...`) for this to take effect.",
        ]
    finally:
        _stop(share)
    quiet = gpumesh(alice, "config", "set", "announce_addresses", "false")
    assert quiet.stdout.splitlines() == ["announce_addresses = false"]


@pytest.mark.parametrize(
    "flags", [("--show-addresses",), ("--region", "eu-west"), ("--contact", "me@example.org")]
)
def test_listing_flags_without_public_are_refused_before_sharing(
    tmp_path: Path, flags: tuple[str, ...]
) -> None:
    """--region and --contact without --public were ignored: a user who forgot
    --public believed the node listed."""
    alice = tmp_path / "alice"
    _init(alice, "alice-pc", _free_udp_port())
    done = gpumesh(alice, "share", *flags)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: {flags[0]} is for the public listing: use it with --public (it would change "
        "nothing without it)"
    ]
    assert not shares(alice)


def test_sync_without_registry_says_so_and_dials(tmp_path: Path) -> None:
    bob = tmp_path / "bob"
    _init(bob, "bob-laptop")
    done = gpumesh(bob, "sync")
    assert done.returncode == 0, done.stderr
    said = "No registry configured (rendezvous_url): refreshed from paired peers only."
    assert said in done.stdout
    assert "No paired peers." in done.stdout


def test_sync_says_a_registry_failure_once_not_on_every_peer_row(tmp_path: Path) -> None:
    bob = tmp_path / "bob"
    _init(bob, "bob-laptop")
    for name in ("alice-pc", "carol-box"):
        peer = tmp_path / name
        _init(peer, name, _free_udp_port())
        code = gpumesh(peer, "pair-code").stdout.strip()
        assert gpumesh(bob, "pair", "--offline", code).returncode == 0
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
    assert gpumesh(bob, "config", "set", "rendezvous_url", url).returncode == 0
    done = gpumesh(bob, "sync", "--no-dial", "--timeout", "5")
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if url in line]
    assert len(lines) == 2, done.stdout  # the re-publish line, and the failure once
    assert lines[1].startswith("The registry could not be asked for any peer: ")
    assert "alice-pc" in done.stdout and "carol-box" in done.stdout


def test_sync_rejects_an_address_record_signed_by_another_key(
    homes: tuple[Path, Path, str],
) -> None:
    alice, bob, _url = homes
    assert gpumesh(bob, "pair", gpumesh(alice, "pair-code").stdout.strip()).returncode == 0
    (before,) = json.loads(gpumesh(bob, "peers", "--json").stdout)
    mallory = Identity.generate()
    theirs = sign_record(
        mallory, address_record_of(mallory, SequenceClock().next(), ["127.0.0.1:9"], "")
    )
    with _ForgingRegistry(_wire(theirs)) as fake:
        gpumesh(bob, "config", "set", "rendezvous_url", fake.url)
        done = gpumesh(bob, "sync", "--json", "--no-dial")
        assert done.returncode == 0, done.stderr
        (peer,) = json.loads(done.stdout)["peers"]
        assert peer["moved"] is False
        assert "signed by another key" in peer["note"]
        # A dial that fails does not take the forged addresses either.
        refused = gpumesh(bob, "connect", "alice-pc")
        assert refused.returncode == 4
    (after,) = json.loads(gpumesh(bob, "peers", "--json").stdout)
    assert after["addresses"] == before["addresses"]


def test_sync_asks_a_share_to_republish_and_a_plain_share_survives_it(
    homes: tuple[Path, Path, str],
) -> None:
    alice, _bob, url = homes
    share = _share(alice)  # publishes nothing
    try:
        done = gpumesh(alice, "sync", "--json")
        assert done.returncode == 0, done.stderr
        # The node process shares, and re-publishes when asked.
        assert json.loads(done.stdout)["republished_by"] == wait_shares(alice)["agent"]["pid"]
        stopped = gpumesh(alice, "share", "stop")
        assert stopped.returncode == 0, stopped.stderr
        share.communicate(timeout=30)
        assert share.returncode == 0
    finally:
        if share.poll() is None:
            _stop(share)
    assert url
