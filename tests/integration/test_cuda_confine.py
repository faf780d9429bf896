"""What one CUDA-allowed peer may cost the provider, attacked end to end: real
agents over real QUIC on loopback, a real worker process per session read
through ``/proc``. The host-memory fallback stands in for the GPU (these
machines have none): its device memory is the host memory being defended."""

from __future__ import annotations

import array
import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from gpumesh.agent.cudaconfine import HEADROOM
from gpumesh.client.node import Node
from gpumesh.cuda import RemoteDevice
from gpumesh.errors import CudaError, LimitError
from gpumesh.gpu.cudakernels import VADD_F32, VADD_PTX
from tests.integration.conftest import arun, pair_both, sharing

MiB = 1024 * 1024


def _offer(alice: Node, bob: Node, **settings: str) -> None:
    for key, value in settings.items():
        alice.home.config.set(key, value)
    alice.home.config.save()
    alice.home.store.set_cuda_share(True)
    alice.home.store.cuda_allow(str(bob.info().node_id))


async def _in_thread(fn: Callable[[], object]) -> object:
    return await asyncio.to_thread(fn)


def _status(pid: int) -> dict[str, str]:
    text = Path(f"/proc/{pid}/status").read_text()
    return {
        key: value.strip() for key, _, value in (line.partition(":") for line in text.splitlines())
    }


def _environ(pid: int) -> list[bytes]:
    return sorted(filter(None, Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")))


def _address_space_limit(pid: int) -> int:
    """The soft RLIMIT_AS of ``pid``, in bytes."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max address space"):
            return int(line.split()[3])
    raise AssertionError("no address-space line in /proc/PID/limits")


def _kib(value: str) -> int:
    number, unit = value.split()
    assert unit == "kB"
    return int(number) * 1024


def test_a_256_mib_vector_add_peaks_within_the_sessions_memory(make_node) -> None:
    """The attack: the fallback's vector add took a 733 MiB session to 3.9 GB."""
    alice, bob = make_node("alice"), make_node("bob")
    memory = 256 * MiB
    n = (memory - MiB) // 12  # three vectors fill the session

    def use(pid: Callable[[], int]) -> int:
        with RemoteDevice("alice", home=bob.home.path, memory=memory) as dev:
            a, b, c = (dev.alloc(n * 4) for _ in range(3))
            dev.copy_to(a, array.array("f", [1.5]) * n)
            dev.copy_to(b, array.array("f", [2.25]) * n)
            dev.launch(VADD_PTX, VADD_F32, grid=(n + 255) // 256, block=256, args=(a, b, c, n))
            dev.synchronize()
            tail = array.array("f", bytes(dev.copy_from(c + (n - 4) * 4, 16)))
            assert list(tail) == [3.75] * 4
            return _kib(_status(pid())["VmHWM"])

    async def scenario() -> None:
        async with sharing(alice) as agent:
            pair_both(alice, bob)
            _offer(alice, bob)
            peak = await _in_thread(lambda: use(lambda: agent.cuda.sessions()[0].process.pid))
            assert isinstance(peak, int)
            assert peak <= memory + HEADROOM, f"the worker peaked at {peak // MiB} MiB"

    arun(scenario())


def test_the_worker_runs_as_job_user_with_no_privileges_environment_or_room_to_grow(
    make_node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attack: the worker ran as the agent's user (root here) with all of the
    agent's environment, so whatever ran in it could act as the agent."""
    if os.geteuid() != 0:
        pytest.skip("the worker switches users only under an agent that runs as root")
    alice, bob = make_node("alice"), make_node("bob")
    monkeypatch.setenv("GPUMESH_AGENT_ONLY_SECRET", "the owner's token")

    async def scenario() -> None:
        async with sharing(alice) as agent:
            pair_both(alice, bob)
            _offer(alice, bob, job_user="4242:4343")
            dev = await _in_thread(lambda: RemoteDevice("alice", home=bob.home.path, memory=MiB))
            try:
                [session] = agent.cuda.sessions()
                pid = session.process.pid
                status = _status(pid)
                assert status["NoNewPrivs"] == "1"
                assert status["Uid"].split() == ["4242"] * 4
                assert status["Gid"].split() == ["4343"] * 4
                assert status["Groups"] == ""
                passed_on = [
                    f"{name}={os.environ[name]}".encode()
                    for name in ("LD_LIBRARY_PATH", "PYTHONPATH")
                    if os.environ.get(name)
                ]
                assert _environ(pid) == sorted(
                    [b"HOME=/", b"LANG=C.UTF-8", b"PATH=/usr/local/bin:/usr/bin:/bin", *passed_on]
                )
                assert os.readlink(f"/proc/{pid}/cwd") == "/"
                assert _address_space_limit(pid) <= _kib(status["VmSize"]) + MiB + HEADROOM
                assert await _in_thread(dev.device_count) == 1  # and it still serves
            finally:
                await _in_thread(dev.close)

    arun(scenario())


def test_cuda_sessions_count_against_share_memory(make_node) -> None:
    """The attack: CUDA sessions were in no machine-wide budget; one peer could
    hold 4 sessions of 4 GiB on a provider sharing far less."""
    alice, bob = make_node("alice"), make_node("bob")

    async def scenario() -> None:
        async with sharing(alice) as agent:
            pair_both(alice, bob)
            _offer(alice, bob, share_memory="600MB")
            opened = []
            for _ in range(2):
                opened.append(
                    await _in_thread(
                        lambda: RemoteDevice("alice", home=bob.home.path, memory=256 * MiB)
                    )
                )
            with pytest.raises(
                LimitError,
                match=r"^alice refused the CUDA session: 536.9MB of memory is promised to its "
                r"running jobs, shells and CUDA sessions, and this CUDA session's 268.4MB "
                r"would go over its share_memory of 600MB; ask for less \(--memory\) or try "
                r"again when one ends$",
            ):
                await _in_thread(
                    lambda: RemoteDevice("alice", home=bob.home.path, memory=256 * MiB)
                )
            assert len(agent.cuda.sessions()) == 2
            await _in_thread(opened.pop().close)
            for _ in range(600):  # the agent lets go once the worker has ended
                if len(agent.jobs.admission.claims()) == 1:
                    break
                await asyncio.sleep(0.05)
            again = await _in_thread(
                lambda: RemoteDevice("alice", home=bob.home.path, memory=256 * MiB)
            )
            for dev in (again, *opened):
                await _in_thread(dev.close)

    arun(scenario())


def test_a_copy_outside_the_sessions_allocations_is_one_line(make_node) -> None:
    alice, bob = make_node("alice"), make_node("bob")

    def use() -> None:
        with RemoteDevice("alice", home=bob.home.path, memory=MiB) as dev:
            ptr = dev.alloc(4096)
            with pytest.raises(
                CudaError,
                match=r"^CUDA_ERROR_INVALID_VALUE: 1099511627776 bytes at 0x[0-9a-f]+ are not "
                r"inside one allocation$",
            ):
                dev.copy_from(ptr, 1 << 40)
            assert dev.device_count() == 1  # the session goes on

    async def scenario() -> None:
        async with sharing(alice):
            pair_both(alice, bob)
            _offer(alice, bob)
            await _in_thread(use)

    arun(scenario())
