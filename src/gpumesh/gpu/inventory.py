"""Where GPU facts come from, behind one small interface.

Order: NVML (``nvidia-ml-py``), then parsing ``nvidia-smi``'s CSV output, then
"no NVIDIA GPU". A simulated inventory stands in for hardware in tests; it is
only ever used when ``GPUMESH_TEST_SIMULATED_GPUS`` is set, and every surface
that shows GPUs says so loudly (``source == "simulated"``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import pynvml

from gpumesh.errors import ConfigError
from gpumesh.settings import ENV_TEST_SIMULATED_GPU_PROCESSES
from gpumesh.units import parse_size

__all__ = [
    "COMPUTE",
    "ENV_SIMULATED",
    "ENV_SIMULATED_LOAD",
    "ENV_SIMULATED_PROCESSES",
    "GRAPHICS",
    "GpuInfo",
    "GpuInventory",
    "GpuProcess",
    "NoGpus",
    "NvidiaSmiInventory",
    "NvmlInventory",
    "SimulatedInventory",
    "detect_inventory",
    "memory_by_pid",
    "parse_compute_apps",
    "parse_nvidia_smi_csv",
    "parse_simulated_processes",
    "process_name",
]

logger = logging.getLogger(__name__)

ENV_SIMULATED = "GPUMESH_TEST_SIMULATED_GPUS"
"""Test-only: ``NAME:MEMORY[:USED],...`` e.g. ``RTX-4090:24GB,A100:80GB:10GB``."""
ENV_SIMULATED_LOAD = "GPUMESH_TEST_SIMULATED_GPU_LOAD"
"""Test-only: ``1`` makes the simulated GPUs' utilisation, memory, temperature and
power change with time (for charts); unset, they stay as declared."""
ENV_SIMULATED_PROCESSES = ENV_TEST_SIMULATED_GPU_PROCESSES
"""Test-only: a file of processes on the simulated GPUs, re-read on each call
(:func:`parse_simulated_processes`); a missing file: none."""

COMPUTE = "compute"
GRAPHICS = "graphics"


@dataclass(frozen=True)
class GpuInfo:
    index: int
    uuid: str
    name: str
    memory_total: int
    """Bytes."""
    memory_used: int
    """Bytes in use by anything on the machine."""
    utilization: int | None = None
    """Percent, when known."""
    temperature: int | None = None
    """Degrees Celsius, when known."""
    processes: int | None = None
    """Compute processes using the GPU, when known (NVML)."""
    power: int | None = None
    """Watts drawn, when known (NVML)."""

    @property
    def memory_free(self) -> int:
        return max(0, self.memory_total - self.memory_used)


@dataclass(frozen=True)
class GpuProcess:
    """A host process using a GPU, as the driver lists it."""

    gpu: int
    """The GPU's index."""
    pid: int
    """Its process id on this host."""
    name: str
    """Its command name as ``/proc/PID/comm`` gives it (``""`` when unknown)."""
    kind: str
    """``compute`` (CUDA, OpenCL...) or ``graphics`` (a game, a desktop)."""
    memory: int = 0
    """Bytes of GPU memory it uses there (0 when the driver does not say)."""


def memory_by_pid(processes: list[GpuProcess]) -> dict[int, int]:
    """GPU memory in bytes per process id, over all GPUs, compute processes only
    (graphics ones do not run GPUMesh work)."""
    usage: dict[int, int] = {}
    for process in processes:
        if process.kind == COMPUTE:
            usage[process.pid] = usage.get(process.pid, 0) + process.memory
    return usage


class GpuInventory(Protocol):
    source: str
    """``nvml``, ``nvidia-smi``, ``simulated`` or ``none``."""

    def gpus(self) -> list[GpuInfo]: ...

    def processes(self) -> list[GpuProcess]:
        """The processes using each GPU now (blocking)."""
        ...

    def process_memory(self) -> dict[int, int]:
        """GPU memory in bytes used by each host process id, on all GPUs."""
        ...


class NoGpus:
    source = "none"

    def gpus(self) -> list[GpuInfo]:
        return []

    def processes(self) -> list[GpuProcess]:
        return []

    def process_memory(self) -> dict[int, int]:
        return {}


