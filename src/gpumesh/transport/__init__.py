"""Transport: QUIC over UDP, authenticated sessions between nodes.

Below the agent and client layers; above identity and protocol. Knows nothing
about the store: who may connect is decided by a callback from above.
"""
