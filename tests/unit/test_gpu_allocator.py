"""agent/gpus: the books of which GPU memory is promised to whom (no sockets, no engine)."""

from __future__ import annotations

import asyncio

import pytest

from gpumesh.agent.gpus import GpuAllocator, Holder, HolderKind
from gpumesh.errors import LimitError
from gpumesh.gpu.inventory import SimulatedInventory

GB = 1000**3


def allocator(declaration: str, max_vram: int = 0) -> GpuAllocator:
    inventory = SimulatedInventory(declaration)
    return GpuAllocator(lambda: inventory, max_vram=max_vram, provider="alice")


def job(job_id: str) -> Holder:
    return Holder(HolderKind.JOB, job_id)


def available(gpus: GpuAllocator) -> dict[int, int]:
    return {f.gpu.index: f.available for f in gpus.figures(gpus.inventory.gpus())}


def test_a_reservation_takes_the_gpu_with_most_room_and_counts_until_released() -> None:
    gpus = allocator("T4:16GB,A100:80GB:10GB")

    async def scenario() -> None:
        assert await gpus.reserve(job("a"), 30 * GB) == ["1"]
        assert available(gpus) == {0: 16 * GB, 1: 40 * GB}
        # The next one goes where the room is now, not where it was.
        assert await gpus.reserve(job("b"), 20 * GB) == ["1"]
        assert available(gpus) == {0: 16 * GB, 1: 20 * GB}
        figures = gpus.figures(gpus.inventory.gpus())
        assert [(f.reserved, f.holders) for f in figures] == [(0, 0), (50 * GB, 2)]
        gpus.release(job("a"))
        assert available(gpus) == {0: 16 * GB, 1: 50 * GB}
        gpus.release(job("a"))  # twice is harmless
        gpus.release(job("b"))
        assert available(gpus) == {0: 16 * GB, 1: 70 * GB}
        assert gpus.reservations() == []

    asyncio.run(scenario())


def test_over_commit_is_refused_with_the_numbers_and_promises_nothing() -> None:
    gpus = allocator("L4:24GB")

    async def scenario() -> None:
        await gpus.reserve(job("a"), 20 * GB)
        with pytest.raises(LimitError) as info:
            await gpus.reserve(job("b"), 5 * GB)
        assert info.value.message == (
            "the job asks for 5GB of GPU memory; the most free on alice is 4GB "
            "(GPU 0 L4, 0B used of 24GB)"
        )
        assert [r.holder for r in gpus.reservations()] == [job("a")]
        # Exactly what is left still fits.
        assert await gpus.reserve(job("b"), 4 * GB) == ["0"]
        assert available(gpus) == {0: 0}

    asyncio.run(scenario())


def test_reservations_made_together_never_share_the_last_room() -> None:
    gpus = allocator("L4:24GB")

    async def scenario() -> list[BaseException | list[str]]:
        return await asyncio.gather(
            *(gpus.reserve(job(str(n)), 10 * GB) for n in range(3)), return_exceptions=True
        )

    results = asyncio.run(scenario())
    assert sum(1 for r in results if r == ["0"]) == 2
    assert sum(1 for r in results if isinstance(r, LimitError)) == 1
    assert sum(r.memory for r in gpus.reservations()) == 20 * GB


def test_max_vram_caps_each_holder_and_what_is_reported_free() -> None:
    gpus = allocator("A100:80GB", max_vram=30 * GB)

    async def scenario() -> None:
        with pytest.raises(LimitError, match=r"asks for 40GB .* alice shares at most 30GB"):
            await gpus.reserve(job("big"), 40 * GB)
        assert available(gpus) == {0: 30 * GB}  # 80GB free, capped
        await gpus.reserve(job("a"), 30 * GB)
        await gpus.reserve(job("b"), 30 * GB)
        assert available(gpus) == {0: 20 * GB}  # under the cap now
        report, source = await gpus.report()
        assert source == "simulated"
        assert [(g.available, g.jobs) for g in report] == [(20 * GB, 2)]

    asyncio.run(scenario())


def test_holders_of_every_kind_share_the_books() -> None:
    gpus = allocator("H100:80GB")
    job_a = Holder(HolderKind.JOB, "a")
    session = Holder(HolderKind.CUDA, "a")  # the same id, another kind: another holder
    shell = Holder(HolderKind.SHELL, "s1")

    async def scenario() -> None:
        await gpus.reserve(job_a, 30 * GB)
        await gpus.reserve(session, 30 * GB)
        with pytest.raises(LimitError, match=r"^the shell asks for 30GB of GPU memory; the most"):
            await gpus.reserve(shell, 30 * GB)
        with pytest.raises(LimitError, match=r"^the session asks for 30GB"):
            await gpus.reserve(Holder(HolderKind.CUDA, "b"), 30 * GB)
        assert await gpus.reserve(shell, 20 * GB) == ["0"]
        report, _source = await gpus.report()
        assert (report[0].available, report[0].jobs) == (0, 3)
        gpus.release(session)
        assert available(gpus) == {0: 30 * GB}
        assert {r.holder for r in gpus.reservations()} == {job_a, shell}

    asyncio.run(scenario())


def test_a_holder_reserving_again_replaces_what_it_held() -> None:
    gpus = allocator("L4:24GB")

    async def scenario() -> None:
        await gpus.reserve(job("a"), 20 * GB)
        # Its own 20GB do not stand in its way: 24GB can be promised to it again.
        assert await gpus.reserve(job("a"), 24 * GB) == ["0"]
        assert [(r.holder, r.memory) for r in gpus.reservations()] == [(job("a"), 24 * GB)]

    asyncio.run(scenario())


def test_a_named_gpu_and_machines_without_one() -> None:
    gpus = allocator("T4:16GB,A100:80GB:70GB,H100:80GB")
    holder = job("j")
    found = gpus.inventory.gpus()
    assert gpus.choose(found, holder, 20 * GB, "2") == ["2"]
    with pytest.raises(LimitError, match=r"the most free on GPU 1 of alice is 10GB"):
        gpus.choose(found, holder, 20 * GB, "1")
    with pytest.raises(LimitError, match="alice has no GPU 7"):
        gpus.choose(found, holder, 0, "7")
    assert gpus.reservations() == []  # choosing promises nothing

    none = allocator("")
    assert none.choose([], holder, 0) == []  # a CPU-only job
    with pytest.raises(LimitError, match="no NVIDIA GPU; run without --gpu-memory"):
        none.choose([], holder, GB)
    with pytest.raises(LimitError) as info:
        none.choose([], Holder(HolderKind.CUDA, "c"), GB)
    assert info.value.message == "alice has no NVIDIA GPU"


def test_promises_recorded_after_a_restart_count_like_new_ones() -> None:
    gpus = allocator("L4:24GB,L4:24GB")
    gpus.hold(job("old"), ["1"], 20 * GB)  # as a job's record keeps them
    assert available(gpus) == {0: 24 * GB, 1: 4 * GB}

    async def scenario() -> list[str]:
        return await gpus.reserve(job("new"), 10 * GB)

    assert asyncio.run(scenario()) == ["0"]
