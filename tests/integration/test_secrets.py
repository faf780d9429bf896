"""Secrets at rest and in logs: the agent's home modes, a job's environment never logged."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpumesh.client.jobs import run_job
from gpumesh.client.jobspec import JobSpec
from gpumesh.client.node import Node
from gpumesh.errors import GPUMeshError
from tests.integration.conftest import arun, pair_both, remove_containers, sharing

IMAGE = os.environ.get("GPUMESH_TEST_DOCKER_IMAGE", "gpumesh-test/busybox:1")
SECRET = "sk-live-7d41c09e2b"


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_sharing_narrows_the_home_again(make_node: Callable[[str], Node]) -> None:
    alice = make_node("alice")
    home = alice.home
    home.path.chmod(0o755)
    home.config_path.chmod(0o644)
    home.db_path.chmod(0o644)

    async def scenario() -> None:
        async with sharing(alice):
            assert _mode(home.path) == 0o700
            assert _mode(home.config_path) == 0o600
            assert _mode(home.db_path) == 0o600

    arun(scenario())


@pytest.fixture
def job_nodes(make_node: Callable[[str], Node]) -> Iterator[tuple[Node, Node]]:
    """alice provides with the test image, bob submits; alice's containers go afterwards."""
    alice, bob = make_node("alice"), make_node("bob")
    for node in (alice, bob):
        node.home.config.set("image", IMAGE)
        node.home.config.set("job_memory", "256MB")
        node.home.config.save()
    yield alice, bob
    remove_containers(str(alice.info().node_id))


def _spec(env: dict[str, str]) -> JobSpec:
    return JobSpec(
        image=IMAGE,
        command=["sh", "-c", 'test -n "$API_TOKEN"'],
        env=env,
        workdir=None,
        gpu_memory=0,
        retries=0,
        timeout=0.0,
        peer="alice",
        group=None,
    )


@pytest.mark.usefixtures("docker_daemon")
def test_a_jobs_environment_never_reaches_the_log(
    job_nodes: tuple[Node, Node], caplog: pytest.LogCaptureFixture
) -> None:
    alice, bob = job_nodes
    caplog.set_level(logging.DEBUG, logger="gpumesh")

    async def scenario() -> None:
        async with sharing(alice):
            pair_both(alice, bob)
            result = await run_job(bob, _spec({"API_TOKEN": SECRET}))
            assert (result.state, result.exit_code) == ("succeeded", 0)
            # Docker's refusal of a NUL would quote the variable, value and all.
            with pytest.raises(GPUMeshError) as refused:
                await run_job(bob, _spec({"API_TOKEN": f"{SECRET}\0rest"}))
            assert SECRET not in str(refused.value)

    arun(scenario())
    assert caplog.records
    assert SECRET not in caplog.text
    for record in caplog.records:
        assert SECRET not in record.getMessage()
