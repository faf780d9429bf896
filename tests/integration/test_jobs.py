"""Docker jobs between real nodes on loopback, against the real Docker engine.

Image: ``$GPUMESH_TEST_DOCKER_IMAGE`` (a static busybox built offline by
scripts/ensure-docker.sh). GPUs are the one thing faked: there is no NVIDIA
hardware here, so GPU tests use the explicit simulated inventory and only
create (never start) containers.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import docker
import pytest

from gpumesh.agent.gpus import Holder, HolderKind
from gpumesh.agent.server import Agent
from gpumesh.client.jobs import JobCallbacks, cancel_job, follow_job, run_job
from gpumesh.client.jobspec import JobSpec
from gpumesh.client.node import Node
from gpumesh.errors import (
    AccessDeniedError,
    ImageMissingError,
    LimitError,
    NotFoundError,
    RuntimeUnavailableError,
)
from gpumesh.gpu.inventory import SimulatedInventory
from gpumesh.protocol.messages import JobQuery, OutputsQuery
from gpumesh.runtime.base import LABEL_JOB, LABEL_NODE
from gpumesh.runtime.docker import DockerRuntime
from gpumesh.runtime.jobnet import names_for
from tests.integration.conftest import arun, job_nodes, pair_both, until_hosted
from tests.jobnet_lab import SESSION_PREFIX, network_host_config

pytestmark = pytest.mark.usefixtures("docker_daemon")

IMAGE = os.environ.get("GPUMESH_TEST_DOCKER_IMAGE", "gpumesh-test/busybox:1")


@pytest.fixture
def cluster(make_node, engine) -> Iterator[Callable[[str], Node]]:
    """Nodes whose job containers are all removed afterwards."""
    with job_nodes(make_node, "256MB") as factory:
        yield factory


def _containers(engine: docker.DockerClient, node: Node) -> list[object]:
    """The node's job containers, from the listing's summaries (the SDK's full
    listing inspects each one, which fails for one whose removal ends meanwhile)."""
    label = f"{LABEL_NODE}={node.info().node_id}"
    return list(engine.containers.list(all=True, sparse=True, filters={"label": label}))


async def _removed(engine: docker.DockerClient, node: Node, job_id: str | None = None) -> bool:
    """Whether the node's job containers (or the one of ``job_id``) are gone, after
    waiting for a removal under way: a finished job's container is removed just
    after its end is told (a generous ceiling; the removal runs in its own thread)."""
    deadline = time.monotonic() + 30
    while True:
        label = f"{LABEL_NODE}={node.info().node_id}"
        # The summaries of the listing (the SDK's own list inspects each container,
        # which fails for one whose removal ends meanwhile).
        found = engine.api.containers(all=True, filters={"label": label})
        jobs = [(c.get("Labels") or {}).get(LABEL_JOB) for c in found]
        gone = not jobs if job_id is None else job_id not in jobs
        if gone:
            return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def providing(node: Node, port: int = 0, **kwargs: object) -> AsyncIterator[Agent]:
    agent = Agent(node.home, host="127.0.0.1", port=port, **kwargs)  # type: ignore[arg-type]
    await agent.start()
    try:
        yield agent
    finally:
        agent.stop()


class Collected(JobCallbacks):
    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.err = bytearray()
        self.states: list[tuple[str, int]] = []
        self.stdout = self.out.extend
        self.stderr = self.err.extend
        self.status = lambda s: self.states.append((s.state, s.attempt))


def spec(peer: str, *command: str, **fields: object) -> JobSpec:
    values: dict[str, object] = {
        "image": IMAGE,
        "command": list(command),
        "env": {},
        "workdir": None,
        "gpu_memory": 0,
        "retries": 0,
        "timeout": 0.0,
        "peer": peer,
        "group": None,
    }
    values.update(fields)
    return JobSpec(**values)  # type: ignore[arg-type]


def test_exit_code_and_streams_are_kept_apart(cluster) -> None:
    alice, bob = cluster("alice"), cluster("bob")

    async def scenario() -> None:
        async with providing(alice):
            pair_both(alice, bob)
            got = Collected()
            result = await run_job(
                bob,
                spec("alice", "sh", "-c", "echo out; echo err >&2; printf 'a\\0b'; exit 3"),
                callbacks=got,
            )
            assert result.exit_code == 3
            assert result.state == "failed"
            assert bytes(got.out) == b"out\na\0b"
            assert bytes(got.err) == b"err\n"
            ok = await run_job(bob, spec("alice", "true"))
            assert (ok.state, ok.exit_code) == ("succeeded", 0)

    arun(scenario())
    submitted = bob.home.store.jobs(role="submitted")
    hosted = alice.home.store.jobs(role="hosted")
    assert {j.exit_code for j in submitted} == {3, 0}
    assert {j.exit_code for j in hosted} == {3, 0}
    assert all(j.peer_name == "bob" for j in hosted)


def test_env_and_workdir_are_visible_in_the_container(cluster, tmp_path: Path, engine) -> None:
    alice, bob = cluster("alice"), cluster("bob")
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    (project / "data" / "input.txt").write_text("42\n")
    (project / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (project / "run.sh").chmod(0o755)
    (project / ".gpumeshignore").write_text("secret.txt\n")
    (project / "secret.txt").write_text("do not send")

    async def scenario() -> None:
        async with providing(alice):
            pair_both(alice, bob)
            got = Collected()
            script = (
                'echo "pwd=$(pwd) greeting=$GREETING"; cat data/input.txt; ./run.sh; '
                "ls secret.txt 2>/dev/null || echo no-secret; echo made > out.txt"
            )
            result = await run_job(
                bob,
                spec("alice", "sh", "-c", script, env={"GREETING": "hi there"}, workdir=project),
                callbacks=got,
            )
            assert result.exit_code == 0, bytes(got.err)
            assert bytes(got.out).decode().splitlines() == [
                "pwd=/workspace greeting=hi there",
                "42",
                "ran",
                "no-secret",
            ]

    arun(scenario())
    hosted = alice.home.store.jobs(role="hosted")[0]
    assert (Path(hosted.workdir) / "out.txt").read_text() == "made\n"
    assert arun(_removed(engine, alice))  # finished containers are removed


def test_a_finished_jobs_container_left_behind_is_removed_by_the_next_start(
    cluster, engine
) -> None:
    """The container of a job is removed after its end is told; an agent stopped
    in between leaves it behind, and its next start removes it (with nothing else
    of the job changed)."""
    alice, bob = cluster("alice"), cluster("bob")

    async def scenario() -> str:
        async with providing(alice) as agent:
            pair_both(alice, bob)
            result = await run_job(bob, spec("alice", "echo", "hi"))
            assert (result.state, result.exit_code) == ("succeeded", 0)
            assert await _removed(engine, alice)
            # As if the agent had stopped between the end and the removal.
            job = agent.jobs.runner.container_spec(
                alice.home.store.job("hosted", result.job_id),  # type: ignore[arg-type]
                1,
                await agent.jobs.containers.who_runs(IMAGE),
            )
            await asyncio.to_thread(agent.jobs.containers.runtime.create, job)
        assert len(_containers(engine, alice)) == 1
        async with providing(alice):
            assert await _removed(engine, alice)
        return result.job_id

    job_id = arun(scenario())
    hosted = alice.home.store.job("hosted", job_id)
    assert hosted is not None and (hosted.state, hosted.exit_code) == ("succeeded", 0)


def test_retries_are_counted_and_stop_at_success(cluster, tmp_path: Path) -> None:
    alice, bob = cluster("alice"), cluster("bob")
    project = tmp_path / "p"
    project.mkdir()

    async def scenario() -> None:
        async with providing(alice):
            pair_both(alice, bob)
            got = Collected()
            # Fails twice, then succeeds: the workdir keeps a counter across attempts.
            script = (
                "n=$(cat n 2>/dev/null || echo 0); n=$((n+1)); echo $n > n; "
                "echo try $n; [ $n -ge 3 ]"
            )
            result = await run_job(
                bob, spec("alice", "sh", "-c", script, retries=5, workdir=project), callbacks=got
            )
            assert (result.state, result.exit_code, result.attempt) == ("succeeded", 0, 3)
            assert bytes(got.out) == b"try 1\ntry 2\ntry 3\n"
            assert ("retrying", 1) in got.states
            assert ("retrying", 2) in got.states
            failed = await run_job(bob, spec("alice", "false", retries=1))
            assert (failed.state, failed.exit_code, failed.attempt) == ("failed", 1, 2)

    arun(scenario())


def test_missing_command_exits_127_like_docker(cluster) -> None:
    alice, bob = cluster("alice"), cluster("bob")

    async def scenario() -> None:
        async with providing(alice):
            pair_both(alice, bob)
            got = Collected()
            result = await run_job(bob, spec("alice", "no-such-command"), callbacks=got)
            assert result.exit_code == 127
            assert b"no-such-command" in bytes(got.err)

    arun(scenario())


def test_cancel_stops_the_container_and_is_never_retried(cluster, engine) -> None:
    alice, bob = cluster("alice"), cluster("bob")

    async def scenario() -> None:
        async with providing(alice):
            pair_both(alice, bob)
            started = await run_job(bob, spec("alice", "sleep", "300", retries=3), detach=True)
            for _ in range(100):
                if alice.home.store.job("hosted", started.job_id).state == "running":  # type: ignore[union-attr]
                    break
                await asyncio.sleep(0.1)
            assert len(_containers(engine, alice)) == 1
            began = time.monotonic()
            cancelled = await cancel_job(bob, "alice", started.job_id)
            assert cancelled.state == "cancelled"
            assert time.monotonic() - began < 15
            assert await _removed(engine, alice)
            assert alice.home.store.job("hosted", started.job_id).attempt == 1  # type: ignore[union-attr]
            assert bob.home.store.job("submitted", started.job_id).state == "cancelled"  # type: ignore[union-attr]

    arun(scenario())


def test_lockdown_is_visible_on_a_running_job_container(cluster, engine) -> None:
    alice, bob = cluster("alice"), cluster("bob")

    async def scenario() -> None:
        async with providing(alice):
            pair_both(alice, bob)
            started = await run_job(bob, spec("alice", "sleep", "300"), detach=True)
            for _ in range(100):
                found = _containers(engine, alice)
                if found:
                    container = found[0]
                    with contextlib.suppress(docker.errors.NotFound):
                        container.reload()  # type: ignore[attr-defined]
                        break
                await asyncio.sleep(0.1)
            host = container.attrs["HostConfig"]  # type: ignore[attr-defined]
            labels = container.labels  # type: ignore[attr-defined]
            assert host["Privileged"] is False
            assert host["CapDrop"] == ["ALL"]
            assert "no-new-privileges" in host["SecurityOpt"]
            assert host["PidsLimit"] == 1024
            assert host["Memory"] == 256_000_000
            network = network_host_config(engine.api, container.id)  # type: ignore[attr-defined]
            assert network["NetworkMode"] == names_for("internet", SESSION_PREFIX).network
            assert network["Sysctls"] == {"net.ipv6.conf.all.disable_ipv6": "1"}
            assert not host.get("Binds")
            assert labels["io.gpumesh.job"] == started.job_id
            assert labels["io.gpumesh.peer"] == bob.info().node_id
            await cancel_job(bob, "alice", started.job_id)

    arun(scenario())


def test_gpu_jobs_get_their_assigned_gpu_through_device_requests(cluster, engine) -> None:
    """Simulated inventory (no NVIDIA hardware here); the container is created, not started."""
    alice = cluster("alice")
    inventory = SimulatedInventory("RTX-4090:24GB:20GB,A100:80GB:10GB")

    async def scenario() -> None:
        async with providing(alice, inventory=inventory) as agent:
            jobs, gpus = agent.jobs, agent.gpus
            holder = Holder(HolderKind.JOB, "feedfacecafe")
            found = inventory.gpus()
            assert gpus.choose(found, holder, 8 * 10**9) == ["1"]  # the GPU with room for it
            with pytest.raises(LimitError, match=r"the most free on alice is 70GB \(GPU 1 A100"):
                gpus.choose(found, holder, 75 * 10**9)
            record = alice.home.store  # noqa: F841 - the spec needs a job record
            from gpumesh.store.jobs import JobRecord

            job = JobRecord(
                **{  # type: ignore[arg-type]
                    "role": "hosted",
                    "job_id": "feedfacecafe",
                    "peer_id": "p",
                    "peer_name": "p",
                    "image": IMAGE,
                    "command": ["true"],
                    "env": {"NVIDIA_VISIBLE_DEVICES": "all"},
                    "gpu_memory": 0,
                    "gpus": ["1"],
                    "retries": 0,
                    "timeout": 0.0,
                    "workdir": "",
                    "state": "queued",
                    "attempt": 0,
                    "exit_code": None,
                    "message": "",
                    "cancel_requested": False,
                    "container_id": "",
                    "log_cursor": {},
                    "last_seq": 0,
                    "created_at": 0.0,
                    "started_at": None,
                    "finished_at": None,
                }
            )
            runtime = DockerRuntime()
            try:
                who = agent.containers.job_user(IMAGE)
                container_id = runtime.create(jobs.runner.container_spec(job, 1, who))
            finally:
                runtime.close()
            inspected = engine.api.inspect_container(container_id)
            requests = inspected["HostConfig"]["DeviceRequests"]
            assert requests[0]["DeviceIDs"] == ["1"]
            assert requests[0]["Capabilities"] == [["gpu"]]
            assert "NVIDIA_VISIBLE_DEVICES=1" in inspected["Config"]["Env"]

    arun(scenario())


def test_a_container_that_cannot_start_is_removed_and_the_job_says_why(cluster, engine) -> None:
    """GPUs simulated (no NVIDIA hardware here), and this engine has no NVIDIA
    runtime: a GPU job's container is created, then its start fails. Created and
    started in one step, it is still known and removed, and the job fails with
    the reason in the provider's name."""
    if "nvidia" in (engine.info().get("Runtimes") or {}):
        pytest.skip("this engine has an NVIDIA runtime: a GPU container starts here")
    alice, bob = cluster("alice"), cluster("bob")
    inventory = SimulatedInventory("RTX-4090:24GB:20GB")

    async def scenario() -> None:
        async with providing(alice, inventory=inventory):
            pair_both(alice, bob)
            result = await run_job(bob, spec("alice", "true", gpu_memory=10**9))
            assert (result.state, result.exit_code) == ("failed", 125)
            assert "alice: this machine's Docker" not in result.message
            assert "nvidia-container-toolkit" in result.message
            assert await _removed(engine, alice)
            (job,) = alice.home.store.jobs(role="hosted")
            assert job.container_id == ""

    arun(scenario())


