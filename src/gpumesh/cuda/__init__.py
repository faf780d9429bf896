"""CUDA remoting: a LAN subset of the CUDA driver API run on a provider's GPU.

``from gpumesh.cuda import RemoteDevice`` is the consumer's API. The rest of the
package: the call protocol without I/O (:mod:`~gpumesh.cuda.protocol`), the
provider's worker process (:mod:`~gpumesh.cuda.worker`) and its backends (the
real driver through ``cuda-bindings``, or the host-memory fallback), and the
consumer's link and bridge (:mod:`~gpumesh.cuda.remote`). ``RemoteDevice`` is
imported lazily, so the worker process loads only what it runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpumesh.cuda.device import DevicePointer, Module, RemoteDevice

__all__ = ["DevicePointer", "Module", "RemoteDevice"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from gpumesh.cuda import device

        return getattr(device, name)
    raise AttributeError(name)