class NvmlInventory:
    source = "nvml"

    def __init__(self) -> None:
        pynvml.nvmlInit()  # raises when no driver: the caller falls back
        self._nvml = pynvml

    def gpus(self) -> list[GpuInfo]:
        nvml = self._nvml
        found = []
        for index in range(nvml.nvmlDeviceGetCount()):
            try:
                found.append(self._gpu(index))
            except nvml.NVMLError as exc:  # e.g. a GPU that fell off the bus: skip it
                logger.warning("GPU %d is not answering NVML: %s", index, exc)
        return found

    def processes(self) -> list[GpuProcess]:
        """NVML's compute and graphics processes of each GPU; a list NVML cannot give
        (an older driver or nvidia-ml-py, a GPU that stopped answering) is skipped."""
        nvml = self._nvml
        found: list[GpuProcess] = []
        names: dict[int, str] = {}
        for index in range(nvml.nvmlDeviceGetCount()):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
            except nvml.NVMLError:
                continue
            for kind, lister in (
                (COMPUTE, "nvmlDeviceGetComputeRunningProcesses"),
                (GRAPHICS, "nvmlDeviceGetGraphicsRunningProcesses"),
            ):
                try:
                    listed = getattr(nvml, lister)(handle)
                except (nvml.NVMLError, AttributeError):
                    continue
                for process in listed:
                    pid = int(process.pid)
                    if pid not in names:
                        names[pid] = self._name(pid)
                    used = getattr(process, "usedGpuMemory", None) or 0
                    found.append(GpuProcess(index, pid, names[pid], kind, int(used)))
        return found

    def _name(self, pid: int) -> str:
        """A process's command name: ``/proc/PID/comm``, else NVML's, else ``""``."""
        name = process_name(pid)
        if name:
            return name
        try:
            raw = self._nvml.nvmlSystemGetProcessName(pid)
        except (self._nvml.NVMLError, AttributeError):
            return ""
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        return os.path.basename(text)[:15]  # comm's length: names compare alike

    def process_memory(self) -> dict[int, int]:
        return memory_by_pid(self.processes())

    def _gpu(self, index: int) -> GpuInfo:
        nvml = self._nvml
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        failed = nvml.NVMLError
        newer = (failed, AttributeError)  # AttributeError: an older nvidia-ml-py
        name = nvml.nvmlDeviceGetName(handle)
        uuid = nvml.nvmlDeviceGetUUID(handle)
        return GpuInfo(
            index=index,
            uuid=uuid.decode() if isinstance(uuid, bytes) else str(uuid),
            name=name.decode() if isinstance(name, bytes) else str(name),
            memory_total=int(memory.total),
            memory_used=int(memory.used),
            utilization=_known(lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu, failed),
            temperature=_known(
                lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU), failed
            ),
            processes=_known(lambda: len(nvml.nvmlDeviceGetComputeRunningProcesses(handle)), newer),
            power=_known(lambda: int(nvml.nvmlDeviceGetPowerUsage(handle)) // 1000, newer),  # mW
        )


def process_name(pid: int) -> str:
    """``/proc/PID/comm`` without its newline; ``""`` when the process is gone or
    there is no ``/proc``."""
    try:
        with open(f"/proc/{pid}/comm", "rb") as comm:
            return comm.read().decode(errors="replace").rstrip("\n")
    except OSError:
        return ""


def _known(
    read: Callable[[], Any], failures: type[Exception] | tuple[type[Exception], ...]
) -> int | None:
    """An optional NVML figure as an int; None when reading it raised one of ``failures``."""
    try:
        return int(read())
    except failures:
        return None


_SMI_FIELDS = "index,uuid,name,memory.total,memory.used,utilization.gpu,temperature.gpu"


def _int_or_none(text: str) -> int | None:
    text = text.strip()
    try:
        return int(float(text))
    except ValueError:
        return None  # "[N/A]", "[Not Supported]"


def parse_nvidia_smi_csv(text: str) -> list[GpuInfo]:
    """Parse ``nvidia-smi --query-gpu=<_SMI_FIELDS> --format=csv,noheader,nounits``."""
    found = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 7:
            continue
        total = _int_or_none(parts[3]) or 0
        used = _int_or_none(parts[4]) or 0
        found.append(
            GpuInfo(
                index=int(parts[0]),
                uuid=parts[1],
                name=parts[2],
                memory_total=total * 1024 * 1024,  # nvidia-smi reports MiB
                memory_used=used * 1024 * 1024,
                utilization=_int_or_none(parts[5]),
                temperature=_int_or_none(parts[6]),
            )
        )
    return found


class NvidiaSmiInventory:
    source = "nvidia-smi"

    def __init__(self, binary: str, timeout: float = 10.0) -> None:
        self._binary = binary
        self.timeout = timeout

    def _query(self, query: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self._binary, query, "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=self.timeout,
            check=False,
        )

    def gpus(self) -> list[GpuInfo]:
        try:
            result = self._query(f"--query-gpu={_SMI_FIELDS}")
        except (subprocess.TimeoutExpired, OSError) as exc:  # a hung driver: no GPUs to offer
            logger.warning("nvidia-smi did not answer: %s", exc)
            return []
        if result.returncode != 0:
            logger.debug("nvidia-smi failed: %s", result.stderr.strip())
            return []
        return parse_nvidia_smi_csv(result.stdout)

    def processes(self) -> list[GpuProcess]:
        """The compute processes only: ``nvidia-smi`` has no query for graphics ones
        (a game goes unseen on a machine without NVML)."""
        try:
            apps = self._query("--query-compute-apps=gpu_uuid,pid,process_name,used_memory")
        except (subprocess.TimeoutExpired, OSError):
            return []
        if apps.returncode != 0:
            return []
        indexes = {gpu.uuid: gpu.index for gpu in self.gpus()} if apps.stdout.strip() else {}
        return parse_compute_apps(apps.stdout, indexes)

    def process_memory(self) -> dict[int, int]:
        return memory_by_pid(self.processes())


