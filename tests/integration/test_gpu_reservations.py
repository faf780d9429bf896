"""The provider's GPU allocator between real nodes: what a job is promised shows in
``status`` (so in placement), holds across a restart of the agent, refuses an
over-commit, and is given back when the job ends.

No NVIDIA hardware here: the inventory is the explicit simulated one, so a GPU
job's container cannot start; each attempt fails and, with its backoff pushed
far out, the job waits in ``retrying``, still holding its promise.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TypeVar

import pytest

from gpumesh.agent.server import Agent
from gpumesh.client.jobs import cancel_job, run_job
from gpumesh.client.node import Node
from gpumesh.errors import LimitError
from gpumesh.gpu.inventory import SimulatedInventory
from gpumesh.protocol.messages import StatusReply, StatusRequest
from gpumesh.runtime.docker import DockerRuntime
from tests.integration.conftest import arun, job_nodes, pair_both, until_hosted
from tests.integration.test_jobs import spec

pytestmark = pytest.mark.usefixtures("docker_daemon")

GB = 1000**3
T = TypeVar("T")


@pytest.fixture
def cluster(make_node, engine) -> Iterator[Callable[[str], Node]]:
    with job_nodes(make_node, "256MB") as factory:
        yield factory


@contextlib.asynccontextmanager
async def providing(node: Node, port: int = 0) -> AsyncIterator[Agent]:
    agent = Agent(node.home, host="127.0.0.1", port=port, inventory=SimulatedInventory("L4:24GB"))
    await agent.start()
    try:
        yield agent
    finally:
        agent.stop()


async def _gpu_figures(consumer: Node, provider: str) -> tuple[int, int]:
    """What ``provider`` tells peers of its one GPU: (available, holders)."""
    async with consumer.session(provider) as session:
        reply = await session.request(StatusRequest())
    assert isinstance(reply, StatusReply)
    (gpu,) = reply.gpus
    return gpu.available, gpu.jobs


def _slowly(call: Callable[..., T]) -> Callable[..., T]:
    """``call`` two seconds late (it runs in a worker thread)."""

    def late(*args: object, **kwargs: object) -> T:
        time.sleep(2)
        return call(*args, **kwargs)

    return late


def test_a_jobs_gpu_memory_is_promised_until_it_ends_and_across_a_restart(
    cluster, monkeypatch
) -> None:
    from gpumesh.agent import jobstate

    monkeypatch.setattr(jobstate, "backoff", lambda _attempt: 3600.0)
    alice, bob = cluster("alice"), cluster("bob")

    async def scenario() -> None:
        async with providing(alice) as agent:
            pair_both(alice, bob)
            port = agent.address[1]
            assert await _gpu_figures(bob, "alice") == (24 * GB, 0)
            job = await run_job(
                bob, spec("alice", "true", gpu_memory=10 * GB, retries=5), detach=True
            )
            await until_hosted(alice, job.job_id, "retrying")
            assert await _gpu_figures(bob, "alice") == (14 * GB, 1)
            with pytest.raises(LimitError, match="the most free on alice is 14GB"):
                await run_job(bob, spec("alice", "true", gpu_memory=20 * GB), detach=True)
            assert await _gpu_figures(bob, "alice") == (14 * GB, 1)  # the refusal holds nothing
        # A restarted agent promises the unfinished job's memory again before it serves.
        monkeypatch.setattr(DockerRuntime, "list_jobs", _slowly(DockerRuntime.list_jobs))
        async with providing(alice, port):
            assert await _gpu_figures(bob, "alice") == (14 * GB, 1)
            # The cancel comes before the restarted agent attached the job (its
            # recovery asks Docker first, slow here on purpose): it waits for that,
            # and does not leave the job to run again after its backoff.
            await cancel_job(bob, "alice", job.job_id)
            assert await _gpu_figures(bob, "alice") == (24 * GB, 0)
            assert alice.home.store.job("hosted", job.job_id).state == "cancelled"

    arun(scenario())
