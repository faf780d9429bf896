"""The provider's side of jobs that move, between real nodes on loopback and the
real Docker engine: a job id held under one fencing epoch refuses every other,
each attempt is told which start of the job it is, what a moved job's submitter
restored in its outputs folder does not travel back, every status and outputs
answer names the copy's epoch, and a copy moved away stops and serves nothing.

The submitter here speaks the wire messages itself (the epoch and the starts
before are its to choose). Every step is awaited (a job followed to its end, a
state reached, a long poll answered), never timed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import docker
import pytest

from gpumesh.agent.jobstate import MOVED
from gpumesh.client.node import Node
from gpumesh.errors import InUseError
from gpumesh.protocol.messages import (
    JobAccepted,
    JobCancel,
    JobLogs,
    JobOutput,
    JobQuery,
    JobStatus,
    JobSubmit,
    Message,
    OutputsQuery,
    OutputsReady,
    decode_message,
)
from gpumesh.runtime.base import LABEL_JOB, LABEL_NODE
from gpumesh.transport.session import Session
from tests.integration.conftest import arun, job_nodes, pair_both, until_hosted
from tests.integration.test_jobs import IMAGE, _removed, providing

pytestmark = pytest.mark.usefixtures("docker_daemon")

JOB = "fe0c0a1b2c3d"
_UNTIL_STOPPED = "while true; do sleep 0.1; done"
"""What a job runs until it is stopped."""


@pytest.fixture
def cluster(make_node, engine) -> Iterator[Callable[[str], Node]]:
    """Nodes whose job containers are all removed afterwards."""
    with job_nodes(make_node, "256MB") as factory:
        yield factory


def _submit(job_id: str, script: str, **fields: object) -> JobSubmit:
    values: dict[str, object] = {
        "job_id": job_id,
        "image": IMAGE,
        "command": ["sh", "-c", script],
        "env": {},
        "workdir_bytes": 0,
        "gpu_memory": 0,
        "retries": 0,
        "timeout": 0.0,
        "attach": False,
        "knows_preempted": True,
        "outputs": "/out",
        "epoch": 1,
    }
    values.update(fields)
    return JobSubmit(**values)  # type: ignore[arg-type]


async def _events(session: Session, job_id: str) -> list[Message]:
    """Every event of the job, followed until it ended (``JobLogs``, one message each)."""
    stream = session.open_stream()
    stream.send_message(
        JobLogs(job_id=job_id, after_seq=0, follow=True, knows_preempted=True), end=True
    )
    got: list[Message] = []
    try:
        while (frame := await stream.read_frame()) is not None:
            got.append(decode_message(frame.body))
    finally:
        session.link.forget_stream(stream.stream_id)
    return got


def _printed(events: list[Message]) -> list[str]:
    out = b"".join(e.data for e in events if isinstance(e, JobOutput) and e.stream == "stdout")
    return out.decode().splitlines()


def _folder(alice: Node, bob: Node, job_id: str) -> Path:
    """The job's outputs folder on alice's disk (bob's sandbox there)."""
    return alice.home.files_dir / str(bob.info().node_id) / "gpumesh-outputs" / job_id


def _containers(engine: docker.DockerClient, node: Node, job_id: str) -> list[object]:
    label = f"{LABEL_NODE}={node.info().node_id}"
    found = engine.api.containers(all=True, filters={"label": label})
    return [c for c in found if (c.get("Labels") or {}).get(LABEL_JOB) == job_id]


def test_each_attempt_is_told_its_start_of_the_job_and_whether_it_resumes(cluster) -> None:
    alice, bob = cluster("alice"), cluster("bob")
    script = "echo $GPUMESH_ATTEMPT $GPUMESH_RESUMED; exit 3"

    async def scenario() -> None:
        async with providing(alice):
            pair_both(alice, bob)
            async with bob.session("alice") as session:
                # A fresh job, and one that made 2 starts on providers before this
                # one; each gets a retry, and sets both names itself (overridden).
                env = {"GPUMESH_ATTEMPT": "99", "GPUMESH_RESUMED": "7"}
                for job_id, before in (("0a0a0a0a0a0a", 0), ("0b0b0b0b0b0b", 2)):
                    accepted = await session.request(
                        _submit(job_id, script, retries=1, attempts_before=before, env=env)
                    )
                    assert isinstance(accepted, JobAccepted)
                fresh = await _events(session, "0a0a0a0a0a0a")
                moved = await _events(session, "0b0b0b0b0b0b")
        assert _printed(fresh) == ["1 0", "2 1"]
        assert _printed(moved) == ["3 1", "4 1"]
        for events in (fresh, moved):
            states = [e.state for e in events if isinstance(e, JobStatus)]
            assert states[-1] == "failed" and "retrying" in states

    arun(scenario())


def test_restored_outputs_stay_unlisted_and_every_answer_names_the_copys_epoch(
    cluster,
) -> None:
    alice, bob = cluster("alice"), cluster("bob")
    # What came home from the hops before, restored by the submitter: the job reads
    # its checkpoint, writes the next one over it, and leaves the other file alone.
    script = (
        "cat $GPUMESH_OUTPUTS/ckpt; echo $GPUMESH_ATTEMPT $GPUMESH_RESUMED; "
        "echo step-two > $GPUMESH_OUTPUTS/.t && mv $GPUMESH_OUTPUTS/.t $GPUMESH_OUTPUTS/ckpt"
    )

    async def scenario() -> None:
        async with providing(alice):
            pair_both(alice, bob)
            folder = _folder(alice, bob, JOB)
            folder.mkdir(parents=True)
            (folder / "ckpt").write_text("step-1\n")
            (folder / "log-1").write_text("hop 1\n")
            async with bob.session("alice") as session:
                submit = _submit(JOB, script, epoch=2, attempts_before=2)
                assert isinstance(await session.request(submit), JobAccepted)
                events = await _events(session, JOB)
                query = await session.request(JobQuery(job_id=JOB, knows_preempted=True))
                ready = await session.request(OutputsQuery(job_id=JOB))
                released = await session.request(OutputsQuery(job_id=JOB, release=True))
        assert _printed(events) == ["step-1", "3 1"]
        statuses = [e for e in events if isinstance(e, JobStatus)]
        assert [s.state for s in statuses][-1] == "succeeded"
        assert {s.epoch for s in statuses} == {2}
        assert isinstance(query, JobStatus) and (query.state, query.epoch) == ("succeeded", 2)
        assert isinstance(ready, OutputsReady) and ready.final and ready.epoch == 2
        assert [f.path for f in ready.files] == ["ckpt"]  # log-1 is home already
        assert isinstance(released, OutputsReady) and released.epoch == 2

    arun(scenario())


def test_a_job_id_refuses_another_epoch_and_a_moved_copy_stops_and_serves_nothing(
    cluster, engine
) -> None:
    alice, bob = cluster("alice"), cluster("bob")
    script = (
        "echo part > $GPUMESH_OUTPUTS/.t && mv $GPUMESH_OUTPUTS/.t $GPUMESH_OUTPUTS/part; "
        + _UNTIL_STOPPED
    )

    async def scenario() -> None:
        async with providing(alice):
            pair_both(alice, bob)
            async with bob.session("alice") as session:
                assert isinstance(await session.request(_submit(JOB, script)), JobAccepted)
                await until_hosted(alice, JOB, "running")
                first = await session.request(OutputsQuery(job_id=JOB, wait=20))
                assert isinstance(first, OutputsReady) and [f.path for f in first.files] == ["part"]

                # Another epoch, newer or older: refused, and the job is untouched.
                with pytest.raises(InUseError) as newer:
                    await session.request(_submit(JOB, script, epoch=2, attempts_before=1))
                assert str(newer.value).startswith(
                    f"job {JOB} ran here before as an older copy (epoch 1): "
                    "it cannot come back under epoch 2"
                )
                with pytest.raises(InUseError, match=r"came here as a newer copy \(epoch 1\)"):
                    await session.request(_submit(JOB, script, epoch=0))
                # The same epoch again (a dropped link): accepted, never a second copy.
                assert isinstance(await session.request(_submit(JOB, script)), JobAccepted)
                job = alice.home.store.job("hosted", JOB)
                assert job is not None
                assert (job.state, job.attempt, job.epoch) == ("running", 1, 1)
                assert len(_containers(engine, alice, JOB)) == 1

                # Moved: stopped as a cancel stops it, then nothing of it is served.
                stopped = await session.request(JobCancel(job_id=JOB, moved=True))
                assert isinstance(stopped, JobStatus)
                assert (stopped.state, stopped.message, stopped.epoch) == ("cancelled", MOVED, 1)
                assert await _removed(engine, alice, JOB)
                assert not _folder(alice, bob, JOB).exists()
                after = await session.request(OutputsQuery(job_id=JOB))
                assert isinstance(after, OutputsReady)
                assert (after.files, after.final, after.epoch) == ([], True, 1)

                # A copy that had ended keeps its state; its outputs go all the same.
                other = "0c0c0c0c0c0c"
                done = (
                    "echo out > $GPUMESH_OUTPUTS/.t && mv $GPUMESH_OUTPUTS/.t $GPUMESH_OUTPUTS/out"
                )
                assert isinstance(await session.request(_submit(other, done)), JobAccepted)
                await until_hosted(alice, other, "succeeded")
                assert (_folder(alice, bob, other) / "out").is_file()
                ended = await session.request(JobCancel(job_id=other, moved=True))
                assert isinstance(ended, JobStatus) and ended.state == "succeeded"
                assert not _folder(alice, bob, other).exists()
                empty = await session.request(OutputsQuery(job_id=other))
                assert isinstance(empty, OutputsReady) and (empty.files, empty.final) == ([], True)

    arun(scenario())
