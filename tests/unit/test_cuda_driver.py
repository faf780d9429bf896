"""The driver backend against a FAKE of NVIDIA's ``cuda.bindings.driver`` module.

These machines have no GPU, so this fake stands in for the CUDA driver (faking
hardware is allowed; nothing else here is faked): the same function names,
the same ``(CUresult, *values)`` returns, device memory in host memory at real
addresses. It reads what the backend passes the way libcuda would: host
buffers and kernel parameters by address, a ``void*[]`` of pointers to each
argument, NUL-terminated PTX. So every driver call, the argument packing and
the error mapping are exercised; only a real GPU can show the PTX compiles
(``scripts/gpu-check.sh``).
"""

from __future__ import annotations

import array
import ctypes
import enum
import re
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest

from gpumesh.agent.cudaworker import CallServer
from gpumesh.gpu.cudabackend import CudaFault
from gpumesh.gpu.cudadriver import READ_PIECE, DriverBackend, _name
from gpumesh.gpu.cudakernels import VADD_F32, VADD_PTX
from gpumesh.protocol.cuda import (
    VERSION,
    Arg,
    CopyDtoH,
    CopyHtoD,
    FrameDecoder,
    Hello,
    Launch,
    MemAlloc,
    ModuleLoad,
    Synchronize,
    call_frame,
    data_frames,
    decode_result,
    decode_welcome,
)


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_INVALID_PTX = 218
    CUDA_ERROR_INVALID_HANDLE = 400
    CUDA_ERROR_NOT_FOUND = 500
    CUDA_ERROR_LAUNCH_FAILED = 719


class CUdevice_attribute(enum.IntEnum):  # the bindings' name
    CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76


