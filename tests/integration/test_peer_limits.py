"""One peer cannot take the whole provider: real agents on loopback, the real Docker engine.

Each limit is met by one peer while another peer still gets served: concurrent
jobs and shells per peer, the memory promised to all running containers
(``share_memory``), requests open on one connection, and the bytes the agent
holds for one connection (``link_buffer``). What the agent holds is measured
with its own count of buffered bytes and by the release of its stream objects,
never with RSS (``bench/streams.py`` reports that).
"""

from __future__ import annotations

import gc
import os
import re
import warnings
import weakref
from collections.abc import Callable, Iterator

import pytest

from gpumesh.agent.server import Agent
from gpumesh.client.jobs import cancel_job, run_job
from gpumesh.client.node import Node
from gpumesh.errors import ConnectionLostError, GPUMeshError, LimitError, error_from_code
from gpumesh.protocol.flow import DEFAULT_WINDOW
from gpumesh.protocol.framing import FrameKind
from gpumesh.protocol.messages import (
    ExecStart,
    ExecStarted,
    FileGet,
    FileInfo,
    Ping,
    Pong,
    Refusal,
    decode_message,
)
from gpumesh.runtime.base import LABEL_NODE
from gpumesh.transport.quic import Buffered, QuicLink
from gpumesh.transport.session import Session
from gpumesh.transport.stream import Stream
from tests.integration.conftest import (
    arun,
    job_nodes,
    pair_both,
    sharing,
    until_async,
    until_hosted,
)
from tests.integration.test_jobs import IMAGE, providing, spec

BIG = 16 * 1024 * 1024
"""A file larger than a flow-control window: its download parks once the window is sent."""


def _agent_link(agent: Agent) -> QuicLink:
    (link,) = [link for link in agent.endpoint.links if not link.is_closed]  # type: ignore[union-attr]
    return link


async def _park_download(session: Session, *, unread: int = 0) -> Stream:
    """A download of a big file that never returns credit: the provider sends one
    flow-control window and waits. Then ``unread`` bulk bytes the provider's handler
    never reads (it is waiting to send)."""
    stream = session.open_stream()
    stream.send_message(FileGet(path="/big.bin", offset=0))
    # Once the whole window is here, the provider has nothing left to send on it.
    await until_async(lambda: stream.held >= DEFAULT_WINDOW, "the window never arrived")
    if unread:
        await stream.send_data(b"u" * unread)
    return stream


async def _refusal_on(stream: Stream) -> GPUMeshError:
    """Read past what the provider sent (file info, bulk data) to its refusal."""
    while (frame := await stream.read_frame()) is not None:
        if frame.kind is FrameKind.MESSAGE:
            message = decode_message(frame.body)
            if isinstance(message, Refusal):
                return error_from_code(message.code, message.message)
            assert isinstance(message, FileInfo)
    raise AssertionError("the stream ended without a refusal")


@pytest.fixture
def peers(make_node) -> tuple[Node, Node, Node]:
    """alice provides; bob and carol are her peers; bob keeps a big file there."""
    alice, bob, carol = make_node("alice"), make_node("bob"), make_node("carol")
    box = alice.home.path / "files" / str(bob.info().node_id)
    box.mkdir(parents=True, mode=0o700)
    (box / "big.bin").write_bytes(os.urandom(BIG))
    return alice, bob, carol


def _refs(link: QuicLink) -> list[weakref.ref[object]]:
    """Weak references to an agent's link and the streams it has now."""
    return [weakref.ref(link), *(weakref.ref(stream) for stream in link._streams.values())]


