"""What a provider finds at its start about its Docker and its GPUs. NVML and
Docker's answer are faked here (no NVIDIA hardware on these machines)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gpumesh.agent.server import Agent
from gpumesh.errors import RuntimeUnavailableError
from gpumesh.gpu.inventory import GpuInfo

H200 = GpuInfo(index=0, uuid="GPU-0", name="NVIDIA H200", memory_total=141 << 30, memory_used=0)


class _Inventory:
    def __init__(self, source: str, gpus: list[GpuInfo]) -> None:
        self.source = source
        self._gpus = gpus

    def gpus(self) -> list[GpuInfo]:
        return self._gpus


class _Runtime:
    def __init__(self, gives: bool | None) -> None:
        self.gives = gives

    def gpu_runtime_available(self) -> bool:
        if self.gives is None:
            raise RuntimeUnavailableError("Docker is not reachable on this machine")
        return self.gives


def _lacks(source: str, gpus: list[GpuInfo], gives: bool | None) -> bool:
    agent = SimpleNamespace(
        gpus=SimpleNamespace(inventory=_Inventory(source, gpus)),
        containers=SimpleNamespace(runtime=_Runtime(gives)),
    )
    return Agent._docker_lacks_gpus(agent)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("source", "gpus", "gives", "lacks"),
    [
        ("nvml", [H200], False, True),  # the one case: GPUs, and Docker cannot give them
        ("nvml", [H200], True, False),
        ("nvml", [H200], None, False),  # Docker does not answer: a job meets that itself
        ("none", [], False, False),  # no GPU: nothing to give
        ("simulated", [H200], False, False),  # stands for a machine whose Docker gives them
    ],
)
def test_a_provider_knows_at_its_start_whether_docker_can_give_its_gpus(
    source: str, gpus: list[GpuInfo], gives: bool | None, lacks: bool
) -> None:
    assert _lacks(source, gpus, gives) is lacks
