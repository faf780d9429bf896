"""Store: everything a node keeps in ``$GPUMESH_HOME`` (config, key, SQLite).

Below the agent and client layers. Never does network or Docker calls, and
never holds a transaction open across one.
"""

from gpumesh.store.db import Peer, Store
from gpumesh.store.home import Home

__all__ = ["Home", "Peer", "Store"]