class FakeDriver:
    """The slice of ``cuda.bindings.driver`` the backend uses, on host memory."""

    CUresult = CUresult
    CUdevice_attribute = CUdevice_attribute

    def __init__(self, memory: int = 1 << 30) -> None:
        self.memory = memory
        self.buffers: dict[int, Any] = {}
        self.modules: dict[int, bytes] = {}
        self.calls: list[str] = []
        self.launches: list[tuple[Any, ...]] = []
        self.context_refs = 0
        self.fail_next: dict[str, CUresult] = {}

    def _log(self, name: str) -> CUresult | None:
        self.calls.append(name)
        return self.fail_next.pop(name, None)

    def _span(self, ptr: int, size: int) -> bool:
        return any(
            b <= ptr and ptr + size <= b + ctypes.sizeof(buf) for b, buf in self.buffers.items()
        )

    def cuInit(self, flags: int) -> tuple[CUresult]:
        return (CUresult.CUDA_SUCCESS,)

    def cuDriverGetVersion(self) -> tuple[CUresult, int]:
        self._log("cuDriverGetVersion")
        return CUresult.CUDA_SUCCESS, 12080

    def cuDeviceGetCount(self) -> tuple[CUresult, int]:
        self._log("cuDeviceGetCount")
        return CUresult.CUDA_SUCCESS, 1

    def cuDeviceGet(self, ordinal: int) -> tuple[CUresult, int]:
        self._log("cuDeviceGet")
        if ordinal != 0:
            return CUresult.CUDA_ERROR_INVALID_VALUE, 0
        return CUresult.CUDA_SUCCESS, 100 + ordinal

    def cuDeviceGetName(self, length: int, device: int) -> tuple[CUresult, bytes]:
        self._log("cuDeviceGetName")
        return CUresult.CUDA_SUCCESS, b"Fake GPU 80GB".ljust(length, b"\0")

    def cuDeviceTotalMem(self, device: int) -> tuple[CUresult, int]:
        self._log("cuDeviceTotalMem")
        return CUresult.CUDA_SUCCESS, self.memory

    def cuDeviceGetAttribute(self, attr: CUdevice_attribute, device: int) -> tuple[CUresult, int]:
        self._log("cuDeviceGetAttribute")
        values = {75: 9, 76: 0, 16: 132}
        return CUresult.CUDA_SUCCESS, values[int(attr)]

    def cuDevicePrimaryCtxRetain(self, device: int) -> tuple[CUresult, str]:
        self._log("cuDevicePrimaryCtxRetain")
        self.context_refs += 1
        return CUresult.CUDA_SUCCESS, "context"

    def cuDevicePrimaryCtxRelease(self, device: int) -> tuple[CUresult]:
        self._log("cuDevicePrimaryCtxRelease")
        self.context_refs -= 1
        return (CUresult.CUDA_SUCCESS,)

    def cuCtxSetCurrent(self, context: str) -> tuple[CUresult]:
        self._log("cuCtxSetCurrent")
        return (CUresult.CUDA_SUCCESS,)

    def cuMemAlloc(self, size: int) -> tuple[CUresult, int]:
        if failure := self._log("cuMemAlloc"):
            return failure, 0
        buffer = ctypes.create_string_buffer(size)
        self.buffers[ctypes.addressof(buffer)] = buffer
        return CUresult.CUDA_SUCCESS, ctypes.addressof(buffer)

    def cuMemFree(self, ptr: int) -> tuple[CUresult]:
        self._log("cuMemFree")
        if self.buffers.pop(int(ptr), None) is None:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        return (CUresult.CUDA_SUCCESS,)

    def cuMemsetD8(self, ptr: int, value: int, count: int) -> tuple[CUresult]:
        self._log("cuMemsetD8")
        if not self._span(ptr, count):
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        ctypes.memset(ptr, value, count)
        return (CUresult.CUDA_SUCCESS,)

    def cuMemcpyHtoD(self, dst: int, src: int, count: int) -> tuple[CUresult]:
        self._log("cuMemcpyHtoD")
        if not isinstance(src, int) or not self._span(dst, count):
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        ctypes.memmove(dst, src, count)
        return (CUresult.CUDA_SUCCESS,)

    def cuMemcpyDtoH(self, dst: int, src: int, count: int) -> tuple[CUresult]:
        if failure := self._log("cuMemcpyDtoH"):
            return (failure,)
        if not isinstance(dst, int) or not self._span(src, count):
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        ctypes.memmove(dst, src, count)
        return (CUresult.CUDA_SUCCESS,)

    def cuMemcpyDtoD(self, dst: int, src: int, count: int) -> tuple[CUresult]:
        self._log("cuMemcpyDtoD")
        if not (self._span(dst, count) and self._span(src, count)):
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        ctypes.memmove(dst, src, count)
        return (CUresult.CUDA_SUCCESS,)

    def cuModuleLoadData(self, image: bytes) -> tuple[CUresult, int]:
        self._log("cuModuleLoadData")
        if not image.endswith(b"\0") or b".version" not in image:
            return CUresult.CUDA_ERROR_INVALID_PTX, 0
        handle = 1000 + len(self.modules)
        self.modules[handle] = image
        return CUresult.CUDA_SUCCESS, handle

    def cuModuleUnload(self, module: int) -> tuple[CUresult]:
        self._log("cuModuleUnload")
        self.modules.pop(module)
        return (CUresult.CUDA_SUCCESS,)

    def cuModuleGetFunction(self, module: int, name: bytes) -> tuple[CUresult, Any]:
        self._log("cuModuleGetFunction")
        entries = re.findall(rb"\.entry\s+(\w+)", self.modules.get(module, b""))
        if name not in entries:
            return CUresult.CUDA_ERROR_NOT_FOUND, None
        return CUresult.CUDA_SUCCESS, ("function", name.decode())

    def cuLaunchKernel(
        self,
        f: Any,
        gx: int,
        gy: int,
        gz: int,
        bx: int,
        by: int,
        bz: int,
        shared: int,
        stream: int,
        params: int,
        extra: int,
    ) -> tuple[CUresult]:
        if failure := self._log("cuLaunchKernel"):
            return (failure,)
        # As libcuda does: params is a void*[]; each entry points at one argument.
        pointers = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        a, b, c = (ctypes.c_uint64.from_address(pointers[i]).value for i in range(3))
        n = ctypes.c_uint32.from_address(pointers[3]).value
        self.launches.append((f, (gx, gy, gz), (bx, by, bz), shared, stream, extra, a, b, c, n))
        count = min(n, gx * bx)
        left = (ctypes.c_float * count).from_address(a)
        right = (ctypes.c_float * count).from_address(b)
        out = (ctypes.c_float * count).from_address(c)
        for i in range(count):
            out[i] = left[i] + right[i]
        return (CUresult.CUDA_SUCCESS,)

    def cuCtxSynchronize(self) -> tuple[CUresult]:
        if failure := self._log("cuCtxSynchronize"):
            return (failure,)
        return (CUresult.CUDA_SUCCESS,)

    def cuGetErrorName(self, err: int) -> tuple[CUresult, bytes]:
        self._log("cuGetErrorName")
        try:
            return CUresult.CUDA_SUCCESS, CUresult(err).name.encode()
        except ValueError:
            return CUresult.CUDA_ERROR_INVALID_VALUE, b""

    def cuGetErrorString(self, err: int) -> tuple[CUresult, bytes]:
        self._log("cuGetErrorString")
        return CUresult.CUDA_SUCCESS, b"the fake driver says no"


