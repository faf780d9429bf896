"""CUDA remoting on a real NVIDIA GPU: the shipped PTX compiles and runs through the
driver backend, and a session over QUIC says it ran on the GPU. Collected only
where libcuda loads (``scripts/gpu-check.sh`` runs these on a GPU machine)."""

from __future__ import annotations

import array

import pytest

from gpumesh.cuda.driver import DriverBackend, load_driver
from gpumesh.cuda.kernels import VADD_F32, VADD_PTX

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
        out = array.array("f", backend.read(c, n * 4))
        assert all(out[i] == (i % 100) + 1.5 for i in range(0, n, 997))
        assert backend.device_info(0).memory_total > 0
    finally:
        backend.close()
