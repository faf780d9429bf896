"""A node running GPUMesh jobs is busy whatever its GPUs: real `gpumesh share`
processes without GPUs, a real Docker CPU job, the real CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.conftest import gpumesh
from tests.integration.conftest import ok as _ok

pytestmark = pytest.mark.usefixtures("gpumesh_processes")


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
