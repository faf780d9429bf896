"""Transport: QUIC over UDP, authenticated sessions between nodes, and the data
channel for bulk bytes (TLS on TCP, ``channel.py``).

Below the agent and client layers; above identity and protocol. Knows nothing
about the store: who may connect is decided by a callback from above. The client
and the agent open and authorise every data channel over a QUIC request.
"""
