"""What runs a CUDA session's calls on the provider: one interface, two backends.

:class:`Backend` is what the worker (:mod:`gpumesh.cuda.worker`) drives. The
driver backend (:mod:`gpumesh.cuda.driver`) runs the calls on a GPU through
NVIDIA's ``cuda-bindings``; the fallback (:mod:`gpumesh.cuda.fallback`) keeps
device memory in host memory and runs only GPUMesh's own kernels by name.
:func:`gpumesh.cuda.worker.open_backend` picks: the driver when libcuda loads,
else the fallback, with the reason. A failing call raises :class:`CudaFault` with CUDA's error name.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = ["Backend", "CudaFault", "DeviceInfo", "LaunchArg", "pack_arg"]


class CudaFault(Exception):
    """A call failed: ``name`` is CUDA's error name (``CUDA_ERROR_INVALID_VALUE``)."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.name = name
        self.message = message


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    memory_total: int
    major: int
    minor: int
    multiprocessors: int


LaunchArg = tuple[str, int | float]
"""A kernel argument: its kind (``ptr``, ``i32``, ``u32``, ``i64``, ``u64``, ``f32``,
``f64``) and value."""

_FORMATS = {
    "ptr": "<Q",
    "u64": "<Q",
    "i64": "<q",
    "u32": "<I",
    "i32": "<i",
    "f32": "<f",
    "f64": "<d",
}
_CTYPES: dict[str, type[ctypes._SimpleCData[int] | ctypes._SimpleCData[float]]] = {
    "ptr": ctypes.c_uint64,
    "u64": ctypes.c_uint64,
    "i64": ctypes.c_int64,
    "u32": ctypes.c_uint32,
    "i32": ctypes.c_int32,
    "f32": ctypes.c_float,
    "f64": ctypes.c_double,
}


def pack_arg(kind: str, value: int | float) -> bytes:
    """The bytes a kernel parameter of ``kind`` holds (little-endian, as on the GPU)."""
    fmt = _FORMATS.get(kind)
    if fmt is None:
        raise CudaFault("CUDA_ERROR_INVALID_VALUE", f"unknown argument kind {kind!r}")
    try:
        if kind in ("f32", "f64"):
            return struct.pack(fmt, float(value))
        if isinstance(value, float):
            raise CudaFault("CUDA_ERROR_INVALID_VALUE", f"a {kind} argument cannot be {value}")
        return struct.pack(fmt, value)
    except struct.error as exc:
        raise CudaFault(
            "CUDA_ERROR_INVALID_VALUE", f"{value} does not fit a {kind} argument ({exc})"
        ) from None


def ctype_arg(
    kind: str, value: int | float
) -> ctypes._SimpleCData[int] | ctypes._SimpleCData[float]:
    """A ctypes object holding ``value`` as ``kind`` (checked by :func:`pack_arg`)."""
    packed = pack_arg(kind, value)
    return _CTYPES[kind].from_buffer_copy(packed)


class Backend(Protocol):
    """One session's device: calls run in order; faults raise :class:`CudaFault`."""

    name: str
    """``driver`` or ``fallback``."""
    detail: str
    """The driver version, or why the fallback."""

    def device_count(self) -> int: ...

    def device_info(self, device: int) -> DeviceInfo: ...

    def alloc(self, size: int) -> int: ...

    def free(self, ptr: int) -> None: ...

    def memset(self, ptr: int, value: int, size: int) -> None: ...

    def write(self, ptr: int, data: bytes | memoryview) -> None:
        """Host to device: ``data`` at ``ptr`` (a piece of a larger copy; a view the
        caller reuses once this returns)."""

    def read(self, ptr: int, size: int) -> bytes | bytearray | memoryview:
        """Device to host: ``size`` bytes at ``ptr`` (possibly a view of device memory
        itself, valid until the next call)."""

    def copy(self, dst: int, src: int, size: int) -> None: ...

    def module_load(self, ptx: bytes) -> int: ...

    def launch(
        self,
        module: int,
        name: str,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared: int,
        args: Sequence[LaunchArg],
    ) -> None: ...

    def synchronize(self) -> None: ...

    def close(self) -> None:
        """Free everything the session holds."""
