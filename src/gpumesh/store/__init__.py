"""Store: everything a node keeps in ``$GPUMESH_HOME`` (config, key, SQLite).

Below the agent and client layers. Never does network or Docker calls, and
never holds a transaction open across one.

The names below load on first use: shell completion imports
:mod:`gpumesh.store.names` at every Tab press and must not pay for the rest.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpumesh.store.db import Store
    from gpumesh.store.home import Home
    from gpumesh.store.peers import Peer

__all__ = ["Home", "Peer", "Store"]

_WHERE = {"Home": "gpumesh.store.home", "Peer": "gpumesh.store.peers", "Store": "gpumesh.store.db"}


def __getattr__(name: str) -> object:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
