"""The driver backend: a CUDA session on a real GPU through NVIDIA's ``cuda-bindings``.

``cuda-bindings`` (the optional ``cuda`` extra) is imported only here and only
when a session or ``cuda doctor`` asks, so nothing else needs it. Every call of
the driver API returns ``(CUresult, *values)``; :meth:`DriverBackend._check`
turns a failure into :class:`CudaFault` with CUDA's error name. Host buffers
and kernel parameters are passed as addresses (``ctypes``), which every version
of the bindings accepts.

Tests drive this class with a fake of the driver module (the same functions,
on host memory), since the machines they run on have no GPU.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator, Sequence
from typing import Any

from gpumesh.gpu.cudabackend import Allocations, CudaFault, DeviceInfo, LaunchArg, ctype_arg
from gpumesh.protocol.cuda import MAX_CHUNK

__all__ = ["READ_PIECE", "DriverBackend", "DriverUnavailable", "load_driver"]

READ_PIECE = MAX_CHUNK
"""Bytes of a device-to-host copy taken out of the device at a time (one DATA frame)."""


class DriverUnavailable(Exception):
    """libcuda (or the bindings) cannot be used here; the message says why."""


def load_driver() -> Any:
    """The initialized ``cuda.bindings.driver`` module, or DriverUnavailable."""
    try:
        from cuda.bindings import driver  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        try:
            # cuda-python before 12.6
            from cuda import cuda as driver  # type: ignore[import-not-found,unused-ignore,no-redef]
        except ImportError:
            raise DriverUnavailable(
                "cuda-bindings is not installed (pip install 'gpumesh[cuda]')"
            ) from None
    try:
        result = driver.cuInit(0)
    except Exception as exc:  # DynamicLibNotFoundError, RuntimeError: no libcuda
        raise DriverUnavailable(f"libcuda did not load: {exc}") from None
    if result[0] != driver.CUresult.CUDA_SUCCESS:
        raise DriverUnavailable(f"cuInit failed: {_name(driver, result[0])}")
    count = driver.cuDeviceGetCount()
    if count[0] != driver.CUresult.CUDA_SUCCESS or count[1] < 1:
        raise DriverUnavailable("libcuda loaded but sees no CUDA device")
    return driver


def _name(cu: Any, err: Any) -> str:
    name = getattr(err, "name", None)
    if isinstance(name, str) and name.startswith("CUDA_"):
        return name
    try:
        found = cu.cuGetErrorName(err)
        if found[0] == cu.CUresult.CUDA_SUCCESS:
            return bytes(found[1]).decode(errors="replace")
    except Exception:  # an unknown code: say the number
        pass
    return f"CUDA_ERROR_{int(err)}"


class DriverBackend:
    """One session's context on one GPU."""

    name = "driver"

    def __init__(self, driver: Any, memory_cap: int, device: int = 0) -> None:
        self._cu = driver
        self.memory_cap = memory_cap
        (version,) = self._check(driver.cuDriverGetVersion(), "cuDriverGetVersion")
        self.detail = f"CUDA driver {int(version) // 1000}.{int(version) % 1000 // 10}"
        (self._device,) = self._check(driver.cuDeviceGet(device), "cuDeviceGet")
        (self._context,) = self._check(
            driver.cuDevicePrimaryCtxRetain(self._device), "cuDevicePrimaryCtxRetain"
        )
        self._check(driver.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")
        self._allocations = Allocations(memory_cap)
        self._modules: dict[int, Any] = {}
        self._functions: dict[tuple[int, str], Any] = {}

    def _check(self, result: Any, call: str) -> tuple[Any, ...]:
        """The values of a driver call's result; CudaFault when it failed."""
        err, *values = result if isinstance(result, tuple) else (result,)
        if err != self._cu.CUresult.CUDA_SUCCESS:
            message = ""
            try:
                found = self._cu.cuGetErrorString(err)
                if found[0] == self._cu.CUresult.CUDA_SUCCESS:
                    message = bytes(found[1]).decode(errors="replace")
            except Exception:  # the name is enough
                pass
            raise CudaFault(_name(self._cu, err), f"{call}: {message or 'failed'}")
        return tuple(values)

    def device_count(self) -> int:
        (count,) = self._check(self._cu.cuDeviceGetCount(), "cuDeviceGetCount")
        return int(count)

    def device_info(self, device: int) -> DeviceInfo:
        cu = self._cu
        (handle,) = self._check(cu.cuDeviceGet(device), "cuDeviceGet")
        (raw,) = self._check(cu.cuDeviceGetName(256, handle), "cuDeviceGetName")
        (total,) = self._check(cu.cuDeviceTotalMem(handle), "cuDeviceTotalMem")
        attrs = cu.CUdevice_attribute
        values = [
            self._check(cu.cuDeviceGetAttribute(attr, handle), "cuDeviceGetAttribute")[0]
            for attr in (
                attrs.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                attrs.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                attrs.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
        ]
        name = bytes(raw).split(b"\0", 1)[0].decode(errors="replace")
        return DeviceInfo(name, int(total), int(values[0]), int(values[1]), int(values[2]))

    # --- memory -----------------------------------------------------------------------------

    def alloc(self, size: int) -> int:
        self._allocations.check_new(size)
        (ptr,) = self._check(self._cu.cuMemAlloc(size), "cuMemAlloc")
        self._allocations.add(int(ptr), size)
        return int(ptr)

    def free(self, ptr: int) -> None:
        # The driver would accept a pointer inside another session's memory: only
        # this session's allocations are passed on, and every range is checked
        # against them before the driver or a host buffer sees it.
        if ptr not in self._allocations:
            raise CudaFault("CUDA_ERROR_INVALID_VALUE", f"{ptr:#x} is not an allocation")
        self._check(self._cu.cuMemFree(ptr), "cuMemFree")
        self._allocations.remove(ptr)

    def memset(self, ptr: int, value: int, size: int) -> None:
        self._allocations.span(ptr, size)
        self._check(self._cu.cuMemsetD8(ptr, value, size), "cuMemsetD8")

    def write(self, ptr: int, data: bytes | memoryview) -> None:
        size = len(data)
        self._allocations.span(ptr, size)
        if isinstance(data, memoryview) and not data.readonly and size:
            # A view of the worker's read buffer: its own memory, no copy.
            address = ctypes.addressof((ctypes.c_char * size).from_buffer(data))
        else:
            source = ctypes.c_char_p(bytes(data))  # a bytes object's own buffer
            address = ctypes.cast(source, ctypes.c_void_p).value or 0
        self._check(self._cu.cuMemcpyHtoD(ptr, address, size), "cuMemcpyHtoD")

    def read(self, ptr: int, size: int) -> Iterator[bytearray]:
        # Checked before any host buffer; then copied out a piece at a time, each a
        # buffer of its own that goes as soon as it is sent: a copy of a whole
        # allocation holds one piece or a few of host memory, never its size.
        self._allocations.span(ptr, size)
        first = self._piece(ptr, min(size, READ_PIECE))  # a fault here is the call's
        return self._pieces(first, ptr, size)

    def _pieces(self, first: bytearray, ptr: int, size: int) -> Iterator[bytearray]:
        yield first
        for start in range(len(first), size, READ_PIECE):
            yield self._piece(ptr + start, min(READ_PIECE, size - start))

    def _piece(self, ptr: int, size: int) -> bytearray:
        target = bytearray(size)
        address = ctypes.addressof((ctypes.c_char * size).from_buffer(target)) if size else 0
        self._check(self._cu.cuMemcpyDtoH(address, ptr, size), "cuMemcpyDtoH")
        return target

    def copy(self, dst: int, src: int, size: int) -> None:
        self._allocations.span(src, size)
        self._allocations.span(dst, size)
        self._check(self._cu.cuMemcpyDtoD(dst, src, size), "cuMemcpyDtoD")

    # --- kernels ----------------------------------------------------------------------------

    def module_load(self, ptx: bytes) -> int:
        image = ptx if ptx.endswith(b"\0") else ptx + b"\0"
        (module,) = self._check(self._cu.cuModuleLoadData(image), "cuModuleLoadData")
        handle = len(self._modules) + 1
        self._modules[handle] = module
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
        loaded = self._modules.get(module)
        if loaded is None:
            raise CudaFault("CUDA_ERROR_INVALID_HANDLE", f"module {module} is not loaded")
        function = self._functions.get((module, name))
        if function is None:
            (function,) = self._check(
                self._cu.cuModuleGetFunction(loaded, name.encode()), "cuModuleGetFunction"
            )
            self._functions[(module, name)] = function
        # cuLaunchKernel reads a void*[] of pointers to each argument's value.
        values = [ctype_arg(kind, value) for kind, value in args]
        pointers = (ctypes.c_void_p * max(1, len(values)))(
            *[ctypes.addressof(value) for value in values]
        )
        params = ctypes.addressof(pointers) if values else 0
        self._check(
            self._cu.cuLaunchKernel(function, *grid, *block, shared, 0, params, 0),
            "cuLaunchKernel",
        )

    def synchronize(self) -> None:
        self._check(self._cu.cuCtxSynchronize(), "cuCtxSynchronize")

    def close(self) -> None:
        """Free the session's memory and modules, and let go of the context."""
        cu = self._cu
        for ptr in self._allocations:
            cu.cuMemFree(ptr)
        for module in self._modules.values():
            cu.cuModuleUnload(module)
        self._allocations.clear()
        self._modules.clear()
        self._functions.clear()
        cu.cuDevicePrimaryCtxRelease(self._device)
