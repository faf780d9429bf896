"""Fixtures shared by every test folder."""

from __future__ import annotations

import os

import pytest


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


@pytest.fixture
def docker_daemon() -> None:
    """Require a running Docker daemon: skipped on a laptop without one, never in CI."""
    if _in_ci():
        return
    if os.environ.get("GPUMESH_TEST_NO_DOCKER") == "1":
        pytest.skip("Docker not available (GPUMESH_TEST_NO_DOCKER=1)")
    import docker
    from docker.errors import DockerException

    try:
        client = docker.from_env(timeout=3)
        client.ping()
        client.close()
    except DockerException:
        pytest.skip("no Docker daemon reachable")
