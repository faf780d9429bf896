"""The owner comes first, between real nodes and real Docker: a process of the
owner's on one GPU reclaims that GPU only (its job ends ``preempted`` with the
reason, on the provider and in the consumer's ``jobs --json``; the job on the
other GPU runs on), while a process named in ``reclaim_ignore`` and a process
inside a job's own container reclaim nothing; the GPU is offered again once the
owner's process is gone for ``reclaim_grace`` (2 s here).

No NVIDIA hardware here: two simulated GPUs, whose processes the test writes in
the file named by ``GPUMESH_TEST_SIMULATED_GPU_PROCESSES``. Docker has no NVIDIA
runtime either, so the provider's runtime creates each job's container without
its device request (the job's record keeps its GPU, as on a machine with one).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpumesh.agent.server import Agent
from gpumesh.client.jobrefresh import refresh_jobs
from gpumesh.client.jobs import run_job
from gpumesh.client.node import Node
from gpumesh.client.views.joblist import JobListEntry
from gpumesh.client.views.node import StatusView
from gpumesh.errors import LimitError
from gpumesh.gpu.inventory import ENV_SIMULATED, ENV_SIMULATED_PROCESSES, SimulatedInventory
from gpumesh.runtime.base import ContainerSpec
from gpumesh.runtime.docker import DockerRuntime
from tests.integration.conftest import arun, job_nodes, pair_both, until_async, until_hosted
from tests.integration.test_jobs import spec

pytestmark = pytest.mark.usefixtures("docker_daemon")

GB = 1000**3
GPUS = "A:24GB,B:24GB"


class _NoDeviceRequests(DockerRuntime):
    """Docker without NVIDIA's runtime: containers are made without their GPUs."""

    def create(self, spec: ContainerSpec) -> str:
        return super().create(dataclasses.replace(spec, gpu_ids=[]))


@pytest.fixture
def cluster(make_node, engine) -> Iterator[Callable[[str], Node]]:
    with job_nodes(make_node, "64MB") as factory:
        yield factory


@contextlib.asynccontextmanager
async def providing(node: Node) -> AsyncIterator[Agent]:
    runtime = _NoDeviceRequests()
    agent = Agent(
        node.home,
        host="127.0.0.1",
        port=0,
        runtime=runtime,
        inventory=SimulatedInventory(GPUS),
    )
    await agent.start()
    try:
        yield agent
    finally:
        agent.stop()
        runtime.close()


async def _looks(agent: Agent, more: int) -> None:
    """Wait until the reclaimer took ``more`` looks at the GPUs (the file as it is now)."""
    seen = agent.reclaimer.looks
    await until_async(lambda: agent.reclaimer.looks >= seen + more, f"{more} looks at the GPUs")


def _hosted(node: Node, job_id: str) -> Any:
    return node.home.store.job("hosted", job_id)


def test_an_owner_process_reclaims_only_its_gpu_and_it_is_offered_again(
    cluster, engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    listing = tmp_path / "gpu-processes"
    monkeypatch.setenv(ENV_SIMULATED_PROCESSES, str(listing))
    monkeypatch.setenv(ENV_SIMULATED, GPUS)  # what `status` reads of this machine
    alice, bob = cluster("alice"), cluster("bob")
    alice.home.config.set("reclaim_grace", "2s")
    alice.home.config.save()

    async def scenario() -> None:
        async with providing(alice) as agent:
            pair_both(alice, bob)
            # Each takes the GPU with the most room: the first GPU 0, the second GPU 1.
            on_0 = await run_job(
                bob, spec("alice", "sleep", "600", gpu_memory=10 * GB), detach=True
            )
            on_1 = await run_job(
                bob, spec("alice", "sleep", "600", gpu_memory=10 * GB), detach=True
            )
            for job in (on_0, on_1):
                await until_hosted(alice, job.job_id, "running")
            assert (_hosted(alice, on_0.job_id).gpus, _hosted(alice, on_1.job_id).gpus) == (
                ["0"],
                ["1"],
            )

            # A job's own process, and the display server: GPUMesh's and ignored.
            container = _hosted(alice, on_1.job_id).container_id
            pid = engine.api.inspect_container(container)["State"]["Pid"]
            listing.write_text(f"1 {pid} sleep compute\n0 4242 Xorg graphics\n")
            await _looks(agent, 2)
            assert agent.gpus.withheld() == {}
            assert [_hosted(alice, j.job_id).state for j in (on_0, on_1)] == ["running"] * 2

            # The owner starts a game on GPU 1: its job only is stopped, with the reason.
            with listing.open("a") as more:
                more.write("1 4343 game graphics\n")
            await until_hosted(alice, on_1.job_id, "preempted")
            reason = "alice's owner is using GPU 1 (game)"
            assert _hosted(alice, on_1.job_id).message == reason
            assert _hosted(alice, on_0.job_id).state == "running"
            await refresh_jobs(bob)
            seen = JobListEntry.of(bob.home.store.job("submitted", on_1.job_id), {})
            assert (seen.state, seen.message) == ("preempted", reason)
            with pytest.raises(LimitError) as refused:  # GPU 0 has 14GB left, GPU 1 is the game's
                await run_job(bob, spec("alice", "true", gpu_memory=20 * GB), detach=True)
            assert "GPU 1 (game) of alice is in use by its owner" in refused.value.message
            status = StatusView.of(alice.status(), submitted_unknown=0)  # `status --json`
            assert [gpu.owner for gpu in status.gpus] == ["", "game"]

            # The game ends: GPU 1 is offered again after the grace.
            listing.write_text("")
            await until_async(lambda: not agent.gpus.withheld(), "GPU 1 to be offered again")
            again = await run_job(
                bob, spec("alice", "sleep", "600", gpu_memory=20 * GB), detach=True
            )
            assert _hosted(alice, again.job_id).gpus == ["1"]
            assert _hosted(alice, on_0.job_id).state == "running"

    arun(scenario())


def test_config_set_refuses_a_bad_reclaim_grace_or_ignore_in_one_line(
    tmp_path: Path, gpumesh_processes: None
) -> None:
    from tests.integration.conftest import gpumesh
    from tests.integration.test_cli import _init, _one_line_error

    home = tmp_path / "a"
    _init(home, "alice-pc")
    for key, value, message in [
        ("reclaim_grace", "soon", "invalid reclaim_grace 'soon': use a duration such as 30s"),
        ("reclaim_grace", "-5s", "invalid reclaim_grace '-5s': it cannot be negative"),
        ("reclaim_ignore", "my game", "invalid reclaim_ignore 'my game': give process names"),
        ("reclaim_ignore", "kwin_wayland_wrapper", "use 'kwin_wayland_wr'"),
    ]:
        # `--`: else click reads -5s as an option
        _one_line_error(gpumesh(home, "config", "set", key, "--", value), 2, message)
    assert gpumesh(home, "config", "set", "reclaim_grace", "2s").returncode == 0
    assert gpumesh(home, "config", "get", "reclaim_grace").stdout.strip() == "2s"
