"""Placement across several real provider agents on loopback.

GPUs are simulated (declared per agent; there is no NVIDIA hardware here),
everything else is real: QUIC probes, the status RPC, the job service's
memory accounting.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from gpumesh.agent.gpus import Holder, HolderKind
from gpumesh.agent.server import Agent
from gpumesh.client.node import Node
from gpumesh.client.placement import choose, place, probe
from gpumesh.errors import LimitError
from gpumesh.gpu.inventory import SimulatedInventory
from tests.integration.conftest import arun, pair_both


@contextlib.asynccontextmanager
async def providers(nodes: dict[Node, str]) -> AsyncIterator[dict[str, Agent]]:
    """Start an agent per node with its declared GPUs (empty: none)."""
    agents: dict[str, Agent] = {}
    try:
        for node, gpus in nodes.items():
            agent = Agent(node.home, host="127.0.0.1", port=0, inventory=SimulatedInventory(gpus))
            await agent.start()
            agents[node.info().name] = agent
        yield agents
    finally:
        for agent in agents.values():
            agent.stop()


@contextlib.contextmanager
def black_holed(me: Node, agents: dict[str, Agent], name: str) -> Iterator[None]:
    """Stop ``name``'s agent and point ``me`` at an address that swallows packets
    (no ICMP refusal): a member that is gone, in the worst case."""
    agents[name].stop()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as blackhole:
        blackhole.bind(("127.0.0.1", 0))
        me.home.store._execute(
            "UPDATE peers SET addresses = ?, last_address = '' WHERE name = ?",
            (f'["127.0.0.1:{blackhole.getsockname()[1]}"]', name),
        )
        yield


def _members(consumer: Node, names: list[str]) -> list[tuple[str, object]]:
    return [(name, consumer.peer(name)) for name in names]


def test_placement_picks_the_roomiest_idle_gpu_and_says_why_others_lost(make_node) -> None:
    me = make_node("me")
    small, big, cpu = make_node("small"), make_node("big"), make_node("cpu")

    async def scenario() -> None:
        async with providers({small: "T4:16GB:12GB", big: "A100:80GB:10GB", cpu: ""}):
            for node in (small, big, cpu):
                pair_both(node, me)
            members = _members(me, ["small", "big", "cpu"])
            placement = choose(await probe(me, members), 8 * 10**9)  # type: ignore[arg-type]
            assert placement.peer_name == "big"
            assert placement.chosen is not None and placement.chosen.gpu is not None
            assert placement.chosen.gpu.index == 0
            reasons = {c.name: c.reason for c in placement.candidates}
            assert reasons["small"].startswith("not enough GPU memory (4GB free")
            assert reasons["cpu"] == "no NVIDIA GPU"
            # Without a memory request a CPU-only member is eligible, but GPUs come first.
            anywhere = choose(await probe(me, members), 0)  # type: ignore[arg-type]
            assert anywhere.peer_name == "big"

    arun(scenario())


def test_placement_skips_a_stopped_member_within_the_probe_timeout(make_node) -> None:
    me, alive, dead = make_node("me"), make_node("alive"), make_node("dead")
    # A dial timeout far above the probe timeout, so the ceiling below tells
    # "one probe timeout" from "a dial timeout per member" with room to spare.
    me.home.config.set("connect_timeout", "60")
    me.home.config.save()

    async def scenario() -> None:
        async with providers({alive: "RTX-4090:24GB", dead: "RTX-4090:24GB"}) as agents:
            pair_both(alive, me)
            pair_both(dead, me)
            with black_holed(me, agents, "dead"):
                began = time.monotonic()
                placement = await place(me, _members(me, ["alive", "dead"]), 10**9, timeout=1.0)  # type: ignore[arg-type]
                elapsed = time.monotonic() - began
            assert placement.peer_name == "alive"
            reasons = {c.name: c.reason for c in placement.candidates}
            assert reasons["dead"].startswith("unreachable")
            assert elapsed < 30  # one probe timeout plus (generous) slack, not a 60 s dial

    arun(scenario())


def test_when_no_member_answers_in_time_the_probe_waits_for_the_first_answer(
    make_node,
) -> None:
    """A loaded machine may miss the probe timeout for every member: the probe then
    waits on for the first answer instead of calling them all unreachable, and a
    member still silent by then is unreachable."""
    me, alive, dead = make_node("me"), make_node("alive"), make_node("dead")

    async def scenario() -> None:
        async with providers({alive: "RTX-4090:24GB", dead: "RTX-4090:24GB"}) as agents:
            pair_both(alive, me)
            pair_both(dead, me)
            with black_holed(me, agents, "dead"):
                # No dial and proof can finish in a millisecond: nobody answers in time.
                members = _members(me, ["alive", "dead"])
                probes = await probe(me, members, timeout=0.001, patience=120.0)  # type: ignore[arg-type]
            found = {p.name: p for p in probes}
            assert found["alive"].status is not None, found["alive"].error
            assert found["dead"].unreachable and found["dead"].status is None
            assert "no answer from 127.0.0.1:" in found["dead"].error

    arun(scenario())


def test_busy_members_are_skipped_and_running_jobs_count(make_node) -> None:
    me, busy, free = make_node("me"), make_node("busy"), make_node("free")

    async def scenario() -> None:
        async with providers({busy: "L4:24GB", free: "L4:24GB:20GB"}) as agents:
            pair_both(busy, me)
            pair_both(free, me)
            # A GPUMesh job holds busy's only GPU (as the job service records it).
            agents["busy"].gpus.hold(Holder(HolderKind.JOB, "x"), ["0"], 4 * 10**9)
            placement = await place(me, _members(me, ["busy", "free"]), 10**9)  # type: ignore[arg-type]
            assert placement.peer_name == "free"
            reasons = {c.name: c.reason for c in placement.candidates}
            assert reasons["busy"] == "busy (GPU 0 at 0% with 1 job(s))"

    arun(scenario())


def test_nothing_fits_is_refused_with_the_table(make_node) -> None:
    me, a, b = make_node("me"), make_node("a"), make_node("b")

    async def scenario() -> None:
        async with providers({a: "T4:16GB", b: ""}):
            pair_both(a, me)
            pair_both(b, me)
            members = [*_members(me, ["a", "b"]), ("stranger", None)]
            with pytest.raises(LimitError) as info:
                await place(me, members, 40 * 10**9)  # type: ignore[arg-type]
            message = info.value.message
            assert message.startswith("no member can take the job with 40GB of GPU memory")
            assert "a: not enough GPU memory (16GB free" in message
            assert "b: no NVIDIA GPU" in message
            assert "stranger: not paired with you" in message
            with pytest.raises(LimitError, match="no other members"):
                await place(me, [], 0)

    arun(scenario())


def test_the_chosen_gpu_is_the_one_the_job_gets(make_node) -> None:
    me, multi = make_node("me"), make_node("multi")

    async def scenario() -> None:
        async with providers({multi: "T4:16GB,A100:80GB:70GB,H100:80GB"}) as agents:
            pair_both(multi, me)
            placement = await place(me, _members(me, ["multi"]), 20 * 10**9)  # type: ignore[arg-type]
            assert placement.chosen is not None and placement.chosen.gpu is not None
            assert placement.chosen.gpu.index == 2
            gpus = agents["multi"].gpus
            job = Holder(HolderKind.JOB, "j")
            assert gpus.choose(gpus.inventory.gpus(), job, 20 * 10**9, "2") == ["2"]
            with pytest.raises(LimitError, match="on GPU 1 of multi is 10GB"):
                gpus.choose(gpus.inventory.gpus(), job, 20 * 10**9, "1")

    arun(scenario())
