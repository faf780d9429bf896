"""The relay: a small server that forwards encrypted QUIC packets between
nodes that cannot reach each other directly, and tells each the address the
other is seen from, so they can punch through NAT and stop needing it.

The rules are in :mod:`gpumesh.protocol.relaycore` (no I/O, shared with nodes
that relay for their peers), the sockets in
:mod:`gpumesh.relay.server`, the TCP listener (TLS, for networks that block
UDP) in :mod:`gpumesh.relay.tcp`, the settings in :mod:`gpumesh.relay.config`,
the ``gpumesh-relay`` command in :mod:`gpumesh.relay.main`. Start one in-process
with ``await serve(RelayConfig(host="127.0.0.1", port=0, open=True))``.
Imports are lazy so ``gpumesh-relay --help`` does not load the crypto.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["RelayConfig", "RelayCore", "RelayServer", "serve"]

if TYPE_CHECKING:
    from gpumesh.protocol.relaycore import RelayCore
    from gpumesh.relay.config import RelayConfig
    from gpumesh.relay.server import RelayServer, serve

_LAZY = {
    "RelayConfig": "gpumesh.relay.config",
    "RelayCore": "gpumesh.protocol.relaycore",
    "RelayServer": "gpumesh.relay.server",
    "serve": "gpumesh.relay.server",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gpumesh.relay' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
