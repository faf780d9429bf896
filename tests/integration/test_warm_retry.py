"""A warm session that dies under a request: the request is sent once more on a
session dialled afresh, when it is safe to send twice. Real agents in-process over
real QUIC, a real pool of warm sessions, Docker running the offline busybox image.

The provider's side cuts the link itself, at the worst moment for a run: the job
is recorded and started there, and its acceptance never reached the consumer."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from gpumesh.agent.deps import RequestContext
from gpumesh.agent.server import Agent
from gpumesh.client import pool
from gpumesh.client.jobrefresh import refresh_jobs
from gpumesh.client.jobs import cancel_job, run_job
from gpumesh.client.node import Node
from gpumesh.client.pool import SessionPool
from gpumesh.errors import GPUMeshError
from gpumesh.protocol.messages import JobCancel, JobQuery, JobSubmit, Message
from gpumesh.protocol.states import FINAL_STATES, JobRole, JobState
from gpumesh.transport.stream import Stream
from tests.integration.conftest import arun, job_nodes, pair_both, sharing
from tests.integration.test_jobs import Collected, providing, spec

pytestmark = pytest.mark.usefixtures("docker_daemon")


@pytest.fixture
def cluster(make_node: Callable[[str], Node], engine: Any) -> Iterator[Callable[[str], Node]]:
    with job_nodes(make_node, "256MB") as factory:
        yield factory


@contextlib.asynccontextmanager
async def _pooled(alice: Node, bob: Node) -> AsyncIterator[Agent]:
    """alice shares, both paired, and bob keeps warm sessions (a pool of its own)."""
    async with sharing(alice) as agent:
        pair_both(alice, bob)
        bob.pool = SessionPool()
        try:
            yield agent
        finally:
            bob.pool.close()


async def _started(node: Node, job_id: str) -> None:
    """Until the provider has the job past its upload (a generous ceiling)."""
    for _ in range(600):
        job = node.home.store.job(JobRole.HOSTED, job_id)
        if job is not None and job.state != JobState.UPLOADING:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"job {job_id} never started")


def _close_on_first(agent: Agent, kind: type[JobQuery] | type[JobCancel]) -> list[Message]:
    """The first request of ``kind`` closes the link it came on, unanswered; later ones
    are served as ever. The requests that closed a link."""
    handle = agent.handlers[kind]
    closed: list[Message] = []

    async def closing(ctx: RequestContext, message: JobQuery | JobCancel) -> None:
        if not closed:
            closed.append(message)
            ctx.link.close()
            return
        await handle(ctx, message)

    agent.handlers[kind] = closing
    return closed


def _silence(stream: Stream) -> None:
    """Nothing the handler answers on ``stream`` leaves."""

    async def nothing(*args: object, **kwargs: object) -> None:
        return None

    for name in ("send_message", "end_data", "finish", "refuse"):
        setattr(stream, name, lambda *args, **kwargs: None)
    stream.send_data = nothing  # type: ignore[method-assign]


def _cut_after_start(agent: Agent, node: Node) -> list[str]:
    """The next ``JobSubmit`` is served (the job starts), its answers are held back,
    and the link it came on is closed; later ones are served as ever. The job ids
    cut so, in order."""
    handle = agent.handlers[JobSubmit]
    cut: list[str] = []

    async def cutting(ctx: RequestContext, message: JobSubmit) -> None:
        if cut:
            await handle(ctx, message)
            return
        cut.append(message.job_id)
        _silence(ctx.stream)
        served = asyncio.ensure_future(handle(ctx, message))
        await _started(node, message.job_id)
        ctx.link.close()
        with contextlib.suppress(GPUMeshError, OSError):
            await served

    agent.handlers[JobSubmit] = cutting
    return cut


def test_a_run_whose_warm_session_died_before_its_acceptance_is_sent_again_and_runs_once(
    cluster: Callable[[str], Node],
) -> None:
    alice, bob = cluster("alice"), cluster("bob")

    async def scenario() -> None:
        async with _pooled(alice, bob) as agent:
            first = await run_job(bob, spec("alice", "sh", "-c", "echo one"))
            assert first.exit_code == 0
            cut = _cut_after_start(agent, alice)
            got = Collected()
            second = await run_job(bob, spec("alice", "sh", "-c", "echo two"), callbacks=got)
            assert cut == [second.job_id]  # the session it was lent died under it
            assert (second.state, second.exit_code) == ("succeeded", 0)
            assert bytes(got.out) == b"two\n"
            hosted = {job.job_id: job for job in alice.home.store.jobs(role="hosted")}
            assert sorted(hosted) == sorted([first.job_id, second.job_id])
            assert hosted[second.job_id].attempt == 1  # never started twice

    arun(scenario())


def test_job_queries_whose_warm_session_closed_under_them_are_asked_again(
    cluster: Callable[[str], Node],
) -> None:
    alice, bob = cluster("alice"), cluster("bob")

    async def scenario() -> None:
        async with _pooled(alice, bob) as agent:
            done = await run_job(bob, spec("alice", "sh", "-c", "echo one"), detach=True)
            for _ in range(600):  # a generous ceiling
                hosted = alice.home.store.job(JobRole.HOSTED, done.job_id)
                if hosted is not None and hosted.state in FINAL_STATES:
                    break
                await asyncio.sleep(0.05)
            closed = _close_on_first(agent, JobQuery)
            unconfirmed = await refresh_jobs(bob, timeout=30)
            assert closed == [JobQuery(job_id=done.job_id, knows_preempted=True)]
            assert unconfirmed == []
            record = bob.home.store.job(JobRole.SUBMITTED, done.job_id)
            assert record is not None and record.state == JobState.SUCCEEDED

    arun(scenario())


def _vanish(agent: Agent) -> int:
    """Stop ``agent`` as a killed process would: no link hears of it. Its port."""
    assert agent.endpoint is not None
    port = agent.endpoint.local_address[1]
    for link in list(agent.endpoint.links):
        link.cancel_timer()
    agent.endpoint.links.clear()
    agent.stop()
    return port


def test_a_run_lent_a_warm_session_its_restarted_provider_no_longer_knows_dials_again(
    cluster: Callable[[str], Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The provider went and came back on the same port within the seconds a warm
    session is lent without a ping (made long here, so the lend never pings): the
    new agent drops the old connection's packets without a word. The submit and a
    ping go unanswered for ``PROBE_TIMEOUT`` seconds each, then the run is sent on
    a new session."""
    monkeypatch.setattr(pool, "PROBE_AFTER", 3600.0)
    alice, bob = cluster("alice"), cluster("bob")

    async def scenario() -> None:
        bob.pool = SessionPool()
        try:
            async with sharing(alice) as first_agent:
                pair_both(alice, bob)
                first = await run_job(bob, spec("alice", "sh", "-c", "echo one"))
                assert first.exit_code == 0
                port = _vanish(first_agent)
            (old,) = bob.pool.sessions()
            async with providing(alice, port=port):
                got = Collected()
                second = await run_job(bob, spec("alice", "sh", "-c", "echo two"), callbacks=got)
                assert (second.state, second.exit_code) == ("succeeded", 0)
                assert bytes(got.out) == b"two\n"
                (new,) = bob.pool.sessions()
                assert new.session is not old.session and old.session.link.is_closed
                hosted = alice.home.store.job(JobRole.HOSTED, second.job_id)
                assert hosted is not None and hosted.attempt == 1
        finally:
            bob.pool.close()

    arun(scenario())


def test_a_cancel_whose_warm_session_closed_under_it_is_sent_again(
    cluster: Callable[[str], Node],
) -> None:
    alice, bob = cluster("alice"), cluster("bob")

    async def scenario() -> None:
        async with _pooled(alice, bob) as agent:
            job = await run_job(bob, spec("alice", "sleep", "60"), detach=True)
            closed = _close_on_first(agent, JobCancel)
            result = await cancel_job(bob, "alice", job.job_id)
            assert closed == [JobCancel(job_id=job.job_id, knows_preempted=True)]
            assert result.state == "cancelled"
            hosted = alice.home.store.job(JobRole.HOSTED, job.job_id)
            assert hosted is not None and hosted.state == JobState.CANCELLED

    arun(scenario())