def test_refusals_create_no_container(cluster, engine, tmp_path: Path) -> None:
    alice, bob = cluster("alice"), cluster("bob")
    alice.home.config.set("upload_limit", "1KB")
    alice.home.config.save()
    big = tmp_path / "big"
    big.mkdir()
    (big / "blob").write_bytes(b"x" * 5000)

    async def scenario() -> None:
        async with providing(alice, max_vram=8 * 10**9):
            pair_both(alice, bob)
            with pytest.raises(
                ImageMissingError,
                match="'no/such-image:1' is not on alice and cannot be pulled",
            ):
                await run_job(bob, spec("alice", "true", image="no/such-image:1"))
            with pytest.raises(LimitError, match="alice shares at most 8GB"):
                await run_job(bob, spec("alice", "true", gpu_memory=16 * 10**9))
            with pytest.raises(LimitError, match="alice has no NVIDIA GPU"):
                await run_job(bob, spec("alice", "true", gpu_memory=10**9))
            with pytest.raises(LimitError, match="NVIDIA_VISIBLE_DEVICES may not be set"):
                await run_job(bob, spec("alice", "true", env={"NVIDIA_VISIBLE_DEVICES": "all"}))
            with pytest.raises(LimitError, match="accepts at most 1KB"):
                await run_job(bob, spec("alice", "true", workdir=big))
            with pytest.raises(NotFoundError, match="alice has no job"):
                await cancel_job(bob, "alice", "0123456789ab")
            assert await _removed(engine, alice)
            assert alice.home.store.jobs(role="hosted") == []

    arun(scenario())


