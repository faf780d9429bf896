"""Tests that need a real NVIDIA GPU: collected only where libcuda loads and sees
one (or when GPUMESH_TEST_GPU=1 insists, so a GPU machine that lost its driver
fails instead of passing quietly). Elsewhere they are not collected at all, so
a run without a GPU reports nothing skipped; scripts/gpu-check.sh runs them."""

from __future__ import annotations

import functools
import os
from pathlib import Path


@functools.cache
def _gpu_here() -> bool:
    if os.environ.get("GPUMESH_TEST_GPU") == "1":
        return True
    from gpumesh.gpu.cudadriver import DriverUnavailable, load_driver

    try:
        load_driver()
    except DriverUnavailable:
        return False
    return True


def pytest_ignore_collect(collection_path: Path) -> bool | None:
    if collection_path.name.startswith("test_") and not _gpu_here():
        return True
    return None
