"""``gpumesh search`` and ``gpumesh-registry`` as users run them: real processes."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gpumesh.client.registry import RegistryClient, SequenceClock, listing_of
from gpumesh.identity.keys import Identity
from gpumesh.protocol.listing import GpuListing
from gpumesh.registry.config import RegistryConfig
from tests.integration.conftest import gpumesh
from tests.integration.public_registry import serve_registry

pytestmark = pytest.mark.usefixtures("gpumesh_processes")

GIB = 1 << 30


def _home(tmp_path: Path, url: str = "") -> Path:
    home = tmp_path / "bob"
    assert gpumesh(home, "init", "--name", "bob").returncode == 0
    if url:
        assert gpumesh(home, "config", "set", "rendezvous_url", url).returncode == 0
    return home


def test_search_table_json_and_what_to_do_next(tmp_path: Path) -> None:
    with serve_registry(str(tmp_path / "r.db"), RegistryConfig()) as registry:
        alice = Identity.generate()
        RegistryClient(registry.url).publish(
            alice,
            listing_of(
                alice,
                SequenceClock(registry.clock).next(),
                name="alice-pc",
                gpus=[GpuListing("NVIDIA GeForce RTX 4090", 24 * GIB, 20 * GIB)],
                idle=True,
                region="us-west",
                contact="matrix:@alice:example.org",
                version="0.1.0",
            ),
        )
        home = _home(tmp_path, registry.url)
        shown = gpumesh(home, "search", "--gpu", "4090", "--vram", "8GB", "--idle")
        assert shown.returncode == 0, shown.stderr
        assert "alice-pc" in shown.stdout and "matrix:@alice:example.org" in shown.stdout
        assert "idle" in shown.stdout and "us-west" in shown.stdout
        assert "contact the owner" in shown.stdout and "gpumesh pair" in shown.stdout
        data = json.loads(gpumesh(home, "search", "--region", "us-west", "--json").stdout)
        assert list(data) == ["listings", "next"]
        (listing,) = data["listings"]
        assert list(listing) == [
            "node_id",
            "name",
            "gpus",
            "idle",
            "region",
            "contact",
            "version",
            "addresses",
            "published_at",
        ]
        assert listing["node_id"] == str(alice.node_id)
        assert listing["gpus"] == [
            {"name": "NVIDIA GeForce RTX 4090", "memory_total": 24 * GIB, "memory_free": 20 * GIB}
        ]
        none = gpumesh(home, "search", "--gpu", "5090")
        assert none.returncode == 0 and "No listing matches" in none.stdout


def test_search_without_registry_or_with_one_down(tmp_path: Path) -> None:
    home = _home(tmp_path)
    unset = gpumesh(home, "search")
    assert unset.returncode == 2
    assert unset.stderr.strip().splitlines() == [
        "error: no registry is configured: set one with `gpumesh config set rendezvous_url "
        "http://HOST:47080` (a gpumesh-registry)"
    ]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    gpumesh(home, "config", "set", "rendezvous_url", f"http://127.0.0.1:{port}")
    down = gpumesh(home, "search")
    assert down.returncode == 4
    assert len(down.stderr.strip().splitlines()) == 1
    assert "is unreachable" in down.stderr and "rendezvous_url" in down.stderr


def test_registry_port_taken_is_one_line_naming_listen(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "gpumesh.registry.main",
                "--listen",
                f"127.0.0.1:{port}",
                "--db",
                str(tmp_path / "r.db"),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}: the port is taken" in lines[0]
    assert "--listen" in lines[0]


def test_registry_bad_db_url_is_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpumesh.registry.main",
            "--listen",
            "127.0.0.1:0",
            "--db",
            "mysql://x",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: unsupported --db mysql://…: use a SQLite file path or a "
        "postgresql://user:password@host/database URL"
    ]