@pytest.fixture
def collected_last() -> Iterator[None]:
    """Collects garbage once the test's other fixtures are torn down (its nodes and
    their agents' engine clients too), still under the test's warning filters."""
    yield
    gc.collect()


# The docker SDK leaves the socket of a failed unix connect unclosed (its bug, not ours).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_docker_down_on_the_provider_is_a_clear_refusal(collected_last, cluster) -> None:
    alice, bob = cluster("alice"), cluster("bob")
    client = docker.DockerClient(base_url="unix:///nonexistent.sock", version="1.41")
    broken = DockerRuntime(client)

    async def scenario() -> None:
        async with providing(alice, runtime=broken):
            pair_both(alice, bob)
            with pytest.raises(RuntimeUnavailableError, match="Docker is not reachable on alice"):
                await run_job(bob, spec("alice", "true"))

    try:
        arun(scenario())
    finally:
        client.close()
        gc.collect()  # surface the SDK's leaked socket here, under this test's filter


def test_another_peers_job_cannot_be_cancelled_or_read(cluster) -> None:
    alice, bob, carol = cluster("alice"), cluster("bob"), cluster("carol")

    async def scenario() -> None:
        async with providing(alice):
            pair_both(alice, bob)
            pair_both(alice, carol)
            job = await run_job(bob, spec("alice", "sleep", "300"), detach=True)
            with pytest.raises(AccessDeniedError, match="submitted by another peer"):
                await cancel_job(carol, "alice", job.job_id)
            async with carol.session("alice") as session:
                with pytest.raises(AccessDeniedError, match="submitted by another peer"):
                    await session.request(JobQuery(job_id=job.job_id))
            await cancel_job(bob, "alice", job.job_id)

    arun(scenario())


