"""Identity: the node's Ed25519 key, node ids, pairing codes and TLS certificates.

The bottom layer: it imports nothing from the rest of GPUMesh but the shared
``errors`` and ``units``. Its one file is the node key (``keys.py`` writes and
reads ``identity.key``).
"""

from gpumesh.identity.keys import Identity, NodeId, node_id_for, verify_signature

__all__ = ["Identity", "NodeId", "node_id_for", "verify_signature"]
