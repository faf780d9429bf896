"""The host-memory fallback: a CUDA session without a GPU.

Device memory is host memory (bytearrays at made-up device addresses, within
the session's cap); copies, memset and frees behave as on a device, with
CUDA's error names. It cannot run PTX: a module is accepted only when every
entry in it is one of GPUMesh's own kernels (:mod:`gpumesh.cuda.kernels`),
which run here by name, so the demo and the benchmark work everywhere; any
other PTX is refused with a clear error.
"""

from __future__ import annotations

import array
import bisect
import re
import sys
from collections.abc import Sequence

from gpumesh.cuda.backend import CudaFault, DeviceInfo, LaunchArg
from gpumesh.cuda.kernels import VADD_F32
from gpumesh.units import format_size

__all__ = ["DEVICE_NAME", "KERNELS", "FallbackBackend", "ptx_entries"]

DEVICE_NAME = "host-memory fallback"
KERNELS = frozenset({VADD_F32})
"""Entry names the fallback runs."""
_BASE = 0x7F00_0000_0000
"""Where made-up device addresses start (never 0, so a null pointer stays invalid)."""
_ALIGN = 512
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
        self._bases: list[int] = []
        """Allocation addresses, sorted."""
        self._memory: dict[int, bytearray] = {}
        self._next = _BASE
        self._used = 0
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
        if size <= 0:
            raise CudaFault("CUDA_ERROR_INVALID_VALUE", "cannot allocate 0 bytes")
        if self._used + size > self.memory_cap:
            raise CudaFault(
                "CUDA_ERROR_OUT_OF_MEMORY",
                f"{format_size(size)} more would pass this session's cap of "
                f"{format_size(self.memory_cap)} ({format_size(self._used)} allocated)",
            )
        try:
            block = bytearray(size)
        except MemoryError:
            raise CudaFault("CUDA_ERROR_OUT_OF_MEMORY", "the provider is out of memory") from None
        ptr = self._next
        self._next += (size + _ALIGN - 1) // _ALIGN * _ALIGN + _ALIGN  # a gap: no overlap
        bisect.insort(self._bases, ptr)
        self._memory[ptr] = block
        self._used += size
        return ptr

    def free(self, ptr: int) -> None:
        block = self._memory.pop(ptr, None)
        if block is None:
            raise CudaFault("CUDA_ERROR_INVALID_VALUE", f"{ptr:#x} is not an allocation")
        self._bases.remove(ptr)
        self._used -= len(block)

    def _span(self, ptr: int, size: int) -> tuple[bytearray, int]:
        """The allocation holding ``[ptr, ptr + size)`` and the offset of ``ptr`` in it."""
        index = bisect.bisect_right(self._bases, ptr) - 1
        if index >= 0:
            base = self._bases[index]
            block = self._memory[base]
            offset = ptr - base
            if offset + size <= len(block):
                return block, offset
        raise CudaFault(
            "CUDA_ERROR_INVALID_VALUE",
            f"{size} bytes at {ptr:#x} are not inside one allocation",
        )

    def memset(self, ptr: int, value: int, size: int) -> None:
        block, offset = self._span(ptr, size)
        block[offset : offset + size] = bytes([value]) * size

    def write(self, ptr: int, data: bytes | memoryview) -> None:
        block, offset = self._span(ptr, len(data))
        block[offset : offset + len(data)] = data

    def read(self, ptr: int, size: int) -> memoryview:
        block, offset = self._span(ptr, size)
        return memoryview(block)[offset : offset + size]  # sent before the next call

    def copy(self, dst: int, src: int, size: int) -> None:
        source, at = self._span(src, size)
        target, to = self._span(dst, size)
        target[to : to + size] = source[at : at + size]

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
        left = _floats(*self._span(a, size), count)
        right = _floats(*self._span(b, size), count)
        target, offset = self._span(c, size)
        out = array.array("f", [x + y for x, y in zip(left, right, strict=True)])
        if sys.byteorder != "little":
            out.byteswap()
        target[offset : offset + size] = out.tobytes()

    def synchronize(self) -> None:
        return None

    def close(self) -> None:
        self._memory.clear()
        self._bases.clear()
        self._modules.clear()
        self._used = 0


def _floats(block: bytearray, offset: int, count: int) -> array.array[float]:
    values = array.array("f")
    values.frombytes(bytes(block[offset : offset + count * 4]))
    if sys.byteorder != "little":
        values.byteswap()
    return values
