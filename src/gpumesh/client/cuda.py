"""CUDA remoting operations for every face (the CLI, scripts, the Python API).

The owner's side: whether this node shares CUDA, its CUDA allowlist
(:func:`share`, :func:`allow`, :func:`deny`), and what this machine offers
(:func:`doctor`). The consumer's side: the demo and the benchmark on an open
:class:`~gpumesh.client.cudadevice.RemoteDevice`. Nothing here prints.
"""

from __future__ import annotations

import array
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpumesh.client.owner import OwnerSession, sessions_of, worker_user
from gpumesh.gpu.cudabackend import CudaFault, DeviceInfo
from gpumesh.gpu.cudadriver import DriverBackend, DriverUnavailable, load_driver
from gpumesh.gpu.cudakernels import VADD_F32, VADD_PTX

if TYPE_CHECKING:
    from gpumesh.client.cudadevice import RemoteDevice
    from gpumesh.client.node import Node
    from gpumesh.store.home import Home
    from gpumesh.store.peers import Peer

__all__ = [
    "BenchResult",
    "BenchRow",
    "DemoResult",
    "DoctorReport",
    "allow",
    "bench",
    "cuda_sessions",
    "demo",
    "deny",
    "doctor",
    "share",
]

MiB = 1024 * 1024
BENCH_SIZES = (1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB)


# --- the owner ------------------------------------------------------------------------------


@dataclass(frozen=True)
class DoctorReport:
    backend: str
    """``driver`` when libcuda loads and sees a device, else ``fallback``."""
    detail: str
    """The driver version, or why the fallback."""
    devices: list[DeviceInfo]
    sharing: bool
    """Whether this node offers CUDA sessions when it shares."""
    allowed: list[str]
    """Names of the peers on the CUDA allowlist."""
    sessions: list[OwnerSession] = field(default_factory=list)
    worker: str | None = None
    """Why sessions' workers run as the agent's own user (not as job_user), if they do."""


def doctor(node: Node) -> DoctorReport:
    """What a CUDA session here would run on, and who may open one."""

    devices: list[DeviceInfo] = []
    try:
        backend = DriverBackend(load_driver(), 0)
    except (DriverUnavailable, CudaFault) as exc:
        kind, detail = "fallback", str(exc)
    else:
        try:
            kind, detail = "driver", backend.detail
            devices = [backend.device_info(i) for i in range(backend.device_count())]
        finally:
            backend.close()
    store = node.home.store
    allowed = store.cuda_allowed()
    names = sorted(peer.name for peer in store.peers() if peer.node_id in allowed)
    sessions = cuda_sessions(node.home)
    worker = worker_user(node.home)
    return DoctorReport(kind, detail, devices, store.cuda_share(), names, sessions, worker)


def share(node: Node, on: bool) -> None:
    """Offer CUDA sessions whenever this node shares (remembered), or stop: open
    sessions end at once."""
    node.home.store.set_cuda_share(on)
    node.home.agent_changed()


def allow(node: Node, query: str) -> Peer:
    """Put a paired peer on the CUDA allowlist."""
    peer = node.peer(query)
    node.home.store.cuda_allow(peer.node_id)
    return peer


def deny(node: Node, query: str) -> Peer:
    """Take a peer off the CUDA allowlist; its open sessions end at once."""
    peer = node.peer(query)
    node.home.store.cuda_deny(peer.node_id)
    node.home.agent_changed()
    return peer


# --- the consumer ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DemoResult:
    elements: int
    correct: bool
    mismatches: int
    backend: str
    device: str
    detail: str
    seconds: float


def demo(device: RemoteDevice, elements: int = 1 << 20) -> DemoResult:
    """Allocate, copy two vectors, add them with the shipped kernel, copy back, check."""
    started = time.perf_counter()
    size = elements * 4
    left = array.array("f", (float(i % 1000) for i in range(elements)))
    right = array.array("f", (0.5 * (i % 7) for i in range(elements)))
    a, b, c = (device.alloc(size) for _ in range(3))
    try:
        device.copy_to(a, left)
        device.copy_to(b, right)
        device.memset(c, 0, size)
        device.launch(
            VADD_PTX,
            VADD_F32,
            grid=(elements + 255) // 256,
            block=256,
            args=(a, b, c, ("u32", elements)),
        )
        device.synchronize()
        out = array.array("f", device.copy_from(c, size))
    finally:
        for ptr in (a, b, c):
            device.free(ptr)
        device.synchronize()
    mismatches = sum(1 for i in range(elements) if out[i] != left[i] + right[i])
    return DemoResult(
        elements=elements,
        correct=mismatches == 0,
        mismatches=mismatches,
        backend=device.backend,
        device=device.name,
        detail=device.detail,
        seconds=time.perf_counter() - started,
    )


@dataclass(frozen=True)
class BenchRow:
    size: int
    htod_mb_s: float
    dtoh_mb_s: float


@dataclass(frozen=True)
class BenchResult:
    backend: str
    device: str
    call_p50_ms: float
    """Median round trip of a call that answers (device count)."""
    small_copies_per_s: float
    """4 KiB host-to-device copies per second, pipelined, with one synchronize."""
    rows: list[BenchRow]
    skipped: list[int] = field(default_factory=list)
    """Sizes over the session's memory cap."""
    link_rtt_ms: float | None = None
    """The link's round trip beside it (a ping), when measured."""
    link_mb_per_s: float | None = None
    """The link's own throughput beside it (64 MiB over QUIC), when measured."""


def _best(seconds: list[float]) -> float:
    return min(seconds) if seconds else 0.0


def bench(
    device: RemoteDevice,
    sizes: tuple[int, ...] = BENCH_SIZES,
    *,
    calls: int = 200,
    small: int = 2000,
    repeats: int = 3,
) -> BenchResult:
    """Call latency, small copies per second, and bandwidth each way per size."""
    latencies = []
    for _ in range(calls):
        sent = time.perf_counter()
        device.device_count()
        latencies.append(time.perf_counter() - sent)
    chunk = bytes(4096)
    buffer = device.alloc(len(chunk))
    started = time.perf_counter()
    for _ in range(small):
        device.copy_to(buffer, chunk)
    device.synchronize()
    small_rate = small / (time.perf_counter() - started)
    device.free(buffer)
    rows, skipped = [], []
    for size in sizes:
        if size > device.memory_cap:
            skipped.append(size)
            continue
        data = bytes(size)
        ptr = device.alloc(size)
        up, down = [], []
        for _ in range(repeats):
            sent = time.perf_counter()
            device.copy_to(ptr, data)
            device.synchronize()
            up.append(time.perf_counter() - sent)
            sent = time.perf_counter()
            device.copy_from(ptr, size)
            down.append(time.perf_counter() - sent)
        device.free(ptr)
        rows.append(BenchRow(size, size / _best(up) / 1e6, size / _best(down) / 1e6))
    device.synchronize()
    return BenchResult(
        backend=device.backend,
        device=device.name,
        call_p50_ms=statistics.median(latencies) * 1000,
        small_copies_per_s=small_rate,
        rows=rows,
        skipped=skipped,
    )


def cuda_sessions(home: Home) -> list[OwnerSession]:
    """The running agent's CUDA sessions (none when it does not run): what ``status``
    and ``cuda doctor`` show, from what the agent says of itself."""
    agent = home.agent_info()
    return [] if agent is None else sessions_of(agent)