def test_another_peers_outputs_cannot_be_listed_or_released(cluster, tmp_path: Path) -> None:
    alice, bob, carol = cluster("alice"), cluster("bob"), cluster("carol")
    script = "echo kept > $GPUMESH_OUTPUTS/.t && mv $GPUMESH_OUTPUTS/.t $GPUMESH_OUTPUTS/kept"

    async def scenario() -> None:
        async with providing(alice):
            pair_both(alice, bob)
            pair_both(alice, carol)
            job = await run_job(
                bob,
                spec("alice", "sh", "-c", script, outputs="/out", outputs_to=tmp_path / "o"),
            )
            assert job.state == "succeeded"
            bob_id = str(bob.info().node_id)
            folder = alice.home.files_dir / bob_id / "gpumesh-outputs" / job.job_id
            assert (folder / "kept").read_text() == "kept\n"
            async with carol.session("alice") as session:
                for query in (
                    OutputsQuery(job_id=job.job_id),
                    OutputsQuery(job_id=job.job_id, release=True),
                ):
                    with pytest.raises(AccessDeniedError, match="submitted by another peer"):
                        await session.request(query)
            assert (folder / "kept").read_text() == "kept\n"  # nothing was released
            async with bob.session("alice") as session:
                ready = await session.request(OutputsQuery(job_id=job.job_id))
                assert [f.path for f in ready.files] == ["kept"] and ready.final

    arun(scenario())


