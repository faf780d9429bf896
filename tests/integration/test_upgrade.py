"""Homes made by an earlier release open, migrate and keep working.

``fixtures/previous-release/`` holds two homes (alice-pc submitted jobs and copied a
file to bob-box, who shared; both paired; a group on alice) exactly as the
release before the store's migrations 6-11 left them: schema version 5. Each home's
``gpumesh.sql`` is SQLite's dump of its ``gpumesh.db`` (text, so a review can read
it) with its ``PRAGMA user_version``; ``identity.key`` and ``config.toml`` are the
files as written then. ``fixtures/this-release/`` is the same flow made by this
release, kept for the next one to test against: when a migration is added, the
fixtures stay as they are and this test proves they still open.

The UDP ports in the fixtures are replaced by free ones before use, so nothing
depends on a fixed port being free.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumesh.store.db import SCHEMA_VERSION
from tests.integration.conftest import gpumesh, remove_containers
from tests.integration.node import wait_shares

pytestmark = pytest.mark.usefixtures("gpumesh_processes")

IMAGE = os.environ.get("GPUMESH_TEST_DOCKER_IMAGE", "gpumesh-test/busybox:1")
FIXTURES = Path(__file__).parent / "fixtures"
RELEASES = ["previous-release", "this-release"]


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _materialise(release: str, into: Path) -> dict[str, Path]:
    """Write the fixture's homes under ``into`` with fresh ports; {name: home}."""
    source = FIXTURES / release
    ports = {}
    for name in ("alice", "bob"):
        config = (source / name / "config.toml").read_text()
        match = re.search(r"^listen_port = (\d+)$", config, re.MULTILINE)
        assert match is not None
        ports[match.group(1)] = str(_free_udp_port())
    homes = {}
    for name in ("alice", "bob"):
        home = into / name
        shutil.copytree(
            source / name, home, ignore=shutil.ignore_patterns("gpumesh.sql", "expected.json")
        )
        home.chmod(0o700)
        (home / "identity.key").chmod(0o600)
        config, dump = (
            (home / "config.toml").read_text(),
            (source / name / "gpumesh.sql").read_text(),
        )
        for old, new in ports.items():
            config = config.replace(f"listen_port = {old}", f"listen_port = {new}")
            dump = dump.replace(f":{old}", f":{new}")
        (home / "config.toml").write_text(config)
        db = sqlite3.connect(home / "gpumesh.db")
        db.executescript(dump)
        db.close()
        homes[name] = home
    return homes


def _version(home: Path) -> int:
    db = sqlite3.connect(home / "gpumesh.db")
    try:
        return int(db.execute("PRAGMA user_version").fetchone()[0])
    finally:
        db.close()


@pytest.fixture(params=RELEASES)
def old_homes(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, Path]]:
    homes = _materialise(str(request.param), tmp_path)
    homes["expected"] = FIXTURES / str(request.param) / "expected.json"
    yield homes
    remove_containers(_node_id(homes["bob"]))


def _node_id(home: Path) -> str:
    status = gpumesh(home, "status", "--json", "--offline")
    return str(json.loads(status.stdout)["node_id"])


def _start_share(home: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpumesh", "share"],
        env=dict(os.environ, GPUMESH_HOME=str(home)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_shares(home, proc)
    except AssertionError:
        proc.kill()
        raise
    return proc


def test_the_previous_release_is_older_than_this_schema(tmp_path: Path) -> None:
    """Else the migration test below would prove nothing."""
    homes = _materialise("previous-release", tmp_path)
    assert {_version(home) for home in homes.values()} == {5}
    assert SCHEMA_VERSION > 5


def test_an_earlier_home_migrates_and_keeps_its_peers_jobs_groups_and_files(
    old_homes: dict[str, Path], docker_daemon: None
) -> None:
    alice, bob = old_homes["alice"], old_homes["bob"]
    expected = json.loads(old_homes["expected"].read_text())
    submitted: dict[str, str] = expected["submitted"]
    finished, left_queued = sorted(submitted, key=lambda job: submitted[job] == "queued")
    for home, other in ((alice, "bob-box"), (bob, "alice-pc")):
        peers = gpumesh(home, "peers", "--json")
        assert peers.returncode == 0, peers.stderr
        assert [(p["name"], p["allowed"]) for p in json.loads(peers.stdout)] == [(other, True)]
        assert _version(home) == SCHEMA_VERSION
        assert gpumesh(home, "config", "show").returncode == 0

    jobs = gpumesh(alice, "jobs", "--json", "--offline")
    assert jobs.returncode == 0, jobs.stderr
    assert {j["job_id"]: j["state"] for j in json.loads(jobs.stdout)} == submitted
    groups = gpumesh(alice, "group", "list", "--json")
    assert groups.returncode == 0, groups.stderr
    assert [g["name"] for g in json.loads(groups.stdout)] == ["lab"]

    # bob hosted both; its event log still replays the old job's output.
    hosted = gpumesh(bob, "logs", finished)
    assert hosted.returncode == 0, hosted.stderr
    assert "hello from the old release" in hosted.stdout

    # And they still work together: bob shares, alice refreshes the job that was
    # left `queued`, fetches the file copied back then, and runs a new job.
    share = _start_share(bob)
    try:
        jobs = gpumesh(alice, "jobs", "--json", timeout=60)
        assert jobs.returncode == 0, jobs.stderr
        states = {j["job_id"]: j["state"] for j in json.loads(jobs.stdout)}
        assert states == dict(submitted, **{left_queued: "succeeded"})
        target = alice.parent / "f.txt"
        copied = gpumesh(alice, "cp", "bob-box:/datasets/f.txt", str(target), timeout=60)
        assert copied.returncode == 0, copied.stderr
        assert target.read_text() == "data\n"
        run = gpumesh(
            alice,
            "run",
            "--peer",
            "bob-box",
            "--image",
            IMAGE,
            "--",
            "echo",
            "still here",
            timeout=120,
        )
        assert run.returncode == 0, run.stderr
        assert run.stdout == "still here\n"
    finally:
        share.send_signal(signal.SIGINT)
        share.wait(timeout=30)
        if share.stderr is not None:
            share.stderr.close()
