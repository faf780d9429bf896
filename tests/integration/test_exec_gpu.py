"""``gpumesh exec --gpu-memory``: a shell with a GPU, through the same checks and the
same GPU allocator as a job. Real agents and the real dockerd; there is no NVIDIA
hardware here, so GPUs are the explicit simulated inventory, and a container that
asks the engine for one is created and inspected, or refused at start by this
engine (it has no NVIDIA runtime), never run."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import docker
import pytest

from gpumesh.agent.gpus import HolderKind
from gpumesh.client.exec import exec_shell
from gpumesh.errors import GPUMeshError, LimitError
from gpumesh.gpu.inventory import SimulatedInventory
from gpumesh.protocol.messages import ExecStart
from gpumesh.runtime.docker import DockerRuntime
from tests.integration.conftest import arun, pair_both
from tests.integration.test_jobs import providing

pytestmark = pytest.mark.usefixtures("docker_daemon", "gpumesh_processes")

IMAGE = os.environ.get("GPUMESH_TEST_DOCKER_IMAGE", "gpumesh-test/busybox:1")
GB = 10**9


async def _nothing() -> None:
    return


async def _no_input():  # type: ignore[no-untyped-def]
    await asyncio.sleep(3600)
    yield b""


def _shell(bob, peer: str, memory: int):  # type: ignore[no-untyped-def]
    return exec_shell(
        bob,
        peer,
        ["true"],
        source=_no_input(),
        sink=lambda data: _nothing(),
        image=IMAGE,
        gpu_memory=memory,
    )


def test_a_shell_asks_for_gpu_memory_like_a_job_and_is_refused_like_one(make_node) -> None:
    alice, bob = make_node("alice"), make_node("bob")

    async def scenario() -> None:
        async with providing(alice, inventory=SimulatedInventory(""), max_vram=8 * GB):
            pair_both(alice, bob)
            with pytest.raises(LimitError, match="alice shares at most 8GB"):
                await _shell(bob, "alice", 16 * GB)
            with pytest.raises(LimitError, match="alice has no NVIDIA GPU"):
                await _shell(bob, "alice", GB)

    arun(scenario())


def test_a_shell_with_a_gpu_holds_its_memory_and_gives_it_back(
    make_node, engine: docker.DockerClient
) -> None:
    """The GPU is chosen and held by the allocator for as long as the shell is being
    opened; this engine then refuses to start a container with a GPU, and the refusal
    names the provider; afterwards nothing is held any more."""
    alice, bob = make_node("alice"), make_node("bob")
    inventory = SimulatedInventory("RTX-4090:24GB:20GB,A100:80GB:10GB")
    seen: list[tuple[HolderKind, tuple[str, ...], int]] = []

    async def scenario() -> None:
        async with providing(alice, inventory=inventory) as agent:
            pair_both(alice, bob)
            original = agent.gpus.hold

            def watched(holder, gpus, memory):  # type: ignore[no-untyped-def]
                seen.append((holder.kind, tuple(gpus), memory))
                original(holder, gpus, memory)

            agent.gpus.hold = watched  # type: ignore[method-assign]
            with pytest.raises(GPUMeshError, match="alice") as caught:
                await _shell(bob, "alice", 30 * GB)
            assert (
                "Docker cannot give GPUs" in caught.value.message or "GPU" in caught.value.message
            )
            assert agent.gpus.reservations() == []

    arun(scenario())
    # The A100 (70GB free of 80GB) is the one with room for 30GB.
    assert seen == [(HolderKind.SHELL, ("1",), 30 * GB)]


def test_a_shell_container_gets_its_gpu_through_device_requests(
    make_node, engine: docker.DockerClient
) -> None:
    alice = make_node("alice")

    async def scenario() -> None:
        async with providing(alice, inventory=SimulatedInventory("A100:80GB")) as agent:
            who = agent.containers.job_user(IMAGE)
            start = ExecStart(image=IMAGE, command=["sh"], env={}, tty=True, rows=24, cols=80)
            from gpumesh.store.peers import Peer

            peer = Peer.__new__(Peer)
            object.__setattr__(peer, "node_id", "p" * 26)
            spec = agent.shells.container_spec(peer, start, who, ["0"])
            runtime = DockerRuntime()
            try:
                container_id = runtime.create_interactive(spec, True)
            finally:
                runtime.close()
            try:
                inspected = engine.api.inspect_container(container_id)
            finally:
                engine.api.remove_container(container_id, force=True)
            requests = inspected["HostConfig"]["DeviceRequests"]
            assert requests[0]["DeviceIDs"] == ["0"]
            assert "NVIDIA_VISIBLE_DEVICES=0" in inspected["Config"]["Env"]
            # The rest of the lockdown is a shell's: no host folder at all.
            assert not inspected["HostConfig"].get("Binds")
            assert inspected["HostConfig"]["Privileged"] is False

    arun(scenario())


def test_the_cli_refuses_a_shell_gpu_where_there_is_none(pair: tuple[Path, Path]) -> None:
    from gpumesh.errors import ExitCode
    from tests.integration.conftest import gpumesh

    _alice, bob = pair
    result = gpumesh(bob, "exec", "--gpu-memory", "8GB", "alice-pc", "true")
    assert result.returncode == ExitCode.USAGE, result.stderr  # a provider's limit
    assert result.stderr.startswith("error: ")
    assert "alice-pc has no NVIDIA GPU" in result.stderr
    assert "Traceback" not in result.stderr
    bad = gpumesh(bob, "exec", "--gpu-memory", "0", "alice-pc", "true")
    assert bad.returncode != 0 and "must be more than 0" in bad.stderr