def test_agent_restart_mid_job_loses_no_line_and_runs_one_copy(cluster, engine) -> None:
    alice, bob = cluster("alice"), cluster("bob")
    script = "for i in $(seq 1 30); do echo line $i; echo err $i >&2; sleep 0.1; done; exit 7"

    async def scenario() -> None:
        async with providing(alice) as first:
            pair_both(alice, bob)
            port = first.address[1]
            job = await run_job(bob, spec("alice", "sh", "-c", script), detach=True)
            await asyncio.sleep(1.0)  # some lines are logged by the first agent
        # The agent is gone; the container keeps running.
        assert len(_containers(engine, alice)) == 1
        await asyncio.sleep(1.0)  # more lines are printed while nobody watches
        async with providing(alice, port=port):
            got = Collected()
            result = await follow_job(bob, job.job_id, callbacks=got)
        assert (result.state, result.exit_code) == ("failed", 7)
        assert bytes(got.out).decode().splitlines() == [f"line {i}" for i in range(1, 31)]
        assert bytes(got.err).decode().splitlines() == [f"err {i}" for i in range(1, 31)]
        assert [s for s in got.states if s[0] == "starting"] == [("starting", 1)]
        assert await _removed(engine, alice)

    arun(scenario())


def test_resubmitting_the_same_job_id_never_runs_a_second_copy(cluster) -> None:
    alice, bob = cluster("alice"), cluster("bob")

    async def scenario() -> None:
        async with providing(alice):
            pair_both(alice, bob)
            first = await run_job(
                bob, spec("alice", "sh", "-c", "echo once"), job_id="abcdef012345"
            )
            bob.home.store.delete_job("submitted", "abcdef012345")
            got = Collected()
            again = await run_job(
                bob, spec("alice", "sh", "-c", "echo once"), job_id="abcdef012345", callbacks=got
            )
            assert first.exit_code == again.exit_code == 0
            assert bytes(got.out) == b"once\n"  # the first run's output, replayed
            assert len(alice.home.store.jobs(role="hosted")) == 1
            assert alice.home.store.jobs(role="hosted")[0].attempt == 1

    arun(scenario())


