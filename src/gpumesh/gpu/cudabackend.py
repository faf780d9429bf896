"""What runs a CUDA session's calls on the provider: one interface, two backends.

:class:`Backend` is what the worker (:mod:`gpumesh.agent.cudaworker`) drives. The
driver backend (:mod:`gpumesh.gpu.cudadriver`) runs the calls on a GPU through
NVIDIA's ``cuda-bindings``; the fallback (:mod:`gpumesh.gpu.cudafallback`) keeps
device memory in host memory and runs only GPUMesh's own kernels by name.
:func:`gpumesh.agent.cudaworker.open_backend` picks: the driver when libcuda loads,
else the fallback, with the reason. A failing call raises :class:`CudaFault` with CUDA's error name.

:class:`Allocations` is the one bookkeeping both backends keep: the session's
cap, and whether a call's bytes lie inside one of its allocations. Every
memory call is checked there before anything is allocated or touched, so a
size a peer makes up (up to :data:`~gpumesh.protocol.cuda.MAX_COPY`) costs
nothing but its error line.
"""

from __future__ import annotations

import bisect
import ctypes
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from gpumesh.units import format_size

__all__ = ["Allocations", "Backend", "CudaFault", "DeviceInfo", "LaunchArg", "pack_arg"]


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


class Allocations:
    """One session's allocations by address, within its cap (no I/O)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.used = 0
        """Bytes allocated now."""
        self._bases: list[int] = []
        """Allocation addresses, sorted."""
        self._sizes: dict[int, int] = {}

    def __contains__(self, ptr: int) -> bool:
        return ptr in self._sizes

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._bases))

    def check_new(self, size: int) -> None:
        """Refuse an allocation of ``size`` that is empty or would pass the cap."""
        if size <= 0:
            raise CudaFault("CUDA_ERROR_INVALID_VALUE", "cannot allocate 0 bytes")
        if self.used + size > self.cap:
            raise CudaFault(
                "CUDA_ERROR_OUT_OF_MEMORY",
                f"{format_size(size)} more would pass this session's cap of "
                f"{format_size(self.cap)} ({format_size(self.used)} allocated)",
            )

    def add(self, ptr: int, size: int) -> None:
        bisect.insort(self._bases, ptr)
        self._sizes[ptr] = size
        self.used += size

    def remove(self, ptr: int) -> int:
        """Forget the allocation at ``ptr``; its size (CudaFault when there is none)."""
        size = self._sizes.pop(ptr, None)
        if size is None:
            raise CudaFault("CUDA_ERROR_INVALID_VALUE", f"{ptr:#x} is not an allocation")
        self._bases.remove(ptr)
        self.used -= size
        return size

    def span(self, ptr: int, size: int) -> tuple[int, int]:
        """``(base, offset)``: the allocation holding ``[ptr, ptr + size)`` and where
        ``ptr`` is in it; CudaFault when those bytes are not inside one allocation."""
        index = bisect.bisect_right(self._bases, ptr) - 1
        if index >= 0 and size >= 0:
            base = self._bases[index]
            offset = ptr - base
            if offset + size <= self._sizes[base]:
                return base, offset
        raise CudaFault(
            "CUDA_ERROR_INVALID_VALUE",
            f"{size} bytes at {ptr:#x} are not inside one allocation",
        )

    def clear(self) -> None:
        self._bases.clear()
        self._sizes.clear()
        self.used = 0


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

    def read(self, ptr: int, size: int) -> Iterator[bytes | bytearray | memoryview]:
        """Device to host: ``size`` bytes at ``ptr``, in order, in pieces to send as
        they come (views of device memory itself, valid until the next call, or
        pieces of at most :data:`~gpumesh.protocol.cuda.MAX_CHUNK` copied out one by
        one, so a copy holds no host buffer of its size). The range is checked, and
        the first piece read, before this returns; a fault in a later piece raises
        while the pieces are taken."""

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
