"""``from gpumesh.cuda import RemoteDevice``: CUDA remoting's Python API for consumers.

CUDA remoting runs a LAN subset of the CUDA driver API on a provider's GPU.
Like every feature it is spread over the layers, one module per layer: the
call protocol without I/O (:mod:`gpumesh.protocol.cuda`); the backends that
run calls, the real driver through ``cuda-bindings`` or the host-memory
fallback (``gpu/cuda*.py``); the provider's service, worker process and its
confinement (``agent/cuda*.py``); the consumer's link and bridge, device and
operations (``client/cuda*.py``); and ``gpumesh cuda`` (``cli/cuda.py``). Like
the package root this module is a face: ``RemoteDevice`` loads when first
asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpumesh.client.cudadevice import DevicePointer, Module, RemoteDevice

__all__ = ["DevicePointer", "Module", "RemoteDevice"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from gpumesh.client import cudadevice

        return getattr(cudadevice, name)
    raise AttributeError(name)