def test_timeout_stops_an_attempt_and_counts_as_a_failure(cluster, engine) -> None:
    alice, bob = cluster("alice"), cluster("bob")

    async def scenario() -> None:
        async with providing(alice):
            pair_both(alice, bob)
            began = time.monotonic()
            result = await run_job(bob, spec("alice", "sleep", "60", timeout=1.0, retries=1))
            assert (result.state, result.exit_code, result.attempt) == ("failed", 124, 2)
            assert "timed out after 1s" in result.message
            assert time.monotonic() - began < 30
            assert await _removed(engine, alice)

    arun(scenario())


def test_follower_survives_a_provider_restart_without_gaps(cluster) -> None:
    alice, bob = cluster("alice"), cluster("bob")
    script = "for i in $(seq 1 40); do echo line $i; sleep 0.05; done"

    async def scenario() -> None:
        got = Collected()
        async with providing(alice) as first:
            pair_both(alice, bob)
            port = first.address[1]
            job = await run_job(bob, spec("alice", "sh", "-c", script), detach=True)
            follower = asyncio.create_task(follow_job(bob, job.job_id, callbacks=got))
            await asyncio.sleep(0.8)
        # The link drops with the agent; the follower keeps redialling.
        await asyncio.sleep(0.5)
        async with providing(alice, port=port):
            result = await asyncio.wait_for(follower, 45)
        assert result.state == "succeeded"
        assert bytes(got.out).decode().splitlines() == [f"line {i}" for i in range(1, 41)]

    arun(scenario())


class _EveryProcessUsesGpuMemory(SimulatedInventory):
    """Stand-in for NVML's per-process accounting (no NVIDIA hardware here)."""

    def process_memory(self) -> dict[int, int]:
        return {int(p): 1_500_000_000 for p in os.listdir("/proc") if p.isdigit()}


