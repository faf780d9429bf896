"""Folders of the submitter's sandbox mounted into its jobs (`run --mount`, `mounts:`)."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpumesh.client.jobs import cancel_job, new_job_id, run_job
from gpumesh.client.jobspec import MountSpec
from gpumesh.client.node import Node
from gpumesh.errors import LimitError, ProtocolError
from gpumesh.store.jobs import JobRecord
from tests.integration.conftest import arun, gpumesh, job_nodes, pair_both
from tests.integration.test_jobs import providing, spec

pytestmark = pytest.mark.usefixtures("docker_daemon", "gpumesh_processes")


def _sandbox(alice: Path, bob: Path) -> Path:
    node_id = json.loads(gpumesh(bob, "status", "--json").stdout)["node_id"]
    return alice / "files" / str(node_id)


def _refused(result: subprocess.CompletedProcess[str], text: str) -> None:
    assert result.returncode != 0, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and text in lines[0], lines[0]
    assert "Traceback" not in result.stderr


def test_a_copied_folder_is_read_only_in_the_job_unless_rw(pair, tmp_path: Path) -> None:
    alice, bob = pair
    data = tmp_path / "datasets"
    data.mkdir()
    (data / "dataset.bin").write_bytes(b"rows of data\n")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("kept\n")
    for local in ("datasets", "out"):
        copied = gpumesh(bob, "cp", "-r", str(tmp_path / local), f"alice-pc:/{local}", timeout=60)
        assert copied.returncode == 0, copied.stderr

    read = gpumesh(
        bob, "run", "--peer", "alice-pc", "-q", "--mount", "/datasets:/data", "--",
        "cat", "/data/dataset.bin", timeout=90,
    )  # fmt: skip
    assert read.returncode == 0, read.stderr
    assert read.stdout == "rows of data\n"

    # Read-only by default: the job cannot change what was copied.
    write = gpumesh(
        bob, "run", "--peer", "alice-pc", "-q", "--mount", "/datasets:/data", "--",
        "sh", "-c", "echo x > /data/dataset.bin", timeout=90,
    )  # fmt: skip
    assert write.returncode != 0
    assert (_sandbox(alice, bob) / "datasets" / "dataset.bin").read_bytes() == b"rows of data\n"

    # :rw in a job file: what the job writes is there for cp afterwards.
    job = tmp_path / "job.yaml"
    job.write_text(
        "peer: alice-pc\n"
        "command: sh -c 'wc -c < /in/dataset.bin > /results/count.txt'\n"
        "mounts:\n  - /datasets:/in\n  - /out:/results:rw\n"
    )
    wrote = gpumesh(bob, "run", "-f", str(job), "-q", timeout=90)
    assert wrote.returncode == 0, wrote.stderr
    back = tmp_path / "count.txt"
    fetched = gpumesh(bob, "cp", "alice-pc:/out/count.txt", str(back), timeout=60)
    assert fetched.returncode == 0, fetched.stderr
    assert back.read_text().strip() == "13"


def test_folders_outside_the_sandbox_links_and_missing_ones_are_refused(
    pair, tmp_path: Path
) -> None:
    alice, bob = pair
    outside = tmp_path / "secret"
    outside.mkdir()
    (outside / "key").write_text("host secret\n")
    assert gpumesh(bob, "cp", str(outside / "key"), "alice-pc:/real/key").returncode == 0
    sandbox = _sandbox(alice, bob)
    (sandbox / "linked").symlink_to(outside)
    (sandbox / "real" / "inner").symlink_to(outside)

    def run(mount: str) -> subprocess.CompletedProcess[str]:
        return gpumesh(
            bob, "run", "--peer", "alice-pc", "-q", "--mount", mount, "--", "cat", "/d/key",
            timeout=90,
        )  # fmt: skip

    _refused(run("/../secret:/d"), "alice-pc refused")
    _refused(run("/linked:/d"), "a symlink is on that path")
    _refused(run("/real/inner:/d"), "a symlink is on that path")
    _refused(run("/missing:/d"), "/missing is not a folder on alice-pc: copy it there first")
    _refused(run("/real/key:/d"), "is not a folder on alice-pc")
    _refused(run("/real:/proc"), "overlaps /proc")
    _refused(run("/real:/workspace/x"), "overlaps /workspace")
    _refused(run("/real:data"), "plain absolute path")
    # Nothing ran: no container of a refused job ever saw the host's folder.
    jobs = json.loads(gpumesh(alice, "jobs", "--json").stdout or "[]")
    assert jobs == [] or all(job.get("state") != "succeeded" for job in jobs)


@pytest.fixture
def cluster(make_node, engine) -> Iterator[Callable[[str], Node]]:
    with job_nodes(make_node, "256MB") as factory:
        yield factory


def test_mounted_folders_are_never_nested_with_another_unfinished_jobs(cluster) -> None:
    # A job with a folder mounted read-write can put a link anywhere below it;
    # Docker mounts by path when a container starts.
    alice, bob = cluster("alice"), cluster("bob")
    box = alice.home.path / "files" / str(bob.info().node_id)
    (box / "w" / "d").mkdir(parents=True)
    (box / "other").mkdir()

    async def scenario() -> None:
        async with providing(alice):
            pair_both(alice, bob)
            rw = [MountSpec("/w", "/w", rw=True)]
            first = await run_job(bob, spec("alice", "sleep", "60", mounts=rw), detach=True)
            below = [MountSpec("/w/d", "/d")]
            with pytest.raises(LimitError, match=rf"your job {first.job_id} \(\w+\) works"):
                await run_job(bob, spec("alice", "true", mounts=below))
            with pytest.raises(LimitError, match="works in a folder above or below"):
                await run_job(bob, spec("alice", "true"), sandbox_dir="/w/d")
            same = await run_job(bob, spec("alice", "ls", "/x", mounts=[MountSpec("/w", "/x")]))
            assert same.state == "succeeded"
            await cancel_job(bob, "alice", first.job_id)
            both = [MountSpec("/w", "/a"), MountSpec("/w/d", "/b")]
            with pytest.raises(LimitError, match="another folder of the same job"):
                await run_job(bob, spec("alice", "true", mounts=both))
            side = [MountSpec("/w", "/a"), MountSpec("/other", "/b")]
            assert (await run_job(bob, spec("alice", "true", mounts=side))).state == "succeeded"

    arun(scenario())


def test_a_provider_that_ignores_mounts_gets_its_job_cancelled_and_the_user_told(
    cluster, monkeypatch
) -> None:
    from gpumesh.agent.jobs import JobService

    alice, bob = cluster("alice"), cluster("bob")
    (alice.home.path / "files" / str(bob.info().node_id) / "data").mkdir(parents=True)

    async def older(self: object, peer: object, wanted: object, workdir: str) -> list[object]:
        return []  # as a provider from before JobSubmit.mounts: the field is dropped

    monkeypatch.setattr(JobService, "_resolve_mounts", older)

    async def scenario() -> None:
        async with providing(alice):
            pair_both(alice, bob)
            job = spec("alice", "sleep", "60", mounts=[MountSpec("/data", "/data")])
            job_id = new_job_id()
            with pytest.raises(ProtocolError, match="older GPUMesh that cannot mount folders"):
                await run_job(bob, job, job_id=job_id)
            hosted = alice.home.store.job("hosted", job_id)
            assert hosted is not None and hosted.state == "cancelled"

    arun(scenario())


def test_a_mounted_folder_is_checked_again_before_every_attempt(
    cluster, monkeypatch, tmp_path: Path
) -> None:
    from gpumesh.agent import jobstate

    monkeypatch.setattr(jobstate, "backoff", lambda _attempt: 3600.0)  # woken by the test
    alice, bob = cluster("alice"), cluster("bob")
    box = alice.home.path / "files" / str(bob.info().node_id)
    (box / "w").mkdir(parents=True)
    outside = tmp_path / "host"
    outside.mkdir()
    (outside / "secret").write_text("host secret\n")

    async def until(job_id: str, states: tuple[str, ...]) -> JobRecord:
        for _ in range(1200):  # a generous ceiling; the state is what is awaited
            job = alice.home.store.job("hosted", job_id)
            if job is not None and job.state in states:
                return job
            await asyncio.sleep(0.05)
        raise AssertionError(f"job {job_id} never reached {states}")

    async def scenario() -> None:
        async with providing(alice) as agent:
            pair_both(alice, bob)
            job = spec(
                "alice", "sh", "-c", "cat /w/secret; exit 3", retries=1,
                mounts=[MountSpec("/w", "/w")],
            )  # fmt: skip
            started = await run_job(bob, job, detach=True)
            await until(started.job_id, ("retrying",))
            # Between attempts the folder becomes a link to a host folder.
            (box / "w").rmdir()
            (box / "w").symlink_to(outside)
            agent.jobs.runner.runs[started.job_id].wake.set()
            ended = await until(started.job_id, ("failed", "succeeded", "cancelled"))
            assert ended.state == "failed"
            assert "its folder /w cannot be used any more" in ended.message
            assert "symlink" in ended.message
            output = b"".join(e.data for e in alice.home.store.job_events(started.job_id, 0))
            assert b"host secret" not in output

    arun(scenario())