def test_the_device_as_the_driver_describes_it() -> None:
    fake = FakeDriver()
    backend = DriverBackend(fake, memory_cap=1 << 20)
    assert backend.detail == "CUDA driver 12.8"
    assert fake.calls[:4] == [
        "cuDriverGetVersion",
        "cuDeviceGet",
        "cuDevicePrimaryCtxRetain",
        "cuCtxSetCurrent",
    ]
    info = backend.device_info(0)
    assert (info.name, info.memory_total, info.major, info.minor, info.multiprocessors) == (
        "Fake GPU 80GB",
        1 << 30,
        9,
        0,
        132,
    )
    assert backend.device_count() == 1
    with pytest.raises(CudaFault, match="CUDA_ERROR_INVALID_VALUE: cuDeviceGet") as caught:
        backend.device_info(1)
    assert caught.value.name == "CUDA_ERROR_INVALID_VALUE"


def test_memory_calls_pass_addresses_and_map_errors() -> None:
    fake = FakeDriver()
    backend = DriverBackend(fake, memory_cap=1 << 20)
    ptr = backend.alloc(4096)
    backend.write(ptr + 16, b"hello, device")
    assert b"".join(backend.read(ptr + 16, 13)) == b"hello, device"
    other = backend.alloc(64)
    backend.copy(other, ptr + 16, 5)
    backend.memset(other + 1, ord("J"), 2)
    assert b"".join(backend.read(other, 5)) == b"hJJlo"
    with pytest.raises(CudaFault, match="CUDA_ERROR_OUT_OF_MEMORY") as caught:
        backend.alloc(1 << 20)  # the session's cap, before the driver is asked
    assert "cuMemAlloc" not in caught.value.message
    fake.fail_next["cuMemAlloc"] = CUresult.CUDA_ERROR_OUT_OF_MEMORY
    with pytest.raises(CudaFault, match="CUDA_ERROR_OUT_OF_MEMORY: cuMemAlloc: the fake driver"):
        backend.alloc(16)
    with pytest.raises(CudaFault, match="CUDA_ERROR_INVALID_VALUE"):
        b"".join(backend.read(ptr + 4090, 16))  # past the end: the driver refuses
    with pytest.raises(CudaFault, match="is not an allocation"):
        backend.free(ptr + 16)  # never handed to the driver: it is another session's
    backend.free(other)
    assert fake.calls.count("cuMemFree") == 1
    backend.close()
    assert fake.buffers == {} and fake.context_refs == 0


