"""The client layer's job, app and shell operations as an API (real agent, QUIC, Docker).

Events come as async iterators; cancel takes a job id; ``run_app`` uses one
session; ``exec_shell`` reads an async source and writes an async sink; a
follower of a hosted job in the agent's process is told by the agent, not by a
poll; one elsewhere reads the store.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from gpumesh.client import jobs as client_jobs
from gpumesh.client.apps import run_app
from gpumesh.client.exec import HANGUP_EXIT, exec_shell
from gpumesh.client.jobs import (
    JobEvent,
    Output,
    StatusChanged,
    cancel,
    find_job,
    logs,
    run_job,
)
from gpumesh.client.node import Node
from gpumesh.protocol.states import JobRole, JobState
from tests.integration.conftest import arun, job_nodes, pair_both
from tests.integration.test_jobs import IMAGE, providing, spec

pytestmark = pytest.mark.usefixtures("docker_daemon")


@pytest.fixture
def cluster(make_node, engine) -> Iterator[Callable[[str], Node]]:
    with job_nodes(make_node, "256MB") as factory:
        yield factory


async def _collect(events: AsyncIterator[JobEvent]) -> list[JobEvent]:
    return [event async for event in events]


def _stdout(events: list[JobEvent]) -> bytes:
    return b"".join(e.data for e in events if isinstance(e, Output) and e.stream == "stdout")


def test_a_submitted_jobs_events_come_as_an_async_iterator(cluster) -> None:
    alice, bob = cluster("alice"), cluster("bob")

    async def scenario() -> None:
        async with providing(alice):
            pair_both(alice, bob)
            done = await run_job(bob, spec("alice", "sh", "-c", "echo out; echo err >&2; exit 3"))
            assert done.state == JobState.FAILED
            # The most recent job when no id is given.
            assert find_job(bob).job_id == done.job_id
            follow = logs(bob)
            events = await _collect(follow)
            assert _stdout(events) == b"out\n"
            errors = [e.data for e in events if isinstance(e, Output) and e.stream == "stderr"]
            assert b"".join(errors) == b"err\n"
            changes = [e for e in events if isinstance(e, StatusChanged)]
            last = changes[-1]
            assert (last.state, last.exited, last.status.exit_code) == (JobState.FAILED, True, 3)
            assert (follow.result.state, follow.result.exit_code) == ("failed", 3)
            assert follow.result.role == JobRole.SUBMITTED

    arun(scenario())


def test_a_run_from_submission_to_its_end_is_one_async_iterator(cluster, tmp_path: Path) -> None:
    from gpumesh.client.runs import Accepted, Uploading, watch_run

    alice, bob = cluster("alice"), cluster("bob")
    work = tmp_path / "work"
    work.mkdir()
    (work / "data.txt").write_bytes(b"from the workdir\n" * 4096)

    async def scenario() -> None:
        async with providing(alice):
            pair_both(alice, bob)
            watch = watch_run(
                bob, spec("alice", "sh", "-c", "head -c 17 data.txt; exit 4", workdir=work)
            )
            events = [event async for event in watch]
            kinds = [type(event).__name__ for event in events]
            first_job_event = kinds.index("StatusChanged")
            # Everything before the job's own events is about getting it there.
            assert "Accepted" in kinds[:first_job_event]
            uploads = [e for e in events if isinstance(e, Uploading)]
            assert uploads and uploads[-1].sent == uploads[-1].total > 64 * 1024
            [accepted] = [e for e in events if isinstance(e, Accepted)]
            assert _stdout(events) == b"from the workdir\n"
            assert watch.result is not None
            assert watch.result.job_id == accepted.accepted.job_id
            assert (watch.result.state, watch.result.exit_code) == (JobState.FAILED, 4)

    arun(scenario())


@pytest.mark.parametrize("in_process", [False, True])
def test_a_hosted_jobs_follower_sees_every_line_to_the_end(
    cluster, monkeypatch, in_process
) -> None:
    # With no fallback re-read to speak of, a follower in the agent's process ends
    # only if the agent tells it; one in another process (no agent to tell it)
    # reads the store on its short timer.
    monkeypatch.setattr(client_jobs, "_REREAD", 3600.0)
    alice, bob = cluster("alice"), cluster("bob")

    async def scenario() -> None:
        async with providing(alice) as agent:
            pair_both(alice, bob)
            command = "sleep 2; echo one; sleep 1; echo two"
            submitted = await run_job(bob, spec("alice", "sh", "-c", command), detach=True)
            changes = agent.jobs if in_process else None
            follow = logs(alice, submitted.job_id, follow=True, changes=changes)
            seen: list[JobEvent] = []
            async with contextlib.aclosing(follow):
                async for event in follow:
                    seen.append(event)
            assert _stdout(seen) == b"one\ntwo\n"
            assert (follow.result.state, follow.result.role) == ("succeeded", JobRole.HOSTED)

    arun(scenario())


def test_cancel_takes_a_job_id_for_submitted_and_hosted_jobs(cluster) -> None:
    alice, bob = cluster("alice"), cluster("bob")
    owner = Node(alice.home.path)

    async def scenario() -> None:
        async with providing(alice):
            pair_both(alice, bob)
            first = await run_job(bob, spec("alice", "sleep", "60"), detach=True)
            result = await cancel(bob, first.job_id[:6])
            assert (result.job_id, result.role, result.state) == (
                first.job_id,
                JobRole.SUBMITTED,
                "cancelled",
            )
            second = await run_job(bob, spec("alice", "sleep", "60"), detach=True)
            hosted = await cancel(owner, second.job_id[:6])
            assert (hosted.job_id, hosted.role, hosted.state) == (
                second.job_id,
                JobRole.HOSTED,
                "cancelled",
            )
            from gpumesh.errors import NotFoundError

            with pytest.raises(NotFoundError):
                await cancel(bob, "ffffffffffff")

    arun(scenario())
    owner.close()


def test_run_app_syncs_runs_and_pulls_on_one_session(cluster, tmp_path: Path) -> None:
    alice, bob = cluster("alice"), cluster("bob")
    project = tmp_path / "proj"
    project.mkdir()
    (project / "in.txt").write_text("hello\n")
    out = tmp_path / "renders"
    opened: list[str] = []
    real_session = Node.session

    def counting(self: Node, query: str, **kwargs: object):  # type: ignore[no-untyped-def]
        opened.append(query)
        return real_session(self, query, **kwargs)  # type: ignore[arg-type]

    async def scenario() -> None:
        async with providing(alice):
            pair_both(alice, bob)
            bob.session = counting.__get__(bob)  # type: ignore[method-assign]
            job = spec("alice", "sh", "-c", "mkdir -p renders && cp in.txt renders/out.txt")
            synced: list[str] = []
            run = await run_app(
                bob, "alice", project, job, out=out, synced=lambda s: synced.append(s.remote)
            )
            assert synced == ["/apps/proj"]
            assert (run.job.state, run.pulled, run.out_remote) == (
                "succeeded",
                True,
                "/apps/proj/renders",
            )
            assert (out / "out.txt").read_text() == "hello\n"
            assert len(opened) == 1  # one handshake for sync, run and pull

            missing = await run_app(
                bob, "alice", project, spec("alice", "true"), out=tmp_path / "x"
            )
            assert (missing.job.state, missing.pulled) == ("succeeded", False)

    arun(scenario())


def test_exec_reads_an_async_source_and_writes_an_async_sink(cluster) -> None:
    alice, bob = cluster("alice"), cluster("bob")

    async def source(*chunks: bytes) -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk

    async def scenario() -> None:
        async with providing(alice):
            pair_both(alice, bob)
            received = bytearray()

            async def sink(data: bytes) -> None:
                received.extend(data)

            code = await exec_shell(
                bob,
                "alice",
                ["sh", "-c", "cat; exit 3"],
                image=IMAGE,
                source=source(b"hel", b"lo\n"),
                sink=sink,
            )
            assert (code, bytes(received)) == (3, b"hello\n")
            # With a terminal, the end of the source is the terminal hanging up.
            code = await exec_shell(
                bob,
                "alice",
                ["sh"],
                image=IMAGE,
                tty=True,
                size=(24, 80),
                source=source(),
                sink=sink,
            )
            assert code == HANGUP_EXIT

    arun(scenario())
