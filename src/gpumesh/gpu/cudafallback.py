"""The host-memory fallback: a CUDA session without a GPU.

Device memory is host memory (bytearrays at made-up device addresses, within
the session's cap); copies, memset and frees behave as on a device, with
CUDA's error names. Beyond the session's memory a call holds at most a
chunk's worth of host memory: copies are views, and the kernels run in
chunks. It cannot run PTX: a module is accepted only when every
entry in it is one of GPUMesh's own kernels (:mod:`gpumesh.gpu.cudakernels`),
which run here by name, so the demo and the benchmark work everywhere; any
other PTX is refused with a clear error.
"""

from __future__ import annotations

import array
import operator
import re
import sys
from collections.abc import Iterator, Sequence

from gpumesh.gpu.cudabackend import Allocations, CudaFault, DeviceInfo, LaunchArg
from gpumesh.gpu.cudakernels import VADD_F32

__all__ = ["DEVICE_NAME", "KERNELS", "FallbackBackend", "ptx_entries"]

DEVICE_NAME = "host-memory fallback"
KERNELS = frozenset({VADD_F32})
"""Entry names the fallback runs."""
_BASE = 0x7F00_0000_0000
"""Where made-up device addresses start (never 0, so a null pointer stays invalid)."""
_ALIGN = 512
_CHUNK = 256 * 1024
"""Bytes a memset or a kernel works on at once (a multiple of 4: whole floats)."""
_ENTRY = re.compile(rb"\.entry\s+([A-Za-z_$%][\w$]*)")


def ptx_entries(ptx: bytes) -> list[str]:
    """The kernel (``.entry``) names a PTX module defines."""
    return [match.decode() for match in _ENTRY.findall(ptx)]


class FallbackBackend:
    """Device memory in host memory; GPUMesh's kernels only."""

    name = "fallback"

    def __init__(self, memory_cap: int, detail: str) -> None:
        self.detail = detail
        self.memory_cap = memory_cap
        self._allocations = Allocations(memory_cap)
        self._memory: dict[int, bytearray] = {}
        self._next = _BASE
        self._modules: dict[int, frozenset[str]] = {}

    def device_count(self) -> int:
        return 1

    def device_info(self, device: int) -> DeviceInfo:
        self._device(device)
        return DeviceInfo(DEVICE_NAME, self.memory_cap, 0, 0, 1)

    def _device(self, device: int) -> None:
        if device != 0:
            raise CudaFault("CUDA_ERROR_INVALID_DEVICE", f"there is no device {device}")

    # --- memory ---------------------------------------------------------------------------

    def alloc(self, size: int) -> int:
        self._allocations.check_new(size)
        try:
            block = bytearray(size)
        except MemoryError:  # the worker's own ceiling, or the machine's
            raise CudaFault("CUDA_ERROR_OUT_OF_MEMORY", "the provider is out of memory") from None
        ptr = self._next
        self._next += (size + _ALIGN - 1) // _ALIGN * _ALIGN + _ALIGN  # a gap: no overlap
        self._allocations.add(ptr, size)
        self._memory[ptr] = block
        return ptr

    def free(self, ptr: int) -> None:
        self._allocations.remove(ptr)
        del self._memory[ptr]

    def _view(self, ptr: int, size: int) -> memoryview:
        """The session's bytes ``[ptr, ptr + size)``, checked to lie in one allocation:
        a view, never a copy, so no call holds more than the session's memory."""
        base, offset = self._allocations.span(ptr, size)
        return memoryview(self._memory[base])[offset : offset + size]

    def memset(self, ptr: int, value: int, size: int) -> None:
        target = self._view(ptr, size)
        fill = bytes([value]) * min(size, _CHUNK)
        for start in range(0, size, _CHUNK):
            piece = target[start : start + _CHUNK]
            piece[:] = fill[: len(piece)]

    def write(self, ptr: int, data: bytes | memoryview) -> None:
        self._view(ptr, len(data))[:] = data

    def read(self, ptr: int, size: int) -> Iterator[memoryview]:
        return iter((self._view(ptr, size),))  # sent before the next call

    def copy(self, dst: int, src: int, size: int) -> None:
        # memoryview assignment is memmove: overlapping copies within one allocation
        # land as cuMemcpyDtoD's would.
        self._view(dst, size)[:] = self._view(src, size)

    # --- kernels ----------------------------------------------------------------------------

    def module_load(self, ptx: bytes) -> int:
        entries = ptx_entries(ptx)
        if not entries:
            raise CudaFault("CUDA_ERROR_INVALID_PTX", "the module defines no kernel (.entry)")
        unknown = [entry for entry in entries if entry not in KERNELS]
        if unknown:
            raise CudaFault(
                "CUDA_ERROR_NOT_SUPPORTED",
                f"the host-memory fallback cannot run PTX ({', '.join(unknown[:3])}); it "
                f"runs only GPUMesh's kernels ({', '.join(sorted(KERNELS))}): use a "
                "provider whose GPU driver loads",
            )
        handle = len(self._modules) + 1
        self._modules[handle] = frozenset(entries)
        return handle

    def launch(
        self,
        module: int,
        name: str,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared: int,
        args: Sequence[LaunchArg],
    ) -> None:
        entries = self._modules.get(module)
        if entries is None:
            raise CudaFault("CUDA_ERROR_INVALID_HANDLE", f"module {module} is not loaded")
        if name not in entries:
            raise CudaFault("CUDA_ERROR_NOT_FOUND", f"the module has no kernel {name!r}")
        if name == VADD_F32:
            self._vadd(grid, block, args)

    def _vadd(
        self, grid: tuple[int, int, int], block: tuple[int, int, int], args: Sequence[LaunchArg]
    ) -> None:
        kinds = [kind for kind, _ in args]
        if len(args) != 4 or kinds[:3] != ["ptr"] * 3 or kinds[3] not in ("u32", "i32"):
            raise CudaFault(
                "CUDA_ERROR_INVALID_VALUE",
                f"{VADD_F32} takes (ptr a, ptr b, ptr c, u32 n), not ({', '.join(kinds)})",
            )
        a, b, c, n = (int(value) for _, value in args)
        # As the PTX does: one thread per element along x, threads past n do nothing.
        count = max(0, min(n, grid[0] * block[0]))
        if not count:
            return
        size = count * 4
        left, right, out = self._view(a, size), self._view(b, size), self._view(c, size)
        # In chunks of _CHUNK bytes: a whole session's worth of Python floats would
        # take several times the session's memory.
        for start in range(0, size, _CHUNK):
            end = min(size, start + _CHUNK)
            x, y = _floats(left[start:end]), _floats(right[start:end])
            total = array.array("f", map(operator.add, x, y))
            if sys.byteorder != "little":
                total.byteswap()
            out[start:end] = memoryview(total).cast("B")

    def synchronize(self) -> None:
        return None

    def close(self) -> None:
        self._memory.clear()
        self._allocations.clear()
        self._modules.clear()


def _floats(data: memoryview) -> array.array[float]:
    """Little-endian f32 bytes as floats (one chunk's copy)."""
    values = array.array("f")
    values.frombytes(data)
    if sys.byteorder != "little":
        values.byteswap()
    return values