@pytest.fixture(autouse=True)
def _no_earlier_garbage() -> None:
    """What earlier tests left to the cyclic collector goes before a test here counts
    its own objects with ``gc.collect()`` (an unclosed socket of theirs would be
    reported against it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


async def _let_go(agent: Agent, refs: list[weakref.ref[object]]) -> None:
    """Wait until the link and its streams are gone from the agent's memory (the endpoint
    keeps a closed link 3 s for retransmitting its close) and no request of it runs."""

    def gone() -> bool:
        gc.collect()
        return all(ref() is None for ref in refs)

    await until_async(gone, "the agent keeps a closed link or its streams")
    assert not [task for task in agent._tasks if "_serve_stream" in repr(task)]
    assert agent.buffered() == 0


def test_a_connection_has_at_most_max_requests_per_link_open(peers) -> None:
    alice, bob, carol = peers
    alice.home.config.set("max_requests_per_link", "4")
    alice.home.config.save()

    async def scenario() -> None:
        async with sharing(alice) as agent:
            pair_both(alice, bob)
            pair_both(alice, carol)
            async with bob.session("alice") as session:
                parked = [await _park_download(session) for _ in range(4)]
                link = _agent_link(agent)
                with pytest.raises(
                    LimitError,
                    match=r"^alice refused this request: your connection has 4 requests open "
                    r"there, and its max_requests_per_link is 4; wait for one to end$",
                ):
                    await session.request(Ping(sent=1.0))
                # Another peer is served meanwhile.
                async with carol.session("alice") as other:
                    assert isinstance(await other.request(Ping(sent=2.0)), Pong)
                # One parked request ends: the connection may open another.
                parked[0].abort()
                await until_async(
                    lambda: len(agent._requests[link]) == 3, "the abandoned download still counts"
                )
                assert isinstance(await session.request(Ping(sent=3.0)), Pong)
                refs = _refs(link)
                assert len(refs) == 1 + 3  # the link and 3 downloads (the proof's stream is gone)
                link = None
            # The connection closed: every request it held ended, and all it held is let go.
            await _let_go(agent, refs)
            assert not agent._requests

    arun(scenario())


def test_a_connection_holds_at_most_link_buffer_and_lets_go_of_it(peers) -> None:
    alice, bob, carol = peers
    cap = 20_000_000
    alice.home.config.set("link_buffer", "20MB")
    alice.home.config.save()

    async def scenario() -> None:
        async with sharing(alice) as agent:
            pair_both(alice, bob)
            pair_both(alice, carol)
            async with bob.session("alice") as session:
                first, second, third = [await _park_download(session) for _ in range(3)]
                link = _agent_link(agent)
                await until_async(
                    lambda: link.buffered() == Buffered(0, 0), "the windows were never sent"
                )
                # Each sends a window of bytes the provider's handler never reads (it waits
                # to send): two fit, the third takes the connection over link_buffer.
                await first.send_data(b"u" * DEFAULT_WINDOW)
                await second.send_data(b"u" * DEFAULT_WINDOW)
                await until_async(
                    lambda: link.buffered() == Buffered(2 * DEFAULT_WINDOW, 0),
                    "the unread bytes never arrived",
                )
                # (bob reads nothing on it before the refusal: reading returns credit, and
                # the provider would send more.)
                with pytest.raises(ConnectionLostError, match="stopped reading"):
                    await third.send_data(b"u" * DEFAULT_WINDOW)  # asked to stop sending
                refused = await _refusal_on(third)
                assert isinstance(refused, LimitError)
                assert re.fullmatch(
                    r"the provider ended this request: your connection took it to [\d.]+MB of "
                    r"unread requests and unsent replies, over its link_buffer of 20MB; read "
                    r"replies as they come and send no more than is read",
                    refused.message,
                ), refused.message
                assert link.buffered() == Buffered(2 * DEFAULT_WINDOW, 0)  # its bytes dropped
                # A reply that would take the connection over it: that request is reset,
                # and bob is told why. First fill up to 100 kB under the limit.
                fourth = await _park_download(session)
                await until_async(lambda: link.buffered().unsent == 0, "the window was never sent")
                await fourth.send_data(b"u" * (cap - 2 * DEFAULT_WINDOW - 100_000))
                await until_async(
                    lambda: link.buffered() == Buffered(cap - 100_000, 0),
                    "the unread bytes never arrived",
                )
                download = session.open_stream()
                download.send_message(FileGet(path="/big.bin", offset=0))
                with pytest.raises(LimitError, match="unsent replies than its link_buffer allows"):
                    while True:
                        await download.read_frame()
                assert link.buffered().total <= cap
                # Another peer is served meanwhile, on its own connection.
                async with carol.session("alice") as other:
                    assert isinstance(await other.request(Ping(sent=1.0)), Pong)
                refs = _refs(link)
                link = None
            # bob's connection closed: what it held is let go.
            await _let_go(agent, refs)

    arun(scenario())


# --- jobs and shells (the real Docker engine) ----------------------------------------------


@pytest.fixture
def cluster(make_node, engine) -> Iterator[Callable[[str], Node]]:
    """Nodes with small containers (64MB), all removed afterwards."""
    with job_nodes(make_node, "64MB") as factory:
        yield factory


def _configure(node: Node, **values: str) -> None:
    for key, value in values.items():
        node.home.config.set(key, value)
    node.home.config.save()


SHELL = ExecStart(image=IMAGE, command=["sh"], env={}, tty=False, rows=0, cols=0)


async def _open_shell(session: Session) -> Stream:
    stream = session.open_stream()
    stream.send_message(SHELL)
    await stream.expect(ExecStarted)
    return stream


@pytest.mark.usefixtures("docker_daemon")
def test_a_peer_runs_at_most_max_jobs_per_peer_and_others_still_run(cluster, engine) -> None:
    alice, bob, carol = cluster("alice"), cluster("bob"), cluster("carol")
    _configure(alice, max_jobs_per_peer="2")

    async def scenario() -> None:
        async with providing(alice):
            pair_both(alice, bob)
            pair_both(alice, carol)
            first = await run_job(bob, spec("alice", "sleep", "60"), detach=True)
            await run_job(bob, spec("alice", "sleep", "60"), detach=True)
            await until_hosted(alice, first.job_id, "running")
            # alice's job containers (not the engine's: other tests' come and go, and
            # her spare network holders are made in the background).
            label = f"{LABEL_NODE}={alice.info().node_id}"

            def containers() -> int:
                found = engine.containers.list(all=True, sparse=True, filters={"label": label})
                return len(found)

            before = containers()
            with pytest.raises(
                LimitError,
                match=r"^alice refused the job: you have 2 unfinished jobs there, and its "
                r"max_jobs_per_peer is 2; wait for one to end, or cancel one$",
            ):
                await run_job(bob, spec("alice", "true"))
            assert containers() == before  # nothing was created
            # carol is not bob: she still runs hers.
            assert (await run_job(carol, spec("alice", "true"))).state == "succeeded"
            # Once one of bob's ends, he may run another.
            await cancel_job(bob, "alice", first.job_id)
            assert (await run_job(bob, spec("alice", "true"))).state == "succeeded"
            assert len(alice.home.store.jobs(role="hosted")) == 4

    arun(scenario())


@pytest.mark.usefixtures("docker_daemon")
def test_a_peer_opens_at_most_max_shells_per_peer_and_others_still_do(cluster) -> None:
    alice, bob, carol = cluster("alice"), cluster("bob"), cluster("carol")
    _configure(alice, max_shells_per_peer="2")

    async def scenario() -> None:
        async with providing(alice) as agent:
            pair_both(alice, bob)
            pair_both(alice, carol)
            async with bob.session("alice") as session:
                shells = [await _open_shell(session), await _open_shell(session)]
                with pytest.raises(
                    LimitError,
                    match=r"^alice refused the shell: you have 2 shells open there, and its "
                    r"max_shells_per_peer is 2; close one first$",
                ):
                    await session.request(SHELL)
                async with carol.session("alice") as other:
                    carols = await _open_shell(other)
                    carols.abort()
                # A shell closed is a place free again.
                shells[0].abort()
                await until_async(
                    lambda: len(agent.jobs.admission.claims()) == 1, "the shell still counts"
                )
                (await _open_shell(session)).abort()
                shells[1].abort()
            await until_async(lambda: not agent.jobs.admission.claims(), "shells still count")

    arun(scenario())


@pytest.mark.usefixtures("docker_daemon")
def test_memory_promised_to_containers_stays_within_share_memory(cluster) -> None:
    # 64MB containers, 512MB shared: with the default counts (4 jobs, 2 shells per
    # peer) bob holds 384MB at most, so carol still finds room; the next is refused.
    alice, bob, carol = cluster("alice"), cluster("bob"), cluster("carol")
    _configure(alice, share_memory="512MB")

    async def scenario() -> None:
        async with providing(alice) as agent:
            pair_both(alice, bob)
            pair_both(alice, carol)
            jobs = [await run_job(bob, spec("alice", "sleep", "60"), detach=True) for _ in range(4)]
            async with bob.session("alice") as session:
                bobs = [await _open_shell(session), await _open_shell(session)]
                with pytest.raises(LimitError, match="max_jobs_per_peer is 4"):
                    await run_job(bob, spec("alice", "true"))
                with pytest.raises(LimitError, match="max_shells_per_peer is 2"):
                    await session.request(SHELL)
                # bob is at his limits; carol still runs a job and opens a shell.
                carols_job = await run_job(carol, spec("alice", "sleep", "60"), detach=True)
                async with carol.session("alice") as other:
                    carols = await _open_shell(other)
                    # 8 x 64MB promised: a ninth container would not fit in 512MB.
                    with pytest.raises(
                        LimitError,
                        match=r"^alice refused the job: 512MB of memory is promised to its "
                        r"running jobs, shells and CUDA sessions, and this job's 64MB "
                        r"\(job_memory\) would go over its share_memory of 512MB; try again "
                        r"when one of them ends$",
                    ):
                        await run_job(carol, spec("alice", "true"))
                    with pytest.raises(LimitError, match="share_memory of 512MB"):
                        await other.request(SHELL)
                    carols.abort()
                    await until_async(
                        lambda: len(agent.jobs.admission.claims()) == 7, "the shell still counts"
                    )
                    # Room again: her job runs.
                    assert (await run_job(carol, spec("alice", "true"))).state == "succeeded"
                for shell in bobs:
                    shell.abort()
            for job in [*jobs, carols_job]:
                await cancel_job(job_node(job.job_id), "alice", job.job_id)

    def job_node(job_id: str) -> Node:
        return bob if bob.home.store.job("submitted", job_id) is not None else carol

    arun(scenario())


@pytest.mark.usefixtures("docker_daemon")
def test_a_job_whose_upload_breaks_off_ends_and_frees_its_place(cluster) -> None:
    alice, bob = cluster("alice"), cluster("bob")
    _configure(alice, max_jobs_per_peer="1")

    async def scenario() -> None:
        async with providing(alice):
            pair_both(alice, bob)
            from gpumesh.protocol.messages import JobAccepted, JobSubmit

            async with bob.session("alice") as session:
                stream = session.open_stream()
                stream.send_message(
                    JobSubmit(
                        job_id="0123456789ab",
                        image=IMAGE,
                        command=["true"],
                        env={},
                        workdir_bytes=10_000,
                        gpu_memory=0,
                        retries=3,
                        timeout=0.0,
                        attach=False,
                    )
                )
                await stream.expect(JobAccepted)
                await stream.send_data(b"x" * 100)
                stream.abort()  # the upload breaks off
                await until_async(
                    lambda: alice.home.store.job("hosted", "0123456789ab").state == "failed",  # type: ignore[union-attr]
                    "the job was left uploading",
                )
            job = alice.home.store.job("hosted", "0123456789ab")
            assert job is not None and job.message.startswith("the workdir upload did not complete")
            # Its place is free again.
            assert (await run_job(bob, spec("alice", "true"))).state == "succeeded"

    arun(scenario())


def test_a_peer_holds_at_most_max_links_per_peer_connections_and_others_still_connect(
    make_node,
) -> None:
    alice, bob, carol = make_node("alice"), make_node("bob"), make_node("carol")
    alice.home.config.set("max_links_per_peer", "2")
    alice.home.config.save()

    async def scenario() -> None:
        async with sharing(alice) as agent:
            pair_both(alice, bob)
            pair_both(alice, carol)
            async with bob.session("alice") as first, bob.session("alice") as second:
                for held in (first, second):
                    assert isinstance(await held.request(Ping(sent=1.0)), Pong)
                with pytest.raises(LimitError) as caught:
                    async with bob.session("alice") as third:
                        await third.request(Ping(sent=2.0))
                assert caught.value.message == (
                    "alice allows at most 2 connections from one peer at once (its "
                    "max_links_per_peer) and you have 2 open; close some (end `logs -f` "
                    "followers, finished copies) and try again"
                )
                # another peer is not affected
                async with carol.session("alice") as other:
                    assert isinstance(await other.request(Ping(sent=3.0)), Pong)
            # once bob closed his (and alice saw them go), he connects again
            await until_async(lambda: not agent._links, "bob's connections to be gone")
            async with bob.session("alice") as again:
                assert isinstance(await again.request(Ping(sent=4.0)), Pong)

    arun(scenario())
