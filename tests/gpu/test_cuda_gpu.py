"""CUDA remoting on a real NVIDIA GPU: the shipped PTX compiles and runs through the
driver backend, and a session over QUIC says it ran on the GPU. Collected only
where libcuda loads (``scripts/gpu-check.sh`` runs these on a GPU machine)."""

from __future__ import annotations

import array

import pytest

from gpumesh.gpu.cudabackend import CudaFault
from gpumesh.gpu.cudadriver import READ_PIECE, DriverBackend, load_driver
from gpumesh.gpu.cudakernels import VADD_F32, VADD_PTX

pytestmark = pytest.mark.gpu


@pytest.fixture
def driver():  # type: ignore[no-untyped-def]
    return load_driver()  # collected only where it loads (conftest.py)


def test_the_shipped_ptx_adds_vectors_on_the_gpu(driver) -> None:  # type: ignore[no-untyped-def]
    backend = DriverBackend(driver, memory_cap=1 << 26)
    try:
        n = 1 << 20
        a, b, c = (backend.alloc(n * 4) for _ in range(3))
        backend.write(a, array.array("f", (float(i % 100) for i in range(n))).tobytes())
        backend.write(b, array.array("f", [1.5] * n).tobytes())
        module = backend.module_load(VADD_PTX.encode())
        args = [("ptr", a), ("ptr", b), ("ptr", c), ("u32", n)]
        backend.launch(module, VADD_F32, ((n + 255) // 256, 1, 1), (256, 1, 1), 0, args)
        backend.synchronize()
        out = array.array("f", b"".join(backend.read(c, n * 4)))
        assert all(out[i] == (i % 100) + 1.5 for i in range(0, n, 997))
        assert backend.device_info(0).memory_total > 0
    finally:
        backend.close()


def test_a_session_stays_inside_its_cap_and_its_allocations(driver) -> None:  # type: ignore[no-untyped-def]
    backend = DriverBackend(driver, memory_cap=1 << 22)
    try:
        with pytest.raises(CudaFault) as too_big:
            backend.alloc(1 << 23)
        assert too_big.value.name == "CUDA_ERROR_OUT_OF_MEMORY"
        ptr = backend.alloc(1 << 21)
        with pytest.raises(CudaFault):  # the cap counts what is held
            backend.alloc(3 << 20)
        # Sizes past the allocation, or a pointer into no allocation, are refused
        # before the driver or a host buffer sees them (1 TiB would not fit anywhere).
        for bad_ptr, size in ((ptr, 1 << 40), (ptr + 16, 1 << 21), (ptr + (1 << 30), 4)):
            with pytest.raises(CudaFault) as outside:
                backend.read(bad_ptr, size)
            assert outside.value.name == "CUDA_ERROR_INVALID_VALUE"
        with pytest.raises(CudaFault):
            backend.write(ptr + (1 << 21) - 2, b"four")
        with pytest.raises(CudaFault):
            backend.free(ptr + 16)
    finally:
        backend.close()


def test_a_device_to_host_copy_comes_out_a_piece_at_a_time(driver) -> None:  # type: ignore[no-untyped-def]
    backend = DriverBackend(driver, memory_cap=1 << 24)
    try:
        size = 3 * READ_PIECE + 12345
        ptr = backend.alloc(size)
        data = bytes(range(256)) * (size // 256) + bytes(size % 256)
        backend.write(ptr, data)
        pieces = list(backend.read(ptr, size))
        assert [len(piece) for piece in pieces] == [READ_PIECE] * 3 + [12345]
        assert b"".join(pieces) == data
    finally:
        backend.close()
