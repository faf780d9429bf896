"""The last hour of this machine's GPU readings, sampled by the serving process.

:class:`GpuHistory` keeps a fixed number of samples per GPU (a ring: the oldest
falls out), so the memory it holds never grows however long the process runs or
however many dashboards read it. :meth:`GpuHistory.run` samples in the caller's
event loop (a reading of ``nvidia-smi`` runs in a thread); pages only read.
The clock and the inventory are passed in, so tests sample without sleeping.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from gpumesh.gpu.inventory import GpuInfo, GpuInventory, detect_inventory
from gpumesh.settings import env

__all__ = [
    "ENV_SAMPLE_SECONDS",
    "HISTORY_SECONDS",
    "SAMPLE_SECONDS",
    "GpuHistory",
    "GpuHistoryView",
    "GpuSeries",
]

logger = logging.getLogger(__name__)

HISTORY_SECONDS = 3600.0
"""How far back the history reaches."""
SAMPLE_SECONDS = 5.0
"""Seconds between two readings."""
ENV_SAMPLE_SECONDS = "GPUMESH_TEST_GPU_SAMPLE_SECONDS"
"""Tests only: a shorter sampling interval (the history keeps its slot count)."""


class GpuSeries(msgspec.Struct):
    """One GPU's readings, oldest first; a reading the source did not give is null."""

    index: int
    uuid: str
    name: str
    memory_total: int
    """Bytes."""
    times: list[float]
    """Unix time of each sample."""
    utilization: list[int | None]
    """Percent."""
    memory_used: list[int]
    """Bytes."""
    temperature: list[int | None]
    """Degrees Celsius."""
    power: list[int | None]
    """Watts."""


class GpuHistoryView(msgspec.Struct):
    """``GET /api/v1/gpus/history``: the last hour of every GPU, as sampled here."""

    source: str
    """``nvml``, ``nvidia-smi``, ``simulated`` (tests only) or ``none``."""
    interval: float
    """Seconds between samples."""
    capacity: int
    """Samples kept per GPU at most."""
    gpus: list[GpuSeries]


@dataclass
class _Ring:
    gpu: GpuInfo
    samples: deque[tuple[float, GpuInfo]]


@dataclass
class GpuHistory:
    """A fixed-size ring of readings per GPU."""

    interval: float = SAMPLE_SECONDS
    capacity: int = int(HISTORY_SECONDS / SAMPLE_SECONDS)
    clock: Callable[[], float] = time.time
    inventory: GpuInventory | None = None
    """The source; detected on the first sample when None."""
    _rings: dict[str, _Ring] = field(default_factory=dict)
    _task: asyncio.Task[None] | None = None

    @classmethod
    def from_env(cls) -> GpuHistory:
        text = env(ENV_SAMPLE_SECONDS)
        interval = float(text) if text else SAMPLE_SECONDS
        # The slot count stays an hour's at the normal interval: memory is fixed.
        return cls(interval=interval)

    def record(self, now: float, gpus: list[GpuInfo]) -> None:
        """Append one reading of each GPU taken at ``now``."""
        for gpu in gpus:
            ring = self._rings.get(gpu.uuid)
            if ring is None:
                ring = self._rings[gpu.uuid] = _Ring(gpu, deque(maxlen=self.capacity))
            ring.gpu = gpu
            ring.samples.append((now, gpu))

    def view(self) -> GpuHistoryView:
        series = []
        for ring in sorted(self._rings.values(), key=lambda r: r.gpu.index):
            readings = [g for _, g in ring.samples]
            series.append(
                GpuSeries(
                    index=ring.gpu.index,
                    uuid=ring.gpu.uuid,
                    name=ring.gpu.name,
                    memory_total=ring.gpu.memory_total,
                    times=[round(t, 3) for t, _ in ring.samples],
                    utilization=[g.utilization for g in readings],
                    memory_used=[g.memory_used for g in readings],
                    temperature=[g.temperature for g in readings],
                    power=[g.power for g in readings],
                )
            )
        source = self.inventory.source if self.inventory is not None else "none"
        return GpuHistoryView(source, self.interval, self.capacity, series)

    def start(self) -> None:
        """Sample in the running event loop until the loop ends."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self.run())

    async def run(self) -> None:
        while True:
            try:
                # nvidia-smi is a subprocess that a hung driver can stall: read in a
                # thread, record in the loop (where the pages read).
                if self.inventory is None:
                    self.inventory = detect_inventory()
                gpus = await asyncio.to_thread(self.inventory.gpus)
                self.record(self.clock(), gpus)
            except Exception:
                logger.warning("reading the GPUs for the dashboard failed", exc_info=True)
            await asyncio.sleep(self.interval)
