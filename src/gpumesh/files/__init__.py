"""Files: what both ends of a transfer do with bytes on disk and on a socket.

Packing a local folder into an exact-size tar and unpacking it safely on a
provider (``pack.py``), the sandbox a hostile job may change under us
(``sandbox.py``), hashing and chunked reads and writes (``hashing.py``,
``transfer.py``), app manifests (``manifest.py``) and the data channel's TCP+TLS
sockets (``channel.py``). Used by both the client and the agent, so it sits below
both; it knows nothing of peers, sessions or asyncio: a QUIC request above opens
and authorises every data channel.
"""