def parse_compute_apps(text: str, indexes: dict[str, int]) -> list[GpuProcess]:
    """Parse ``nvidia-smi --query-compute-apps=gpu_uuid,pid,process_name,used_memory
    --format=csv,noheader,nounits``; ``indexes`` maps each GPU's UUID to its index
    (a process on a GPU not in it is left out)."""
    found = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4:
            continue
        uuid, pid_text, used_text = parts[0], parts[1], parts[-1]
        path = ",".join(parts[2:-1])  # a process name may hold commas
        pid, used = _int_or_none(pid_text), _int_or_none(used_text)
        if pid is None or uuid not in indexes:
            continue
        name = process_name(pid) or os.path.basename(path)[:15]
        found.append(GpuProcess(indexes[uuid], pid, name, COMPUTE, (used or 0) * 1024 * 1024))
    return found


class SimulatedInventory:
    """Declared GPUs for tests on machines without any. Never real."""

    source = "simulated"

    def __init__(self, declaration: str) -> None:
        self._gpus = []
        for index, item in enumerate(p for p in declaration.split(",") if p.strip()):
            parts = item.strip().split(":")
            if len(parts) not in (2, 3):
                raise ConfigError(
                    f"{ENV_SIMULATED}: {item!r} must be NAME:MEMORY or NAME:MEMORY:USED"
                )
            used = parse_size(parts[2]) if len(parts) == 3 else 0
            self._gpus.append(
                GpuInfo(
                    index=index,
                    uuid=f"GPU-simulated-{index}",
                    name=parts[0],
                    memory_total=parse_size(parts[1]),
                    memory_used=used,
                    utilization=0,
                    temperature=None,
                )
            )

    def gpus(self) -> list[GpuInfo]:
        if os.environ.get(ENV_SIMULATED_LOAD, "") != "1":
            return list(self._gpus)
        return [_simulated_load(gpu, time.time()) for gpu in self._gpus]

    def processes(self) -> list[GpuProcess]:
        """What the test wrote in :data:`ENV_SIMULATED_PROCESSES`'s file now."""
        path = os.environ.get(ENV_SIMULATED_PROCESSES, "").strip()
        if not path:
            return []
        try:
            with open(path, encoding="utf-8") as listing:
                text = listing.read()
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise ConfigError(f"{ENV_SIMULATED_PROCESSES}: cannot read {path}: {exc}") from None
        return parse_simulated_processes(text, len(self._gpus))

    def process_memory(self) -> dict[int, int]:
        return memory_by_pid(self.processes())


def parse_simulated_processes(text: str, gpus: int) -> list[GpuProcess]:
    """The processes on simulated GPUs: one a line, ``INDEX PID NAME [compute|graphics]``
    (compute when left out); blank lines and ``#`` comments are skipped. ``gpus``: how
    many GPUs are simulated. A malformed line is a ConfigError naming the variable."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        kind = words[3] if len(words) == 4 else COMPUTE
        if (
            len(words) not in (3, 4)
            or not words[0].isdigit()
            or not words[1].isdigit()
            or kind not in (COMPUTE, GRAPHICS)
            or int(words[0]) >= gpus
        ):
            raise ConfigError(
                f"{ENV_SIMULATED_PROCESSES}: line {number} {line.strip()!r} must be "
                f"INDEX PID NAME [compute|graphics], INDEX below {gpus}"
            )
        found.append(GpuProcess(int(words[0]), int(words[1]), words[2], kind))
    return found


def _simulated_load(gpu: GpuInfo, now: float) -> GpuInfo:
    """``gpu`` as if it worked: smooth waves of utilisation, memory, temperature and
    power over ``now`` (each GPU its own phase), within the declared memory."""
    wave = (math.sin(now / 7.0 + gpu.index) + 1) / 2  # 0..1, a period of ~44 s
    spare = gpu.memory_total - gpu.memory_used
    return dataclasses.replace(
        gpu,
        utilization=round(100 * wave),
        memory_used=gpu.memory_used + int(spare * 0.5 * wave),
        temperature=35 + round(45 * wave),
        power=30 + round(270 * wave),
    )


def detect_inventory() -> GpuInventory:
    """The best available source: simulated (tests only), NVML, nvidia-smi, none."""
    declared = os.environ.get(ENV_SIMULATED, "").strip()
    if declared:
        return SimulatedInventory(declared)
    try:
        return NvmlInventory()
    except Exception as exc:  # pynvml raises its own NVMLError_* types, or ImportError
        logger.debug("NVML unavailable: %s", exc)
    binary = shutil.which("nvidia-smi")
    if binary is not None:
        return NvidiaSmiInventory(binary)
    return NoGpus()
