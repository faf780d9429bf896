"""Identity: the node's Ed25519 key, node ids, pairing codes and TLS certificates.

The bottom layer: it imports nothing from the rest of GPUMesh but ``errors``.
"""

from gpumesh.identity.keys import Identity, NodeId, node_id_for, verify_signature

__all__ = ["Identity", "NodeId", "node_id_for", "verify_signature"]
