"""The dashboard's GPU history: a fixed ring per GPU, sampled with an injected clock
and inventory (simulated GPUs stand in for NVIDIA hardware here)."""

from __future__ import annotations

import pytest

from gpumesh.control.dashboard.history import GpuHistory
from gpumesh.gpu.inventory import ENV_SIMULATED_LOAD, GpuInfo, SimulatedInventory


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_history_keeps_a_fixed_number_of_samples_oldest_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV_SIMULATED_LOAD, "1")
    clock = _Clock()
    inventory = SimulatedInventory("A:10GB,B:20GB:5GB")
    history = GpuHistory(interval=5, capacity=4, clock=clock, inventory=inventory)
    for step in range(10):
        clock.now = 1000.0 + 5 * step
        history.record(clock.now, inventory.gpus())
    view = history.view()
    assert view.source == "simulated" and view.capacity == 4
    assert [g.name for g in view.gpus] == ["A", "B"]
    for gpu in view.gpus:
        assert gpu.times == [1030.0, 1035.0, 1040.0, 1045.0]  # the newest four
        assert len(gpu.utilization) == len(gpu.memory_used) == len(gpu.power) == 4
        assert all(0 <= u <= 100 for u in gpu.utilization if u is not None)
        assert all(used <= gpu.memory_total for used in gpu.memory_used)
    b = view.gpus[1]
    assert all(used >= 5 * 10**9 for used in b.memory_used)  # never below the declared use


def test_simulated_load_moves_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    inventory = SimulatedInventory("A:10GB:1GB")
    monkeypatch.delenv(ENV_SIMULATED_LOAD, raising=False)
    still = inventory.gpus()[0]
    assert (still.utilization, still.memory_used, still.temperature) == (0, 10**9, None)

    monkeypatch.setenv(ENV_SIMULATED_LOAD, "1")
    clock = _Clock()
    history = GpuHistory(interval=1, capacity=100, clock=clock, inventory=inventory)
    monkeypatch.setattr("gpumesh.gpu.inventory.time.time", clock)
    for step in range(20):
        clock.now = 1000.0 + 3 * step
        history.record(clock.now, inventory.gpus())
    gpu = history.view().gpus[0]
    assert len(set(gpu.utilization)) > 5 and len(set(gpu.temperature)) > 5
    assert len(set(gpu.memory_used)) > 5 and len(set(gpu.power)) > 5


def test_a_gpu_that_disappears_keeps_its_history_and_one_that_appears_starts_empty() -> None:
    clock = _Clock()
    history = GpuHistory(interval=1, capacity=10, clock=clock)
    history.record(clock.now, SimulatedInventory("A:1GB").gpus())
    clock.now += 1
    history.record(clock.now, [GpuInfo(1, "GPU-x", "X", 2 * 10**9, 10**9, 50, 60, None, 70)])
    view = history.view()
    assert [(g.name, g.times) for g in view.gpus] == [("A", [1000.0]), ("X", [1001.0])]
    assert view.gpus[1].power == [70]
