"""A job's forwarded ports between real nodes on loopback, against the real Docker
engine: a busybox httpd and a busybox nc echo in the job's container reached from the
consumer's 127.0.0.1, on every path, and the refusals (another peer, another local
user, a port nothing listens on, a job that ended)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable, Iterator

import pytest

from gpumesh.client.jobs import cancel_job, run_job
from gpumesh.client.node import Node
from gpumesh.client.ports import ForwardReady, forward_ports
from gpumesh.errors import AccessDeniedError, AgentError, GPUMeshError, NotFoundError
from gpumesh.protocol.ports import PortSpec
from tests.conftest import OtherUser
from tests.integration.conftest import (
    arun,
    job_nodes,
    pair_both,
    sharing,
    until_async,
    until_hosted,
)
from tests.integration.test_jobs import spec

pytestmark = pytest.mark.usefixtures("docker_daemon")

CEILING = 30.0
"""Generous bound for anything that should be quick (the CI box is loaded)."""

SERVERS = (
    "mkdir -p /tmp/www && echo hello-from-the-job > /tmp/www/index.html && "
    "busybox httpd -f -p 8000 -h /tmp/www & "
    "busybox nc -ll -p 9000 -e /bin/cat & "
    "sleep 300"
)
"""An HTTP server on 8000 and a TCP echo on 9000 (both in the test image's busybox)."""


@pytest.fixture
def cluster(make_node: Callable[[str], Node]) -> Iterator[Callable[[str], Node]]:
    with job_nodes(make_node, "128MB") as factory:
        yield factory


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def http_get(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET / HTTP/1.0\r\nHost: localhost\r\n\r\n")
        await writer.drain()
        async with asyncio.timeout(CEILING):
            return await reader.read()
    finally:
        writer.close()


async def echo_round_trips(port: int, count: int = 3) -> list[bytes]:
    """A WebSocket-like exchange at the byte level: an upgrade request, then frames
    both ways on one connection, each answered before the next is sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    got = []
    try:
        frames = [b"GET /ws HTTP/1.1\r\nUpgrade: websocket\r\n\r\n"]
        frames += [bytes([0x81, 5]) + b"msg-%d" % i for i in range(count)]
        for frame in frames:
            writer.write(frame)
            await writer.drain()
            async with asyncio.timeout(CEILING):
                got.append(await reader.readexactly(len(frame)))
    finally:
        writer.close()
    return got


@contextlib.asynccontextmanager
async def forwarding(
    node: Node, job_id: str, specs: list[PortSpec], **callbacks: object
) -> AsyncIterator[tuple[ForwardReady, asyncio.Task[None]]]:
    readies: list[ForwardReady] = []
    task = asyncio.create_task(
        forward_ports(node, job_id, specs, ready=readies.append, **callbacks)  # type: ignore[arg-type]
    )
    async with asyncio.timeout(CEILING):
        while not readies:
            if task.done():
                task.result()
            await asyncio.sleep(0.02)
    try:
        yield readies[0], task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, GPUMeshError):
            await task


async def started(bob: Node, command: str = SERVERS) -> str:
    result = await run_job(bob, spec("alice", "sh", "-c", command), detach=True)
    return result.job_id


def test_http_and_a_websocket_like_echo_reach_the_jobs_container(
    cluster: Callable[[str], Node],
) -> None:
    alice, bob = cluster("alice"), cluster("bob")
    web, echo = free_port(), free_port()
    answered: list[PortSpec] = []

    async def scenario() -> None:
        async with sharing(alice):
            pair_both(alice, bob)
            job_id = await started(bob)
            await until_hosted(alice, job_id, "running")
            specs = [PortSpec(web, 8000), PortSpec(echo, 9000)]
            async with forwarding(bob, job_id, specs, answers=answered.append) as (ready, task):
                assert ready.provider == "alice"
                await until_async(lambda: len(answered) == 2, "both ports answer")
                page = await http_get(web)
                assert page.startswith(b"HTTP/1.") and b"hello-from-the-job" in page
                sent = [b"GET /ws HTTP/1.1\r\nUpgrade: websocket\r\n\r\n"]
                sent += [bytes([0x81, 5]) + b"msg-%d" % i for i in range(3)]
                assert await echo_round_trips(echo) == sent
                # The job's end ends the forward, and its local port closes.
                await cancel_job(bob, "alice", job_id)
                async with asyncio.timeout(CEILING):
                    with pytest.raises(NotFoundError, match="ended"):
                        await task
            with pytest.raises(OSError):
                socket.create_connection(("127.0.0.1", web), timeout=5).close()

    arun(scenario())
    assert sorted(s.container for s in answered) == [8000, 9000]


def test_a_port_nothing_listens_on_is_refused_per_connection(
    cluster: Callable[[str], Node],
) -> None:
    alice, bob = cluster("alice"), cluster("bob")
    local = free_port()
    warnings: list[GPUMeshError] = []

    async def scenario() -> None:
        async with sharing(alice):
            pair_both(alice, bob)
            job_id = await started(bob, "sleep 300")
            await until_hosted(alice, job_id, "running")
            specs = [PortSpec(local, 8888)]
            async with forwarding(bob, job_id, specs, connection_refused=warnings.append) as (
                ready,
                task,
            ):
                assert ready.listening == []
                reader, writer = await asyncio.open_connection("127.0.0.1", local)
                async with asyncio.timeout(CEILING):
                    assert await reader.read() == b""  # closed
                writer.close()
                assert not task.done()  # the forward goes on
            await cancel_job(bob, "alice", job_id)

    arun(scenario())
    assert [type(w) for w in warnings] == [AgentError]
    assert "nothing listens on 8888 in job" in warnings[0].message


def test_only_the_submitter_may_forward_and_a_taken_port_is_named(
    cluster: Callable[[str], Node],
) -> None:
    alice, bob, carol = cluster("alice"), cluster("bob"), cluster("carol")

    async def scenario() -> None:
        async with sharing(alice):
            pair_both(alice, bob)
            pair_both(alice, carol)
            job_id = await started(bob, "sleep 300")
            await until_hosted(alice, job_id, "running")
            # carol knows the id, yet asks for bob's job: alice refuses her.
            carol.home.store  # noqa: B018 - the store exists before the forward asks it
            from gpumesh.protocol.messages import PortOpen, PortOpened

            async with carol.session("alice") as session:
                with pytest.raises(AccessDeniedError, match="another peer"):
                    await session.request(PortOpen(job_id=job_id, port=80, watch=True))
                with pytest.raises(AccessDeniedError, match="another peer"):
                    await session.request(PortOpen(job_id=job_id, port=80))
                assert PortOpened  # the reply type a submitter gets
            # Not submitted from carol's node: refused before anything is asked.
            with pytest.raises(NotFoundError):
                await forward_ports(carol, job_id, [PortSpec(free_port(), 80)])
            with socket.create_server(("127.0.0.1", 0)) as taken:
                port = taken.getsockname()[1]
                with pytest.raises(GPUMeshError, match=f"127.0.0.1:{port}"):
                    await forward_ports(bob, job_id, [PortSpec(port, 80)])
            await cancel_job(bob, "alice", job_id)
            with pytest.raises(NotFoundError, match="ended"):
                await forward_ports(bob, job_id, [PortSpec(free_port(), 80)])

    arun(scenario())


def test_job_network_none_is_reached_inside_the_container(
    cluster: Callable[[str], Node],
) -> None:
    alice, bob = cluster("alice"), cluster("bob")
    alice.home.config.set("job_network", "none")
    alice.home.config.save()
    local = free_port()

    async def scenario() -> None:
        async with sharing(alice):
            pair_both(alice, bob)
            job_id = await started(bob)
            await until_hosted(alice, job_id, "running")
            answered: list[PortSpec] = []
            async with forwarding(bob, job_id, [PortSpec(local, 8000)], answers=answered.append):
                await until_async(lambda: answered, "the port answers")
                assert b"hello-from-the-job" in await http_get(local)
            await cancel_job(bob, "alice", job_id)

    arun(scenario())


def test_another_local_user_is_refused(
    cluster: Callable[[str], Node], other_user: OtherUser
) -> None:
    import sys

    alice, bob = cluster("alice"), cluster("bob")
    local = free_port()
    refused: list[int | None] = []
    script = (
        "import socket, sys\n"
        "s = socket.create_connection(('127.0.0.1', int(sys.argv[1])))\n"
        "s.sendall(b'GET / HTTP/1.0\\r\\n\\r\\n')\n"
        "s.settimeout(20)\n"
        "try:\n"
        "    got = s.recv(100)\n"
        "except ConnectionResetError:\n"
        "    got = b''\n"
        "sys.stdout.write(repr(got))\n"
    )

    async def scenario() -> None:
        async with sharing(alice):
            pair_both(alice, bob)
            job_id = await started(bob)
            await until_hosted(alice, job_id, "running")
            async with forwarding(
                bob, job_id, [PortSpec(local, 8000)], refused_local=refused.append
            ):
                ran = await asyncio.to_thread(
                    other_user.run, sys.executable, "-c", script, str(local)
                )
                assert ran.stdout == "b''", ran.stderr  # closed (or reset), nothing served
            await cancel_job(bob, "alice", job_id)

    arun(scenario())
    assert refused == [other_user.uid]