def test_a_kernel_launch_packs_typed_arguments_as_the_driver_reads_them() -> None:
    fake = FakeDriver()
    backend = DriverBackend(fake, memory_cap=1 << 20)
    n = 300
    a, b, c = (backend.alloc(n * 4) for _ in range(3))
    backend.write(a, array.array("f", range(n)).tobytes())
    backend.write(b, array.array("f", [0.25] * n).tobytes())
    module = backend.module_load(VADD_PTX.encode())
    assert fake.modules[1000].endswith(b"}\n\0")  # NUL-terminated, as cuModuleLoadData wants
    args = [("ptr", a), ("ptr", b), ("ptr", c), ("u32", n)]
    backend.launch(module, VADD_F32, (2, 1, 1), (256, 1, 1), 0, args)
    backend.launch(module, VADD_F32, (2, 1, 1), (256, 1, 1), 0, args)
    assert fake.calls.count("cuModuleGetFunction") == 1  # looked up once
    [launch, _] = fake.launches
    assert launch == (("function", VADD_F32), (2, 1, 1), (256, 1, 1), 0, 0, 0, a, b, c, n)
    backend.synchronize()
    out = array.array("f", b"".join(backend.read(c, n * 4)))
    assert out.tolist() == [i + 0.25 for i in range(n)]
    with pytest.raises(CudaFault, match="CUDA_ERROR_NOT_FOUND: cuModuleGetFunction"):
        backend.launch(module, "missing", (1, 1, 1), (1, 1, 1), 0, [])
    with pytest.raises(CudaFault, match="CUDA_ERROR_INVALID_HANDLE"):
        backend.launch(7, VADD_F32, (1, 1, 1), (1, 1, 1), 0, args)
    with pytest.raises(CudaFault, match="CUDA_ERROR_INVALID_PTX: cuModuleLoadData"):
        backend.module_load(b"garbage")
    fake.fail_next["cuCtxSynchronize"] = CUresult.CUDA_ERROR_LAUNCH_FAILED
    with pytest.raises(CudaFault, match="CUDA_ERROR_LAUNCH_FAILED: cuCtxSynchronize") as caught:
        backend.synchronize()
    assert caught.value.name == "CUDA_ERROR_LAUNCH_FAILED"
    backend.close()
    assert fake.modules == {} and fake.buffers == {}


def test_error_names_come_from_the_driver_when_the_code_is_a_plain_number() -> None:
    fake = FakeDriver()
    assert _name(fake, 719) == "CUDA_ERROR_LAUNCH_FAILED"
    assert _name(fake, 4242) == "CUDA_ERROR_4242"


def test_the_worker_session_on_the_driver_backend() -> None:
    fake = FakeDriver()
    server = CallServer(DriverBackend(fake, memory_cap=1 << 20), 1 << 20)
    decoder = FrameDecoder()

    def answers(*chunks: bytes) -> list[Any]:
        return [f for chunk in chunks for out in server.feed(chunk) for f in decoder.feed(out)]

    [welcome] = answers(call_frame(Hello(version=VERSION)))
    assert decode_welcome(welcome.body).backend == "driver"
    assert decode_welcome(welcome.body).device == "Fake GPU 80GB"
    [alloc] = answers(call_frame(MemAlloc(size=64)))
    ptr = decode_result(alloc.body).value
    assert answers(call_frame(CopyHtoD(ptr=ptr, size=8)), *data_frames(b"\0" * 8)) == []
    [module] = answers(call_frame(ModuleLoad(ptx=VADD_PTX.encode())))
    fake.fail_next["cuLaunchKernel"] = CUresult.CUDA_ERROR_LAUNCH_FAILED
    launch = Launch(
        module=decode_result(module.body).value,
        name=VADD_F32,
        grid=(1, 1, 1),
        block=(2, 1, 1),
        args=[Arg("ptr", ptr), Arg("ptr", ptr), Arg("ptr", ptr), Arg("u32", 2)],
    )
    assert answers(call_frame(launch)) == []
    [sync] = answers(call_frame(Synchronize()))
    assert decode_result(sync.body).error == "CUDA_ERROR_LAUNCH_FAILED"