def test_peak_gpu_memory_is_measured_and_reported_to_the_submitter(cluster) -> None:
    alice, bob = cluster("alice"), cluster("bob")

    async def scenario() -> None:
        async with providing(alice, inventory=SimulatedInventory("")) as agent:
            pair_both(alice, bob)
            # A CPU job (GPU containers cannot start here), sampled as a GPU job would be.
            job = await run_job(bob, spec("alice", "sleep", "30"), detach=True)
            for _ in range(100):
                record = alice.home.store.job("hosted", job.job_id)
                if record is not None and record.state == "running" and record.container_id:
                    break
                await asyncio.sleep(0.1)
            run = agent.jobs.runner.runs[job.job_id]
            agent.gpus._inventory = _EveryProcessUsesGpuMemory("L4:24GB")
            sampler = asyncio.create_task(
                agent.jobs.runner.sample_gpu_memory(run, record.container_id)
            )
            await asyncio.sleep(0.5)
            sampler.cancel()
            runtime = DockerRuntime()
            try:
                pids = runtime.pids(record.container_id)
            finally:
                runtime.close()
            peak = alice.home.store.job("hosted", job.job_id).peak_gpu_memory  # type: ignore[union-attr]
            assert peak == 1_500_000_000 * len(pids) > 0
            await cancel_job(bob, "alice", job.job_id)
            got = Collected()
            await follow_job(bob, job.job_id, callbacks=got)
            assert bob.home.store.job("submitted", job.job_id).peak_gpu_memory == peak  # type: ignore[union-attr]

    arun(scenario())


def test_a_silent_job_keeps_its_link_alive(cluster, monkeypatch) -> None:
    from gpumesh.transport import quicsetup as quic

    monkeypatch.setattr(quic, "IDLE_TIMEOUT", 1.5)  # keepalives every 0.5 s
    alice, bob = cluster("alice"), cluster("bob")

    async def scenario() -> None:
        async with providing(alice):
            pair_both(alice, bob)
            got = Collected()
            drops: list[object] = []
            got.reconnecting = drops.append
            result = await run_job(
                bob, spec("alice", "sh", "-c", "sleep 5; echo done"), callbacks=got
            )
            assert (result.state, bytes(got.out)) == ("succeeded", b"done\n")
            assert drops == []  # never idled out, so never had to reconnect

    arun(scenario())


@pytest.mark.parametrize("where", ["uploaded workdir", "sandbox folder"])
def test_a_job_writing_past_its_peers_file_quota_is_stopped_with_the_reason(
    cluster, engine, monkeypatch, tmp_path: Path, where: str
) -> None:
    from gpumesh.agent import jobrun as job_service

    monkeypatch.setattr(job_service, "QUOTA_INTERVAL", 0.2)
    alice, bob = cluster("alice"), cluster("bob")
    alice.home.config.set("file_quota", "1MB")
    alice.home.config.save()
    work = tmp_path / "work"
    work.mkdir()
    (work / "input.txt").write_text("small\n")
    # The job writes 3 MB where it may write, then would idle for a minute.
    command = ("sh", "-c", "head -c 3000000 /dev/zero > grown.bin; echo wrote; sleep 60")

    async def scenario() -> None:
        async with providing(alice):
            pair_both(alice, bob)
            got = Collected()
            if where == "uploaded workdir":
                result = await run_job(bob, spec("alice", *command, workdir=work), callbacks=got)
            else:
                box = alice.home.path / "files" / str(bob.info().node_id) / "data"
                box.mkdir(parents=True)
                result = await run_job(
                    bob, spec("alice", *command), callbacks=got, sandbox_dir="/data"
                )
            assert result.state == "failed"
            assert "over its file_quota of 1MB" in result.message, result.message
            assert b"wrote\n" in bytes(got.out)
            assert b"gpumesh: stopped: your files on alice grew to" in bytes(got.err)
            assert result.attempt == 1  # never retried: it would only fill the disk again
            assert await _removed(engine, alice)

    arun(scenario())


