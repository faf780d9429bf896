"""GPUMesh: share idle NVIDIA GPUs among people who trust each other.

The public Python API is :class:`Node` (one node's home and operations) plus
the error tree in :mod:`gpumesh.errors`. The CLI and the dashboard call the
same functions. Imports are lazy so ``gpumesh --help`` stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpumesh.version import __version__

__all__ = [
    "AccessDeniedError",
    "ConnectResult",
    "GPUMeshError",
    "Node",
    "Peer",
    "UnreachableError",
    "__version__",
]

if TYPE_CHECKING:
    from gpumesh.client.node import ConnectResult, Node
    from gpumesh.errors import AccessDeniedError, GPUMeshError, UnreachableError
    from gpumesh.store.db import Peer

_LAZY = {
    "Node": "gpumesh.client.node",
    "ConnectResult": "gpumesh.client.node",
    "Peer": "gpumesh.store.db",
    "GPUMeshError": "gpumesh.errors",
    "AccessDeniedError": "gpumesh.errors",
    "UnreachableError": "gpumesh.errors",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gpumesh' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