def test_a_read_outside_the_sessions_allocations_allocates_nothing() -> None:
    """The attack: a device-to-host copy of a made-up size (up to 1 TiB on the wire)
    made the backend allocate a host buffer of that size before the driver refused."""
    fake = FakeDriver()
    backend = DriverBackend(fake, memory_cap=1 << 20)
    ptr = backend.alloc(4096)
    tracemalloc.start()
    try:
        with pytest.raises(CudaFault, match=r"^CUDA_ERROR_INVALID_VALUE: 268435456 bytes at"):
            backend.read(ptr, 256 * 1024 * 1024)  # refused before it returns
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1024 * 1024
    assert "cuMemcpyDtoH" not in fake.calls  # refused before the driver was asked


def test_every_memory_call_is_checked_against_the_allocations_before_the_driver() -> None:
    fake = FakeDriver()
    backend = DriverBackend(fake, memory_cap=1 << 20)
    ptr = backend.alloc(4096)
    elsewhere = ptr + 8192  # not this session's: another's memory, to the driver
    calls: list[tuple[str, Callable[[], object]]] = [
        ("cuMemcpyDtoH", lambda: backend.read(ptr + 4000, 100)),
        ("cuMemcpyHtoD", lambda: backend.write(elsewhere, b"x" * 16)),
        ("cuMemsetD8", lambda: backend.memset(ptr, 0, 4097)),
        ("cuMemcpyDtoD", lambda: backend.copy(elsewhere, ptr, 16)),
        ("cuMemcpyDtoD", lambda: backend.copy(ptr, ptr - 16, 16)),
    ]
    for name, call in calls:
        with pytest.raises(CudaFault, match=r"CUDA_ERROR_INVALID_VALUE: .* not inside one"):
            call()
        assert name not in fake.calls


def test_a_copy_of_a_whole_allocation_to_the_host_holds_a_piece_not_its_size() -> None:
    """Device-to-host copies are read from the device a piece at a time as they are
    sent: a session's worker holds no host buffer of a copy's size (its device
    memory is the GPU's, not the host's), so a large session cannot take the
    provider's host memory by reading its allocations back."""
    fake = FakeDriver()
    size = 64 * 1024 * 1024
    server = CallServer(DriverBackend(fake, memory_cap=size), size)
    list(server.feed(call_frame(Hello(version=VERSION))))
    [alloc] = FrameDecoder().feed(b"".join(server.feed(call_frame(MemAlloc(size=size)))))
    ptr = decode_result(alloc.body).value
    fake.calls.clear()
    tracemalloc.start()
    try:
        sent = 0
        for part in server.feed(call_frame(CopyDtoH(ptr=ptr, size=size))):
            sent += len(part)  # written to the pipe and dropped, as the worker does
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sent > size
    assert fake.calls.count("cuMemcpyDtoH") == size // READ_PIECE
    assert peak < 4 * READ_PIECE, peak  # was the whole 64 MiB


def test_a_fault_in_the_middle_of_a_copy_raises_while_it_is_sent() -> None:
    fake = FakeDriver()
    backend = DriverBackend(fake, memory_cap=8 * READ_PIECE)
    ptr = backend.alloc(4 * READ_PIECE)
    fake.fail_next["cuMemcpyDtoH"] = CUresult.CUDA_ERROR_LAUNCH_FAILED
    with pytest.raises(CudaFault, match="CUDA_ERROR_LAUNCH_FAILED"):
        backend.read(ptr, 4 * READ_PIECE)  # the first piece: the call's own error
    pieces = backend.read(ptr, 4 * READ_PIECE)
    fake.fail_next["cuMemcpyDtoH"] = CUresult.CUDA_ERROR_LAUNCH_FAILED
    assert len(next(pieces)) == READ_PIECE
    with pytest.raises(CudaFault, match="CUDA_ERROR_LAUNCH_FAILED"):
        next(pieces)  # the worker ends the session with it (the stream is cut)
