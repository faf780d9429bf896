"""A node running GPUMesh jobs is busy whatever its GPUs: real `gpumesh share`
processes without GPUs, a real Docker CPU job, the real CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import gpumesh, remove_containers
from tests.integration.test_cli import _free_udp_port, _init, _start_share

pytestmark = pytest.mark.usefixtures("gpumesh_processes")


def _ok(home: Path, *args: str, timeout: float = 30) -> str:
    result = gpumesh(home, *args, timeout=timeout)
    assert result.returncode == 0, (args, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    return result.stdout + result.stderr


@pytest.fixture
def trio(tmp_path: Path) -> Iterator[tuple[Path, Path, Path]]:
    """alice-pc and carol share (no GPUs, simulated or real); bob is paired with both
    and has them in his group `research`."""
    image = os.environ.get("GPUMESH_TEST_DOCKER_IMAGE", "gpumesh-test/busybox:1")
    alice, carol, bob = tmp_path / "a", tmp_path / "c", tmp_path / "b"
    _init(alice, "alice-pc", _free_udp_port())
    _init(carol, "carol", _free_udp_port())
    _init(bob, "bob-laptop")
    for home in (alice, carol, bob):
        _ok(home, "config", "set", "image", image)
    shares: list[subprocess.Popen[str]] = []
    try:
        for provider in (alice, carol):
            shares.append(_start_share(provider))
            _ok(bob, "pair", _ok(provider, "pair-code").strip(), "--offline")
            _ok(provider, "pair", _ok(bob, "pair-code").strip(), "--offline")
        _ok(bob, "group", "create", "research")
        _ok(bob, "group", "add", "research", "alice-pc")
        _ok(bob, "group", "add", "research", "carol")
        yield alice, carol, bob
    finally:
        for share in shares:
            if share.poll() is None:
                share.send_signal(signal.SIGINT)
                share.wait(timeout=15)
            for pipe in (share.stdout, share.stderr):
                if pipe is not None:
                    pipe.close()
        for provider in (alice, carol):
            remove_containers(json.loads(_ok(provider, "status", "--json"))["node_id"])


def test_a_cpu_node_running_a_job_is_busy_and_not_chosen(
    trio: tuple[Path, Path, Path],
) -> None:
    alice, carol, bob = trio
    job_id = _ok(bob, "run", "--peer", "alice-pc", "--detach", "--", "sleep", "120").split()[-1]
    try:
        status = json.loads(_ok(alice, "status", "--json"))
        assert status["state"] == "busy"
        assert "Jobs     busy: 1 running here" in _ok(alice, "status")
        assert json.loads(_ok(carol, "status", "--json"))["state"] == "idle"

        listed = json.loads(_ok(bob, "group", "members", "research", "--json"))
        members = {m["name"]: m for m in listed}
        assert members["alice-pc"]["state"] == "busy"
        assert members["carol"]["state"] == "idle"

        # Both are CPU-only and equally near: only alice-pc's job tells them apart.
        explained = _ok(bob, "run", "--group", "research", "--explain", "--", "true", timeout=60)
        assert "placing on carol: CPU only" in explained
        assert "alice-pc: skipped: busy (1 GPUMesh job running)" in explained
    finally:
        _ok(bob, "cancel", "--peer", "alice-pc", job_id)


def test_every_member_busy_is_refused_with_the_reason(trio: tuple[Path, Path, Path]) -> None:
    _alice, _carol, bob = trio
    jobs = [
        (peer, _ok(bob, "run", "--peer", peer, "--detach", "--", "sleep", "120").split()[-1])
        for peer in ("alice-pc", "carol")
    ]
    try:
        refused = gpumesh(bob, "run", "--group", "research", "--", "true", timeout=60)
        assert refused.returncode != 0
        assert "no member can take the job" in refused.stderr
        assert "alice-pc: busy (1 GPUMesh job running)" in refused.stderr
        assert "carol: busy (1 GPUMesh job running)" in refused.stderr
        assert "Traceback" not in refused.stderr
    finally:
        for peer, job_id in jobs:
            _ok(bob, "cancel", "--peer", peer, job_id)