def test_jobs_of_a_peer_never_share_nested_sandbox_folders(cluster, tmp_path: Path) -> None:
    # A job can rename anything below its folder and put a symlink there; Docker
    # mounts a job's folder by path when its container starts. So while one job
    # is unfinished, no other job of the peer may use a folder below or above it.
    alice, bob = cluster("alice"), cluster("bob")
    box = alice.home.path / "files" / str(bob.info().node_id)
    (box / "w" / "d").mkdir(parents=True)
    (box / "other").mkdir()

    async def scenario() -> None:
        async with providing(alice):
            pair_both(alice, bob)
            for running, nested in (("/w", "/w/d"), ("/w/d", "/w")):
                first = await run_job(
                    bob, spec("alice", "sleep", "60"), detach=True, sandbox_dir=running
                )
                with pytest.raises(LimitError, match=rf"your job {first.job_id} \(\w+\) works"):
                    await run_job(bob, spec("alice", "true"), sandbox_dir=nested)
                # The same folder, and one beside it, are fine meanwhile.
                same = await run_job(bob, spec("alice", "true"), sandbox_dir=running)
                beside = await run_job(bob, spec("alice", "true"), sandbox_dir="/other")
                assert (same.state, beside.state) == ("succeeded", "succeeded")
                await cancel_job(bob, "alice", first.job_id)
                # Once it ended, the nested folder is free.
                after = await run_job(bob, spec("alice", "true"), sandbox_dir=nested)
                assert after.state == "succeeded"

    arun(scenario())


def test_deny_cancels_the_peers_jobs_at_once_and_they_are_never_retried(
    cluster, engine, tmp_path: Path
) -> None:
    alice, bob, carol = cluster("alice"), cluster("bob"), cluster("carol")
    owner = Node(alice.home.path)  # the owner's own Node, as the node process's API has

    async def scenario() -> None:
        async with providing(alice):
            pair_both(alice, bob)
            pair_both(alice, carol)
            long = spec("alice", "sleep", "60", retries=3)
            bobs = await run_job(bob, long, detach=True)
            carols = await run_job(carol, long, detach=True)
            await until_hosted(alice, bobs.job_id, "running")
            owner.deny("bob")
            await until_hosted(alice, bobs.job_id, "succeeded", "failed", "cancelled", within=30)
            job = alice.home.store.job("hosted", bobs.job_id)
            assert (job.state, job.message, job.attempt) == ("cancelled", "access revoked", 1)  # type: ignore[attr-defined]
            # carol is untouched; bob's container is gone
            assert alice.home.store.job("hosted", carols.job_id).state in ("starting", "running")  # type: ignore[union-attr]
            assert await _removed(engine, alice, bobs.job_id)
            found = _containers(engine, alice)
            labels = [(c.attrs.get("Labels") or {}).get(LABEL_JOB) for c in found]  # type: ignore[attr-defined]
            assert carols.job_id in labels
            # and bob can neither follow nor submit any more
            with pytest.raises(AccessDeniedError):
                await follow_job(bob, bobs.job_id)
            await cancel_job(carol, "alice", carols.job_id)

    arun(scenario())
    owner.close()


def test_the_providers_owner_cancels_a_hosted_job(cluster, engine) -> None:
    from gpumesh.client.jobs import cancel_hosted

    alice, bob = cluster("alice"), cluster("bob")
    owner = Node(alice.home.path)

    async def scenario() -> None:
        async with providing(alice):
            pair_both(alice, bob)
            submitted = await run_job(bob, spec("alice", "sleep", "60", retries=2), detach=True)
            await until_hosted(alice, submitted.job_id, "running")
            result = await cancel_hosted(owner, submitted.job_id[:6])
            assert (result.state, result.message) == (
                "cancelled",
                "cancelled by the provider's owner",
            )
            assert result.exit_code is not None
            followed = await follow_job(bob, submitted.job_id)
            assert (followed.state, followed.attempt) == ("cancelled", 1)
            assert followed.message == "cancelled by the provider's owner"
            assert await _removed(engine, alice)

    arun(scenario())
    owner.close()
