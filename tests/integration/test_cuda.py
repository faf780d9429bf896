"""CUDA remoting end to end: real agents over real QUIC on loopback, a real worker
process per session, the host-memory fallback (these machines have no GPU)."""

from __future__ import annotations

import array
import asyncio
import os
import signal
from collections.abc import Callable

import pytest

from gpumesh.agent.gpus import HolderKind
from gpumesh.client.cuda import cuda_sessions
from gpumesh.client.node import Node
from gpumesh.cuda import DevicePointer, RemoteDevice
from gpumesh.errors import AccessDeniedError, CudaError, GPUMeshError, LimitError
from gpumesh.gpu.cudakernels import VADD_F32, VADD_PTX
from tests.integration.conftest import arun, pair_both, sharing, until_async

MiB = 1024 * 1024


def _cuda_pair(make_node: Callable[[str], Node]) -> tuple[Node, Node]:
    alice, bob = make_node("alice"), make_node("bob")
    return alice, bob


def _offer(alice: Node, bob: Node) -> None:
    alice.home.store.set_cuda_share(True)
    alice.home.store.cuda_allow(str(bob.info().node_id))


async def _in_thread(fn: Callable[[], object]) -> object:
    return await asyncio.to_thread(fn)


def test_the_demo_runs_on_the_fallback_and_every_call_works(make_node) -> None:
    alice, bob = _cuda_pair(make_node)

    def use() -> None:
        with RemoteDevice("alice", home=bob.home.path, memory=64 * MiB) as dev:
            assert (dev.backend, dev.name, dev.memory_cap) == (
                "fallback",
                "host-memory fallback",
                64 * MiB,
            )
            assert dev.device_count() == 1
            assert dev.properties()["backend"] == "fallback"
            n = 100_000
            a, b, c = (dev.alloc(n * 4) for _ in range(3))
            assert isinstance(a, DevicePointer)
            dev.copy_to(a, array.array("f", [float(i) for i in range(n)]))
            dev.copy_to(b, array.array("f", [2.0] * n))
            dev.launch(VADD_PTX, VADD_F32, grid=(n + 255) // 256, block=256, args=(a, b, c, n))
            dev.synchronize()
            out = array.array("f", dev.copy_from(c, n * 4))
            assert out[0] == 2.0 and out[n - 1] == n + 1.0
            big = os.urandom(5 * MiB + 3)  # several chunks each way
            d = dev.alloc(len(big))
            dev.copy_to(d, big)
            assert dev.copy_from(d, len(big)) == big
            dev.copy_device(a, d + 8, 16)
            dev.memset(a + 4, 0, 4)
            assert dev.copy_from(a, 16) == big[8:12] + b"\0" * 4 + big[16:24]
            dev.free(d)
            dev.synchronize()
            with pytest.raises(CudaError, match="CUDA_ERROR_OUT_OF_MEMORY") as caught:
                dev.alloc(64 * MiB)
            assert caught.value.name == "CUDA_ERROR_OUT_OF_MEMORY"
            dev.free(d)  # twice: not answered now ...
            with pytest.raises(CudaError, match=r"CUDA_ERROR_INVALID_VALUE: 0x[0-9a-f]+ is not"):
                dev.synchronize()  # ... but here
            with pytest.raises(CudaError, match="CUDA_ERROR_NOT_SUPPORTED: the host-memory"):
                dev.launch(".entry mine()\n{ ret; }", "mine", grid=1, block=1)
            dev.synchronize()  # the session goes on after errors

    async def scenario() -> None:
        async with sharing(alice) as agent:
            pair_both(alice, bob)
            _offer(alice, bob)
            await _in_thread(use)
            await until_async(lambda: not agent.cuda.sessions(), "the agent to end the session")
            assert not [r for r in agent.gpus.reservations() if r.holder.kind is HolderKind.CUDA]

    arun(scenario())


def test_cuda_is_off_by_default_and_needs_its_own_allowlist(make_node) -> None:
    alice, bob = _cuda_pair(make_node)

    async def scenario() -> None:
        async with sharing(alice):
            pair_both(alice, bob)
            refused = r"does not share CUDA.*`gpumesh cuda share`"
            with pytest.raises(AccessDeniedError, match=refused):
                await _in_thread(lambda: RemoteDevice("alice", home=bob.home.path))
            alice.home.store.set_cuda_share(True)
            with pytest.raises(
                AccessDeniedError, match=r"not allowed you CUDA sessions.*`gpumesh cuda allow bob`"
            ):
                await _in_thread(lambda: RemoteDevice("alice", home=bob.home.path))

    arun(scenario())


def test_session_memory_is_held_in_the_gpu_books_and_capped(make_node) -> None:
    alice, bob = _cuda_pair(make_node)

    async def scenario() -> None:
        async with sharing(alice) as agent:
            pair_both(alice, bob)
            _offer(alice, bob)
            too_much = r"asks for 8.6GB; alice has no GPU and holds at most 4.3GB per session"
            with pytest.raises(LimitError, match=too_much):
                await _in_thread(lambda: RemoteDevice("alice", home=bob.home.path, memory=8 << 30))
            dev = await _in_thread(lambda: RemoteDevice("alice", home=bob.home.path, memory=MiB))
            try:
                [held] = [r for r in agent.gpus.reservations() if r.holder.kind is HolderKind.CUDA]
                assert held.memory == MiB
                [seen] = cuda_sessions(alice.home)
                assert (seen.peer, seen.memory, seen.backend) == ("bob", MiB, "fallback")
            finally:
                await _in_thread(dev.close)
            await until_async(lambda: not agent.gpus.reservations(), "the agent to free the GPU")
            assert cuda_sessions(alice.home) == []

    arun(scenario())


@pytest.mark.parametrize("how", ["cuda deny", "deny", "cuda share stop"])
def test_revoking_ends_the_session_at_once(make_node, how: str) -> None:
    alice, bob = _cuda_pair(make_node)

    async def scenario() -> None:
        async with sharing(alice) as agent:
            pair_both(alice, bob)
            _offer(alice, bob)
            dev = await _in_thread(lambda: RemoteDevice("alice", home=bob.home.path, memory=MiB))
            ptr = await _in_thread(lambda: dev.alloc(1024))
            [session] = agent.cuda.sessions()
            bob_id = str(bob.info().node_id)
            if how == "cuda deny":
                alice.home.store.cuda_deny(bob_id)
            elif how == "deny":
                alice.deny("bob")
            else:
                alice.home.store.set_cuda_share(False)
            await agent.revoke_denied()  # what the deny's notification wakes
            await until_async(lambda: not agent.cuda.sessions(), "the agent to end the session")
            assert session.process.returncode is not None
            expected = AccessDeniedError if how != "deny" else Exception
            with pytest.raises(expected, match=r"revoked|stopped sharing CUDA"):
                await _in_thread(lambda: dev.copy_from(ptr, 16))
            await _in_thread(dev.close)

    arun(scenario())


def test_a_worker_crash_is_one_line_and_the_agent_serves_on(make_node) -> None:
    alice, bob = _cuda_pair(make_node)

    async def scenario() -> None:
        async with sharing(alice) as agent:
            pair_both(alice, bob)
            _offer(alice, bob)
            dev = await _in_thread(lambda: RemoteDevice("alice", home=bob.home.path, memory=MiB))
            [session] = agent.cuda.sessions()
            os.kill(session.process.pid, signal.SIGSEGV)  # as a faulting driver would
            with pytest.raises(CudaError) as caught:
                await _in_thread(dev.synchronize)
            assert str(caught.value) == (
                "the CUDA worker on alice crashed (SIGSEGV); the session and its device "
                "memory are gone: open a new one"
            )
            await _in_thread(dev.close)
            await until_async(lambda: not agent.gpus.reservations(), "the agent to free the GPU")
            again = await _in_thread(lambda: RemoteDevice("alice", home=bob.home.path))
            assert await _in_thread(again.device_count) == 1
            await _in_thread(again.close)

    arun(scenario())


def test_on_a_gpu_the_session_holds_its_memory_there_and_max_vram_caps_it(make_node) -> None:
    """GPUs here are the explicit simulated inventory (no NVIDIA hardware on these
    machines); the worker, finding no driver, runs the fallback."""
    from gpumesh.gpu.inventory import SimulatedInventory
    from tests.integration.test_jobs import providing

    alice, bob = _cuda_pair(make_node)
    inventory = SimulatedInventory("Sim GPU:40GB")

    async def scenario() -> None:
        async with providing(alice, inventory=inventory, max_vram=8 * 10**9) as agent:
            pair_both(alice, bob)
            _offer(alice, bob)
            with pytest.raises(
                LimitError,
                match=r"asks for 17.2GB of GPU memory; alice shares at most 8GB \(--max-vram\)",
            ):
                await _in_thread(lambda: RemoteDevice("alice", home=bob.home.path, memory=16 << 30))
            dev = await _in_thread(
                lambda: RemoteDevice("alice", home=bob.home.path, memory=2 << 30)
            )
            try:
                [held] = agent.gpus.reservations()
                assert (held.holder.kind, held.gpus, held.memory) == (
                    HolderKind.CUDA,
                    ("0",),
                    2 << 30,
                )
                reports, _ = await agent.gpus.report()
                assert reports[0].jobs == 1  # what peers' status and placement read
                [figures] = agent.gpus.figures(inventory.gpus())
                assert figures.reserved == 2 << 30
            finally:
                await _in_thread(dev.close)
            await until_async(lambda: not agent.gpus.reservations(), "the agent to free the GPU")
            agent.cuda.backend = "driver"  # as if the GPU's driver had to be used, and is missing
            with pytest.raises(
                CudaError,
                match="the CUDA worker on alice could not open a device: CUDA_ERROR_NO_DEVICE",
            ):
                await _in_thread(lambda: RemoteDevice("alice", home=bob.home.path))
            await until_async(lambda: not agent.gpus.reservations(), "the agent to free the GPU")

    arun(scenario())


def test_stopping_the_agent_ends_its_sessions_and_their_workers(make_node) -> None:
    alice, bob = _cuda_pair(make_node)

    async def scenario() -> None:
        async with sharing(alice) as agent:
            pair_both(alice, bob)
            _offer(alice, bob)
            dev = await _in_thread(lambda: RemoteDevice("alice", home=bob.home.path, memory=MiB))
            [session] = agent.cuda.sessions()
            agent.stop()
            assert await session.process.wait() != 0
            with pytest.raises(GPUMeshError) as caught:
                await _in_thread(dev.synchronize)
            assert "\n" not in str(caught.value)
            await _in_thread(dev.close)

    arun(scenario())


def test_an_unknown_peer_or_bridge_is_one_clear_error(make_node, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from gpumesh.errors import ConnectionLostError, PeerError

    bob = make_node("bob")
    with pytest.raises(PeerError, match="nobody"):
        RemoteDevice("nobody", home=bob.home.path)
    with pytest.raises(ConnectionLostError, match=r"no CUDA bridge at unix:.*`gpumesh cuda bridge"):
        RemoteDevice.bridge(f"unix:{tmp_path / 'none.sock'}")
